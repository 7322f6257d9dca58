"""What does `jaxshard.verify` cost over a plain compile at pod scale?

A train step of `examples/transformer.py`'s model at about 59 billion parameters (80
layers, d 8192, 64 heads of 128, MLP hidden size 28672; bfloat16), for a 6,144-chip
TPU v5p slice (`v5p:16x16x24`, mesh dp 6 x fsdp 128 x tp 8, Auto axes), compiled with
libtpu on this CPU-only machine. The step is the forward pass (the layers in a
`lax.scan`, each remat'ed with `jax.checkpoint`, as `examples/moe.py` does), the
gradient of a squared error (`jax.grad`) and an SGD update; batches of 768 sequences
of 2048 tokens.

As `bench_verify.py` measures (and with its helpers): verify (`jaxshard.verify` of the
step, every contract checked, then `report.save`) against a plain
`jax.jit(step).lower(*args).compile()` of the same step with the example's `jaxtyped`
decorators deleted, on the same abstract inputs; each from a cold cache (the
persistent compilation cache off, `jax.clear_caches()` and a garbage collection before
each), the two alternating within a round (A B, B A). The ratio is the median of the
ratios within rounds, of wall-clock and of CPU time.

Run: `python benchmarks/bench_pod.py` (needs libtpu: `pip install 'jaxshard[tpu]'`;
about 3 minutes on two cores); `--quick` for a smoke test (4 layers, one round).

docs/performance.md gives the figures this script prints (section "What verify
costs").
"""

import importlib.util
import os
import pathlib
import sys
import tempfile
import time
from statistics import median


# No TPU here: libtpu only compiles. JAX must not look for one.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from beartype import beartype  # noqa: E402

import jaxshard  # noqa: E402


sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_verify import load, print_table, side_by_side, timed  # noqa: E402


QUICK = "--quick" in sys.argv[1:]  # a smoke test of the script, not a measurement
ROUNDS = 1 if QUICK else 2
TOPOLOGY, AXES = "v5p:16x16x24", {"dp": 6, "fsdp": 128, "tp": 8}
# 80 x (4 x 8192 x 64 x 128 + 2 x 8192 x 28672) = 59.1 billion parameters.
SIZE = {"d": 8192, "heads": 64, "hd": 128, "hidden": 28672}
LAYERS = 4 if QUICK else 80
BATCH, SEQLEN = 768, 2048
TARGET = 1.05


def train_step(m, checked: bool):
    """`(params, x, y) -> params`: one SGD step of the module `m`'s model (layers
    scanned and remat'ed) on the squared error to `y`; decorated as the example's
    functions are if `checked`."""

    def forward(params, x):
        @jax.checkpoint  # each layer keeps its input only; the rest is recomputed
        def layer(x, weights):
            return m.block(m.Block(*weights), x), None

        x, _ = jax.lax.scan(layer, x, params)
        return x

    def step(params: m.Stack, x: m.X, y: m.X) -> m.Stack:
        def loss(params):
            error = (forward(params, x) - y).astype(jnp.float32)
            return jnp.mean(error * error)

        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda w, g: w - 1e-4 * g, params, grads)

    return jaxshard.jaxtyped(typechecker=beartype)(step) if checked else step


def compare(checked_step, plain_step, mesh, dims, rounds: int):
    """(wall, cpu) seconds of verify and of plain, per round."""
    args = jaxshard.abstract_args(checked_step, mesh, dims, jnp.bfloat16)
    snapshots = pathlib.Path(tempfile.mkdtemp())

    def verify():
        report = jaxshard.verify(
            checked_step, mesh=mesh, dims=dims, dtypes=jnp.bfloat16
        )
        report.save(snapshots / "report.json")

    def plain():
        with jax.set_mesh(mesh):  # the model's sharding constraints name mesh axes
            jax.jit(plain_step).lower(*args).compile()

    return side_by_side(lambda: timed(verify), lambda: timed(plain), rounds=rounds)


def main() -> int:
    if importlib.util.find_spec("libtpu") is None:
        print("bench_pod needs libtpu: pip install 'jaxshard[tpu]'")
        return 1
    jax.config.update("jax_enable_compilation_cache", False)
    checked, plain = load("transformer", True), load("transformer_plain", False)
    assert set(SIZE) == set(checked.DIMS), "the example's dimensions have changed"
    mesh = jaxshard.tpu_mesh(TOPOLOGY, AXES, axis_types="auto")
    dims = {**SIZE, "batch": BATCH, "seqlen": SEQLEN, "layers": LAYERS}
    billions = LAYERS * (4 * SIZE["d"] * SIZE["heads"] * SIZE["hd"]) / 1e9
    billions += LAYERS * 2 * SIZE["d"] * SIZE["hidden"] / 1e9
    started = time.perf_counter()
    print(
        f"jax {jax.__version__}; train step of the {LAYERS}-layer transformer "
        f"({billions:.1f}B parameters), {dims}, bfloat16; {TOPOLOGY} "
        f"({mesh.devices.size} x {mesh.devices.flat[0].device_kind}), mesh "
        f"{' x '.join(f'{k}={v}' for k, v in AXES.items())}, Auto axes"
        + (" (--quick: too few rounds to trust)" if QUICK else ""),
        flush=True,
    )
    checked_step, plain_step = train_step(checked, True), train_step(plain, False)
    # Warm up: libtpu's start-up, jaxshard's and beartype's first calls.
    compare(checked_step, plain_step, mesh, {**dims, "layers": 1}, rounds=1)
    a, b = compare(checked_step, plain_step, mesh, dims, rounds=ROUNDS)
    for r, (x, y) in enumerate(zip(a, b)):
        print(
            f"  round {r + 1}: verify {x[0]:.2f} s ({x[1]:.2f} s CPU), plain "
            f"{y[0]:.2f} s ({y[1]:.2f} s CPU)",
            flush=True,
        )
    rows = [
        ("", "verify", "plain", "ratio", "CPU ratio", "target", ""),
        (
            f"{billions:.0f}B train step, {mesh.devices.size} chips",
            f"{median(x[0] for x in a):.2f} s",
            f"{median(y[0] for y in b):.2f} s",
            f"{median([x[0] / y[0] for x, y in zip(a, b)]):.3f}",
            f"{median([x[1] / y[1] for x, y in zip(a, b)]):.3f}",
            f"<= {TARGET}",
            f"rounds: {ROUNDS}",
        ),
    ]
    print_table(rows, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
