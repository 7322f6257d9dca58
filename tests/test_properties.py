"""jaxshard's verdict is jax's own `NamedSharding.is_equivalent_to`, on every path:
eager, `jit` on Explicit meshes (trace time), `jit` on Auto meshes (compile time), and
inside `shard_map` (where a block may vary only over the axes its spec names).

Random meshes, specs and shapes (sizes that divide the mesh, size 1, and sizes the
annotation's spec does not divide). `JAXSHARD_PROPERTY_EXAMPLES` sets how many
examples the four paths get in all (`nox -s soak` runs 10,000); by default a few
hundred.
"""

import math
import os

import beartype
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jaxtyping
from hypothesis import given, settings
from jax import Array
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import Float, strategies as js


_TOTAL = int(os.environ.get("JAXSHARD_PROPERTY_EXAMPLES", "0"))


def examples(default: int) -> int:
    """This path's share of `JAXSHARD_PROPERTY_EXAMPLES`, else `default`."""
    return max(1, _TOTAL // 4) if _TOTAL else default


def _axes(entry) -> tuple:
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _ways(mesh, entry) -> int:
    return math.prod(mesh.shape[a] for a in _axes(entry))


@st.composite
def cases(draw, axis_type):
    """`(mesh, shape, expected, actual)`: `actual` divides `shape` (it is a real
    array's sharding); `expected`, the annotation's, need not."""
    mesh = draw(js.meshes(axis_types=axis_type))
    ndim = draw(st.integers(1, 3))
    shape = tuple(
        draw(st.sampled_from([mesh.size, 2 * mesh.size, 1, 3, 5, mesh.size + 1]))
        for _ in range(ndim)
    )
    expected = draw(js.partition_specs(ndim, mesh))
    drawn = draw(js.partition_specs(ndim, mesh))
    actual = P(*(e if n % _ways(mesh, e) == 0 else None for e, n in zip(drawn, shape)))
    return mesh, shape, expected, actual


def oracle(mesh, ndim, expected, actual):
    return NamedSharding(mesh, expected).is_equivalent_to(
        NamedSharding(mesh, actual), ndim
    )


def annotated(expected, ndim):
    dims = " ".join(f"d{i}" for i in range(ndim))

    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    def f(x: Float[Array, dims, expected]):
        return x * 2

    return f


@settings(max_examples=examples(60), deadline=None)
@given(cases(AxisType.Explicit))
def test_eager_and_explicit_trace(case):
    mesh, shape, expected, actual = case
    ndim = len(shape)
    x = jax.device_put(jnp.ones(shape), NamedSharding(mesh, actual))
    want = oracle(mesh, ndim, expected, actual)
    ann = Float[Array, " ".join("_" * ndim), expected]
    assert isinstance(x, ann) == want
    f = annotated(expected, ndim)
    try:
        jax.jit(f).trace(x)
        got = True
    except jaxtyping.TypeCheckError:
        got = False
    assert got == want


@settings(max_examples=examples(25), deadline=None)
@given(cases(AxisType.Auto))
def test_auto_compile(case):
    mesh, shape, expected, actual = case
    ndim = len(shape)
    want = oracle(mesh, ndim, expected, actual)
    f = annotated(expected, ndim)
    x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, actual))
    try:
        jax.jit(f).lower(x).compile()
        got = True
    except jaxshard.ShardingError:
        got = False
    assert got == want


@jaxshard.jaxtyped(typechecker=beartype.beartype)
def layer(
    x: Float[Array, "b d", P("a")], w: Float[Array, "d e"]
) -> Float[Array, "b e"]:
    return x @ w


@settings(max_examples=examples(25), deadline=None)
@given(cases(None))
def test_shard_map(case):
    """Inside `shard_map` a block may differ across the mesh axes its spec names and
    no others: it fails exactly when it varies over an axis the spec leaves out."""
    mesh, shape, expected, actual = case
    ndim = len(shape)
    named = {a for e in expected for a in _axes(e)}
    varying = {a for e in actual for a in _axes(e)}
    want = varying <= named
    dims = " ".join("_" for _ in range(ndim))  # the block's shape is not the point

    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    def body(x: Float[Array, dims, expected]):
        return x

    mapped = jax.shard_map(body, mesh=mesh, in_specs=actual, out_specs=actual)
    x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, actual))
    try:
        jax.jit(mapped).trace(x)
        got = True
    except jaxtyping.TypeCheckError:
        got = False
    assert got == want


@settings(max_examples=examples(40), deadline=None)
@given(st.data())
def test_drawn_arrays_pass_an_annotated_function(data):
    mesh = data.draw(js.meshes())
    dims = {}
    x = data.draw(js.arrays(Float[Array, "b d", P("a")], mesh, dims))
    w = data.draw(js.arrays(Float[Array, "d e"], mesh, dims))
    assert layer(x, w).shape == (dims["b"], dims["e"])
    with jax.set_mesh(mesh):
        assert jax.jit(layer)(x, w).shape == (dims["b"], dims["e"])
