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
import inspect
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, get_args, get_origin

import jax
import jaxtyping
from jax.sharding import NamedSharding, PartitionSpec

from .._annotations.hints import type_hints
from .._annotations.logical import using
from .._errors import AnnotationError, expect, expect_callable, user_facing
from .._jax_internals import context_mesh
from .array_types import partition_spec
from .compare import missing_axes
from .describe import value_name


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
    if _is_callable_object(target):  # an equinox Module: its `__call__`, bound
        bound, target = True, inspect.unwrap(type(target).__call__)
    sig = inspect.signature(target)
    try:
        hints = type_hints(target)
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


def _is_callable_object(target: Any) -> bool:
    """Whether `target` is an instance called through its class's Python
    `__call__` (an equinox Module, a model object), not a function or a class."""
    call = getattr(type(target), "__call__", None)
    return (
        not isinstance(target, type)
        and not callable(getattr(target, "__func__", None))
        and inspect.isfunction(inspect.unwrap(call) if call is not None else None)
    )


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
        f"{_said(where)}: the annotation gives different shardings to the leaves "
        "of a tree whose structure it does not fix. Annotate it with a type that "
        "fixes the structure (a tuple[...], NamedTuple, dataclass or equinox Module), "
        "or give its leaves one spec."
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
            hints = type_hints(annotation)
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
    hints = type_hints(cls)
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


_INTO = re.compile(r"parameter '(\w+)'(?=[.\[])(.*)$")


def _said(where: str) -> str:
    """`f, parameter 'weights'.layers` as messages say it: `f, field
    'weights.layers'`."""
    found = _INTO.search(where)
    if found is None:
        return where
    return where[: found.start()] + value_name(found[1] + found[2])


def _tree(annotation: Any, leaf: Callable[[Any, str], Any], where: str) -> Any:
    """`_walk`, where a tree that cannot be built gives one value for the whole tree
    if `leaf` allows tree prefixes, and an error otherwise."""
    try:
        return _walk(annotation, leaf, where)
    except OpenStructure as e:
        if not _is_prefixable(leaf):
            raise AnnotationError(
                f"{_said(e.args[0])}: the annotation does not fix the structure of "
                f"this tree ({annotation!r}), so its leaves cannot be built one by "
                "one. Annotate it with a type that does (a tuple[...], NamedTuple, "
                "dataclass or equinox Module whose static fields have defaults), or "
                "pass the value yourself (`values={...}`)."
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
        for a in type_hints(annotation).values():
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
    """`train_step`, `Model.forward`: the qualified name without `<locals>`."""
    target = inspect.unwrap(fn)
    name = getattr(target, "__qualname__", None)
    if name is None:  # a callable object (an equinox Module): its class's name
        name = type(target).__qualname__ if _is_callable_object(target) else repr(fn)
    return name.split("<locals>.")[-1]


# --- shardings and specs ------------------------------------------------------------


def _input_spec(spec: PartitionSpec) -> PartitionSpec:
    # An input or output sharding fixes every dimension: "unconstrained" becomes None.
    return PartitionSpec(
        *(None if e is PartitionSpec.UNCONSTRAINED else e for e in spec)
    )


def expect_mesh(mesh: Any, function: str) -> None:
    """Refuses, as `function`'s error, a `mesh=` argument that is not a mesh."""
    expect(
        mesh is None or isinstance(mesh, jax.sharding.Mesh),
        function,
        "mesh",
        "a jax.sharding.Mesh (or None for the one in context)",
        mesh,
    )


def _resolve_mesh(mesh: Any, what: str) -> Any:
    expect_mesh(mesh, what.removeprefix("jaxshard.").split("(")[0])
    mesh = context_mesh() if mesh is None else mesh
    if mesh is None:
        raise ValueError(
            f"{what} needs a mesh: pass `mesh=...`, or call it inside "
            "`with jax.set_mesh(mesh):`."
        )
    return mesh


@user_facing
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
        return _shardings(
            fn, lambda spec: NamedSharding(mesh, _input_spec(spec)), mesh=mesh
        )


def _shardings(
    fn: Callable, make: Callable[[PartitionSpec], Any], mesh: Any = None
) -> tuple[tuple, Any]:
    """`shardings`, each spec made into a leaf by `make`. With `mesh`, every spec
    naming an axis the mesh lacks is found first, and a `ValueError` names them all
    (JAX's own error names no function or parameter)."""
    sig, hints = signature(fn)
    misplaced = []

    def leaf(annotation, where, default=None):
        del default
        spec = None if annotation is None else partition_spec(annotation)
        if spec is None:
            return None
        reason = "" if mesh is None else missing_axes(spec, mesh)
        if reason:
            if hasattr(annotation, "explain"):  # say which rule
                reason += f" ({annotation.explain()})"
            misplaced.append(f"{where}: {reason}")
            return None
        return make(spec)

    leaf.prefixable = True  # pyright: ignore[reportFunctionMemberAccess]
    what = f"jaxshard.shardings({_name(fn)})"
    ins = tuple(
        _tree(hints.get(p.name, Any), leaf, f"{what}, parameter {p.name!r}")
        for p in _positional(sig, what)
    )
    out = _tree(hints.get("return", Any), leaf, f"{what}, return value")
    if misplaced:
        raise ValueError(
            "; ".join(misplaced) + ". Name the mesh's axes in the annotation, or "
            "in the axis rules that map its logical names to them."
        )
    return ins, out


def _listing(noun: str, names: list[str]) -> str:
    quoted = ", ".join(map(repr, names))
    return f"{noun}s {quoted} have" if len(names) > 1 else f"{noun} {quoted} has"


# --- abstract inputs ----------------------------------------------------------------
