"""The verdict on one layout: how a sharding differs from an annotation's spec, as the
end of a sentence ("" if it does not)."""

import functools as ft

from jax.sharding import NamedSharding, PartitionSpec

from .._annotations.spec import (
    axes_of,
    fill_unconstrained,
    format_spec,
    sharded_type,
)
from .._errors import did_you_mean
from .describe import describe_mesh, describe_sharding


# --- comparing shardings ------------------------------------------------------------


def missing_axes(spec: PartitionSpec, mesh) -> str:
    """Why `spec` cannot be placed on `mesh`: the axes it names that the mesh lacks
    ("" if none). The one wording of this mistake: eager, jit, `shardings`, `verify`."""
    names = [a for entry in spec for a in axes_of(entry) if a not in mesh.axis_names]
    if not names:
        return ""
    return (
        f"the annotation's spec {format_spec(spec)} names mesh "
        f"ax{'is' if len(names) == 1 else 'es'} {', '.join(map(repr, names))}"
        f"{did_you_mean(names, mesh.axis_names, inline=True)}, but the mesh "
        f"{describe_mesh(mesh)} has axes {', '.join(map(repr, mesh.axis_names))}"
    )


def invalid(spec: PartitionSpec, mesh, ndim: int) -> str:
    """Why `spec` cannot describe an array of `ndim` dimensions on `mesh`; ""."""
    reason = missing_axes(spec, mesh)
    if not reason and len(spec) > ndim:
        reason = (
            f"the annotation's spec {format_spec(spec)} has {len(spec)} entries but "
            f"the array has {ndim} dimensions"
        )
    return reason


@ft.lru_cache(maxsize=4096)
def compare(spec: PartitionSpec, actual, shape: tuple, dtype, mesh=None) -> str:
    """How `actual` differs from `NamedSharding(mesh, spec)` for an array of `shape`
    and `dtype`, as the end of a sentence, each layout also in JAX's notation
    (`float32[8@dp,4]`); "" if the two are equivalent. `mesh` defaults to `actual`'s
    own."""
    ndim = len(shape)
    if mesh is None:
        mesh = actual.mesh
    reason = invalid(spec, mesh, ndim)
    if reason:
        return reason
    # Unconstrained dimensions are not checked: take the actual entry there.
    same_mesh = isinstance(actual, NamedSharding) and actual.mesh == mesh
    filled = fill_unconstrained(spec, actual.spec if same_mesh else (), mesh.shape)
    expected = NamedSharding(mesh, filled)
    if expected.is_equivalent_to(actual, ndim):
        return ""
    found = describe_sharding(actual, ndim)
    if isinstance(actual, NamedSharding):
        found += f" ({sharded_type(dtype, shape, actual.spec)})"
    return (
        f"is {found}, but the annotation expects {format_spec(spec)} "
        f"({sharded_type(dtype, shape, expected.spec)}), on mesh {describe_mesh(mesh)}"
    )


def phrase(array: str, reason: str) -> str:
    if reason.startswith("is "):
        return f"this array ({array}) {reason}."
    return f"{reason} (array {array})."
