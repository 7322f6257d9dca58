"""What do sharding checks cost? Each ratio is measured side by side in one run.

(a) Steady state: a jitted data- and tensor-parallel MLP training step whose layer
    functions carry sharded annotations, against the same step unannotated, on an Auto
    mesh (compile-time probes) and on an Explicit mesh (trace-time checks). Also: how
    many operations the checks add to the compiled program.
(b) Eager: per-call overhead of a 3-argument function checked by `jaxshard.jaxtyped`
    with sharded annotations, against `jaxtyping.jaxtyped` with plain ones and against
    no decorator.
(c) First call: trace + compile time of the step with and without checks, in the
    CPU time of all the process's threads (XLA compiles on its own).
(d) Logical axis names: the eager call of (b) with its annotations written in
    logical names (`L(...)`, resolved under `jaxshard.axis_rules`) against the same
    annotations written with `P(...)`; and the step of (a) annotated in logical names,
    whose compiled program must be the unannotated one's.

Rounds of the variants alternate (A B, B A, A B, ...) so that drift on a busy machine
hits each alike. The table shows the median time of each, and the median over rounds
of the ratio within a round.

Run: `python benchmarks/bench_core.py` (or `nox -s bench`); `--quick` for a smoke test.

docs/performance.md gives the figures this script prints
(its section "Sharding contracts: `bench_core.py`").
"""

import re
import sys
import time
from collections import Counter
from statistics import median

import jax


# Before anything touches the devices: 8 simulated CPU devices for a 4 x 2 mesh.
jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import jaxtyping  # noqa: E402
from beartype import beartype  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402
from jaxtyping import Array  # noqa: E402

import jaxshard  # noqa: E402
from jaxshard import Float  # noqa: E402


BATCH, D, HIDDEN, LAYERS = 128, 128, 512, 3
QUICK = "--quick" in sys.argv[1:]  # a smoke test of the script, not a measurement
ROUNDS = {
    "steady": 4 if QUICK else 61,
    "eager": 3 if QUICK else 15,
    "first": 1 if QUICK else 5,
}
STEADY_CALLS, EAGER_CALLS = 20, 2000

# --- the model ----------------------------------------------------------------------

X = Float[Array, "batch d", P("dp", None)]
H = Float[Array, "batch hidden", P("dp", "tp")]
W1 = Float[Array, "d hidden", P(None, "tp")]
W2 = Float[Array, "hidden d", P("tp", None)]
# The same in logical names, and the rules that map them to the mesh's axes.
LX = Float[Array, "batch d", jaxshard.L("batch", None)]
LH = Float[Array, "batch hidden", jaxshard.BY_NAME]
LW1 = Float[Array, "d hidden", jaxshard.L(None, "hidden")]
LW2 = Float[Array, "hidden d", jaxshard.L("hidden", None)]
RULES = [("batch", "dp"), ("hidden", "tp"), ("d", None)]
# jaxtyping's own annotations, the baseline for the eager check.
PlainX = jaxtyping.Float[Array, "batch d"]
PlainW1 = jaxtyping.Float[Array, "d hidden"]
PlainW2 = jaxtyping.Float[Array, "hidden d"]


def up(x, w1):
    return jax.nn.gelu(x @ w1)


def down(h, w2):
    # A contraction over "tp": Explicit axes need the output sharding named.
    explicit = AxisType.Explicit in jax.typeof(h).sharding.mesh.axis_types
    return jnp.dot(h, w2, out_sharding=P("dp", None) if explicit else None)


def make_step(checked: bool, logical: bool = False):
    """A fresh training step (new function objects, so a fresh jit traces it)."""
    up_, down_ = up, down
    if checked and logical:

        def up_(x: LX, w1: LW1) -> LH:
            return up(x, w1)

        def down_(h: LH, w2: LW2) -> LX:
            return down(h, w2)

    elif checked:

        def up_(x: X, w1: W1) -> H:
            return up(x, w1)

        def down_(h: H, w2: W2) -> X:
            return down(h, w2)

    if checked:
        up_ = jaxshard.jaxtyped(up_, typechecker=beartype)
        down_ = jaxshard.jaxtyped(down_, typechecker=beartype)

    def loss(params, x, y):
        for w1, w2 in params:
            x = x + down_(up_(x, w1), w2)
        return jnp.mean((x - y) ** 2)

    def step(params, x, y):
        grads = jax.grad(loss)(params, x, y)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)

    return step


def inputs(mesh):
    keys = iter(jax.random.split(jax.random.key(0), 2 * LAYERS + 2))

    def put(shape, spec, scale=1.0):
        a = scale * jax.random.normal(next(keys), shape)
        return jax.device_put(a, NamedSharding(mesh, spec))

    params = [
        (
            put((D, HIDDEN), P(None, "tp"), D**-0.5),
            put((HIDDEN, D), P("tp", None), HIDDEN**-0.5),
        )
        for _ in range(LAYERS)
    ]
    return params, put((BATCH, D), P("dp", None)), put((BATCH, D), P("dp", None))


# --- measuring ----------------------------------------------------------------------


def per_call(fn, args, calls: int) -> float:
    """Seconds per call. Every result is waited for: with 8 devices on 2 cores, a host
    running far ahead of the devices can deadlock the pipelined loop."""
    start = time.perf_counter()
    for _ in range(calls):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / calls


def side_by_side(*runs, rounds: int) -> list[list[float]]:
    """The seconds each of `runs` takes in each round; rounds run ABC, CBA, ABC, ..."""
    times = [[] for _ in runs]
    for r in range(rounds):
        order = list(range(len(runs)))[:: 1 if r % 2 == 0 else -1]
        for i in order:
            times[i].append(runs[i]())
    return times


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?\S+\s+=\s+(.*)$", re.M)
_OPCODE = re.compile(r"\b([a-z][\w\-]*)\(")  # shapes hold no `name(`: `(f32[2], s32[])`


def hlo_ops(compiled_text: str) -> Counter:
    """The opcodes of a compiled HLO module; names, shapes and metadata ignored."""
    ops = Counter()
    for rest in _INSTRUCTION.findall(compiled_text):
        ops[_OPCODE.search(rest)[1]] += 1
    return ops


# --- the benchmarks -----------------------------------------------------------------


def steady_state(mesh, logical: bool = False) -> tuple[list, list, int, int]:
    args = inputs(mesh)
    with jax.set_mesh(mesh), jaxshard.axis_rules(RULES):
        checked = jax.jit(make_step(True, logical))
        plain = jax.jit(make_step(False))
        jax.block_until_ready((checked(*args), plain(*args)))  # compile both
        ops = [hlo_ops(f.lower(*args).compile().as_text()) for f in (checked, plain)]
        a, b = side_by_side(
            lambda: per_call(checked, args, STEADY_CALLS),
            lambda: per_call(plain, args, STEADY_CALLS),
            rounds=ROUNDS["steady"],
        )
    extra = ops[0] - ops[1]  # ops in the checked program beyond the plain one's
    return a, b, sum(extra.values()), sum(ops[1].values())


def first_call(
    mesh, rounds: int | None = None, clock=time.perf_counter
) -> list[list[float]]:
    """Seconds of `clock` for the first call (trace, compile, run) of the step,
    annotated and not, JAX's caches cleared before each."""
    args = inputs(mesh)

    def compile_and_run(checked: bool) -> float:
        jax.clear_caches()
        step = jax.jit(make_step(checked))
        start = clock()
        jax.block_until_ready(step(*args))
        return clock() - start

    with jax.set_mesh(mesh):
        for checked in (True, False):  # lazy initialisation
            compile_and_run(checked)
        return side_by_side(
            lambda: compile_and_run(True),
            lambda: compile_and_run(False),
            rounds=rounds or ROUNDS["first"],
        )


def eager(mesh) -> list[list[float]]:
    """Per-call seconds of: P annotations, jaxtyping's plain ones, no decorator, and
    logical annotations (under `RULES`)."""

    def f(x, y, z):
        return x

    def sharded(x: X, y: W1, z: W2) -> X:
        return x

    def plain(x: PlainX, y: PlainW1, z: PlainW2) -> PlainX:
        return x

    def logical(x: LX, y: LW1, z: LW2) -> LX:
        return x

    sharded = jaxshard.jaxtyped(sharded, typechecker=beartype)
    plain = jaxtyping.jaxtyped(plain, typechecker=beartype)
    logical = jaxshard.jaxtyped(logical, typechecker=beartype)
    shapes_specs = [
        ((8, 4), P("dp", None)),
        ((4, 8), P(None, "tp")),
        ((8, 4), P("tp", None)),
    ]
    args = [
        jax.device_put(jnp.ones(s), NamedSharding(mesh, p)) for s, p in shapes_specs
    ]

    def timed(fn):
        return lambda: per_call(fn, args, EAGER_CALLS)

    runs = [timed(fn) for fn in (sharded, plain, f, logical)]
    with jaxshard.axis_rules(RULES):
        for run in runs:  # warm up
            run()
        return side_by_side(*runs, rounds=ROUNDS["eager"])


# --- the table ----------------------------------------------------------------------


def main() -> int:
    assert jax.device_count() == 8, jax.devices()
    explicit = jax.make_mesh((4, 2), ("dp", "tp"))
    auto = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    started = time.perf_counter()
    print(
        f"jax {jax.__version__}, {jax.device_count()} CPU devices, mesh dp=4 x tp=2; "
        f"MLP batch={BATCH} d={D} hidden={HIDDEN} layers={LAYERS}"
        + (" (--quick: too few rounds to trust)" if QUICK else ""),
        flush=True,
    )
    rows = [("", "checked", "baseline", "ratio", "target", "")]

    def row(what, checked, baseline, unit, target="-", note=""):
        scale = {"ms": 1e3, "us": 1e6}[unit]
        times = [f"{median(t) * scale:.3g} {unit}" for t in (checked, baseline)]
        ratio = median([c / b for c, b in zip(checked, baseline)])
        rows.append((what, *times, f"{ratio:.3f}", target, note))

    for name, mesh in [("Auto", auto), ("Explicit", explicit)]:
        a, b, extra, total = steady_state(mesh)
        note = f"extra HLO ops: {extra} of {total} (target 0)"
        row(f"(a) jit step, {name} mesh", a, b, "ms", "<= 1.02", note)
    sharded, plain, bare, logical = eager(explicit)
    row("(b) eager call vs jaxtyping", sharded, plain, "us", "<= 1.5")
    note = f"+{(median(sharded) - median(bare)) * 1e6:.0f} us per call"
    row("(b) eager call vs undecorated", sharded, bare, "us", note=note)
    row("(d) eager call, L(...) vs P(...)", logical, sharded, "us", "<= 1.2")
    a, b, extra, total = steady_state(auto, logical=True)
    note = f"extra HLO ops: {extra} of {total} (target 0)"
    row("(d) jit step, logical, Auto", a, b, "ms", "<= 1.02", note)
    for name, mesh in [("Auto", auto), ("Explicit", explicit)]:
        a, b = first_call(mesh, clock=time.process_time)
        row(f"(c) first call, {name} mesh", a, b, "ms", note="trace + compile + run")

    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    seconds = time.perf_counter() - started
    print(f"({seconds:.0f} s; medians over rounds; ratios paired within rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
