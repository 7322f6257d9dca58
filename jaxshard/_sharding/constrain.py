"""`jaxshard.constrain`: `jax.lax.with_sharding_constraint` from an annotation.

`lay_out` is the one way jaxshard puts a value where a spec says, which
`jaxshard.device_put` shares: eagerly a `jax.device_put`; inside `jit`, on Auto axes
a `with_sharding_constraint`, on Explicit axes a `jax.sharding.reshard` (where
`with_sharding_constraint` only asserts the layout the value's type already has:
jax 0.10.2 to 0.12 raise an `AssertionError` for any other), and on a mesh of both,
each for its own axes.
"""

from typing import Any

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
from jax import Array
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from .._annotations.logical import BY_NAME, L, using
from .._annotations.spec import axes_of, fill_unconstrained, format_spec
from .._errors import (
    AnnotationError,
    expect,
    ShardingError,
    TypeCheckError,
    user_facing,
)
from .._jax_internals import ArrayMeta, context_mesh
from .array_types import partition_spec, Shaped
from .compare import invalid
from .describe import describe_array, describe_mesh
from .layout import block_mismatch, spec_global_shape
from .signature import expect_mesh


@user_facing
def constrain(x: Any, annotation: Any, *, mesh: Any = None, rules: Any = None) -> Array:
    """Lays `x` out as `annotation` says: `jax.lax.with_sharding_constraint` driven
    by an annotation, checking the shape and dtype too.

    Inside `jax.jit` on Auto axes it is a sharding constraint, as
    `with_sharding_constraint` (or flax's `nn.with_logical_constraint`) is. On
    Explicit axes, where `with_sharding_constraint` only asserts the layout the
    value's type already has, it is `jax.sharding.reshard`: the value's type
    changes to the annotation's layout. On a mesh of both kinds, each for its own
    axes. Eagerly it is `jax.device_put`. `P.UNCONSTRAINED` dimensions keep the
    layout they have (on Auto axes, XLA chooses it; onto another mesh, the axes of
    that layout must be that mesh's too). Inside a `shard_map` body the
    value is one block of the global array the annotation describes (its shape is
    checked as the global one): the axes the body is manual over are shard_map's
    and stay as its specs have them (a block that differs across one the spec says
    is replicated is a `ShardingError`, as for a `jaxtyped` parameter); the others
    are laid out as above.

    **Arguments:**

    - `x`: an array (or a tracer inside `jit`).
    - `annotation`: a jaxshard annotation, such as an alias
        `Act = Float[Array, "b s d", L("batch", None, "embed")]` (its shape and dtype
        are checked, with the dimension sizes bound in the enclosing `jaxtyped`
        function, if any), or a bare `PartitionSpec` or `jaxshard.L(...)` (only its
        rank is checked). Logical names are resolved under the rules in force.
    - `mesh`: the mesh; by default the one in context (`jax.set_mesh`), else the
        one `x` is laid out on.
    - `rules`: the axis rules for logical names, as `jaxshard.axis_rules` takes
        them; by default those in force.

    **Returns:**

    `x`, laid out as the annotation says.

    **Raises:**

    `jaxtyping.TypeCheckError` if `x`'s shape or dtype does not match the
    annotation; `jaxshard.ShardingError` if the spec cannot lay it out on the mesh
    (an axis the mesh lacks, a dimension the axes do not divide, a `shard_map`
    block that differs across an axis the spec says is replicated).

    !!! Example

        ```python
        Act = Float[Array, "batch seq embed", L("batch", None, "embed")]

        def block(x: Act, w) -> Act:
            h = jaxshard.constrain(x @ w, Act)  # not jax.lax.with_sharding_constraint
            ...
        ```
    """
    with using(rules):
        spec, expected = spec_of(annotation)
    value = x if isinstance(x, jax.Array) else jnp.asarray(x)
    if expected is not None:
        reason = ArrayMeta.__instancecheck_str__(expected, value)
        if reason:
            raise TypeCheckError(
                f"jaxshard.constrain: the value ({_array(value)}) does not match the "
                f"annotation {expected!r}: {reason}\nConstrain an array of the "
                "annotated shape and dtype, or use the annotation this value has."
            )
    target = find_mesh(mesh, [value], "jaxshard.constrain")
    annotation = as_annotation(annotation, "jaxshard.constrain")
    target = _check_fits(value, spec, target, annotation, rules)
    return lay_out(value, spec, target)


def _check_fits(value: Any, spec: PartitionSpec, target: Any, annotation, rules):
    """Raises unless `spec` can lay `value` out on `target`; returns the mesh it is
    laid out on (inside a shard_map body, the body's)."""
    target, shape = laid_out_on(spec, value, target)
    reason = unfit(spec, target, shape)
    if reason:
        raise ShardingError(
            f"jaxshard.constrain: the value ({_array(value)}) cannot be laid out as "
            f"annotated: {reason}. Change the annotation's spec (or the rules), or "
            "the mesh."
        )
    reason = _not_kept(value, spec, target)
    if reason:
        whole = PartitionSpec(
            *(None if e is PartitionSpec.UNCONSTRAINED else e for e in spec)
        )
        raise ShardingError(
            f"jaxshard.constrain: {reason}. Say how to lay those dimensions out on "
            f"this mesh (a spec naming axes it has, or {format_spec(whole)} to "
            "replicate them), or constrain the value on the mesh it is on."
        )
    with using(rules):
        reason = block_mismatch(value, spec, annotation)
    if reason:
        raise ShardingError(f"jaxshard.constrain: {reason} {BLOCK_FIX}")
    return target


def _not_kept(value: Any, spec: PartitionSpec, mesh: Any) -> str:
    """Why the `P.UNCONSTRAINED` dimensions of `spec` cannot keep the layout
    `value` has once it is on `mesh`, another mesh ("" if they can): an axis of
    that layout `mesh` lacks, or one that splits a dimension unevenly there. A
    traced value keeps the layout of its type, on Explicit axes (see `lay_out`)."""
    loose = [i for i, e in enumerate(spec) if e is PartitionSpec.UNCONSTRAINED]
    if isinstance(value, jax.core.Tracer):
        sharding = jax.typeof(value).sharding
        if AxisType.Explicit not in mesh.axis_types:
            return ""
    else:
        sharding = getattr(value, "sharding", None)
    if (
        not loose
        or not isinstance(sharding, NamedSharding)
        or sharding.mesh.shape == mesh.shape  # the same axes: the layout fits
    ):
        return ""
    kept = fill_unconstrained(spec, sharding.spec, mesh.shape)
    has = (
        f"P.UNCONSTRAINED keeps the layout the value ({_array(value)}) has, "
        f"{format_spec(sharding.spec)} on mesh {describe_mesh(sharding.mesh)}"
    )
    missing = [(i, a) for i in loose for a in axes_of(kept[i]) if a not in mesh.shape]
    if missing:
        axes = sorted({a for _, a in missing})
        dims = sorted({i for i, _ in missing})
        return (
            f"mesh {describe_mesh(mesh)} has no axis {', '.join(map(repr, axes))} "
            f"(its axes are {', '.join(map(repr, mesh.axis_names))}), which the "
            f"annotation's spec {format_spec(spec)} keeps in dimension"
            f"{'s' * (len(dims) > 1)} {', '.join(map(str, dims))}: {has}"
        )
    reason = unfit(kept, mesh, tuple(value.shape))
    if not reason:
        return ""
    return (
        f"the annotation's spec {format_spec(spec)} is {format_spec(kept)} for this "
        f"value, and {reason}: {has}"
    )


# What to do about a `block_mismatch`, for the functions that lay values out.
BLOCK_FIX = (
    "Inside shard_map the axes the body is manual over are shard_map's, not "
    "laid out again: name them in the annotation's spec where the array is split "
    "over them, or make the block the same on each of their devices first (e.g. "
    "`jax.lax.psum` or `jax.lax.all_gather` over them)."
)


def laid_out_on(spec: PartitionSpec, value: Any, target: Any) -> tuple[Any, tuple]:
    """The mesh `value` is laid out on, and the shape `spec` describes: `target`
    and the value's shape; inside a `shard_map` body, the body's mesh (the axes it
    is manual over are shard_map's, the others the compiler's) and the global array
    of which the value is one block (`spec_global_shape`)."""
    if isinstance(value, jax.core.Tracer):
        whole = spec_global_shape(spec, value)
        if whole is not None:
            return jax.typeof(value).sharding.mesh, whole
    return target, tuple(np.shape(value))


def spec_of(annotation: Any) -> tuple[PartitionSpec, Any]:
    """The spec an annotation (or a bare `P`/`L`) states under the rules in force,
    and the annotation to check the value's shape and dtype against (`None`)."""
    if isinstance(annotation, PartitionSpec):
        return annotation, None
    if isinstance(annotation, L):
        spec = partition_spec(as_annotation(annotation, "jaxshard.constrain"))
        assert spec is not None
        return spec, None
    as_annotation(annotation, "jaxshard.constrain")  # not BY_NAME
    is_array = isinstance(annotation, type) and issubclass(
        annotation, jaxtyping.AbstractArray
    )
    expect(
        is_array,
        "constrain",
        "annotation",
        "a jaxshard annotation (`Float[Array, 'b d', P('dp', None)]`), a "
        "PartitionSpec or a jaxshard.L(...)",
        annotation,
    )
    spec = partition_spec(annotation)
    if spec is None:
        raise AnnotationError(
            f"jaxshard.constrain: the annotation {annotation!r} states no partition "
            "spec, so it does not say how to lay the value out. Add one as its "
            "third item: `Float[Array, 'b d', P('dp', None)]`."
        )
    return spec, annotation


def as_annotation(annotation: Any, what: str) -> Any:
    """`annotation`, a bare `P` or `L(...)` made the annotation of one array of any
    shape and dtype laid out so, `Shaped[Array, "...", spec]` (only its rank is
    checked): the specs `constrain` takes, for the functions that take a tree's
    annotation (`what`, as messages name it)."""
    if isinstance(annotation, (PartitionSpec, L)):
        return Shaped[Array, "...", annotation]
    if annotation is BY_NAME:
        raise AnnotationError(
            f"{what}: BY_NAME takes its logical names from a shape string; pass an "
            "annotation that has one, e.g. `Float[Array, 'batch embed', BY_NAME]`, "
            "or `jaxshard.L(...)`."
        )
    return annotation


def spec_name(annotation: Any) -> str | None:
    """What messages call a value whose annotation is a bare `P` or `L(...)`: the
    spec as written (`None` for any other annotation)."""
    if isinstance(annotation, PartitionSpec):
        return format_spec(annotation)
    return repr(annotation) if isinstance(annotation, L) else None


def find_mesh(mesh: Any, values: list, what: str) -> Any:
    """`mesh`, else the concrete mesh in context, else (inside `jit`) the abstract
    one, else the mesh the first laid-out value of `values` is on."""
    expect_mesh(mesh, what.removeprefix("jaxshard."))
    if mesh is not None:
        return mesh
    found = context_mesh()
    if found is not None:
        return found
    if any(isinstance(v, jax.core.Tracer) for v in values):
        abstract = jax.sharding.get_abstract_mesh()
        if not abstract.empty:
            return abstract
    for value in values:
        sharding = getattr(value, "sharding", None)
        if isinstance(value, jax.core.Tracer):
            sharding = jax.typeof(value).sharding
        if isinstance(sharding, NamedSharding) and not sharding.mesh.empty:
            return sharding.mesh
    raise ValueError(
        f"{what} needs a mesh: pass `mesh=...`, or call it inside "
        "`with jax.set_mesh(mesh):`."
    )


def unfit(spec: PartitionSpec, mesh: Any, shape: tuple[int, ...]) -> str:
    """Why `spec` cannot lay out an array of `shape` on `mesh` ("" if it can): an
    axis the mesh lacks, more entries than dimensions, a dimension its axes do not
    divide (JAX splits a dimension evenly)."""
    reason = invalid(spec, mesh, len(shape))
    if reason:
        return reason
    sizes = dict(mesh.shape)
    for dim, (size, entry) in enumerate(zip(shape, spec)):
        axes = axes_of(entry)
        parts = int(np.prod([sizes[a] for a in axes])) if axes else 1
        if size % parts:
            names = ", ".join(map(repr, axes))
            return (
                f"{format_spec(spec)} splits dimension {dim} (of size {size}) over "
                f"{names} ({parts} devices) on mesh {describe_mesh(mesh)}, which does "
                "not divide it evenly"
            )
    return ""


def lay_out(value: Any, spec: PartitionSpec, mesh: Any) -> Any:
    """`value` laid out as `spec` on `mesh`: eagerly by `jax.device_put`, inside
    `jit` by `reshard` on Explicit axes and a sharding constraint on Auto axes."""
    if not isinstance(value, jax.core.Tracer):
        if not isinstance(mesh, jax.sharding.Mesh):
            raise ValueError(
                "jaxshard: a concrete array is laid out on a concrete mesh; call it "
                "inside `with jax.set_mesh(mesh):` or pass `mesh=...`."
            )
        sharding = getattr(value, "sharding", None)
        current = sharding.spec if isinstance(sharding, NamedSharding) else ()
        filled = fill_unconstrained(spec, current, mesh.shape)
        return jax.device_put(value, NamedSharding(mesh, filled))
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    explicit = {a for a, t in types.items() if t == AxisType.Explicit}
    auto = {a for a, t in types.items() if t == AxisType.Auto}
    if explicit:
        current = jax.typeof(value).sharding.spec
        part = fill_unconstrained(_only(spec, explicit), current, mesh.shape)
        value = jax.sharding.reshard(value, NamedSharding(mesh, part))
    if auto:
        part = _only(spec, auto)
        value = jax.lax.with_sharding_constraint(value, NamedSharding(mesh, part))
    return value


def _only(spec: PartitionSpec, axes: set[str]) -> PartitionSpec:
    """`spec` naming only the mesh axes in `axes` (`P.UNCONSTRAINED` kept)."""
    entries = []
    for entry in spec:
        if entry is PartitionSpec.UNCONSTRAINED:
            entries.append(entry)
            continue
        kept = tuple(a for a in axes_of(entry) if a in axes)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*entries)


def _array(value: Any) -> str:
    return describe_array(value.dtype, value.shape)
