"""What does `jaxshard.annotate` cost over a `jaxshard.verify` of the same function?

The model is the 24-layer transformer of `examples/transformer.py` (its layers
scanned), on a 256-chip TPU v5e pod (`v5e:16x16`, mesh dp=4 x fsdp=8 x tp=8, Auto
axes) compiled with libtpu on this CPU-only machine, or on 8 simulated CPU devices
without libtpu. Each round measures, alternating (A B, B A, ...) so that drift on a
busy machine hits each alike, after `jax.clear_caches()` and a garbage collection:

- verify: `jaxshard.verify(model, mesh=..., dims=..., dtypes=bfloat16)`;
- annotate: `jaxshard.annotate(model, ...)` with the same arguments, then
    `.diff()`, the patch's text: the observation of every call while verify traces
    and compiles, the inference, and the rewriting of the source.

The table gives the median of each, and the median over rounds of the ratio within a
round, of wall-clock and of CPU time. Run: `python benchmarks/bench_annotate.py`
(`--quick` for a smoke test).
"""

import gc
import importlib.util
import os
import pathlib
import sys
import time
from statistics import median


os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu only compiles

if importlib.util.find_spec("libtpu") is None:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxshard  # noqa: E402


EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))
import transformer  # noqa: E402


def mesh():
    if importlib.util.find_spec("libtpu") is None:
        cpus = jax.make_mesh((2, 2, 2), ("dp", "fsdp", "tp"))
        return "8 simulated CPU devices", cpus
    axes = {"dp": 4, "fsdp": 8, "tp": 8}
    return "v5e:16x16 (256 chips)", jaxshard.tpu_mesh("v5e:16x16", axes)


def timed(fn) -> tuple[float, float]:
    jax.clear_caches()
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> int:
    quick = "--quick" in sys.argv[1:]
    rounds = 2 if quick else 7
    where, m = mesh()
    dims = {**transformer.DIMS, "batch": 256, "seqlen": 2048, "layers": 24}
    args = dict(mesh=m, dims=dims, dtypes=jnp.bfloat16)

    def verify():
        jaxshard.verify(transformer.model, **args)

    def annotate():
        jaxshard.annotate(transformer.model, **args).diff()

    runs = [lambda: timed(verify), lambda: timed(annotate)]
    times: list[list] = [[], []]
    for r in range(rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            times[i].append(runs[i]())
    (v, a) = times
    wall = median(x[0] / y[0] for x, y in zip(a, v))
    cpu = median(x[1] / y[1] for x, y in zip(a, v))
    print(f"jax {jax.__version__}; the transformer (24 layers, scanned) on {where}")
    print(f"  verify     {median(t[0] for t in v):6.2f} s wall")
    print(f"  annotate   {median(t[0] for t in a):6.2f} s wall (with the patch's text)")
    print(f"  annotate / verify: {wall:.3f} wall, {cpu:.3f} CPU (target <= 1.5)")
    print(f"({rounds} rounds, alternating; medians of the ratios within rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
