"""Hypothesis strategies: arrays that satisfy an annotation, meshes, partition specs.

This module needs `hypothesis`, which jaxshard itself does not depend on.
"""

import math
from collections.abc import MutableMapping
from typing import Any

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
from hypothesis import reject, strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.extra import numpy as hnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ._annotations import tensors
from ._annotations.dims import Dim, dimensions, shape
from ._annotations.logical import using
from ._annotations.spec import axes_of
from ._errors import AnnotationError
from ._sharding.array_types import partition_spec


__all__ = ["arrays", "meshes", "partition_specs"]

# The dtypes `hypothesis.extra.numpy` can draw; bfloat16 is drawn as float32, rounded.
_DTYPES = tuple(
    "bool uint8 uint16 uint32 uint64 int8 int16 int32 int64 float16 bfloat16 float32 "
    "float64 complex64 complex128".split()
)
# Default values: moderate floats, by kind.
_BOUNDS = {"f": {"min_value": -100, "max_value": 100}, "c": {"max_magnitude": 100}}


def arrays(
    annotation: Any,
    mesh: Mesh,
    dims: MutableMapping[str, Any] | None = None,
    *,
    elements: st.SearchStrategy | None = None,
    min_size: int = 1,
    max_size: int = 8,
    rules: Any = None,
) -> st.SearchStrategy[jax.Array]:
    """Draws `jax.Array`s whose dtype, shape and sharding satisfy `annotation`
    (torchax tensors on the 'jax' device for a `torch.Tensor` annotation).

    The dtype is one the annotation allows, among bool, (u)int8-64, float16, bfloat16,
    float32, float64, complex64 and complex128 (64-bit ones need `jax_enable_x64`).
    A dimension gets a size in `[min_size, max_size]`, a variadic one (`*batch`, `...`)
    0 to 2 of them. A dimension the spec shards gets a multiple of its number of shards
    (the product of the sizes of the mesh axes in its entry), the smallest one from
    `min_size` up if none is in range. A size bound earlier that the shards do not
    divide (one given in `dims`, or bound by an annotation that does not shard it)
    makes hypothesis reject the example, as `assume(False)` would.

    **Arguments:**

    - `annotation`: a jaxtyping or jaxshard annotation, e.g.
        `Float[Array, "batch d", P("dp", None)]`. Without a spec, arrays are drawn
        replicated.
    - `mesh`: the `jax.sharding.Mesh` to place arrays on (Explicit or Auto axes).
    - `dims`: sizes by dimension name (`{"batch": 8}`; `{"rest": (2, 3)}` for
        `*rest`, `{"...": ()}` for `...`), to which a draw adds the sizes it picks.
        Share one dict, made inside the test, between the draws of one example so that
        each name has one size; `None` (the default) binds afresh in each draw.
    - `elements`: a strategy for the values, for every dtype drawn. By default floats
        are finite and at most 100 in magnitude; integers and bools are unrestricted.
    - `min_size`, `max_size`: keyword-only, bounds on each size drawn.
    - `rules`: keyword-only, the axis rules for a logical annotation (`L(...)`,
        `BY_NAME`), as `jaxshard.axis_rules` takes them; by default those in force
        when the strategy is made.

    **Returns:**

    A strategy of `jax.Array`s, placed with `NamedSharding(mesh, spec)`.

    !!! Example

        ```python
        from hypothesis import given, strategies as st
        from jaxshard import strategies as js

        @given(st.data())
        def test_layer(data):
            dims = {}
            x = data.draw(js.arrays(Float[Array, "b d", P("dp")], mesh, dims))
            w = data.draw(js.arrays(Float[Array, "d e"], mesh, dims))
            layer(x, w)  # x.shape[1] == w.shape[0]
        ```
    """
    if not (
        isinstance(annotation, type) and issubclass(annotation, jaxtyping.AbstractArray)
    ):
        raise InvalidArgument(
            "arrays(annotation, mesh) takes a jaxtyping array annotation such as "
            f"Float[Array, 'batch d', P('dp', None)]; got {annotation!r}."
        )
    if not 0 <= min_size <= max_size:
        raise InvalidArgument(
            f"arrays() needs 0 <= min_size <= max_size; got {min_size}, {max_size}."
        )
    try:
        with using(rules):
            spec = partition_spec(annotation) or PartitionSpec()
    except AnnotationError as e:
        raise InvalidArgument(str(e)) from None
    # Unconstrained dimensions are drawn replicated.
    placed = PartitionSpec(
        *[None if e is PartitionSpec.UNCONSTRAINED else e for e in spec]
    )
    sharding = NamedSharding(mesh, placed)  # raises if the spec names other axes
    shards = [math.prod(mesh.shape[a] for a in axes_of(e)) for e in spec]
    for dim in dimensions(annotation):
        axis = _axis(annotation, dim, {})
        if dim.kind == "fixed" and axis is not None and axis < len(shards):
            if dim.size % shards[axis]:  # pyright: ignore[reportOptionalOperand]
                raise InvalidArgument(
                    f"In {annotation!r} the dimension of size {dim.size} is split "
                    f"into {shards[axis]} shards on this mesh, which do not divide it."
                )
    dtypes = _dtypes(annotation)
    return _arrays(
        annotation, sharding, shards, dtypes, dims, elements, (min_size, max_size)
    )


def _dtypes(annotation) -> list[np.dtype]:
    allowed = annotation.dtypes
    if not isinstance(allowed, (tuple, list)):  # `Shaped`: any dtype
        allowed = _DTYPES
    out = {}
    for name in allowed:
        try:
            dtype = jnp.dtype(name)
        except TypeError:
            continue
        if dtype.name in _DTYPES and jax.dtypes.canonicalize_dtype(dtype) == dtype:
            out[dtype] = None
    if not out:
        raise InvalidArgument(
            f"arrays() cannot draw any dtype {annotation!r} allows "
            f"({', '.join(allowed)}). It draws {', '.join(_DTYPES)}; the 64-bit ones "
            f"only with jax_enable_x64 (now {jax.config.jax_enable_x64})."
        )
    return list(out)


def _axis(annotation, dim: Dim, dims) -> int | None:
    """The array axis of `dim`: not known if it follows a variadic dimension that is
    not bound yet."""
    variadic = annotation.index_variadic
    if variadic is None or dim.position <= variadic:
        return dim.position
    name = dimensions(annotation)[variadic].name
    if not isinstance(dims.get(name), tuple):
        return None
    return dim.position - 1 + len(dims[name])


@st.composite
def _arrays(draw, annotation, sharding, shards, dtypes, dims, elements, sizes):
    dims = {} if dims is None else dims
    lo, hi = sizes
    order = dimensions(annotation)

    def multiple(k: int) -> int:
        m = -(-lo // k)
        return k * draw(st.integers(m, max(m, hi // k)))

    def shards_at(axis: int | None) -> int:
        return shards[axis] if axis is not None and axis < len(shards) else 1

    def fill(dim: Dim, name: str):
        if dim.kind == "variadic":
            least = max(0, len(shards) - len(order) + 1)  # a dimension for each entry
            n = draw(st.integers(least, max(least, 2)))
            return tuple(multiple(shards_at(dim.position + i)) for i in range(n))
        if dim.kind == "anonymous":
            return multiple(shards_at(_axis(annotation, dim, dims)))
        if dim.kind == "symbolic":  # `batch-1`: rejected below if it does not divide
            return multiple(1)
        # A name may occur more than once: a multiple of the shards at each place.
        same = [d for d in order if d.kind == "named" and d.name == name]
        at = [_axis(annotation, d, dims) for d in same]
        return multiple(math.lcm(*map(shards_at, at)))

    shape_, _ = shape(annotation, dims, fill)
    assert shape_ is not None
    if len(shape_) < len(shards) or any(s < 0 for s in shape_):
        reject()  # e.g. `n-1` with n = 0, or a variadic dimension bound too short
    if any(s % k for s, k in zip(shape_, shards)):
        reject()
    dtype = draw(st.sampled_from(dtypes))
    drawn = np.dtype(np.float32) if dtype == jnp.bfloat16 else dtype
    if elements is None and drawn.kind in _BOUNDS:
        finite = {"allow_nan": False, "allow_infinity": False}
        elements = hnp.from_dtype(drawn, **finite, **_BOUNDS[drawn.kind])
    x = draw(hnp.arrays(drawn, shape_, elements=elements))
    array = jax.device_put(x.astype(dtype), sharding)
    if tensors.is_tensor_type(annotation.array_type):
        return tensors.from_jax(array)
    return array


def meshes(
    max_devices: int = 8,
    *,
    axis_names: tuple[str, ...] = ("a", "b", "c"),
    axis_types: AxisType | None = None,
) -> st.SearchStrategy[Mesh]:
    """Draws meshes of one or more axes over the first devices.

    **Arguments:**

    - `max_devices`: at most this many devices (and at most `jax.device_count()`).
    - `axis_names`: the names of the axes; a mesh of `n` axes uses the first `n`.
    - `axis_types`: one `jax.sharding.AxisType` for every axis; by default each axis
        is drawn Explicit or Auto.

    **Returns:**

    A strategy of `jax.sharding.Mesh`es over the first devices, with axis sizes
    (1 or more) whose product is at most `max_devices`.

    !!! Example

        ```python
        @given(js.meshes(axis_types=AxisType.Explicit))
        def test_on_any_mesh(mesh): ...
        ```
    """
    names = tuple(axis_names)
    if not names or len(set(names)) != len(names):
        raise InvalidArgument(f"meshes() needs distinct axis names; got {names!r}.")
    if max_devices < 1:
        raise InvalidArgument(f"meshes() needs max_devices >= 1; got {max_devices}.")
    return _meshes(max_devices, names, axis_types)


@st.composite
def _meshes(draw, max_devices, names, axis_type):
    limit = min(max_devices, jax.device_count())
    sizes = []
    for _ in range(draw(st.integers(1, len(names)))):
        sizes.append(draw(st.integers(1, limit // math.prod(sizes))))
    kinds = st.sampled_from([AxisType.Explicit, AxisType.Auto])
    types = tuple(draw(kinds) if axis_type is None else axis_type for _ in sizes)
    devices = jax.devices()[: math.prod(sizes)]
    return jax.make_mesh(
        tuple(sizes), names[: len(sizes)], axis_types=types, devices=devices
    )


def partition_specs(ndim: int, mesh: Mesh) -> st.SearchStrategy[PartitionSpec]:
    """Draws partition specs for an array of `ndim` dimensions on `mesh`.

    **Arguments:**

    - `ndim`: the number of dimensions; a spec has at most this many entries.
    - `mesh`: the mesh whose axes the specs name.

    **Returns:**

    A strategy of `PartitionSpec`s whose entries are each `None`, one axis name or a
    tuple of several, naming each mesh axis at most once. Whether the shards divide an
    array's sizes is left to the caller.

    !!! Example

        ```python
        @given(st.data())
        def test_specs(data):
            mesh = data.draw(js.meshes())
            spec = data.draw(js.partition_specs(2, mesh))  # e.g. P(("b", "a"), None)
        ```
    """
    if ndim < 0:
        raise InvalidArgument(f"partition_specs() needs ndim >= 0; got {ndim}.")
    return _partition_specs(ndim, tuple(mesh.axis_names))


@st.composite
def _partition_specs(draw, ndim, names):
    unused = draw(st.permutations(names))
    entries = []
    for _ in range(draw(st.integers(0, ndim))):
        k = draw(st.integers(0, len(unused)))
        axes, unused = tuple(unused[:k]), unused[k:]
        entries.append(None if k == 0 else axes[0] if k == 1 else axes)
    return PartitionSpec(*entries)
