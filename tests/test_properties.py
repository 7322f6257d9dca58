"""jaxshard's verdict is jax's own `NamedSharding.is_equivalent_to`, on every path."""

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


@st.composite
def cases(draw, axis_type):
    mesh = draw(js.meshes(axis_types=axis_type))
    ndim = draw(st.integers(1, 3))
    return (
        mesh,
        ndim,
        draw(js.partition_specs(ndim, mesh)),
        draw(js.partition_specs(ndim, mesh)),
    )


def full_shape(mesh, ndim):
    """Every spec divides this shape: each axis size divides the mesh's size."""
    return (mesh.size,) * ndim


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


@settings(max_examples=60, deadline=None)
@given(cases(AxisType.Explicit))
def test_eager_and_explicit_trace(case):
    mesh, ndim, expected, actual = case
    x = jax.device_put(jnp.ones(full_shape(mesh, ndim)), NamedSharding(mesh, actual))
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


@settings(max_examples=25, deadline=None)
@given(cases(AxisType.Auto))
def test_auto_compile(case):
    mesh, ndim, expected, actual = case
    want = oracle(mesh, ndim, expected, actual)
    f = annotated(expected, ndim)
    x = jax.ShapeDtypeStruct(
        full_shape(mesh, ndim), jnp.float32, sharding=NamedSharding(mesh, actual)
    )
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


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_drawn_arrays_pass_an_annotated_function(data):
    mesh = data.draw(js.meshes())
    dims = {}
    x = data.draw(js.arrays(Float[Array, "b d", P("a")], mesh, dims))
    w = data.draw(js.arrays(Float[Array, "d e"], mesh, dims))
    assert layer(x, w).shape == (dims["b"], dims["e"])
    with jax.set_mesh(mesh):
        assert jax.jit(layer)(x, w).shape == (dims["b"], dims["e"])
