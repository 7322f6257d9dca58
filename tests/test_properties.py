"""jaxshard's verdict is jax's own `NamedSharding.is_equivalent_to`, on every path."""

import math

import beartype
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jaxtyping
from hypothesis import given, settings
from jax import Array
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import Float


NAMES = ("a", "b", "c")


@st.composite
def meshes(draw, axis_type):
    n = draw(st.integers(1, 3))
    sizes = []
    for _ in range(n):
        room = 8 // math.prod(sizes)
        sizes.append(draw(st.sampled_from([s for s in (1, 2, 4, 8) if s <= room])))
    devices = jax.devices()[: math.prod(sizes)]
    return jax.make_mesh(
        tuple(sizes), NAMES[:n], axis_types=(axis_type,) * n, devices=devices
    )


@st.composite
def specs(draw, mesh, ndim):
    unused = list(mesh.axis_names)
    entries = []
    for _ in range(draw(st.integers(0, ndim))):
        k = draw(st.integers(0, min(2, len(unused))))
        axes = draw(st.permutations(unused))[:k] if k else []
        for a in axes:
            unused.remove(a)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return P(*entries)


@st.composite
def cases(draw, axis_type):
    mesh = draw(meshes(axis_type))
    ndim = draw(st.integers(1, 3))
    return mesh, ndim, draw(specs(mesh, ndim)), draw(specs(mesh, ndim))


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
    x = jax.device_put(jnp.ones((8,) * ndim), NamedSharding(mesh, actual))
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
        (8,) * ndim, jnp.float32, sharding=NamedSharding(mesh, actual)
    )
    try:
        jax.jit(f).lower(x).compile()
        got = True
    except jaxshard.ShardingError:
        got = False
    assert got == want
