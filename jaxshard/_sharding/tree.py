"""`jaxshard.check_tree`: check the arrays of a Module, dataclass or NamedTuple against
their annotations at any point, not only when it is made."""

import dataclasses
import typing
from typing import Any, get_args, get_origin

import jax
import jaxtyping
from jax import Array
from jax.sharding import NamedSharding, PartitionSpec

from .._annotations.logical import active_rules, flax_rules, L, using
from .._annotations.spec import axes_of
from .._errors import ShardingError, TypeCheckError
from .._jax_internals import ArrayMeta
from .array_types import _MetaShardedArray, Shaped
from .describe import naming


_union_types = (typing.Union, type(int | str))


def check_tree(tree: Any, annotation: Any = None, *, name: str | None = None) -> None:
    """Checks every array in `tree` against its annotation: shape, dtype and sharding.

    An equinox Module's fields are checked by jaxtyping when it is made (`__init__`),
    and not after `eqx.tree_at`, an optimizer update or any other change.
    `check_tree(model)` checks them whenever it is called: every field of the Module,
    dataclass or NamedTuple, at any depth (`tuple[...]`, `list[...]`, `dict[...]`,
    `PyTree[...]` and `Optional` fields included), with one set of dimension bindings
    for the whole tree. Any other class with annotated attributes is walked the same
    way, such as a `flax.nnx.Module` whose attributes are annotated
    `nnx.Param[Float[Array, "d f", P(None, "tp")]]` (the array a Param holds is
    checked). Eagerly it raises at once; inside `jax.jit` it checks as
    annotations do there (at trace time on Explicit meshes, when XLA compiles on Auto
    meshes).

    **Arguments:**

    - `tree`: the value, e.g. an equinox Module.
    - `annotation`: its type; by default `type(tree)`.
    - `name`: what to call it in messages (default: its class's name).

    **Raises:**

    `jaxshard.ShardingError` if an array is sharded other than as annotated, else
    `jaxtyping.TypeCheckError` if one has the wrong shape or dtype; the message lists
    every failing array by its path.

    !!! Example

        ```python
        model = eqx.tree_at(lambda m: m.w, model, new_w)
        jaxshard.check_tree(model)  # is model.w still sharded as annotated?
        ```
    """
    annotation = type(tree) if annotation is None else annotation
    name = getattr(annotation, "__name__", "tree") if name is None else name
    found: list[tuple[str, Any, Any]] = []
    _collect(tree, annotation, name, found)
    _check_all(
        f"check_tree({name})",
        [(where, expected, value, None) for where, expected, value in found],
        (
            "1 array does not match its annotation",
            "{} arrays do not match their annotations",
        ),
    )


def _check_all(what: str, found: list, heads: tuple[str, str]) -> None:
    """Checks each `(path, annotation, value, rules)` of `found`, with one set of
    dimension bindings, and raises listing every failure by path: a
    `ShardingError` if a sharding is among the reasons, else a `TypeCheckError`.
    `heads` says how many failed: one, then several (`{}` for the number)."""
    function = what.split("(", 1)[0]
    failures = []
    with jaxtyping.jaxtyped("context"):
        for where, expected, value, rules in found:
            with naming(function, where), using(rules):
                reason, sharding = _reason(expected, value)
            if reason:
                failures.append((where, reason, sharding))
    if failures:
        error = ShardingError if any(s for *_, s in failures) else TypeCheckError
        head = heads[0] if len(failures) == 1 else heads[1].format(len(failures))
        raise error(
            f"{what}: {head}:\n" + "\n".join(f"- {w}: {r}" for w, r, _ in failures)
        )


def _reason(expected: Any, value: Any) -> tuple[str, bool]:
    """Why `value` fails `expected` ("" if it does not), and whether the sharding is
    the reason."""
    options = _arrays(expected)
    reasons = []
    for option in options:
        plain = ArrayMeta.__instancecheck_str__(option, value)
        if plain:
            reasons.append((plain, False))
            continue
        if isinstance(option, _MetaShardedArray):
            sharded = type(option).__instancecheck_str__(option, value)
            if sharded:
                reasons.append((sharded, True))
                continue
        return "", False
    if value is None and type(None) in get_args(expected):
        return "", False
    return reasons[0] if reasons else ("", False)


def _arrays(annotation: Any) -> list:
    if get_origin(annotation) in _union_types:
        return [a for a in get_args(annotation) if _is_array(a)]
    return [annotation]


def _is_array(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(
        annotation, jaxtyping.AbstractArray
    )


def _collect(value: Any, annotation: Any, where: str, out: list) -> None:
    """Appends `(path, array annotation, value)` for every annotated array in
    `value`, walking the value's own structure."""
    if annotation is None or annotation is Any:
        return
    if _is_variable(value):  # flax.nnx.Param and the like: check what it holds
        inner = get_args(annotation)[0] if get_args(annotation) else annotation
        annotation = inner if _is_array_like_annotation(inner) else annotation
        value = value.get_value()
    if _is_array_like_annotation(annotation):
        if not (value is None and type(None) in get_args(annotation)):
            out.append((where, annotation, value))
        return
    if isinstance(annotation, type(jaxtyping.PyTree)):
        leaves = jax.tree_util.tree_flatten_with_path(value)[0]
        for path, leaf in leaves:
            _collect(leaf, annotation.leaftype, where + jax.tree_util.keystr(path), out)
        return
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in _union_types:
        for option in args:
            if option is not type(None) and _fits(value, option):
                _collect(value, option, where, out)
                return
        return
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        hints = typing.get_type_hints(type(value), include_extras=True)
        for field in dataclasses.fields(value):
            if field.metadata.get("static", False):
                continue
            here = f"{where}.{field.name}"
            _collect(getattr(value, field.name, None), hints.get(field.name), here, out)
        return
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):  # NamedTuple
        hints = typing.get_type_hints(type(value), include_extras=True)
        for field in type(value)._fields:
            here = f"{where}.{field}"
            _collect(getattr(value, field), hints.get(field), here, out)
        return
    if origin in (tuple, list) and isinstance(value, (tuple, list)):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            items = list(zip(args, value))
        else:
            items = [(args[0] if args else None, v) for v in value]
        for i, (a, v) in enumerate(items):
            _collect(v, a, f"{where}[{i}]", out)
        return
    if origin is dict and isinstance(value, dict) and len(args) == 2:
        for k, v in value.items():
            _collect(v, args[1], f"{where}[{k!r}]", out)
        return
    if isinstance(annotation, type) and isinstance(value, annotation):
        # Any other class whose attributes are annotated (a flax.nnx.Module, say).
        try:
            hints = typing.get_type_hints(type(value), include_extras=True)
        except Exception:  # an annotation naming something out of scope
            return
        for name, hint in hints.items():
            if not name.startswith("_") and hasattr(value, name):
                _collect(getattr(value, name), hint, f"{where}.{name}", out)


def _is_array_like_annotation(annotation: Any) -> bool:
    return _is_array(annotation) or any(_is_array(a) for a in _arrays(annotation))


def _is_variable(value: Any) -> bool:
    """A `flax.nnx.Variable` (`nnx.Param`, ...), without importing flax."""
    return type(value).__module__.startswith("flax.nnx") and hasattr(value, "get_value")


def _fits(value: Any, option: Any) -> bool:
    cls = get_origin(option) or option
    return isinstance(cls, type) and isinstance(value, cls)


# --- parameter trees that carry their own partitioning ------------------------------


def check_partitioning(
    tree: Any, specs: Any = None, *, name: str = "params", rules: Any = None
) -> None:
    """Checks every array of a parameter tree against the partitioning its leaves
    carry, or against `specs`.

    Weights that a library layer creates (flax linen's `Dense`, `Embed`,
    `LayerNorm`, ...) are not function parameters, so no annotation reaches them; their
    partitioning is in the tree itself:

    - flax linen's boxed leaves, `nn.LogicallyPartitioned` (logical names, resolved by
        the box's own rules, else those in force) and `nn.Partitioned` (mesh axes), as
        `model.init` makes them with `nn.with_logical_partitioning`;
    - flax nnx `Variable`s (`nnx.Param`, ...) with sharding metadata
        (`nnx.with_partitioning`, `nnx.Param(..., sharding=...)`), read with
        `nnx.get_partition_spec`;
    - or `specs`: a tree of the same structure whose leaves are `PartitionSpec`s,
        logical `jaxshard.L(...)` specs or annotations (`None` leaves a leaf
        unchecked), e.g. `nn.get_partition_spec(abstract_variables)` for a tree that
        was unboxed.

    Leaves with no partitioning are not checked. Eagerly it raises at once; inside
    `jax.jit` it checks as annotations do there. `jaxshard.Partitioned` as a
    parameter's annotation does the same for a `jaxtyped` function's argument.

    **Arguments:**

    - `tree`: the parameters (boxed flax linen variables, an nnx Module or State, or
        any pytree with `specs`).
    - `specs`: the partitioning of each leaf, if the tree does not carry it.
    - `name`: what to call the tree in messages (default `"params"`).
    - `rules`: the axis rules for logical names, as `jaxshard.axis_rules` takes them;
        by default those in force (a flax box's own rules come first).

    **Raises:**

    `jaxshard.ShardingError` naming the path of every mis-sharded leaf
    (`params['Dense_0']['kernel']`), with what it is and what its metadata says.
    """
    with using(rules):
        found = partitioned_leaves(tree, specs, name)
        _check_all(
            f"check_partitioning({name})",
            found,
            (
                "1 array is not partitioned as its metadata says",
                "{} arrays are not partitioned as their metadata says",
            ),
        )


def partitioned_leaves(tree: Any, specs: Any, name: str) -> list:
    """`(path, annotation, array, rules)` for each leaf with a partitioning."""
    out = []
    if specs is not None:
        pairs = jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)[0]
        values = jax.tree_util.tree_leaves(tree, is_leaf=_is_box)
        if len(pairs) != len(values):
            raise ValueError(
                f"check_partitioning({name}): `specs` has {len(pairs)} leaves and the "
                f"tree {len(values)}; give one spec (or None) per array, in the "
                "tree's structure."
            )
        for (path, spec), value in zip(pairs, values):
            if spec is not None:
                value = _unboxed(value)
                annotation = _annotation(_logical_if_named(spec, value))
                out.append((_path(name, path), annotation, value, None))
        return out
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_box)[0]:
        spec, own = _metadata(leaf)
        if spec is not None:
            out.append((_path(name, path), _annotation(spec), _unboxed(leaf), own))
    return out


def _path(name: str, path: tuple) -> str:
    """`params['Dense_0']['kernel']`: without the `.value` of a flax box."""
    return (name + jax.tree_util.keystr(path)).removesuffix(".value")


def _logical_if_named(spec: Any, value: Any) -> Any:
    """`spec`, or `L(*spec)` for a `PartitionSpec` of logical names, as
    `nn.get_partition_spec` makes from flax's logical metadata: one naming axes that
    the value's mesh does not have (or, with no mesh known, only names) that the
    rules in force know."""
    rules = active_rules()
    if rules is None or not isinstance(spec, PartitionSpec):
        return spec
    names = {a for entry in spec for a in axes_of(entry)}
    mesh = _mesh_of(value)
    known = set(rules.known)
    if not names or not names & known:
        return spec
    if mesh is None and names <= known or mesh is not None and names - set(mesh):
        return L(*spec)
    return spec


def _mesh_of(value: Any) -> tuple[str, ...] | None:
    """The axis names of the mesh `value` is laid out on, or in context."""
    sharding = getattr(value, "sharding", None)
    if isinstance(value, jax.core.Tracer):
        sharding = jax.typeof(value).sharding
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and not mesh.empty:
        return tuple(mesh.axis_names)
    context = jax.sharding.get_abstract_mesh()
    return None if context.empty else tuple(context.axis_names)


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, (PartitionSpec, L)) or _is_array(x)


def _is_box(x: Any) -> bool:
    """A flax linen partitioning box, or an nnx Variable."""
    return _is_variable(x) or type(x).__name__ in _BOXES and hasattr(x, "names")


_BOXES = ("Partitioned", "LogicallyPartitioned")
# Where nnx Variables keep their partitioning: `out_sharding` in flax 0.12, earlier
# `sharding_names` and `sharding`.
_NNX_KEYS = ("out_sharding", "sharding_names", "sharding")


def _metadata(leaf: Any) -> tuple[Any, Any]:
    """The partitioning a leaf carries (`PartitionSpec` or `L`), and its own rules."""
    if _is_variable(leaf):
        metadata = leaf.get_metadata()
        names = next((metadata[k] for k in _NNX_KEYS if metadata.get(k)), None)
        if names is None:
            return None, None
        if flax_rules() is None and not metadata.get("sharding_rules"):
            # Mesh axes, as nnx reads them; logical names if the rules in force
            # know them and the mesh does not.
            spec = PartitionSpec(*names)
            return _logical_if_named(spec, _unboxed(leaf)), None
        # As nnx placed it: its own renaming by flax's rules (a name without a rule
        # stays as it is, a mesh axis).
        from flax import nnx

        spec = nnx.get_partition_spec(leaf)
        return PartitionSpec(*(spec.get_value() if _is_variable(spec) else spec)), None
    if _is_box(leaf):
        names = tuple(leaf.names)
        if type(leaf).__name__ == "LogicallyPartitioned":
            return L(*names), getattr(leaf, "rules", None) or None
        return PartitionSpec(*names), None
    return None, None


def _unboxed(leaf: Any) -> Any:
    if _is_variable(leaf):
        return leaf.get_value()
    if _is_box(leaf):
        return leaf.value
    return leaf


def place_partitioned(tree: Any, mesh: Any) -> Any:
    """`tree` with each abstract leaf (`jax.ShapeDtypeStruct` without a sharding) in
    a partitioning box or nnx Variable placed on `mesh` as its metadata says, under
    the rules in force: what `jax.eval_shape(model.init, ...)` gives, ready to
    compile."""

    def place(leaf: Any) -> Any:
        value = _unboxed(leaf)
        if not (isinstance(value, jax.ShapeDtypeStruct) and value.sharding is None):
            return leaf
        spec, own = _metadata(leaf)
        if spec is None:
            return leaf
        with using(own):
            spec = _annotation(spec).spec
        placed = jax.ShapeDtypeStruct(
            value.shape, value.dtype, sharding=NamedSharding(mesh, spec)
        )
        if _is_variable(leaf):
            return leaf.replace(placed)
        return leaf.replace_boxed(placed)

    if not any(_is_box(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_box)):
        return tree
    return jax.tree_util.tree_map(place, tree, is_leaf=_is_box)


def _annotation(spec: Any) -> Any:
    if _is_array(spec):
        return spec
    return Shaped[Array, "...", spec]


class _PartitionedMeta(type):
    def __instancecheck__(cls, value: Any) -> bool:
        from .decorator import note_failure
        from .describe import where

        _, parameter = where(value)
        try:
            check_partitioning(value, name=parameter or "")
        except (ShardingError, TypeCheckError) as e:
            note_failure(value, str(e).split(":\n", 1)[-1])
            return False
        return True


class Partitioned(metaclass=_PartitionedMeta):
    """An annotation for a parameter tree: each leaf must be partitioned as its own
    metadata says (flax linen's boxes, nnx Variables; see
    `jaxshard.check_partitioning`).

    !!! Example

        ```python
        @jaxshard.jaxtyped(typechecker=beartype)
        def train_step(params: jaxshard.Partitioned, batch: Batch) -> ...:
            ...
        ```
    """
