"""`jaxshard.check_tree` and `jaxshard.check_partitioning`: a tree's arrays against
their annotations (and, where none reaches them, the partitioning they carry), and a
parameter tree's arrays against the partitioning their leaves carry (flax linen's
boxes, nnx Variables) or against a layout tree (of specs, shardings or
`ShapeDtypeStruct`s), and `jaxshard.Partitioned`."""

import functools as ft
from collections.abc import Mapping
from typing import Any

import jax
from jax import Array
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from .._annotations.logical import active_rules, flax_rules, L, using
from .._annotations.spec import axes_of
from .._errors import ShardingError, TypeCheckError, user_facing
from .array_types import Shaped
from .boxes import is_box, is_variable, unboxed
from .constrain import as_annotation, spec_name
from .tree import _check_all, _collect, _is_array, Stated


@user_facing
def check_partitioning(
    tree: Any, specs: Any = None, *, name: str | None = None, rules: Any = None
) -> None:
    """Checks every array of a parameter tree against the partitioning its leaves
    carry, or against a layout tree `specs`.

    Weights that a library layer creates (flax linen's `Dense`, `Embed`,
    `LayerNorm`, ...) are not function parameters, so no annotation reaches them; their
    partitioning is in the tree itself:

    - flax linen's boxed leaves, `nn.LogicallyPartitioned` (logical names, resolved by
        the box's own rules, else those in force) and `nn.Partitioned` (mesh axes), as
        `model.init` makes them with `nn.with_logical_partitioning`;
    - flax nnx `Variable`s (`nnx.Param`, ...) with sharding metadata
        (`nnx.with_partitioning`, `nnx.Param(..., sharding=...)`), read with
        `nnx.get_partition_spec`;
    - or `specs`, a layout tree of the same structure whose leaves are
        `PartitionSpec`s, logical `jaxshard.L(...)` specs, annotations, shardings
        (`NamedSharding`s, as `jax.jit(out_shardings=...)` takes them and
        `jax.tree.map(lambda x: x.sharding, tree)` gives them; the mesh is compared
        too) or `jax.ShapeDtypeStruct`s (their shape, dtype and sharding); `None`
        leaves a leaf unchecked. E.g. `nn.get_partition_spec(abstract_variables)`
        for a tree that was unboxed, or a model's own tree of its weights' shardings.

    Leaves with no partitioning are not checked. Eagerly it raises at once; inside
    `jax.jit` it checks as annotations do there (a sharding's spec, on the mesh in
    context). `jaxshard.Partitioned` as a parameter's annotation does the same for a
    `jaxtyped` function's argument.

    **Arguments:**

    - `tree`: the parameters (boxed flax linen variables, an nnx Module or State, or
        any pytree with `specs`).
    - `specs`: the layout of each leaf, if the tree does not carry it.
    - `name`: what to call the tree in messages (default `"params"` for a mapping
        or list, else its class's name: `TrainState.params[...]`, not
        `params.params[...]`).
    - `rules`: the axis rules for logical names, as `jaxshard.axis_rules` takes them;
        by default those in force (a flax box's own rules come first).

    **Raises:**

    `jaxshard.ShardingError` naming the path of every mis-sharded leaf with both
    layouts (`params.layers[1].w_down is sharded as P(None, 'tp') (...), where the
    layout tree says P('tp', None) (...)`); `TypeError` for a layout tree leaf that
    states no layout; `ValueError` if the two trees' leaves do not pair up.

    !!! Example

        ```python
        jaxshard.check_partitioning(weights, weights.shardings(cfg))
        jaxshard.check_partitioning(state.params)  # linen boxes: their metadata
        ```
    """
    if name is None:
        plain = isinstance(tree, (Mapping, list, tuple))  # an nnx State is a Mapping
        name = "params" if plain else type(tree).__name__
    with using(rules):
        found = partitioned_leaves(tree, specs, name)
        source = "its metadata" if specs is None else "the layout tree"
        laid = "partitioned" if specs is None else "laid out"
        _check_all(
            f"check_partitioning({name})",
            found,
            f"{{}} arrays are not {laid} as {source.replace('its', 'their')} says",
            source,
        )


def partitioned_leaves(tree: Any, specs: Any, name: str) -> list:
    """`(path, annotation or Stated, array, rules)` for each leaf with a
    partitioning."""
    out = []
    if specs is not None:
        pairs = jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)[0]
        values = jax.tree_util.tree_leaves(tree, is_leaf=is_box)
        if len(pairs) != len(values):
            raise ValueError(
                f"check_partitioning({name}): `specs` has {len(pairs)} leaves and the "
                f"tree {len(values)}; give one spec (or None) per array, in the "
                "tree's structure."
            )
        for (path, spec), value in zip(pairs, values):
            if spec is not None:
                value = unboxed(value)
                expected = _expected(spec, value, _path(name, path))
                out.append((_path(name, path), expected, value, None))
        return out
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]:
        spec, own = _metadata(leaf)
        if spec is not None:
            out.append((_path(name, path), _annotation(spec), unboxed(leaf), own))
    return out


def _expected(leaf: Any, value: Any, where: str) -> Any:
    """What a layout tree's leaf states: an annotation, or a `Stated` layout."""
    if isinstance(leaf, Sharding):
        return Stated(leaf)
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return Stated(leaf.sharding, tuple(leaf.shape), leaf.dtype)
    if isinstance(leaf, (PartitionSpec, L)) or _is_array(leaf):
        return _annotation(_logical_if_named(leaf, value))
    shown = repr(leaf) if len(repr(leaf)) <= 60 else repr(leaf)[:57] + "..."
    raise TypeError(
        f"check_partitioning: the layout tree's leaf for {where} is {shown} (type "
        f"{type(leaf).__name__}), which states no layout. Each leaf is a "
        "PartitionSpec, a jaxshard.L(...) spec, an annotation, a sharding (a "
        "NamedSharding), a jax.ShapeDtypeStruct, or None to leave the array "
        "unchecked."
    )


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
    """A layout tree's leaf (anything else is flattened, and refused if a leaf)."""
    return (
        x is None
        or isinstance(x, (PartitionSpec, L, Sharding, jax.ShapeDtypeStruct))
        or _is_array(x)
    )


# Where nnx Variables keep their partitioning: `out_sharding` in flax 0.12, earlier
# `sharding_names` and `sharding`.
_NNX_KEYS = ("out_sharding", "sharding_names", "sharding")


def _metadata(leaf: Any) -> tuple[Any, Any]:
    """The partitioning a leaf carries (`PartitionSpec` or `L`), and its own rules."""
    if is_variable(leaf):
        metadata = leaf.get_metadata()
        names = next((metadata[k] for k in _NNX_KEYS if metadata.get(k)), None)
        if names is None:
            return None, None
        if flax_rules() is None and not metadata.get("sharding_rules"):
            # Mesh axes, as nnx reads them; logical names if the rules in force
            # know them and the mesh does not.
            spec = PartitionSpec(*names)
            return _logical_if_named(spec, unboxed(leaf)), None
        # As nnx placed it: its own renaming by flax's rules (a name without a rule
        # stays as it is, a mesh axis).
        from flax import nnx

        spec = nnx.get_partition_spec(leaf)
        return PartitionSpec(*(spec.get_value() if is_variable(spec) else spec)), None
    if is_box(leaf):
        names = tuple(leaf.names)
        if type(leaf).__name__ == "LogicallyPartitioned":
            return L(*names), getattr(leaf, "rules", None) or None
        return PartitionSpec(*names), None
    return None, None


def place_partitioned(tree: Any, mesh: Any) -> Any:
    """`tree` with each abstract leaf (`jax.ShapeDtypeStruct` without a sharding) in
    a partitioning box or nnx Variable placed on `mesh` as its metadata says, under
    the rules in force: what `jax.eval_shape(model.init, ...)` gives, ready to
    compile."""

    def place(leaf: Any) -> Any:
        value = unboxed(leaf)
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
        if is_variable(leaf):
            return leaf.replace(placed)
        return leaf.replace_boxed(placed)

    if not any(is_box(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_box)):
        return tree
    return jax.tree_util.tree_map(place, tree, is_leaf=is_box)


@ft.lru_cache(maxsize=4096)
def _annotation(spec: Any) -> Any:
    """The annotation a spec states, made once per spec: an annotation keeps the
    layouts known to pass, so that a weight checked again costs little."""
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


METADATA = "its metadata"


def metadata_checks(tree: Any, name: str, annotated: set[str]) -> list:
    """`_check_all`'s entries for each leaf of `tree` that carries its partitioning
    (an nnx Variable's metadata, a flax linen box's names) and whose path, `name`
    and its keys (`Decoder.blocks[0].up.kernel`), is none of `annotated`: an
    annotation, where there is one, says the layout."""
    return [
        (*entry, METADATA)
        for entry in partitioned_leaves(tree, None, name)
        if entry[0] not in annotated
    ]


@user_facing
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
    checked). A weight that no annotation reaches but that carries its partitioning,
    an nnx Variable made with `nnx.with_partitioning` by a layer (`nnx.Linear`'s
    kernel) or a flax linen box, is checked against that metadata, as
    `check_partitioning` checks it (logical names resolved under the rules in
    force); where both say, the annotation does. Eagerly it raises at once; inside
    `jax.jit` it checks as annotations do there (at trace time on Explicit meshes,
    when XLA compiles on Auto meshes).

    **Arguments:**

    - `tree`: the value, e.g. an equinox Module, or a tuple, list or dict of
        values, each checked by its own type: `check_tree((model, opt_state))`.
    - `annotation`: its type; by default `type(tree)`. For one array, an array
        annotation, or a bare `PartitionSpec` or `jaxshard.L(...)` as
        `jaxshard.constrain` takes them (of its shape and dtype, only the rank is
        checked).
    - `name`: what to call it in messages (default: its class's name).

    **Raises:**

    `jaxshard.ShardingError` if an array is sharded other than as annotated (or as
    its metadata says), else `jaxtyping.TypeCheckError` if one has the wrong shape or
    dtype; the message lists every failing array by its path
    (`Decoder.blocks[0].up.kernel`).

    !!! Example

        ```python
        model = eqx.tree_at(lambda m: m.w, model, new_w)
        jaxshard.check_tree(model)  # is model.w still sharded as annotated?
        ```
    """
    name = spec_name(annotation) if name is None else name
    annotation = type(tree) if annotation is None else annotation
    annotation = as_annotation(annotation, "jaxshard.check_tree")
    if name is None:  # as `device_put` says it: `tree[0].w` for a bare tuple
        plain = annotation in (dict, list, tuple)
        name = "tree" if plain else getattr(annotation, "__name__", "tree")
    found: list[tuple[str, Any, Any]] = []
    _collect(tree, annotation, name, found)
    carried = metadata_checks(tree, name, {where for where, *_ in found})
    said = " or metadata" if found and carried else ""
    _check_all(
        f"check_tree({name})",
        [(where, expected, value, None) for where, expected, value in found] + carried,
        f"{{}} arrays do not match their annotations{said}"
        if found or not carried
        else "{} arrays are not partitioned as their metadata says",
    )
