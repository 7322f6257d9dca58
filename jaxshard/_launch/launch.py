"""Running a function in several JAX processes on this machine, as on a pod's hosts.

Each process is a fresh Python with its own simulated CPU devices, joined to the
others by `jax.distributed.initialize` over loopback, with gloo for the collectives.
Every process has a hard time limit: one that hangs (say, waiting in a collective
for a process that raised) is killed, and its outcome says so.
"""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any


@dataclasses.dataclass(frozen=True)
class ProcessOutcome:
    """How one process of `jaxshard.launch` ended.

    **Attributes:**

    - `process_id`: its `jax.process_index()`.
    - `returned`: what the function returned (if it returned something JSON can
        hold; else its `repr`), or `None`.
    - `error`: the qualified name of the exception the function raised (e.g.
        `"jaxshard.ShardingError"`), or `None`.
    - `message`: that exception's message.
    - `timed_out`: whether the process was killed at the time limit.
    - `returncode`: the process's exit code.
    - `seconds`: how long it ran.
    - `output`: what it printed (stdout and stderr together).
    """

    process_id: int
    returned: Any
    error: str | None
    message: str | None
    timed_out: bool
    returncode: int | None
    seconds: float
    output: str

    @property
    def ok(self) -> bool:
        """Whether the function returned and the process exited cleanly."""
        return self.error is None and not self.timed_out and self.returncode == 0


def launch(
    target: str,
    *,
    processes: int = 2,
    devices: int = 4,
    timeout: float = 120.0,
    args: tuple = (),
    env: dict[str, str] | None = None,
) -> list[ProcessOutcome]:
    """Runs a function in `processes` JAX processes at once, each with `devices`
    simulated CPU devices, joined into one runtime as a pod's hosts are.

    Each process starts a fresh Python, sets up its CPU devices, calls
    `jax.distributed.initialize` with a coordinator on a free loopback port, then
    calls the function with `args`. `jax.devices()` then lists every process's
    devices, so a mesh over them spans processes, as on a pod.

    **Arguments:**

    - `target`: the function, as `"module:function"` (importable) or
        `"path/to/file.py:function"`.
    - `processes`: how many processes.
    - `devices`: CPU devices per process.
    - `timeout`: seconds every process may take, start-up included. A process still
        running then is killed (so is every other one still running), and its
        outcome has `timed_out=True`.
    - `args`: positional arguments for the function; they must be JSON values.
    - `env`: extra environment variables for the processes.

    **Returns:**

    One `jaxshard.ProcessOutcome` per process, in process order.

    !!! Example

        ```python
        outcomes = jaxshard.launch("my_tests.pod:train_step", processes=4)
        assert all(o.ok for o in outcomes), outcomes
        ```
    """
    if not isinstance(target, str) or ":" not in target:
        raise ValueError(
            f"jaxshard.launch: target must be 'module:function' or "
            f"'path/to/file.py:function'; got {target!r}."
        )
    if processes < 1 or devices < 1:
        raise ValueError(
            f"jaxshard.launch: processes and devices must be at least 1; got "
            f"processes={processes}, devices={devices}."
        )
    json.dumps(list(args))  # fails early, in this process, if it cannot be sent
    coordinator = f"127.0.0.1:{_free_port()}"
    child_env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="jaxshard-launch-") as tmp:
        running = []
        for i in range(processes):
            result = os.path.join(tmp, f"{i}.json")
            log = open(os.path.join(tmp, f"{i}.log"), "w+")
            command = [sys.executable, "-m", "jaxshard._launch.worker"]
            spec = dict(
                target=target,
                coordinator=coordinator,
                processes=processes,
                process_id=i,
                devices=devices,
                timeout=timeout,
                args=list(args),
                result=result,
            )
            proc = subprocess.Popen(
                [*command, json.dumps(spec)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env,
                cwd=os.getcwd(),
            )
            running.append((proc, log, result))
        ended = _wait(running, start + timeout)
        return [
            _outcome(i, proc, log, result, timed_out, seconds - start)
            for i, ((proc, log, result), (timed_out, seconds)) in enumerate(
                zip(running, ended)
            )
        ]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(running: list, deadline: float) -> list[tuple[bool, float]]:
    """Waits for every process until `deadline`, then kills those still running:
    for each, whether it was killed and when it ended."""
    ended: list[tuple[bool, float] | None] = [None] * len(running)
    while any(e is None for e in ended):
        now = time.monotonic()
        for i, (proc, _, _) in enumerate(running):
            if ended[i] is None and proc.poll() is not None:
                ended[i] = (False, now)
        if now >= deadline:
            for i, (proc, _, _) in enumerate(running):
                if ended[i] is None:
                    proc.kill()
                    proc.wait()
                    ended[i] = (True, now)
        time.sleep(0.05)
    return ended  # pyright: ignore[reportReturnType]


def _outcome(i, proc, log, result, timed_out, seconds) -> ProcessOutcome:
    log.seek(0)
    output = log.read()
    log.close()
    report = {}
    if os.path.exists(result):
        with open(result) as f:
            report = json.load(f)
    return ProcessOutcome(
        process_id=i,
        returned=report.get("returned"),
        error=report.get("error"),
        message=report.get("message"),
        timed_out=timed_out,
        returncode=None if timed_out else proc.returncode,
        seconds=seconds,
        output=output,
    )
