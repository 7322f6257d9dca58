"""What do contracts cost the host? Each figure is measured side by side in one run.

(a) Eager calls, on one device, tiny arrays: a function with two sharded
    annotations checked by `jaxshard.jaxtyped` against the same function with plain
    annotations under `jaxtyping.jaxtyped` (both with beartype), the specs written
    with mesh axes (`P`), with logical names under a 32-rule table (`L`), and with a
    variadic shape (`"*b d"`, against jaxtyping's `"*b d"`), and the `P` function
    given arrays on no mesh (`jnp.ones`: code annotated for a pod, run on one
    device); the plain annotations written with jaxshard's names and decorator
    against jaxtyping's; `isinstance(x, T)` for a sharded `T` against jaxtyping's
    plain `T`.
(b) Recompiles: how many programs XLA compiles when a compiled `checked(jax.jit(f))`
    is called again in another checks mode, under an equal rule table, or in
    `config(...)` scopes that change nothing the program depends on (target 0), and
    when checks are turned off (a different program: 1).
(c) Dispatch, on one device: `jax.jit` of `x + 1` under a 32-rule
    `jaxshard.axis_rules` table against the same without (the table is part of every
    jit call's cache key); host time per call of `checked(jax.jit(f))` (`f` is
    `x + 1` on 64 floats with one check) in each mode, and of checkify's version of
    the same check with `err.throw()` after each call, each over `jax.jit` of `x + 1`;
    and the program `checked` runs, called directly (its check and the output that
    holds what the check found), on its own and keeping the last 64 calls' findings
    as deferred mode does, so that the wrapper's own share is the rest.
    "raise" and checkify wait for every call, and so does their baseline; the others
    and theirs wait every 16th call.
(d) First call: trace, compile and one run of bench_core's training step on an Auto
    mesh of 8 devices (compile-time probes), annotated against unannotated, JAX's
    caches cleared before each: the CPU time of all the process's threads (XLA
    compiles on its own).
(e) Import: `import jax`, then `import jaxshard`, in a fresh interpreter, from cached
    bytecode: what jaxshard adds to `import jax`, each timed in the same process.

Host time is the calling thread's CPU time (`time.thread_time`): on a busy machine,
the time other processes hold the cores is not counted. Rounds alternate the order of
the variants (A B, B A, ...); the table shows the median time of each and the median
over rounds of the ratio (or difference) within a round.

Run: `python benchmarks/bench_host.py` (or `nox -s bench`); `--quick` for a smoke
test. docs/performance.md gives the figures (its section "Host costs:
`bench_host.py`").
"""

import collections
import contextlib
import os
import subprocess
import sys
import time
from statistics import median

import jax


# Before anything touches the devices: 8 CPU devices, for bench_core's Auto mesh.
jax.config.update("jax_num_cpu_devices", 8)

import jax.monitoring  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxtyping  # noqa: E402
from beartype import beartype  # noqa: E402
from jax.experimental import checkify  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402
from jaxtyping import Array  # noqa: E402

import jaxshard  # noqa: E402


QUICK = "--quick" in sys.argv[1:]  # a smoke test of the script, not a measurement
ROUNDS = {"eager": 3, "dispatch": 3, "first": 1, "import": 2} if QUICK else {}
ROUNDS = {"eager": 21, "dispatch": 31, "first": 21, "import": 9} | ROUNDS
CALLS = 300 if QUICK else 3000

X = jaxshard.Float[Array, "b d", P("dp", None)]
Y = jaxshard.Float[Array, "d e", P(None, "tp")]
LX = jaxshard.Float[Array, "b d", jaxshard.L("batch", None)]
LY = jaxshard.Float[Array, "d e", jaxshard.L(None, "mlp")]
VX = jaxshard.Float[Array, "*b d", P(None, None)]
NAMED = jaxshard.Float[Array, "b d"]  # jaxshard's name, no spec: jaxtyping's annotation
PlainX = jaxtyping.Float[Array, "b d"]
PlainY = jaxtyping.Float[Array, "d e"]
PlainVX = jaxtyping.Float[Array, "*b d"]
# A rule table of MaxText's size: the two rules these annotations use, and others.
RULES = [("batch", "dp"), ("mlp", "tp")] + [(f"name{i}", None) for i in range(30)]


def side_by_side(runs: dict, rounds: int) -> dict:
    """The seconds each of `runs` takes in each round; rounds run ABC, CBA, ..."""
    for run in runs.values():  # warm up, compile
        run()
    times = {name: [] for name in runs}
    for r in range(rounds):
        for name in list(runs)[:: 1 if r % 2 == 0 else -1]:
            times[name].append(runs[name]())
    return times


def per_call(fn, args, every: int = 0, mode: str | None = None, rules=None):
    """Host seconds per call of `fn(*args)`, waiting for every `every`th result, in
    checks mode `mode` and under the axis rules `rules` (set once per run, as a user
    sets them)."""

    def run() -> float:
        scope = jaxshard.config(checks=mode) if mode else jaxshard.config()
        rule_scope = jaxshard.axis_rules(rules) if rules else contextlib.nullcontext()
        with scope, rule_scope:
            start = time.thread_time()
            for i in range(CALLS):
                out = fn(*args)
                if every and i % every == 0:
                    jax.block_until_ready(out)
            if every:
                jax.block_until_ready(out)
            return (time.thread_time() - start) / CALLS

    return run


def ratio(times: dict, a: str, b: str) -> float:
    return median(x / y for x, y in zip(times[a], times[b]))


def extra_us(times: dict, a: str, b: str) -> float:
    return median(x - y for x, y in zip(times[a], times[b])) * 1e6


# --- (a) eager ----------------------------------------------------------------------


def eager_times() -> dict:
    mesh = jax.make_mesh((1, 1), ("dp", "tp"), devices=jax.devices()[:1])

    def sharded(x: X, y: Y) -> NAMED:
        return x

    def plain(x: PlainX, y: PlainY) -> PlainX:
        return x

    def logical(x: LX, y: LY) -> NAMED:
        return x

    def variadic(x: VX, y: VX) -> NAMED:
        return x

    def plain_variadic(x: PlainVX, y: PlainVX) -> PlainX:
        return x

    def named(x: NAMED, y: NAMED) -> NAMED:
        return x

    def plain_named(x: PlainX, y: PlainX) -> PlainX:
        return x

    x = jax.device_put(jnp.ones((4, 4)), NamedSharding(mesh, P("dp", None)))
    y = jax.device_put(jnp.ones((4, 4)), NamedSharding(mesh, P(None, "tp")))
    local = jnp.ones((4, 4))
    runs = {
        "sharded": per_call(jaxshard.jaxtyped(sharded, typechecker=beartype), (x, y)),
        "jaxtyping": per_call(jaxtyping.jaxtyped(plain, typechecker=beartype), (x, y)),
        "logical": per_call(
            jaxshard.jaxtyped(logical, typechecker=beartype), (x, y), rules=RULES
        ),
        "variadic": per_call(jaxshard.jaxtyped(variadic, typechecker=beartype), (x, x)),
        # Code annotated for a pod, run on one device: arrays on no mesh.
        "one device": per_call(
            jaxshard.jaxtyped(sharded, typechecker=beartype), (local, local)
        ),
        "jaxtyping, one device": per_call(
            jaxtyping.jaxtyped(plain, typechecker=beartype), (local, local)
        ),
        "jaxtyping variadic": per_call(
            jaxtyping.jaxtyped(plain_variadic, typechecker=beartype), (x, x)
        ),
        "named": per_call(jaxshard.jaxtyped(named, typechecker=beartype), (x, x)),
        "jaxtyping named": per_call(
            jaxtyping.jaxtyped(plain_named, typechecker=beartype), (x, x)
        ),
        "isinstance sharded": per_call(lambda: isinstance(x, X), ()),
        "isinstance plain": per_call(lambda: isinstance(x, PlainX), ()),
    }
    return side_by_side(runs, ROUNDS["eager"])


# --- (b) recompiles -----------------------------------------------------------------

_compiles = [0]


def _count(event: str, duration: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles[0] += 1


def recompiles() -> list[tuple[str, int, str]]:
    """(what, programs compiled, target) for each way of calling the step again."""
    jax.monitoring.register_event_duration_secs_listener(_count)

    def f(x):
        jaxshard.check(x[0] > -1, "x[0] is {v}", v=x[0])
        return x + 1

    step = jaxshard.checked(jax.jit(f))
    x = jnp.zeros(64)
    rules = [("batch", "dp")]
    with jaxshard.axis_rules(rules):
        step(x)
    out = []

    def count(what: str, target: str, scope) -> None:
        before = _compiles[0]
        with jaxshard.axis_rules(list(rules)), scope():
            step(x)
        out.append((what, _compiles[0] - before, target))

    count("deferred_checks()", "0", jaxshard.deferred_checks)
    count("config(sharding='check'), an equal table", "0", jaxshard.config)
    count("config(checks='off'): another program", "1", lambda: _off())
    count("config(checks='off') again", "0", lambda: _off())
    count("config(checks='raise') after", "0", lambda: jaxshard.config(checks="raise"))
    return out


def _off():
    return jaxshard.config(checks="off")


# --- (c) dispatch -------------------------------------------------------------------


def dispatch_times() -> dict:
    x = jax.device_put(jnp.zeros(64), jax.devices()[0])

    def f(x):
        jaxshard.check(x[0] > -1, "x[0] is {v}", v=x[0])
        return x + 1

    def with_checkify(x):
        checkify.check(x[0] > -1, "x[0] is {v}", v=x[0])
        return x + 1

    checked = jaxshard.checked(jax.jit(f))
    baseline = jax.jit(lambda x: x + 1)
    checkified = jax.jit(checkify.checkify(with_checkify))

    def throwing(x):
        err, out = checkified(x)
        err.throw()
        return out

    program = _compiled(jax.jit(f))

    def program_alone(x):
        return program(x)[0]

    # What deferred mode keeps between its questions: the rows of the last calls.
    from jaxshard._values.flags import _READ_AFTER

    kept = collections.deque(maxlen=_READ_AFTER)

    def program_kept(x):
        out, found = program(x)
        kept.append(found)
        return out

    # What deferred mode asks once per `_READ_AFTER` calls: whether any failed.
    from jaxshard._values.flags import _any_failed

    batch = [program(x)[1] for _ in range(_READ_AFTER)]

    def ask(batch):
        return _any_failed(batch)

    runs = {
        "jax.jit": per_call(baseline, (x,), every=16),
        "jax.jit, rules": per_call(baseline, (x,), every=16, rules=RULES),
        "the question": per_call(ask, (batch,), every=16),
        "off": per_call(checked, (x,), every=16, mode="off"),
        "deferred": per_call(checked, (x,), every=16, mode="deferred"),
        "program alone": per_call(program_alone, (x,), every=16),
        "program, rows kept": per_call(program_kept, (x,), every=16),
        "jax.jit, waited": per_call(baseline, (x,), every=1),
        "raise": per_call(checked, (x,), every=1, mode="raise"),
        "checkify + throw": per_call(throwing, (x,), every=1),
    }
    times = side_by_side(runs, ROUNDS["dispatch"])
    jaxshard.flush_checks()
    return times


def _compiled(fn):
    """The program `checked(fn)` runs, with its checks' findings among its outputs:
    called directly, what the wrapper adds is the rest (jaxshard's internals)."""
    from jaxshard._values.frames import _compiled
    from jaxshard._values.records import Scope

    return _compiled(fn, Scope("program"))


# --- (d) first call; (e) import -----------------------------------------------------


def first_call_times() -> dict:
    from bench_core import first_call  # the same step, mesh and inputs

    mesh = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    # The CPU time of every thread of the process: XLA compiles on threads of its
    # own, and wall time on a shared machine moves by a tenth from call to call.
    annotated, plain = first_call(mesh, ROUNDS["first"], clock=time.process_time)
    return {"annotated": annotated, "unannotated": plain}


# In a fresh interpreter: `import jax`, then `import jaxshard`, each timed; what
# jaxshard adds is the second (jaxtyping's import among it), measured beside the first
# in one process. Two fresh interpreters' `import jax` alone differ by up to a tenth
# (about 100 ms here), more than the whole of what jaxshard adds.
_IMPORT = (
    "import time; t = time.perf_counter(); import jax; u = time.perf_counter(); "
    "import jaxshard; print(u - t, time.perf_counter() - t)"
)


def import_times() -> dict:
    # As an installed package imports: from cached bytecode (pip compiles it on
    # install), which the warm-up run writes here if it is missing.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}

    def run() -> tuple[float, float]:
        out = subprocess.run(
            [sys.executable, "-c", _IMPORT],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        jax_alone, both = map(float, out.stdout.split())
        return jax_alone, both

    run()  # warm up
    rounds = [run() for _ in range(ROUNDS["import"])]
    return {
        "jax": [jax_alone for jax_alone, _ in rounds],
        "jax, then jaxshard": [both for _, both in rounds],
    }


# --- the table ----------------------------------------------------------------------


def main() -> int:
    started = time.perf_counter()
    print(
        f"jax {jax.__version__}, jaxtyping {jaxtyping.__version__}, host CPU time "
        "per call" + (" (--quick: too few rounds to trust)" if QUICK else ""),
        flush=True,
    )
    rows = [("", "jaxshard", "baseline", "ratio", "target", "")]
    notes = []

    def row(what, times, a, b, target="-", unit="us", note=""):
        scale = {"ms": 1e3, "us": 1e6}[unit]
        shown = [f"{median(times[k]) * scale:.3g} {unit}" for k in (a, b)]
        rows.append((what, *shown, f"{ratio(times, a, b):.3f}", target, note))

    times = eager_times()
    row("(a) eager, 2 sharded args", times, "sharded", "jaxtyping", "<= 1.05")
    row("(a) eager, logical (L)", times, "logical", "jaxtyping", "<= 1.05")
    row("(a) eager, variadic", times, "variadic", "jaxtyping variadic", "<= 1.05")
    one = ("one device", "jaxtyping, one device")
    row("(a) eager, one-device arrays", times, *one, "<= 1.05")
    row("(a) eager, jaxshard's names", times, "named", "jaxtyping named", "<= 1.02")
    row("(a) isinstance", times, "isinstance sharded", "isinstance plain", "<= 1.05")
    times = dispatch_times()
    for mode, base, target in [
        ("jax.jit, rules", "jax.jit", "-"),
        ("off", "jax.jit", "+5 us"),
        ("deferred", "jax.jit", "+5 us"),
        ("program alone", "jax.jit", "-"),
        ("program, rows kept", "jax.jit", "-"),
        ("raise", "jax.jit, waited", "checkify's"),
        ("checkify + throw", "jax.jit, waited", "-"),
    ]:
        note = f"{extra_us(times, mode, base):+.1f} us over jax.jit"
        row(f"(c) dispatch, {mode}", times, mode, base, target, note=note)
    from jaxshard._values.flags import _READ_AFTER

    asked = median(times["the question"]) * 1e6 / _READ_AFTER
    notes.append(f"deferred's question per {_READ_AFTER} calls: {asked:.1f} us a call")
    times = first_call_times()
    row("(d) first call, Auto", times, "annotated", "unannotated", "<= 1.05", "ms")
    times = import_times()
    both = ("jax, then jaxshard", "jax")
    note = f"{extra_us(times, *both) / 1e3:+.0f} ms (target <= +100 ms)"
    row("(e) import jax, then jaxshard", times, *both, unit="ms", note=note)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    for note in notes:
        print(f"(c) {note}")
    print("(b) programs compiled when a compiled checked step is called again:")
    for what, compiled, target in recompiles():
        print(f"    {what}: {compiled} (target {target})")
    seconds = time.perf_counter() - started
    print(f"({seconds:.0f} s; medians over rounds; ratios paired within rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
