"""What a function's annotations say about its inputs and outputs, as pytrees: the
shardings for `jax.jit`, the specs for `jax.shard_map`, abstract inputs for `verify`.

`_walk` maps each array annotation inside a parameter's annotation to a leaf (a
sharding, a spec, a `jax.ShapeDtypeStruct`), keeping the tree structure the annotation
states: tuples, NamedTuples and dataclasses (equinox Modules among them). Containers
whose structure the annotation leaves open (`PyTree[...]`, `list[...]`, `dict[...]`)
give one value for all their leaves, which JAX takes as a tree prefix; where leaves
must be built one by one, they are an error.
"""

import dataclasses
import functools as ft
import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, get_args, get_origin

import jax
import jaxtyping
from jax.sharding import NamedSharding, PartitionSpec

from .._annotations.logical import active_rules, normalise, using
from .._annotations.spec import format_spec
from .._errors import AnnotationError, expect, expect_callable, ShardingError
from .._jax_internals import context_mesh
from .array_types import partition_spec
from .decorator import checked_by_jaxshard
from .layout import explicit_mismatch, is_explicit


_union_types = (typing.Union, type(int | str))
_open_containers = (list, dict, set, frozenset, Sequence, Mapping)
_POSITIONAL = (
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
)


class OpenStructure(Exception):
    """Raised inside `_walk` where leaves must be built one by one but the annotation
    does not fix the tree's structure."""


def signature(fn: Callable) -> tuple[inspect.Signature, dict[str, Any]]:
    """`fn`'s signature and its resolved annotations (of the function inside a
    `jax.jit` or a `functools.wraps` wrapper; of a bound method, without its first
    parameter)."""
    bound = inspect.ismethod(fn)
    target = inspect.unwrap(fn.__func__ if bound else fn)
    sig = inspect.signature(target)
    try:
        hints = typing.get_type_hints(target, include_extras=True)
    except Exception:  # an annotation naming something out of scope
        hints = {
            name: p.annotation
            for name, p in sig.parameters.items()
            if p.annotation is not p.empty
        }
        if sig.return_annotation is not sig.empty:
            hints["return"] = sig.return_annotation
    parameters = list(sig.parameters.values())
    if bound and parameters and parameters[0].kind in _POSITIONAL:
        sig = sig.replace(parameters=parameters[1:])  # `self`, bound already
        hints.pop(parameters[0].name, None)
    return sig, hints


def _is_array_annotation(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(
        annotation, jaxtyping.AbstractArray
    )


def _leaves(tree: Any) -> list:
    return jax.tree.leaves(
        tree,
        is_leaf=lambda x: x is None or isinstance(x, (PartitionSpec, NamedSharding)),
    )


def _uniform(tree: Any, where: str) -> Any:
    leaves = _leaves(tree)
    if all(leaf == leaves[0] for leaf in leaves):
        return leaves[0] if leaves else None
    raise AnnotationError(
        f"{where}: the annotation gives different shardings to the leaves of a tree "
        "whose structure it does not fix. Annotate it with a type that fixes the "
        "structure (a tuple[...], NamedTuple, dataclass or equinox Module), or give "
        "its leaves one spec."
    )


def _walk(annotation: Any, leaf: Callable[[Any, str], Any], where: str) -> Any:
    """Maps each array annotation in `annotation` to `leaf(array_annotation, where)`,
    and each annotation that holds no array to `leaf(None, where)`."""
    if _is_array_annotation(annotation):
        return leaf(annotation, where)
    origin = get_origin(annotation)
    if origin in _union_types:
        members = [a for a in get_args(annotation) if a is not type(None)]
        arrays = [a for a in members if _is_array_annotation(a)]
        if len(members) == 1:
            return _walk(members[0], leaf, where)
        if arrays and len({partition_spec(a) for a in arrays}) == 1:
            # `Float[Array | np.ndarray, ...]`: one contract, several array types.
            return _walk(arrays[0], leaf, where)
        if not arrays:
            return leaf(None, where)
        raise AnnotationError(
            f"{where}: the union {annotation!r} allows several partition specs, so "
            "it does not say how the value is sharded."
        )
    if isinstance(annotation, type(jaxtyping.PyTree)):  # PyTree[...]
        return _open(annotation.leaftype, leaf, where)
    if origin is tuple or annotation is tuple:
        args = get_args(annotation)
        if not args or (len(args) == 2 and args[1] is Ellipsis):
            return _open(args[0] if args else Any, leaf, where)
        return tuple(_walk(a, leaf, f"{where}[{i}]") for i, a in enumerate(args))
    if origin is not None and isinstance(origin, type):
        if issubclass(origin, _open_containers):
            args = get_args(annotation)
            return _open(args[-1] if args else Any, leaf, where)
        annotation = origin  # e.g. a generic dataclass `Params[T]`
    if isinstance(annotation, type):
        if issubclass(annotation, tuple) and hasattr(annotation, "_fields"):
            hints = typing.get_type_hints(annotation, include_extras=True)
            return annotation(
                *(
                    _walk(hints.get(f, Any), leaf, f"{where}.{f}")
                    for f in annotation._fields
                )
            )
        if dataclasses.is_dataclass(annotation):
            return _dataclass(annotation, leaf, where)
        if issubclass(annotation, _open_containers):
            return _open(Any, leaf, where)
    return leaf(None, where)


def _open(element: Any, leaf: Callable[[Any, str], Any], where: str) -> Any:
    """A container whose structure the annotation leaves open: one value for all its
    leaves, where `leaf` allows a tree prefix."""
    if not _is_prefixable(leaf):
        raise OpenStructure(where)
    return _uniform(_walk(element, leaf, f"{where}[...]"), where)


def _is_prefixable(leaf: Callable) -> bool:
    return getattr(leaf, "prefixable", False)


def _dataclass(cls: type, leaf: Callable[[Any, str], Any], where: str) -> Any:
    hints = typing.get_type_hints(cls, include_extras=True)
    values = {}
    for field in dataclasses.fields(cls):
        here = f"{where}.{field.name}"
        if field.metadata.get("static", False):
            # Part of the tree's structure: only its default can stand in for it.
            if field.default is not dataclasses.MISSING:
                values[field.name] = field.default
                continue
            if field.default_factory is not dataclasses.MISSING:
                values[field.name] = field.default_factory()
                continue
            raise OpenStructure(here)
        hint = hints.get(field.name, Any)
        if not _array_annotations(hint) and field.default is not dataclasses.MISSING:
            values[field.name] = leaf(None, here, field.default)
            continue
        values[field.name] = _walk(hint, leaf, here)
    # Build the instance without running `__init__`, which may compute or check
    # fields: only the tree structure and the leaves matter here.
    out = object.__new__(cls)
    for name, value in values.items():
        object.__setattr__(out, name, value)
    return out


def _tree(annotation: Any, leaf: Callable[[Any, str], Any], where: str) -> Any:
    """`_walk`, where a tree that cannot be built gives one value for the whole tree
    if `leaf` allows tree prefixes, and an error otherwise."""
    try:
        return _walk(annotation, leaf, where)
    except OpenStructure as e:
        if not _is_prefixable(leaf):
            raise AnnotationError(
                f"{e.args[0]}: the annotation does not fix the structure of this tree "
                f"({annotation!r}), so its leaves cannot be built one by one. Annotate "
                "it with a type that does (a tuple[...], NamedTuple, dataclass or "
                "equinox Module whose static fields have defaults), or pass the "
                "value yourself (`values={...}`)."
            ) from None
        found = [leaf(a, where) for a in _array_annotations(annotation)]
        return _uniform(found or [None], where)


def _array_annotations(annotation: Any, seen: set | None = None) -> list:
    seen = set() if seen is None else seen
    if _is_array_annotation(annotation):
        return [annotation]
    if id(annotation) in seen:
        return []
    seen.add(id(annotation))
    if isinstance(annotation, type(jaxtyping.PyTree)):
        return _array_annotations(annotation.leaftype, seen)
    out = []
    for a in get_args(annotation):
        out += _array_annotations(a, seen)
    if isinstance(annotation, type) and (
        dataclasses.is_dataclass(annotation)  # equinox Modules too
        or (issubclass(annotation, tuple) and hasattr(annotation, "_fields"))
    ):
        for a in typing.get_type_hints(annotation, include_extras=True).values():
            out += _array_annotations(a, seen)
    return out


def _positional(sig: inspect.Signature, what: str) -> list[inspect.Parameter]:
    out = []
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            raise AnnotationError(
                f"{what}: `*{p.name}` takes any number of arguments, so the "
                "annotations do not say how many there are."
            )
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            out.append(p)
    return out


def _name(fn: Callable) -> str:
    return getattr(inspect.unwrap(fn), "__qualname__", repr(fn))


# --- shardings and specs ------------------------------------------------------------


def _input_spec(spec: PartitionSpec) -> PartitionSpec:
    # An input or output sharding fixes every dimension: "unconstrained" becomes None.
    return PartitionSpec(
        *(None if e is PartitionSpec.UNCONSTRAINED else e for e in spec)
    )


def _resolve_mesh(mesh: Any, what: str) -> Any:
    function = what.removeprefix("jaxshard.").split("(")[0]
    expect(
        mesh is None or isinstance(mesh, jax.sharding.Mesh),
        function,
        "mesh",
        "a jax.sharding.Mesh (or None for the one in context)",
        mesh,
    )
    mesh = context_mesh() if mesh is None else mesh
    if mesh is None:
        raise ValueError(
            f"{what} needs a mesh: pass `mesh=...`, or call it inside "
            "`with jax.set_mesh(mesh):`."
        )
    return mesh


def shardings(
    fn: Callable, mesh: Any = None, *, rules: Any = None
) -> tuple[tuple, Any]:
    """The shardings `fn`'s annotations ask for, ready for `jax.jit`.

    **Arguments:**

    - `fn`: a function with jaxshard annotations (jitted or not).
    - `mesh`: the mesh to place the specs on; by default the one in context
        (`jax.set_mesh`).
    - `rules`: the axis rules for logical annotations (`L(...)`, `BY_NAME`), as
        `jaxshard.axis_rules` takes them; by default those in force.

    **Returns:**

    `(in_shardings, out_shardings)`: a tuple with one entry per positional parameter,
    and a tree for the return value. Each is a pytree of `NamedSharding`s following the
    annotation (tuples, NamedTuples, dataclasses and equinox Modules keep their
    structure); an annotation with no partition spec, or no annotation, gives `None`,
    which leaves the choice to `jax.jit`. A `PyTree[...]`, `list[...]` or `dict[...]`
    annotation gives one sharding for all its leaves (a tree prefix, which `jax.jit`
    accepts) and is an error if its leaves have different specs. `P.UNCONSTRAINED`
    dimensions become `None` (replicated).

    !!! Example

        ```python
        in_shardings, out_shardings = jaxshard.shardings(step, mesh)
        step = jax.jit(step, in_shardings=in_shardings, out_shardings=out_shardings)
        ```
    """
    expect_callable("shardings", fn)
    mesh = _resolve_mesh(mesh, "jaxshard.shardings")
    with using(rules):
        return _shardings(fn, lambda spec: NamedSharding(mesh, _input_spec(spec)))


def _shardings(fn: Callable, make: Callable[[PartitionSpec], Any]) -> tuple[tuple, Any]:
    sig, hints = signature(fn)

    def leaf(annotation, where, default=None):
        del default
        spec = None if annotation is None else partition_spec(annotation)
        return None if spec is None else make(spec)

    leaf.prefixable = True  # pyright: ignore[reportFunctionMemberAccess]
    what = f"jaxshard.shardings({_name(fn)})"
    ins = tuple(
        _tree(hints.get(p.name, Any), leaf, f"{what}, parameter {p.name!r}")
        for p in _positional(sig, what)
    )
    out = _tree(hints.get("return", Any), leaf, f"{what}, return value")
    return ins, out


def shard_map(
    fn: Callable | None = None, mesh: Any = None, *, rules: Any = None, **kwargs
) -> Callable:
    """`jax.shard_map`, with `in_specs` and `out_specs` read from `fn`'s annotations.

    The function is wrapped in `jaxshard.jaxtyped` (with beartype), so inside it each
    annotated block is checked as the core annotations describe: shapes against the
    global array, and which mesh axes it varies over.

    **Arguments:**

    - `fn`: the per-shard function; its positional parameters and its return value
        carry partition specs. Leave it out to use `jaxshard.shard_map(mesh=...)` as a
        decorator.
    - `mesh`: as for `jax.shard_map`; by default the mesh in context.
    - `rules`: the axis rules for logical annotations, as `jaxshard.axis_rules`
        takes them; by default those in force at each call (the specs are read again
        when they change).
    - `**kwargs`: passed on to `jax.shard_map` (`axis_names`, `check_vma`, and
        `in_specs`/`out_specs` to override the annotations).

    **Returns:**

    The function `jax.shard_map` returns.

    !!! Example

        ```python
        @jaxshard.shard_map(mesh=mesh)
        def local_sum(x: Float[Array, "batch d", P("dp")]) -> Float[Array, "d", P()]:
            return jax.lax.psum(x.sum(0), "dp")
        ```
    """
    expect(fn is None or callable(fn), "shard_map", "fn", "a function", fn)
    if fn is None:
        return ft.partial(shard_map, mesh=mesh, rules=rules, **kwargs)
    what = f"jaxshard.shard_map({_name(fn)})"
    if rules is not None or _is_logical(fn):
        # Logical specs are read at each call, under the rules then in force.
        made: dict = {}
        table = None if rules is None else normalise(rules)

        @ft.wraps(fn)
        def logical(*args):
            with using(table):
                key = active_rules()
                if key not in made:
                    made[key] = _shard_map(fn, mesh, what, dict(kwargs))
                return made[key](*args)

        return logical
    return _shard_map(fn, mesh, what, kwargs)


def _is_logical(fn: Callable) -> bool:
    _, hints = signature(fn)
    return any(
        hasattr(a, "explain") for h in hints.values() for a in _array_annotations(h)
    )


def _shard_map(fn: Callable, mesh: Any, what: str, kwargs: dict) -> Callable:
    sig, _ = signature(fn)
    for p in sig.parameters.values():
        if p.kind is p.KEYWORD_ONLY and p.default is p.empty:
            raise AnnotationError(
                f"{what}: parameter {p.name!r} is keyword-only, but jax.shard_map "
                "passes arguments by position."
            )
    annotated = "in_specs" not in kwargs  # the in_specs are the annotations'
    if "in_specs" not in kwargs or "out_specs" not in kwargs:
        # A block is laid out whole along an unconstrained dimension.
        ins, out = _shardings(fn, _input_spec)
        params = _positional(sig, what)
        missing = [p.name for p, s in zip(params, ins) if _has_none(s)]
        if "in_specs" not in kwargs:
            if missing:
                raise AnnotationError(
                    f"{what}: {_listing('parameter', missing)} no partition spec in "
                    "the annotation, so there is no in_spec for it. Add one to the "
                    "annotation (`P()` for a replicated value) or pass `in_specs=`."
                )
            kwargs["in_specs"] = ins
        if "out_specs" not in kwargs:
            if _has_none(out):
                raise AnnotationError(
                    f"{what}: the return annotation has no partition spec (or only "
                    "for some leaves), so there is no out_spec. Add one (`P()` for a "
                    "replicated value) or pass `out_specs=`."
                )
            kwargs["out_specs"] = out
    from .._values.frames import Findings, shard_map_checks

    body = checked_by_jaxshard(fn)

    def body_with_checks(*args):
        # Value checks inside the body come out as an extra, replicated output,
        # whose tree structure holds the frame (so jit's cache gives it back).
        with shard_map_checks() as frame:
            out = body(*args)
        return out, Findings(frame, frame.packed())

    kwargs["out_specs"] = (kwargs["out_specs"], PartitionSpec())
    mapped = jax.shard_map(body_with_checks, mesh=mesh, **kwargs)
    # JAX runs a shard_map op by op outside jit (eagerly, or under `grad` or `vmap`
    # there), and then refuses the Refs its body's checks make: it is always jitted
    # (inside an outer jit, a nested jit is inlined into it).
    compiled = jax.jit(mapped)

    _, hints = signature(fn)
    arrays = [
        (i, p.name, hints[p.name])
        for i, p in enumerate(_positional(sig, what))
        if annotated and partition_spec(hints.get(p.name)) is not None
    ]

    @ft.wraps(fn)
    def wrapper(*args):
        args = _laid_out(what, arrays, args)
        out, found = compiled(*args)
        found.frame.forward(found.packed)
        return out

    return wrapper


def _laid_out(what: str, arrays: list[tuple[int, str, Any]], args: tuple) -> tuple:
    """`args`, each as its in_spec (its annotation's) lays it out. On Explicit axes
    `jax.shard_map` takes an input only in its in_spec's very layout: one laid out
    otherwise is a `ShardingError` naming the parameter (not JAX's own error), and
    one in an equivalent layout (`P('dp')` for `P()`, `dp` of size 1) gets the
    in_spec's."""
    args = list(args)
    for i, name, annotation in arrays:
        if i >= len(args):
            break
        arg = args[i]
        spec = _input_spec(annotation.spec)  # an unconstrained dimension is whole
        reason = explicit_mismatch(annotation, arg, spec)
        if reason:
            raise ShardingError(
                f"{what}, parameter {name!r}: {reason} On Explicit mesh axes, "
                "jax.shard_map takes its inputs laid out as its in_specs (here the "
                "annotations, unconstrained dimensions whole) say: reshard it first, "
                f"e.g. `jax.sharding.reshard(x, {format_spec(spec)})`."
            )
        if is_explicit(arg) and jax.typeof(arg).sharding.spec != _padded(spec, arg):
            concrete = not isinstance(arg, jax.core.Tracer)
            mesh = (arg.sharding if concrete else jax.typeof(arg).sharding).mesh
            args[i] = jax.sharding.reshard(arg, NamedSharding(mesh, spec))
    return tuple(args)


def _padded(spec: PartitionSpec, arg: Any) -> PartitionSpec:
    return PartitionSpec(*spec, *[None] * (len(arg.shape) - len(spec)))


def _has_none(tree: Any) -> bool:
    return any(leaf is None for leaf in _leaves(tree))


def _listing(noun: str, names: list[str]) -> str:
    quoted = ", ".join(map(repr, names))
    return f"{noun}s {quoted} have" if len(names) > 1 else f"{noun} {quoted} has"


# --- abstract inputs ----------------------------------------------------------------
