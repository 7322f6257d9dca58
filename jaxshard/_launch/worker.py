"""One process of `jaxshard.launch`: `python -m jaxshard._launch.worker SPEC`, where
SPEC is the JSON `launch` writes. Joins the others, calls the target, and writes
what happened to the result file."""

import importlib
import importlib.util
import json
import os
import sys
import threading
import traceback


def _load(target: str):
    where, _, name = target.rpartition(":")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location("__jaxshard_target__", where)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {where!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def _json(value):
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def main(spec: dict) -> int:
    import jax

    report: dict = {}
    try:
        _join(jax, spec)
        fn = _load(spec["target"])
        report["returned"] = _json(fn(*spec["args"]))
    except BaseException as e:  # noqa: BLE001 -- reported to the launching process
        kind = type(e)
        report["error"] = f"{kind.__module__}.{kind.__qualname__}"
        report["message"] = str(e)
        traceback.print_exc()
    with open(spec["result"], "w") as f:
        json.dump(report, f)
    # Leave together if the others got here too; if they did not (say, they wait in
    # a collective this process never joined), leave anyway, soon.
    done = threading.Thread(target=jax.distributed.shutdown, daemon=True)
    done.start()
    done.join(timeout=_SHUTDOWN_WAIT)
    return 1 if "error" in report else 0


def _join(jax, spec: dict) -> None:
    """This process's CPU devices, and the others' through the coordinator."""
    jax.config.update("jax_num_cpu_devices", spec["devices"])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Short heartbeats and shutdown: a process whose peers died stops soon after.
    limit = max(1, int(spec["timeout"]))
    jax.distributed.initialize(
        coordinator_address=spec["coordinator"],
        num_processes=spec["processes"],
        process_id=spec["process_id"],
        initialization_timeout=limit,
        heartbeat_timeout_seconds=min(limit, 30),
        shutdown_timeout_seconds=min(limit, 30),
    )


_SHUTDOWN_WAIT = 10.0  # seconds


if __name__ == "__main__":
    code = main(json.loads(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # not through atexit, where JAX would wait for the others again
