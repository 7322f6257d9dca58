"""What does a recompile keep in memory? Each figure is measured in a fresh process.

A small `jaxshard.jaxtyped` function with a sharding contract on its input
(`Float[Array, "b d", P("dp", None)]`, beartype) and a value check
(`jaxshard.check_finite`) runs on a mesh of 8 CPU devices, given `x` of shape
`(8 * k, 16)` placed with `NamedSharding` for k in 1..N (N = 350): a new shape, so a
new trace and compile, at each call. After a warm-up of a few shapes, the process's
resident memory (VmRSS in /proc/self/status, after `gc.collect()`) is read before
and after the N calls, for

(a) `jax.jit(f)`, the plain program, and
(b) `jaxshard.checked(jax.jit(f))`, the same with its check compiled in.

The table shows each one's growth per recompile, the ratio (target: checked's within
1.10x of plain's), and what remains of the growth after `jax.clear_caches()` and
`gc.collect()`: what jaxshard keeps per program must go with JAX's caches, so the
difference between the two should go too. The allocator keeps some freed memory, so
"after clear" is an upper bound of what is still held.

Each variant runs in its own interpreter, ROUNDS times, alternating which runs first;
the table shows the medians. Memory is not time: a busy machine changes it little.

Run: `python benchmarks/bench_recompiles_memory.py` (or `nox -s bench`); `--quick`
for a smoke test. docs/performance.md gives the figures (its section "Memory per
recompile: `bench_recompiles_memory.py`").
"""

import json
import os
import subprocess
import sys
from statistics import median


QUICK = "--quick" in sys.argv[1:]  # a smoke test of the script, not a measurement
N = 30 if QUICK else 350
WARMUP = 3 if QUICK else 20
ROUNDS = 1 if QUICK else 3


def _rss() -> int:
    """The process's resident memory now, in bytes (after a collection)."""
    import gc

    gc.collect()
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _child(variant: str, n: int, warmup: int) -> dict:
    """In a fresh process: the RSS growth over `n` new shapes, and after clearing
    JAX's caches."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    from beartype import beartype
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxtyping import Array

    import jaxshard

    mesh = jax.make_mesh((8,), ("dp",), axis_types=(jax.sharding.AxisType.Explicit,))
    sharding = NamedSharding(mesh, P("dp", None))

    @jaxshard.jaxtyped(typechecker=beartype)
    def f(
        x: jaxshard.Float[Array, "b d", P("dp", None)],
    ) -> jaxshard.Float[Array, "b d", P("dp", None)]:
        jaxshard.check_finite(x)
        return x * 2

    g = jax.jit(f) if variant == "plain" else jaxshard.checked(jax.jit(f))

    def call(k: int) -> None:
        x = jax.device_put(jnp.ones((8 * k, 16), jnp.float32), sharding)
        with jax.set_mesh(mesh):
            jax.block_until_ready(g(x))

    for k in range(1, warmup + 1):
        call(k)
    before = _rss()
    for k in range(warmup + 1, warmup + n + 1):
        call(k)
    after = _rss()
    jax.clear_caches()
    cleared = _rss()
    return {"growth": after - before, "after_clear": cleared - before}


def _run(variant: str) -> dict:
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); "
        "import bench_recompiles_memory as b; "
        "print(json.dumps(b._child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(
        [sys.executable, "-c", code, here, variant, str(N), str(WARMUP)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    import jax

    results: dict[str, list[dict]] = {"plain": [], "checked": []}
    for r in range(ROUNDS):
        order = ["plain", "checked"] if r % 2 == 0 else ["checked", "plain"]
        for variant in order:
            results[variant].append(_run(variant))

    def per(variant: str, key: str) -> float:
        return median(res[key] for res in results[variant]) / N / 1024

    print(f"jax {jax.__version__}; {N} new shapes, {ROUNDS} rounds (medians)")
    print(f"{'':<28}{'KiB per recompile':>18}{'MiB in all':>12}{'after clear':>14}")
    for variant, name in [("plain", "jax.jit(f)"), ("checked", "checked(jax.jit(f))")]:
        growth, cleared = per(variant, "growth"), per(variant, "after_clear")
        print(
            f"{name:<28}{growth:>18.1f}{growth * N / 1024:>12.1f}"
            f"{cleared * N / 1024:>11.1f} MiB"
        )
    plain, checked = per("plain", "growth"), per("checked", "growth")
    extra = checked - plain
    print(f"checked / plain: {checked / plain:.2f}x (target <= 1.10x)")
    print(f"checked - plain: {extra:.1f} KiB per recompile")
    difference = (per("checked", "after_clear") - per("plain", "after_clear")) * N
    print(f"after jax.clear_caches(): checked - plain = {difference / 1024:.1f} MiB")


if __name__ == "__main__":
    main()
