"""`jaxshard.summary`: every array of a tree, its layout and what it costs each device,
as a table (flax's `tabulate`, for memory); and the rows `verify`'s report shows of
its inputs."""

import dataclasses
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from .._annotations.logical import using
from .._annotations.spec import format_spec
from .._errors import user_facing
from .._jax_internals import context_mesh
from .boxes import is_box, unboxed
from .describe import describe_bytes, describe_mesh
from .partitioning import _path
from .place import _name, plan
from .signature import _input_spec


@dataclasses.dataclass(frozen=True)
class ArrayRow:
    """One array of `jaxshard.summary`'s table (or of `Report.arrays`).

    **Attributes:**

    - `path`: where it is in the tree, `"Model.blocks[0].up"`.
    - `shape`, `dtype`: its global shape and dtype.
    - `spec`: how it is laid out, `"P('fsdp', 'tp')"`; `"one device"`;
        `"unplaced"` for an abstract array that nothing places; or `"unknown"` for
        a value traced inside `jit` on Auto axes that nothing annotates (XLA
        chooses its layout when it compiles). Those last two count whole.
    - `bytes_total`: its size, all of it.
    - `bytes_per_device`: what one device holds of it (its shard).
    - `bytes_replicated`: what each device holds of it beyond an even share of its
        size over the devices it is on: 0 for an array split over every device,
        nearly all of it for a replicated one; what splitting it further would free.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: str
    bytes_per_device: int
    bytes_total: int
    bytes_replicated: int

    def to_dict(self) -> dict:
        """The row as plain data (the entries of `Report.to_dict()["arrays"]`)."""
        return {
            "path": self.path,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "spec": self.spec,
            "bytes_per_device": self.bytes_per_device,
            "bytes_total": self.bytes_total,
        }


# The sharding of a value whose layout is not known while tracing (see `_own`).
UNKNOWN = "unknown"


def array_row(path: str, shape: tuple, dtype: Any, sharding: Any) -> ArrayRow:
    """The row of an array of `shape` and `dtype` laid out by `sharding` (`None`:
    not placed; `UNKNOWN`: not known)."""
    shape = tuple(int(d) for d in shape)
    itemsize = getattr(dtype, "itemsize", None) or np.dtype(dtype).itemsize
    total = int(np.prod(shape, dtype=np.int64)) * itemsize
    if sharding is None or sharding is UNKNOWN:
        said = "unplaced" if sharding is None else UNKNOWN
        return ArrayRow(path, shape, str(dtype), said, total, total, 0)
    local = sharding.shard_shape(shape)
    per_device = int(np.prod(local, dtype=np.int64)) * itemsize
    devices = _devices(sharding)
    if isinstance(sharding, NamedSharding):
        spec = format_spec(_trimmed(sharding.spec))
    elif devices == 1:
        spec = "one device"
    else:
        spec = "replicated" if sharding.is_fully_replicated else repr(sharding)
    replicated = max(0, per_device - -(-total // devices))
    return ArrayRow(path, shape, str(dtype), spec, per_device, total, replicated)


def _devices(sharding: Any) -> int:
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        return int(mesh.size)  # an abstract mesh
    return len(sharding.device_set)


def _trimmed(spec: PartitionSpec) -> PartitionSpec:
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def largest_first(rows: Iterable[ArrayRow]) -> tuple[ArrayRow, ...]:
    return tuple(sorted(rows, key=lambda r: (-r.bytes_per_device, -r.bytes_total)))


def table(rows: Iterable[ArrayRow]) -> list[str]:
    """The rows as aligned text lines, with a header."""
    cells = [("path", "shape", "dtype", "spec", "per device", "total", "replicated")]
    for r in rows:
        cells.append(
            (
                r.path,
                str(r.shape),
                r.dtype,
                r.spec,
                describe_bytes(r.bytes_per_device),
                describe_bytes(r.bytes_total),
                describe_bytes(r.bytes_replicated),
            )
        )
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    right = {4, 5, 6}  # the byte counts
    lines = []
    for n, row in enumerate(cells):
        parts = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


@dataclasses.dataclass(frozen=True)
class Summary:
    """What `jaxshard.summary` returns: `str(summary)` is the table, largest arrays
    per device first, with a line of totals.

    **Attributes:**

    - `rows`: one `jaxshard.ArrayRow` per array, largest per device first.
    - `name`: what the tree is called (its class's name).
    - `bytes_total`, `bytes_per_device`, `bytes_replicated`: the rows' sums.
    """

    rows: tuple[ArrayRow, ...]
    name: str
    mesh: Any = dataclasses.field(default=None, repr=False)

    @property
    def bytes_total(self) -> int:
        return sum(r.bytes_total for r in self.rows)

    @property
    def bytes_per_device(self) -> int:
        return sum(r.bytes_per_device for r in self.rows)

    @property
    def bytes_replicated(self) -> int:
        return sum(r.bytes_replicated for r in self.rows)

    def to_dict(self) -> list[dict]:
        return [r.to_dict() for r in self.rows]

    def __str__(self) -> str:
        on = "" if self.mesh is None else f" on mesh {describe_mesh(self.mesh)}"
        n = len(self.rows)
        lines = [f"jaxshard.summary: {self.name}, {n} array{'s' * (n != 1)}{on}", ""]
        lines += table(self.rows) if self.rows else ["(no arrays)"]
        lines.append("")
        lines.append(
            f"Total {describe_bytes(self.bytes_total)}; per device "
            f"{describe_bytes(self.bytes_per_device)}, of which "
            f"{describe_bytes(self.bytes_replicated)} beyond an even share "
            "(replicated)."
        )
        if any(r.spec == UNKNOWN for r in self.rows):
            lines.append(
                "unknown: layout not known while tracing (inside jit on Auto axes, "
                "XLA chooses it when it compiles), counted whole; annotate the "
                "array, or summarise outside jit."
            )
        return "\n".join(lines)


@user_facing
def summary(tree: Any, mesh: Any = None, *, rules: Any = None) -> Summary:
    """A table of every array in `tree`: its path, shape, dtype, layout, and the
    bytes it costs each device, largest first, with totals.

    `print(jaxshard.summary(model))` shows which arrays dominate each device's
    memory, as flax's `tabulate` shows parameter counts. It takes concrete trees
    (each array's own sharding) and abstract ones (`jax.eval_shape(init, ...)`): an
    abstract array without a sharding is shown as its annotation (or nnx Variable's
    metadata) would place it on `mesh`, as `jaxshard.device_put` reads them, and so
    is one `jax.eval_shape` gives a sharding on an abstract mesh (the layout its
    function makes it with, before anything places it). Inside `jax.jit` a value
    on Explicit axes is shown as its type says; one on Auto axes, whose layout XLA
    chooses when it compiles, as its annotation would place it, else as
    `"unknown"`.

    **Arguments:**

    - `tree`: any pytree: a Module, a dataclass, a dict of parameters, an optimizer
        state.
    - `mesh`: the mesh for abstract arrays without a sharding; by default the one in
        context (`jax.set_mesh`), else the abstract mesh of the traced values.
        Without one, they are shown unplaced.
    - `rules`: the axis rules for logical names; by default those in force.

    **Returns:**

    A `jaxshard.Summary`: `str()` is the table; `.rows` are `jaxshard.ArrayRow`s,
    largest per device first, and `.bytes_per_device` and the other totals.

    !!! Example

        ```python
        print(jaxshard.summary(jax.eval_shape(init, key), mesh))
        ```
    """
    name = _name(tree, None)
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]
    values = [unboxed(leaf) for _, leaf in leaves]
    arrays = [hasattr(v, "shape") and hasattr(v, "dtype") for v in values]
    own = [_own(v) if a else (None, False) for v, a in zip(values, arrays)]
    shardings = [sharding for sharding, _ in own]
    target = mesh if mesh is not None else context_mesh()
    target = _traced_mesh(values, own) if target is None else target
    pending = [a and p for a, (_, p) in zip(arrays, own)]
    if target is not None and any(pending):
        with using(rules):
            found = plan(tree, None, name)[0]
        for i, f in enumerate(found):
            if pending[i] and f.spec is not None:
                shardings[i] = NamedSharding(target, _input_spec(f.spec))
    rows = [
        array_row(_path(name, path), values[i].shape, values[i].dtype, shardings[i])
        for i, (path, _) in enumerate(leaves)
        if arrays[i]
    ]
    if target is None:
        named = [s for s in shardings if isinstance(s, NamedSharding)]
        target = named[0].mesh if named else None
    return Summary(largest_first(rows), name, target)


def _own(value: Any) -> tuple[Any, bool]:
    """The sharding `value` has (`None` if none, `UNKNOWN` if it is not known
    while tracing), and whether its layout is still open, so that its annotation's
    is shown where it states one (as `shardings_of` reads it): an abstract array
    without a sharding, one `jax.eval_shape` gives a sharding on an abstract mesh
    (the layout its function makes it with, before anything places it), and a
    value traced on Auto axes (whose type says nothing of them: XLA chooses its
    layout when it compiles)."""
    if isinstance(value, jax.core.Tracer):
        sharding = jax.typeof(value).sharding
        if sharding.mesh.empty:
            return None, True
        if AxisType.Auto in sharding.mesh.axis_types:
            return UNKNOWN, True
        return sharding, False  # Explicit axes: its layout is in its type
    sharding = getattr(value, "sharding", None)
    if isinstance(value, jax.ShapeDtypeStruct) and isinstance(sharding, NamedSharding):
        return sharding, isinstance(sharding.mesh, AbstractMesh)
    return sharding, sharding is None


def _traced_mesh(values: list, own: list) -> Any:
    """The mesh of the first value whose layout is open and that names one (an
    abstract mesh); else None."""
    for value, (sharding, pending) in zip(values, own):
        if not pending:
            continue
        if isinstance(value, jax.core.Tracer):
            sharding = jax.typeof(value).sharding
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and not mesh.empty:
            return mesh
    return None
