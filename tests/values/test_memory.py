"""What `checked(jax.jit(f))` keeps per compiled program is bounded as JAX's own
cache is: one frame (and its sites) per program JAX holds, and none of them once
`jax.clear_caches()` drops the programs (but the function's first frame, one per
function). `benchmarks/bench_recompiles_memory.py` measures the memory."""

import gc

import jax
import jax.numpy as jnp
from beartype import beartype
from jax import Array
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard._values.frames import Frame
from jaxshard._values.sites import Site
from jaxshard._values.state import Item


def _live() -> list:
    """The live frames, sites and items."""
    gc.collect()
    return [o for o in gc.get_objects() if type(o) in (Frame, Site, Item)]


def _new(before: dict[int, object]) -> dict[str, int]:
    """How many frames, sites and items live that were not in `before` (which keeps
    those alive, so that no new one takes the id of one)."""
    counts = {"Frame": 0, "Site": 0, "Item": 0}
    for o in _live():
        if id(o) not in before:
            counts[type(o).__name__] += 1
    return counts


def test_what_checked_keeps_per_recompile_goes_with_jax_caches():
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(AxisType.Explicit,))
    sharding = NamedSharding(mesh, P("dp", None))

    @jaxshard.jaxtyped(typechecker=beartype)
    def f(
        x: jaxshard.Float[Array, "b d", P("dp", None)],
    ) -> jaxshard.Float[Array, "b d", P("dp", None)]:
        jaxshard.check_finite(x)
        return x * 2

    g = jaxshard.checked(jax.jit(f))
    before = {id(o): o for o in _live()}
    for k in range(1, 51):  # 50 new shapes: 50 traces and compiles
        x = jax.device_put(jnp.ones((8 * k, 16), jnp.float32), sharding)
        with jax.set_mesh(mesh):
            g(x)
    grown = _new(before)
    assert grown == {"Frame": 50, "Site": 50, "Item": 50}  # one of each per program
    jax.clear_caches()
    left = _new(before)
    assert all(n <= 1 for n in left.values()), left  # the first frame, at most
    bad = jax.device_put(jnp.full((8, 16), jnp.nan, jnp.float32), sharding)
    with jax.set_mesh(mesh):
        try:
            g(bad)
        except jaxshard.CheckError as e:
            assert len(e.failures) == 1
        else:
            raise AssertionError("the check did not fail after clear_caches")
