"""What does `jaxshard.verify` cost over compiling the same model without checks?

The model is the 24-layer transformer of `examples/transformer.py` (4.8 billion
parameters in bfloat16, batches of 256 sequences of 2048 tokens), compiled for a
256-chip TPU v5e pod (`v5e:16x16`, mesh dp=4 x fsdp=8 x tp=8, Auto axes) with libtpu,
on this CPU-only machine. Two ways of stacking the layers:

- `lax.scan` over the stacked weights, as the example does: one layer is traced and
    compiled, whatever the depth;
- a Python loop, unrolled: each of the 24 layers is traced, checked and compiled
    on its own, so the checks' cost is paid 24 times.

A third row is a flax linen decoder the size of flax's lm1b example (8 layers, embed
2048, logical axis names under lm1b's rules, `tests/decoders.py`'s `LinenDecoder`),
its forward pass verified for the same pod on a mesh of its own axes.

Each is measured two ways, alternating within every round (A B, B A, A B, ...) so that
drift on a busy machine hits each alike:

- verify: `jaxshard.verify(model, mesh=..., dims=..., dtypes=bfloat16, against=...)`
    then `report.save(...)`, everything included (building the abstract inputs,
    tracing with every contract checked, compiling, reading the shardings XLA chose,
    the collectives from the compiled program's text, memory and cost analysis,
    comparing with a golden snapshot, written once before the rounds, and writing a
    new one);
- plain: `jax.jit(model).lower(*args).compile()` of the same model with no checks at
    all, on the same abstract inputs (`jaxshard.abstract_args`, so the same input
    shardings), built outside the timed region.

Before each measurement `jax.clear_caches()` runs, then the garbage collector (so that
neither measurement pays for collecting the other's garbage), and a fresh `jax.jit`
object is made (verify makes its own); the persistent compilation cache is off. So
every measurement traces and compiles from scratch. The table shows the median
wall-clock time of each, and the median over rounds of the ratio within a round: of
wall-clock time, and of CPU time, which other work on a shared machine disturbs less.

Run: `python benchmarks/bench_verify.py` (needs libtpu: `pip install 'jaxshard[tpu]'`);
`--quick` for a smoke test.

docs/performance.md gives the figures this script prints
(its sections "What verify costs" and "The report page").
"""

import gc
import importlib.util
import os
import pathlib
import re
import sys
import tempfile
import time
from collections import Counter
from statistics import median


# No TPU here: libtpu only compiles. JAX must not look for one.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxshard  # noqa: E402


QUICK = "--quick" in sys.argv[1:]  # a smoke test of the script, not a measurement
# Even (but for --quick), so that each of the two goes first in as many rounds.
ROUNDS = {
    "scan": 2 if QUICK else 10,
    "unrolled": 1 if QUICK else 4,
    "linen": 2 if QUICK else 6,
}
LAYERS = 24
TOPOLOGY, AXES = "v5e:16x16", {"dp": 4, "fsdp": 8, "tp": 8}
EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "transformer.py"
DECORATOR = "@jaxshard.jaxtyped(typechecker=beartype)\n"


def load(name: str, checked: bool):
    """The example as a module; `checked=False` deletes its decorator lines first.

    That is the honest baseline: the same functions, calling each other as before,
    but nothing reads their annotations, so there is no typechecker, no sharding check
    and nothing added to the program. (The annotations are still evaluated, once, at
    import; JAX never looks at them. `jaxshard.config(sharding="off")` would not do:
    the typechecker and jaxtyping's shape checks would still run.)
    """
    source = EXAMPLE.read_text()
    if not checked:
        assert source.count(DECORATOR) >= 6, "the example's decorators have changed"
        source = source.replace(DECORATOR, "")
    return module_from(name, EXAMPLE, source)


def module_from(name: str, path: pathlib.Path, source: str):
    """The module `name` made from `source`, an edited copy of the file at `path`
    (its functions' code still names `path`, so lines and frames are the file's)."""
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(path)
    sys.modules[name] = module  # for the NamedTuples' and beartype's sake
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def unrolled(m):
    """The example's model with its `lax.scan` replaced by a Python loop."""

    def model(params: m.Stack, x: m.X) -> m.X:
        for i in range(LAYERS):
            x = m.block(m.Block(*(w[i] for w in params)), x)
        return x

    return model


# lm1b's size, for the flax linen decoder of tests/decoders.py: 8 layers, embed 2048.
LM1B = {"VOCAB": 32000, "EMBED": 2048, "MLP": 8192, "LAYERS": 8, "BATCH": 256}
LM1B_LENGTH = 512
LM1B_AXES = {"data": 4, "fsdp": 8, "tensor": 8}  # the decoder's rules name these
DECODERS = pathlib.Path(__file__).parent.parent / "tests" / "decoders.py"


def linen(name: str, checked: bool):
    """tests/decoders.py at lm1b's size, its decorators deleted if not `checked`;
    the forward `(params, tokens) -> logits`, and its abstract inputs placed as the
    parameters' metadata says under the decoder's rules."""

    source = DECODERS.read_text()
    if not checked:
        assert source.count("    @jaxshard.jaxtyped\n") >= 9
        source = source.replace("    @jaxshard.jaxtyped\n", "")
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(DECODERS)
    sys.modules[name] = module
    exec(compile(source, str(DECODERS), "exec"), module.__dict__)
    module.__dict__.update(LM1B, LENGTH=LM1B_LENGTH)
    model = module.LinenDecoder(layers=LM1B["LAYERS"])

    def forward(params, tokens):
        return model.apply({"params": params}, tokens)

    return module, model, forward


def lm1b_inputs(module, model, mesh) -> dict:
    import flax.linen as nn

    tokens = jax.ShapeDtypeStruct((LM1B["BATCH"], LM1B_LENGTH), jnp.int32)
    key = jax.random.key(0)
    with nn.logical_axis_rules(module.RULES):
        abstract = jax.eval_shape(model.init, key, tokens)["params"]
        specs = nn.get_partition_spec(abstract)
        shardings = nn.logical_to_mesh_sharding(specs, mesh, module.RULES)
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        nn.unbox(abstract),
        shardings,
    )
    batch = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(("data", "fsdp"))
    )
    return {
        "params": params,
        "tokens": jax.ShapeDtypeStruct(tokens.shape, tokens.dtype, sharding=batch),
    }


def compare_linen(mesh, rounds: int):
    """As `compare`, for the linen decoder's forward at lm1b's size."""
    import flax.linen as nn

    checked_module, checked_model, checked_forward = linen("decoders_checked", True)
    _, _, plain_forward = linen("decoders_plain", False)
    values = lm1b_inputs(checked_module, checked_model, mesh)
    rules = checked_module.RULES
    programs = {}

    def verify():
        with nn.logical_axis_rules(rules):
            report = jaxshard.verify(checked_forward, mesh=mesh, values=values)
        programs["checked"] = report.compiled
        programs["rows"] = len(report.rows)
        programs["report"] = report

    def plain():
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            lowered = jax.jit(plain_forward).lower(values["params"], values["tokens"])
            programs["plain"] = lowered.compile()

    a, b = side_by_side(lambda: timed(verify), lambda: timed(plain), rounds=rounds)
    ops = {k: hlo_ops(programs[k].as_text()) for k in ("checked", "plain")}
    extra = ops["checked"] - ops["plain"]
    report = programs["report"]
    page = (
        f"its report page (report.html()): {len(report.html().encode()) / 1024:.0f} "
        f"KiB, of {len(report.collectives)} collectives and {len(report.inputs)} inputs"
    )
    return a, b, sum(extra.values()), sum(ops["plain"].values()), programs["rows"], page


# --- measuring ----------------------------------------------------------------------


def print_table(rows: list, started: float) -> None:
    """`rows` (a header, then the variants' rows) in columns, and what they are."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    seconds = time.perf_counter() - started
    print(
        f"({seconds:.0f} s; wall-clock times, medians over rounds; ratios paired "
        "within rounds, of wall-clock and of CPU time)"
    )


def side_by_side(*runs, rounds: int) -> list[list]:
    """What each of `runs` returns in each round; rounds run AB, BA, AB, ..."""
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


def timed(fn) -> tuple[float, float]:
    """Wall-clock and CPU seconds (all of this process's threads) of `fn()`. Other
    work on a shared machine stretches the first more than the second."""
    jax.clear_caches()
    gc.collect()  # so that neither pays for collecting the other's garbage
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def compare(checked_model, plain_model, mesh, dims, rounds: int):
    """(wall, cpu) seconds of verify and of plain, per round, and the number of
    operations the checked program has beyond the plain one's, and the plain one's."""
    args = jaxshard.abstract_args(checked_model, mesh, dims, jnp.bfloat16)
    programs = {}
    snapshots = pathlib.Path(tempfile.mkdtemp())
    golden = snapshots / "golden.json"
    jaxshard.verify(checked_model, mesh=mesh, dims=dims, dtypes=jnp.bfloat16).save(
        golden
    )

    def verify():
        report = jaxshard.verify(
            checked_model, mesh=mesh, dims=dims, dtypes=jnp.bfloat16, against=golden
        )
        report.save(snapshots / "new.json")
        programs["checked"] = report.compiled

    def plain():
        with jax.set_mesh(mesh):  # the model's sharding constraints name mesh axes
            programs["plain"] = jax.jit(plain_model).lower(*args).compile()

    a, b = side_by_side(lambda: timed(verify), lambda: timed(plain), rounds=rounds)
    ops = {k: hlo_ops(p.as_text()) for k, p in programs.items()}
    extra = ops["checked"] - ops["plain"]  # ops in the checked program beyond plain's
    return a, b, sum(extra.values()), sum(ops["plain"].values())


# --- the table ----------------------------------------------------------------------


def main() -> int:
    if importlib.util.find_spec("libtpu") is None:
        print("bench_verify needs libtpu: pip install 'jaxshard[tpu]'")
        return 1
    jax.config.update("jax_enable_compilation_cache", False)
    checked, plain = load("transformer", True), load("transformer_plain", False)
    mesh = jaxshard.tpu_mesh(TOPOLOGY, AXES, axis_types="auto")
    dims = {**checked.DIMS, "batch": 256, "seqlen": 2048, "layers": LAYERS}
    started = time.perf_counter()
    print(
        f"jax {jax.__version__}; {LAYERS}-layer transformer, {dims}, bfloat16; "
        f"{TOPOLOGY} ({mesh.devices.size} x {mesh.devices.flat[0].device_kind}), "
        f"mesh {' x '.join(f'{k}={v}' for k, v in AXES.items())}, Auto axes"
        + (" (--quick: too few rounds to trust)" if QUICK else ""),
        flush=True,
    )
    # Warm up: libtpu's start-up, jaxshard's and beartype's first calls.
    compare(checked.model, plain.model, mesh, {**dims, "layers": 1}, rounds=1)

    rows = [("", "verify", "plain", "ratio", "CPU ratio", "target", "")]
    variants = [
        ("scan", checked.model, plain.model),
        ("unrolled", unrolled(checked), unrolled(plain)),
    ]
    for name, checked_model, plain_model in variants:
        a, b, extra, total = compare(
            checked_model, plain_model, mesh, dims, rounds=ROUNDS[name]
        )
        wall = median([x[0] / y[0] for x, y in zip(a, b)])
        cpu = median([x[1] / y[1] for x, y in zip(a, b)])
        rows.append(
            (
                f"{LAYERS} layers, {'lax.scan' if name == 'scan' else 'Python loop'}",
                f"{median(x[0] for x in a):.2f} s",
                f"{median(y[0] for y in b):.2f} s",
                f"{wall:.3f}",
                f"{cpu:.3f}",
                "<= 1.05",
                f"rounds: {ROUNDS[name]}; extra HLO ops: {extra} of {total} (target 0)",
            )
        )
        print(f"  {rows[-1][0]}: done", flush=True)

    # lm1b's size: a flax linen decoder (tests/decoders.py), its forward verified
    # from its parameters' own metadata under its logical rules.
    lm1b_mesh = jaxshard.tpu_mesh(TOPOLOGY, LM1B_AXES, axis_types="auto")
    a, b, extra, total, contracts, page = compare_linen(
        lm1b_mesh, rounds=ROUNDS["linen"]
    )
    rows.append(
        (
            f"linen decoder, {LM1B['LAYERS']} layers, embed {LM1B['EMBED']}",
            f"{median(x[0] for x in a):.2f} s",
            f"{median(y[0] for y in b):.2f} s",
            f"{median([x[0] / y[0] for x, y in zip(a, b)]):.3f}",
            f"{median([x[1] / y[1] for x, y in zip(a, b)]):.3f}",
            "<= 1.05",
            f"rounds: {ROUNDS['linen']}; {contracts} contracts; extra HLO ops: "
            f"{extra} of {total} (target 0)",
        )
    )
    print(f"  {rows[-1][0]}: done", flush=True)

    print_table(rows, started)
    print(f"The linen decoder's {page}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
