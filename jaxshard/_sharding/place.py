"""`jaxshard.device_put` and `jaxshard.shardings_of`: a Module, dataclass, NamedTuple or
annotated pytree laid out on a mesh as its field annotations say.

`plan` pairs each leaf of the value's pytree with what states its layout. It follows
the leaf's key path through the value, reading at each object the type hints of its
own class (so a `list[Block]` field, an `nnx.List` of modules or a field annotated
with a base class all lead to the fields of the objects they hold), and narrowing the
annotation through `tuple[...]`, `list[...]`, `dict[...]`, `PyTree[...]`, unions and
`nnx.Param[...]`. A leaf with no array annotation takes the partitioning its flax box
or nnx Variable carries (`nnx.with_partitioning`, `nn.with_logical_partitioning`), as
`check_partitioning` reads it. A concrete array that nothing lays out is replicated
over the mesh by `device_put` (`_unstated`). `jaxshard.summary` reads the same plan.
"""

import dataclasses
import functools as ft
import typing
from collections.abc import Mapping, Sequence
from typing import Any, get_args, get_origin

import jax
import jaxtyping
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .._annotations.hints import type_hints
from .._annotations.logical import using
from .._annotations.spec import fill_unconstrained
from .._errors import ShardingError, TypeCheckError, user_facing
from .._jax_internals import ArrayMeta
from .array_types import partition_spec
from .boxes import is_box, is_variable, unboxed
from .constrain import (
    as_annotation,
    BLOCK_FIX,
    find_mesh,
    laid_out_on,
    lay_out,
    spec_name,
    unfit,
)
from .describe import describe_array
from .layout import block_mismatch
from .partitioning import _annotation, _metadata, _path
from .signature import _input_spec
from .tree import _fits, _is_array


_union_types = (typing.Union, type(int | str))
_MISSING = object()


@dataclasses.dataclass(frozen=True)
class Planned:
    """One leaf of a tree, and what states its layout."""

    where: str  # `Model.blocks[0].up`
    leaf: Any  # as in the tree: the array, or the box or Variable holding it
    value: Any  # the array (or `jax.ShapeDtypeStruct`, tracer, ...)
    annotation: Any  # the leaf's array annotation, or None
    spec: PartitionSpec | None  # the layout it asks for, or None (nothing says)


def plan(tree: Any, annotation: Any, name: str) -> tuple[list[Planned], Any]:
    """Each leaf of `tree` (boxes and Variables as leaves) with its annotation and
    spec under the rules in force, and the tree's structure."""
    root = type(tree) if annotation is None else annotation
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)
    out = []
    for path, leaf in leaves:
        found = _annotation_at(tree, root, path)
        if is_box(leaf) and not _is_array(found):
            inner = get_args(found)  # `nnx.Param[Float[Array, ...]]`
            found = _narrow(unboxed(leaf), inner[0]) if inner else None
        found = found if _is_array(found) else None
        spec = None if found is None else partition_spec(found)
        if found is None and is_box(leaf):
            meta, own = _metadata(leaf)
            if meta is not None:
                with using(own):
                    spec = _annotation(meta).spec
        out.append(Planned(_path(name, path), leaf, unboxed(leaf), found, spec))
    return out, treedef


def _annotation_at(value: Any, annotation: Any, path: tuple) -> Any:
    """The annotation of the leaf at `path` in `value`, whose annotation is
    `annotation` (`None` where nothing says)."""
    for key in path:
        annotation = _narrow(value, annotation)
        if isinstance(annotation, type(jaxtyping.PyTree)):
            leaf = annotation.leaftype
            if _is_array(_narrow(None, leaf)):
                return _narrow(None, leaf)
            annotation = None  # `PyTree[Block]`: each Block's own fields say
        value, annotation = _step(value, annotation, key)
        if value is _MISSING:
            return None
    return _narrow(value, annotation)


def _narrow(value: Any, annotation: Any) -> Any:
    """The member of a union that describes `value` (its array member, for an
    array), else `annotation` as it is."""
    if get_origin(annotation) not in _union_types:
        return annotation
    members = [a for a in get_args(annotation) if a is not type(None)]
    arrays = [a for a in members if _is_array(a)]
    if arrays and (value is None or not any(_fits(value, m) for m in members)):
        return arrays[0]
    for member in members:
        if _fits(value, member):
            return arrays[0] if arrays and member in arrays else member
    return members[0] if len(members) == 1 else None


def _step(value: Any, annotation: Any, key: Any) -> tuple[Any, Any]:
    """The child of `value` at `key`, and its annotation."""
    origin, args = get_origin(annotation), get_args(annotation)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return getattr(value, key.name, _MISSING), _hints(type(value)).get(key.name)
    try:
        if isinstance(key, jax.tree_util.SequenceKey):
            child = value[key.idx]
        elif isinstance(key, jax.tree_util.DictKey):
            child = value[key.key]
        else:
            return _MISSING, None
    except Exception:  # a container that does not index as it flattens
        return _MISSING, None
    if not isinstance(origin, type):
        return child, None
    if isinstance(key, jax.tree_util.DictKey):
        return child, args[-1] if issubclass(origin, Mapping) and args else None
    if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        return child, args[key.idx] if key.idx < len(args) else None
    return child, args[0] if issubclass(origin, Sequence) and args else None


@ft.lru_cache(maxsize=1024)
def _hints(cls: type) -> dict[str, Any]:
    """`cls`'s annotations, resolved; those that resolve, if some name something out
    of scope."""
    try:
        return type_hints(cls)
    except Exception:
        out: dict[str, Any] = {}
        for base in reversed(cls.__mro__):
            for name, hint in vars(base).get("__annotations__", {}).items():
                if not isinstance(hint, str):
                    out[name] = hint
        return out


def _name(tree: Any, annotation: Any) -> str:
    named = spec_name(annotation)
    if named is not None:
        return named
    cls = type(tree) if annotation is None else annotation
    if cls in (dict, list, tuple) or not isinstance(cls, type):
        return "tree"
    return cls.__name__


# --- checks -------------------------------------------------------------------------


def checked_plan(
    tree: Any, mesh: Any, annotation: Any, rules: Any, what: str
) -> tuple[list[Planned], Any, Any]:
    """`plan`, with every annotated leaf's shape and dtype checked and every spec
    checked to fit its array on the mesh; and the mesh."""
    find_mesh(mesh, [], what) if mesh is not None else None  # its type, first
    name = _name(tree, annotation)
    call = f"{what}({name})"
    annotation = as_annotation(annotation, what)
    if _is_array(annotation) and not _is_leaf(tree):
        n = len(jax.tree.leaves(tree))
        raise TypeCheckError(
            f"{call}: `annotation` describes one array, but the value is a "
            f"{type(tree).__name__} of {n} lea{'f' if n == 1 else 'ves'}, which it "
            "would leave unplaced. Give the tree's annotation (its class, or "
            "`dict[str, Float[Array, ...]]` and the like), or place each array by "
            "itself."
        )
    with using(rules):
        found, treedef = plan(tree, annotation, name)
    failures = _mismatches(found)
    if failures:
        head = _head(failures, "does not match its annotation",
                     "arrays do not match their annotations")  # fmt: skip
        raise TypeCheckError(
            f"{call}: {head}, so nothing was placed:\n"
            + "\n".join(f"- {w}: {r}" for w, r in failures)
            + "\nFix the array (its shape or dtype) or the field's annotation."
        )
    placed = [f for f in found if f.spec is not None]
    target = None
    if placed:
        target = find_mesh(mesh, [f.value for f in placed], what)
    _check_placeable(placed, target, rules, call)
    return found, treedef, target


def _head(failures: list, one: str, several: str) -> str:
    """`w is ...` for one failure at `w`, `N arrays are ..., the first w` for more."""
    first = failures[0][0]
    if len(failures) == 1:
        return f"{first} {one}"
    return f"{len(failures)} {several}, the first {first}"


def _check_placeable(placed: list[Planned], target: Any, rules: Any, call: str):
    """Raises unless each of `placed` can be laid out as its spec says on `target`
    (inside a shard_map body, each a block of the array its spec describes)."""
    failures = [
        (f.where, _array(f.value), reason)
        for f in placed
        if (reason := unfit(f.spec, *_laid_out_on(f, target)))
    ]
    if failures:
        raise ShardingError(
            f"{call}: {len(failures)} of the annotated layouts cannot be placed:\n"
            + "\n".join(f"- {w} ({a}): {r}" for w, a, r in failures)
            + "\nChange the annotation's spec (or the axis rules), or the mesh."
        )
    with using(rules):
        blocks = [
            (f.where, reason)
            for f in placed
            if (reason := block_mismatch(f.value, f.spec, f.annotation))
        ]
    if blocks:
        head = _head(blocks, "is not a block of its annotated layout",
                     "arrays are not blocks of their annotated layouts")  # fmt: skip
        raise ShardingError(
            f"{call}: {head}:\n"
            + "\n".join(f"- {w}: {r}" for w, r in blocks)
            + f"\n{BLOCK_FIX}"
        )


def _is_leaf(tree: Any) -> bool:
    """Whether `tree` is one leaf (an array, or a box or Variable holding one)."""
    return jax.tree_util.treedef_is_leaf(jax.tree.structure(tree, is_leaf=is_box))


def _laid_out_on(f: Planned, target: Any) -> tuple[Any, tuple[int, ...]]:
    """`constrain.laid_out_on` for a leaf (its value as it is, if nothing says its
    layout)."""
    if f.spec is None:
        return target, tuple(np.shape(f.value))
    return laid_out_on(f.spec, f.value, target)


def _mismatches(found: list[Planned]) -> list[tuple[str, str]]:
    """`(path, reason)` for each annotated leaf whose shape or dtype is not its
    annotation's, with one set of dimension bindings for the whole tree. Each is
    checked as a tracer of its shape and dtype, so that numpy arrays and
    `jax.ShapeDtypeStruct`s are checked as the arrays they will become (and a
    block of a shard_map body as the global array, see `laid_out_on`)."""
    annotated, structs, described, failures = [], [], [], []
    for f in found:
        if f.annotation is None:
            continue
        try:
            dtype = f.value.dtype if hasattr(f.value, "dtype") else None
            dtype = jax.numpy.result_type(f.value) if dtype is None else dtype
        except TypeError:
            failures.append((f.where, f"it is not an array ({type(f.value).__name__})"))
            continue
        shape = _laid_out_on(f, None)[1]
        what = _array(f.value)
        if shape != np.shape(f.value):
            what += f", one block of the global {describe_array(dtype, shape)}"
        annotated.append(f)
        structs.append(jax.ShapeDtypeStruct(shape, dtype))
        described.append(what)

    def check(*values):
        with jaxtyping.jaxtyped("context"):
            for f, what, x in zip(annotated, described, values):
                reason = ArrayMeta.__instancecheck_str__(f.annotation, x)
                if reason:
                    failures.append((f.where, f"{what}: {reason}"))

    if annotated:
        jax.eval_shape(check, *structs)
    return failures


def _array(value: Any) -> str:
    return describe_array(getattr(value, "dtype", "?"), np.shape(value))


# --- placing ------------------------------------------------------------------------


@user_facing
def device_put(
    tree: Any, mesh: Any = None, *, annotation: Any = None, rules: Any = None
) -> Any:
    """Places every array of `tree` on the mesh as its annotation says.

    `tree` is an equinox Module, a flax nnx Module, a dataclass, a NamedTuple, or any
    pytree with `annotation`. Each array is found by its path, through nested modules
    and `list[Block]`, `tuple[...]`, `dict[...]` and `PyTree[...]` fields; an nnx
    `Param` with no annotation is placed as its own sharding metadata says
    (`nnx.with_partitioning`), and so is a flax linen box. Logical names are resolved
    under the rules in force. An array whose layout nothing states (no annotation,
    or one without a spec, and no metadata: a LayerNorm's scale) is replicated over
    the mesh, unless it is laid out on it already, so that the whole tree ends up
    on the mesh. A new tree is returned; `tree` is unchanged.

    As `jax.device_put` and `eqx.filter_shard` do, it works on any kind of leaf:

    - arrays (and numpy arrays) are placed with `jax.device_put`; a numpy array
        whose layout nothing states stays a numpy array;
    - inside `jax.jit`, tracers are constrained as `jaxshard.constrain` does (a
        sharding constraint on Auto axes, `reshard` on Explicit ones): a model
        created inside a jitted function comes out placed, so that it never exists
        whole on one device;
    - `jax.ShapeDtypeStruct`s (from `jax.eval_shape`) come back with their
        `sharding` set, for `jaxshard.verify`'s `values=` or `jax.jit(...).lower`;
    - inside a `shard_map` body, as `jaxshard.constrain` does: each array is one
        block of the global array its annotation describes (its shape is checked
        as the global one), the axes the body is manual over stay shard_map's (a
        block that differs across one its spec says is replicated is an error, as
        for a `jaxtyped` parameter), and the others are laid out.

    **Arguments:**

    - `tree`: the value.
    - `mesh`: the mesh; by default the one in context (`jax.set_mesh`).
    - `annotation`: the tree's type; by default `type(tree)`. For one array, an
        array annotation, or a bare `PartitionSpec` or `jaxshard.L(...)` as
        `jaxshard.constrain` takes them (of its shape and dtype, only the rank is
        checked).
    - `rules`: the axis rules for logical names, as `jaxshard.axis_rules` takes them;
        by default those in force.

    **Returns:**

    A tree of the same structure, each annotated array placed.

    **Raises:**

    `jaxtyping.TypeCheckError` naming the path of every array whose shape or dtype
    does not match its annotation; `jaxshard.ShardingError` naming those whose
    annotation cannot lay them out on the mesh.

    !!! Example

        ```python
        model = Model(key)  # on one device
        model = jaxshard.device_put(model)  # on the mesh in context, as annotated

        # Created already placed: the init is jitted, its output laid out as annotated.
        model = eqx.filter_jit(lambda key: jaxshard.device_put(Model(key)))(key)
        ```
    """
    found, treedef, target = checked_plan(
        tree, mesh, annotation, rules, "jaxshard.device_put"
    )
    loose = [f.value for f in found if f.spec is None and _concrete(f.value)]
    if target is None and loose:
        target = find_mesh(mesh, loose, "jaxshard.device_put")
    done: dict[int, Any] = {}
    eager, shardings = [], []
    for i, f in enumerate(found):
        if f.spec is None:
            sharding = _unstated(f.value, target)
            if sharding is not None:
                eager.append(i)
                shardings.append(sharding)
        elif isinstance(f.value, jax.ShapeDtypeStruct):
            sharding = NamedSharding(target, _input_spec(f.spec))
            done[i] = _abstract(f.value, sharding)
        elif isinstance(f.value, jax.core.Tracer):
            done[i] = lay_out(f.value, f.spec, _laid_out_on(f, target)[0])
        else:
            eager.append(i)
            shardings.append(_eager_sharding(f, target))
    if not eager and not done:
        return tree
    if eager:
        values = [found[i].value for i in eager]
        done.update(zip(eager, jax.device_put(values, shardings)))
    leaves = [
        _rebox(f.leaf, done[i]) if i in done else f.leaf for i, f in enumerate(found)
    ]
    return jax.tree_util.tree_unflatten(treedef, leaves)


@user_facing
def shardings_of(
    tree: Any, mesh: Any = None, *, annotation: Any = None, rules: Any = None
) -> Any:
    """The shardings `tree`'s annotations ask for, as a tree of its structure: for
    `jax.jit`'s `in_shardings` and `out_shardings`.

    The leaves are read as `jaxshard.device_put` reads them (field annotations, else
    an nnx Variable's or flax box's partitioning); a leaf nothing places is `None`,
    which leaves its layout to `jax.jit`. `P.UNCONSTRAINED` dimensions become `None`
    (replicated), as an input or output sharding fixes every dimension. Give it an
    abstract tree (`jax.eval_shape(init, ...)`) to create a model already placed:

    ```python
    abstract = jax.eval_shape(init, key)
    model = jax.jit(init, out_shardings=jaxshard.shardings_of(abstract))(key)
    ```

    **Arguments:**

    As `jaxshard.device_put`'s.

    **Returns:**

    A tree of `NamedSharding`s and `None`s (an nnx Variable or flax box holding
    one, where the tree has one).
    """
    if isinstance(tree, type):
        raise TypeError(
            f"jaxshard.shardings_of takes a value, not the class {tree.__name__}: "
            "give it an abstract instance, `jax.eval_shape(init, ...)`, whose arrays "
            "are `ShapeDtypeStruct`s."
        )
    found, treedef, target = checked_plan(
        tree, mesh, annotation, rules, "jaxshard.shardings_of"
    )
    leaves = [
        _rebox(f.leaf, None)
        if f.spec is None
        else _rebox(f.leaf, NamedSharding(target, _input_spec(f.spec)))
        for f in found
    ]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _abstract(value: jax.ShapeDtypeStruct, sharding: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(
        value.shape, value.dtype, sharding=sharding, weak_type=value.weak_type
    )


def _eager_sharding(f: Planned, mesh: Any) -> NamedSharding:
    """The sharding of a concrete array: `P.UNCONSTRAINED` keeps what it has."""
    assert f.spec is not None
    sharding = getattr(f.value, "sharding", None)
    same = isinstance(sharding, NamedSharding) and sharding.mesh == mesh
    spec = fill_unconstrained(f.spec, sharding.spec if same else (), mesh.shape)
    return NamedSharding(mesh, spec)


def _concrete(value: Any) -> bool:
    return isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer)


def _unstated(value: Any, mesh: Any) -> NamedSharding | None:
    """Where a concrete array whose layout nothing states goes on `mesh`: replicated
    over it (a LayerNorm's scale made on one device), unless it is laid out on it
    already; laid out as it is, on a mesh of the same axes and devices. `None`
    where it stays as it is (a tracer, whose layout is `jit`'s to choose; an
    abstract or numpy array; anything that is not an array)."""
    if not (_concrete(value) and isinstance(mesh, jax.sharding.Mesh)):
        return None
    sharding = value.sharding
    if isinstance(sharding, NamedSharding):
        if sharding.mesh == mesh:
            return None
        same = (sharding.mesh.shape_tuple, sharding.mesh.device_ids.tolist()) == (
            mesh.shape_tuple,
            mesh.device_ids.tolist(),
        )
        if same:
            return NamedSharding(mesh, sharding.spec)
    return NamedSharding(mesh, PartitionSpec())


def _rebox(leaf: Any, value: Any) -> Any:
    """`value` in `leaf`'s box or Variable, as it was."""
    if is_variable(leaf):
        return leaf.replace(value)
    if is_box(leaf):
        return leaf.replace_boxed(value)
    return value
