"""What does verifying a DeepSeek-V3-shaped MoE train step for 8,960 chips cost?

The train step is `examples/moe.py`'s (forward, gradient and Adam update of a
mixture-of-experts decoder, layers scanned and remat'ed, the routed experts in a
`jax.shard_map` with two all-to-alls over "ep"), at DeepSeek-V3's shapes: 61 layers,
the first 3 dense, d 7168, 256 routed experts (top 8) and one shared, expert hidden
size 2048, batches of 8,960 x 4,096 tokens in bfloat16. It is compiled with libtpu for
the largest TPU v5p slice (`v5p:16x20x28`, 8,960 chips; mesh dp 5 x fsdp 28 x ep 64)
on this CPU-only machine. Two sides, each in a fresh process of its own (so that the
peak RSS is that side's alone), alternating within rounds (A B, B A, ...):

- verify: the example's `verify(mesh, FULL)`, that is `jaxshard.verify(train_step,
    ...)`: building the abstract inputs, tracing with every contract checked,
    compiling, reading the compiled program's shardings, collectives, memory and cost;
- plain: `jax.jit(train_step, static_argnums=3).lower(state, x, y, cfg).compile()`
    of the same step with its `jaxtyped` decorators deleted and its value checks
    (`jaxshard.check_finite(...)`, `jaxshard.check(...)`) replaced by `pass`: no
    typechecker, no sharding or value check, nothing added to the program. Its
    arguments come from `jaxshard.abstract_args` (the same input shardings), built
    outside the timed region.

Each child times only its side: wall-clock (`time.perf_counter`) and CPU time of all
its threads (`time.process_time`), with the persistent compilation cache off, and
reports its peak RSS (`getrusage(RUSAGE_SELF).ru_maxrss`: the interpreter, JAX and
libtpu included, as in any real run). The table gives the medians over rounds, the
ratio of the medians and the median of the ratios within a round.

Then the whole example runs once, as a user runs it (`python examples/moe.py
--topology v5p:16x20x28`: the verify, its report, and a misplaced expert weight
verified and caught), in a subprocess: its wall-clock time, CPU time and peak RSS
(`os.wait4`), against the targets of 120 s and 4 GiB. The script exits non-zero if
the example fails or misses a target.

Run: `python benchmarks/bench_moe.py` (needs libtpu: `pip install 'jaxshard[tpu]'`;
about 5 minutes on two quiet cores); `--quick` for a smoke test (one round on
`v5p:2x2x2` with the example's small setup, and the example's small run on 8 CPU
devices).

docs/performance.md gives the figures this script prints (its section "A
mixture-of-experts train step on 8,960 chips").
"""

import importlib.util
import json
import os
import pathlib
import resource
import subprocess
import sys
import time
from statistics import median


# No TPU here: libtpu only compiles. JAX must not look for one.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

QUICK = "--quick" in sys.argv[1:]  # a smoke test of the script, not a measurement
ROUNDS = 1 if QUICK else 2  # even (but for --quick): each side goes first as often
TOPOLOGY = "v5p:2x2x2" if QUICK else "v5p:16x20x28"
SETUP = "SMALL" if QUICK else "FULL"
EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "moe.py"
DECORATOR = "@jaxshard.jaxtyped(typechecker=beartype)\n"
VALUE_CHECKS = ("jaxshard.check_finite(", "jaxshard.check(")
TARGET_WALL, TARGET_RSS = 120.0, 4 * 2**30  # the whole example: seconds, bytes
GIB = 2**30


def load(name: str, checked: bool):
    """The example as a module; `checked=False` deletes its decorator lines and
    replaces its value checks by `pass` first.

    That is the honest baseline: the same functions, calling each other as before,
    but nothing reads their annotations, so there is no typechecker, no sharding or
    value check and nothing added to the program. (`jaxshard.config(sharding="off")`
    would not do: the typechecker and jaxtyping's shape checks would still run.)
    """
    source = EXAMPLE.read_text()
    if not checked:
        assert source.count(DECORATOR) == 10, "the example's decorators have changed"
        source = source.replace(DECORATOR, "")
        lines, replaced = [], {call: 0 for call in VALUE_CHECKS}
        for line in source.splitlines(keepends=True):
            stripped = line.lstrip()
            call = next((c for c in VALUE_CHECKS if stripped.startswith(c)), None)
            if call is not None:
                replaced[call] += 1
                line = line[: len(line) - len(stripped)] + "pass\n"
            lines.append(line)
        assert replaced == {c: 1 for c in VALUE_CHECKS}, (
            f"the example's value checks have changed: {replaced}"
        )
        source = "".join(lines)
    from bench_verify import module_from  # in the child: it imports JAX

    return module_from(name, EXAMPLE, source)


# --- a child: one side, in a process of its own ---------------------------------------


def child(side: str) -> None:
    """Time one side; print its wall and CPU seconds and peak RSS as a JSON line."""
    import jax
    import jax.numpy as jnp

    import jaxshard

    jax.config.update("jax_enable_compilation_cache", False)
    checked = load("moe", True)
    setup = getattr(checked, SETUP)
    mesh = jaxshard.tpu_mesh(TOPOLOGY, setup["mesh"])
    if side == "verify":

        def run():
            checked.verify(mesh, setup)

    else:
        plain = load("moe_plain", False)
        args = jaxshard.abstract_args(
            checked.train_step,
            mesh,
            setup["dims"],
            jnp.bfloat16,
            values={"cfg": setup["cfg"]},
        )
        assert args[-1] == setup["cfg"], "cfg is no longer the last argument"

        def run():
            with jax.set_mesh(mesh):  # the shard_map and constraints name mesh axes
                jax.jit(plain.train_step, static_argnums=3).lower(*args).compile()

    wall, cpu = time.perf_counter(), time.process_time()
    run()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"side": side, "wall": wall, "cpu": cpu, "rss": rss}))


# --- the parent: the rounds, the whole example, the table ----------------------------


def spawn(side: str) -> dict:
    """Run `side` in a fresh interpreter; what it reports."""
    command = [sys.executable, __file__, "--child", side] + (["--quick"] * QUICK)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"the {side} child failed ({done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def side_by_side(rounds: int) -> dict[str, list[dict]]:
    """Each side's figures per round; rounds run verify, plain, then plain, verify."""
    results = {"verify": [], "plain": []}
    for r in range(rounds):
        for side in ["verify", "plain"][:: 1 if r % 2 == 0 else -1]:
            results[side].append(spawn(side))
            got = results[side][-1]
            print(
                f"  round {r + 1}, {side}: {got['wall']:.1f} s wall, "
                f"{got['cpu']:.1f} s CPU, {got['rss'] / GIB:.2f} GiB",
                flush=True,
            )
    return results


def whole_example() -> tuple[int, float, float, int, str]:
    """The example run as a user runs it: exit code, wall and CPU seconds, peak RSS
    in bytes (of that process alone: `os.wait4`), and the tail of its output."""
    command = [sys.executable, str(EXAMPLE)]
    if not QUICK:  # the small run on CPUs; --topology always means the full size
        command += ["--topology", TOPOLOGY]
    started = time.perf_counter()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output = process.stdout.read()
    process.stdout.close()
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    tail = "\n".join(output.strip().splitlines()[-3:])
    return (
        process.returncode,
        wall,
        usage.ru_utime + usage.ru_stime,
        usage.ru_maxrss * 1024,
        tail,
    )


def table(results: dict[str, list[dict]]) -> list[tuple]:
    """Rows of verify, plain and their ratios: medians, and medians of ratios."""
    med = {
        side: {k: median(r[k] for r in runs) for k in ("wall", "cpu", "rss")}
        for side, runs in results.items()
    }
    paired = list(zip(results["verify"], results["plain"]))
    rows = [("", "wall", "CPU", "peak RSS", "target")]
    for side in ("verify", "plain"):
        m = med[side]
        rss = f"{m['rss'] / GIB:.2f} GiB"
        rows.append((side, f"{m['wall']:.1f} s", f"{m['cpu']:.1f} s", rss, ""))
    v, p = med["verify"], med["plain"]
    rows.append(
        ("ratio of medians",)
        + tuple(f"{v[k] / p[k]:.3f}" for k in ("wall", "cpu", "rss"))
        + ("",)
    )
    rows.append(
        ("median of ratios",)
        + tuple(
            f"{median(a[k] / b[k] for a, b in paired):.3f}"
            for k in ("wall", "cpu", "rss")
        )
        + ("",)
    )
    return rows


def main() -> int:
    if "--child" in sys.argv[1:]:
        child(sys.argv[sys.argv.index("--child") + 1])
        return 0
    if importlib.util.find_spec("libtpu") is None:
        print("bench_moe needs libtpu: pip install 'jaxshard[tpu]'")
        return 0
    import jax

    started = time.perf_counter()
    print(
        f"jax {jax.__version__}; examples/moe.py's train step, {SETUP} setup, for "
        f"{TOPOLOGY}; {ROUNDS} round(s), each side in a fresh process"
        + (" (--quick: a smoke test, not a measurement)" if QUICK else ""),
        flush=True,
    )
    rows = table(side_by_side(ROUNDS))
    code, wall, cpu, rss, tail = whole_example()
    ok = code == 0 and wall < TARGET_WALL and rss < TARGET_RSS
    rows.append(
        (
            "whole example" + (" (small, CPU)" if QUICK else ""),
            f"{wall:.1f} s",
            f"{cpu:.1f} s",
            f"{rss / GIB:.2f} GiB",
            f"< {TARGET_WALL:.0f} s, < {TARGET_RSS / GIB:.0f} GiB, exit 0 "
            f"(exit {code}): {'ok' if ok else 'MISSED'}",
        )
    )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print(
        f"({time.perf_counter() - started:.0f} s; medians over rounds; ratios are "
        "verify / plain; peak RSS of each side's own process)"
    )
    if not ok:
        print(f"The example's last lines:\n{tail}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
