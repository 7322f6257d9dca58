"""The hypothesis strategies draw what they promise."""

import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, HealthCheck, settings
from hypothesis.errors import InvalidArgument, Unsatisfiable
from jax import Array
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxshard import (
    BFloat16,
    Bool,
    Float,
    Float8e5m2,
    Float64,
    Int,
    Int4,
    Key,
    Num,
    Shaped,
    strategies as js,
)
from jaxshard._annotations.spec import axes_of


def shards(mesh, entry):
    return math.prod(mesh.shape[a] for a in axes_of(entry))


def mesh_of(sizes, names, kind=AxisType.Explicit):
    devices = jax.devices()[: math.prod(sizes)]
    return jax.make_mesh(sizes, names, axis_types=(kind,) * len(sizes), devices=devices)


def test_devices():
    assert jax.device_count() == 8


@pytest.mark.parametrize("dtype", [Float, Int, Bool, BFloat16, Num, Shaped])
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_arrays_satisfy_annotation(dtype, data):
    mesh = data.draw(js.meshes())
    spec = data.draw(js.partition_specs(2, mesh))
    annotation = dtype[Array, "b d", spec]
    x = data.draw(js.arrays(annotation, mesh))
    assert isinstance(x, annotation)
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)
    assert dtype is Shaped or x.dtype.name in annotation.dtypes
    for size, entry in zip(x.shape, spec):
        assert size % shards(mesh, entry) == 0


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_plain_annotation_is_replicated(data):
    mesh = data.draw(js.meshes())
    x = data.draw(js.arrays(Float[Array, "b"], mesh))
    assert x.sharding == NamedSharding(mesh, P())
    assert isinstance(x, Float[Array, "b", P()])


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_shared_dims(data):
    mesh = data.draw(js.meshes())
    dims = {}
    x = data.draw(js.arrays(Float[Array, "b d", P("a")], mesh, dims))
    w = data.draw(js.arrays(Float[Array, "d e"], mesh, dims))
    assert dims == {"b": x.shape[0], "d": x.shape[1], "e": w.shape[1]}
    assert x.shape[1] == w.shape[0]
    assert x.shape[0] % mesh.shape["a"] == 0


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_bound_dims_are_kept(data):
    mesh = mesh_of((2,), ("a",))
    dims = {"b": 6, "rest": (3,)}
    x = data.draw(js.arrays(Float[Array, "b *rest", P("a")], mesh, dims))
    assert x.shape == (6, 3)
    assert dims == {"b": 6, "rest": (3,)}


def test_indivisible_bound_size_is_rejected():
    mesh = mesh_of((2,), ("a",))

    @settings(max_examples=5, suppress_health_check=list(HealthCheck))
    @given(js.arrays(Float[Array, "b", P("a")], mesh, {"b": 3}))
    def draw(x):
        pass

    with pytest.raises(Unsatisfiable):
        draw()


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_sharded_sizes_are_multiples(data):
    mesh = mesh_of((3, 2), ("a", "b"), AxisType.Auto)
    lo = data.draw(st.integers(0, 4))
    hi = data.draw(st.integers(lo, 12))
    annotation = Float[Array, "n m n", P("a", None, "b")]
    x = data.draw(js.arrays(annotation, mesh, min_size=lo, max_size=hi))
    n, m, n2 = x.shape
    assert n == n2 and n % 6 == 0  # sharded 3 ways at one place, 2 ways at the other
    assert lo <= m <= hi
    assert isinstance(x, annotation)
    y = data.draw(js.arrays(Float[Array, "_ _", P("b", "a")], mesh, min_size=lo))
    assert y.shape[0] % 2 == 0 and y.shape[1] % 3 == 0
    assert isinstance(y, Float[Array, "_ _", P("b", "a")])


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_variadic_dims(data):
    mesh = mesh_of((2, 2), ("a", "b"))
    dims = {}
    x = data.draw(js.arrays(Float[Array, "*batch d", P("a")], mesh, dims))
    y = data.draw(js.arrays(Float[Array, "... d"], mesh, dims))
    assert 0 <= len(dims["batch"]) <= 2
    assert x.shape == (*dims["batch"], dims["d"])
    assert x.shape[0] % 2 == 0  # the first of `batch`, or `d` if `batch` is empty
    assert isinstance(x, Float[Array, "*batch d", P("a")])
    assert 0 <= len(dims["..."]) <= 2
    assert y.shape == (*dims["..."], dims["d"])
    z = data.draw(js.arrays(Float[Array, "*rest", P(None, "a")], mesh))
    assert 2 <= z.ndim <= 4 and z.shape[1] % 2 == 0  # enough dims for the spec


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_symbolic_and_unconstrained(data):
    mesh = mesh_of((2,), ("a",))
    annotation = Float[Array, "n n+1", P(P.UNCONSTRAINED, "a")]
    x = data.draw(js.arrays(annotation, mesh))
    assert x.shape[1] == x.shape[0] + 1
    assert x.shape[1] % 2 == 0
    assert isinstance(x, annotation)


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_elements(data):
    mesh = mesh_of((2,), ("a",))
    x = data.draw(js.arrays(Float[Array, "b", P("a")], mesh, elements=st.just(1.5)))
    assert np.all(np.asarray(x) == 1.5)
    y = data.draw(js.arrays(Float[Array, "b"], mesh))
    assert np.all(np.isfinite(np.asarray(y, np.float32)))
    assert np.all(np.abs(np.asarray(y, np.float32)) <= 100)


@pytest.mark.parametrize("dtype", [Key, Int4, Float8e5m2, Float64])
def test_unsupported_dtype(dtype):
    mesh = mesh_of((1,), ("a",))
    annotation = dtype[Array, "b"]
    with pytest.raises(InvalidArgument, match="cannot draw any dtype") as e:
        js.arrays(annotation, mesh)
    assert all(name in str(e.value) for name in annotation.dtypes)
    assert "jax_enable_x64 (now False)" in str(e.value)


def test_x64_dtypes():
    mesh = mesh_of((1,), ("a",))

    @settings(max_examples=3, deadline=None)
    @given(st.data())
    def draw(data):
        x = data.draw(js.arrays(Float64[Array, "b"], mesh))
        assert x.dtype == jnp.float64

    with jax.enable_x64(True):
        draw()


def test_bad_arguments():
    mesh = mesh_of((2,), ("a",))
    with pytest.raises(InvalidArgument, match="jaxtyping array annotation"):
        js.arrays(float, mesh)
    with pytest.raises(InvalidArgument, match="do not divide it"):
        js.arrays(Float[Array, "3 d", P("a")], mesh)
    with pytest.raises(ValueError, match="not found in mesh"):
        js.arrays(Float[Array, "b", P("dp")], mesh)
    with pytest.raises(InvalidArgument, match="min_size"):
        js.arrays(Float[Array, "b"], mesh, min_size=3, max_size=2)
    with pytest.raises(InvalidArgument, match="max_devices"):
        js.meshes(0)
    with pytest.raises(InvalidArgument, match="distinct"):
        js.meshes(axis_names=("a", "a"))
    with pytest.raises(InvalidArgument, match="ndim"):
        js.partition_specs(-1, mesh)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_meshes(data):
    max_devices = data.draw(st.integers(1, 12))
    kind = data.draw(st.sampled_from([None, AxisType.Explicit, AxisType.Auto]))
    mesh = data.draw(js.meshes(max_devices, axis_names=("x", "y"), axis_types=kind))
    assert 1 <= mesh.size <= min(max_devices, 8)
    assert list(mesh.devices.flat) == jax.devices()[: mesh.size]
    assert mesh.axis_names in (("x",), ("x", "y"))
    allowed = {kind} if kind else {AxisType.Explicit, AxisType.Auto}
    assert set(mesh.axis_types) <= allowed


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_partition_specs(data):
    mesh = data.draw(js.meshes())
    ndim = data.draw(st.integers(0, 3))
    spec = data.draw(js.partition_specs(ndim, mesh))
    assert len(spec) <= ndim
    names = [a for entry in spec for a in axes_of(entry)]
    assert len(names) == len(set(names))
    for entry in spec:
        assert entry is None or isinstance(entry, str) or len(entry) >= 2
    NamedSharding(mesh, spec)
