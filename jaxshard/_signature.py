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
import math
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, get_args, get_origin

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from . import _dims
from ._array_types import partition_spec
from ._errors import AnnotationError, expect, expect_callable
from ._jax_internals import context_mesh, in_trace
from ._spec import axes_of, format_spec


_union_types = (typing.Union, type(int | str))
_open_containers = (list, dict, set, frozenset, Sequence, Mapping)


class OpenStructure(Exception):
    """Raised inside `_walk` where leaves must be built one by one but the annotation
    does not fix the tree's structure."""


def signature(fn: Callable) -> tuple[inspect.Signature, dict[str, Any]]:
    """`fn`'s signature and its resolved annotations (of the function inside a
    `jax.jit` or a `functools.wraps` wrapper)."""
    target = inspect.unwrap(fn)
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
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        for a in typing.get_type_hints(annotation, include_extras=True).values():
            out += _array_annotations(a, seen)
    return out


def stray_dims(fn: Callable, dims: Mapping[str, Any]) -> str:
    """Why `dims` names a dimension that no annotation of `fn` uses ("" if none
    does): for the command line, where a stray `--dim` is a typo. (The Python API
    takes one `dims` for several functions.)"""
    known = _dimension_names(signature(fn)[1].values())
    stray = sorted(set(dims) - known)
    if not stray:
        return ""
    return (
        f"--dim names {', '.join(map(repr, stray))}, which no annotation of "
        f"{_name(fn)} uses; its dimensions are "
        f"{', '.join(map(repr, sorted(known))) or 'none'}"
    )


def _dimension_names(annotations: Any) -> set[str]:
    """The keys `dims` may have for these annotations: named and variadic dimensions,
    the expressions of symbolic ones and the names in them."""
    names = set()
    for annotation in annotations:
        for array in _array_annotations(annotation):
            for dim in _dims.dimensions(array):
                if dim.kind in ("named", "variadic", "symbolic"):
                    names.add(dim.name)
                if dim.kind == "symbolic":
                    names.update(_dims._names(dim.name))
    return names


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


def shardings(fn: Callable, mesh: Any = None) -> tuple[tuple, Any]:
    """The shardings `fn`'s annotations ask for, ready for `jax.jit`.

    **Arguments:**

    - `fn`: a function with jaxshard annotations (jitted or not).
    - `mesh`: the mesh to place the specs on; by default the one in context
        (`jax.set_mesh`).

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


def shard_map(fn: Callable | None = None, mesh: Any = None, **kwargs) -> Callable:
    """`jax.shard_map`, with `in_specs` and `out_specs` read from `fn`'s annotations.

    The function is wrapped in `jaxshard.jaxtyped` (with beartype), so inside it each
    annotated block is checked as the core annotations describe: shapes against the
    global array, and which mesh axes it varies over.

    **Arguments:**

    - `fn`: the per-shard function; its positional parameters and its return value
        carry partition specs. Leave it out to use `jaxshard.shard_map(mesh=...)` as a
        decorator.
    - `mesh`: as for `jax.shard_map`; by default the mesh in context.
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
        return ft.partial(shard_map, mesh=mesh, **kwargs)
    what = f"jaxshard.shard_map({_name(fn)})"
    sig, _ = signature(fn)
    for p in sig.parameters.values():
        if p.kind is p.KEYWORD_ONLY and p.default is p.empty:
            raise AnnotationError(
                f"{what}: parameter {p.name!r} is keyword-only, but jax.shard_map "
                "passes arguments by position."
            )
    if "in_specs" not in kwargs or "out_specs" not in kwargs:
        ins, out = _shardings(fn, lambda spec: spec)
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
    from ._check_records import Findings, shard_map_checks
    from ._verify import checked_by_jaxshard

    body = checked_by_jaxshard(fn)

    def body_with_checks(*args):
        # Value checks inside the body come out as an extra, replicated output,
        # whose tree structure holds the frame (so jit's cache gives it back).
        with shard_map_checks() as frame:
            out = body(*args)
        return out, Findings(frame, None, tuple(frame.contents()), None)

    kwargs["out_specs"] = (kwargs["out_specs"], PartitionSpec())
    mapped = jax.shard_map(body_with_checks, mesh=mesh, **kwargs)
    # JAX runs a shard_map op by op when called outside jit, and then refuses the
    # Refs its body's checks make: called eagerly, it is compiled instead.
    compiled = jax.jit(mapped)

    @ft.wraps(fn)
    def wrapper(*args):
        out, found = (mapped if in_trace() else compiled)(*args)
        found.frame.forward(found.states)
        return out

    return wrapper


def _has_none(tree: Any) -> bool:
    return any(leaf is None for leaf in _leaves(tree))


def _listing(noun: str, names: list[str]) -> str:
    quoted = ", ".join(map(repr, names))
    return f"{noun}s {quoted} have" if len(names) > 1 else f"{noun} {quoted} has"


# --- abstract inputs ----------------------------------------------------------------


_DEFAULT_DTYPES = ("float32", "int32", "uint32", "complex64", "bool")


def _dtype(annotation: Any, where: str, key: str, dtypes: Any, used: set) -> Any:
    """The dtype of an input; the entry of `dtypes` that decided it goes in `used`
    (`...` for a blanket dtype)."""
    allowed = annotation.dtypes
    chosen = None
    if isinstance(dtypes, Mapping):
        name = annotation.dtype.__name__
        for k in (where, key, name):
            if k in dtypes:
                chosen = dtypes[k]
                used.add(k)
                break
        else:
            for k, v in dtypes.items():
                if isinstance(k, type) and getattr(k, "__name__", None) == name:
                    chosen = v
                    used.add(k)
    elif dtypes is not None:
        chosen = dtypes
        if isinstance(allowed, tuple) and np.dtype(chosen).name not in allowed:
            chosen = None  # a blanket dtype applies where the annotation allows it
        else:
            used.add(...)
    if chosen is not None:
        chosen = np.dtype(chosen)
        if isinstance(allowed, tuple) and chosen.name not in allowed:
            raise ValueError(
                f"{where}: dtypes asks for {chosen.name}, but the annotation "
                f"{annotation!r} allows only {', '.join(allowed)}."
            )
        return chosen
    if not isinstance(allowed, tuple):  # Shaped: any dtype
        return np.dtype("float32")
    if allowed == ("prng_key",):
        return jax.eval_shape(jax.random.key, 0).dtype
    for name in _DEFAULT_DTYPES:
        if name in allowed and (name != "bool" or len(allowed) <= 2):
            return np.dtype(name)
    return jnp.dtype(allowed[0])


def _bound_inputs(
    fn: Callable,
    mesh: Any,
    dims: Mapping[str, Any] | None,
    dtypes: Any,
    values: Mapping[str, Any] | None,
    what: str,
) -> dict[str, Any]:
    """Parameter name -> abstract input, for every parameter that needs a value."""
    sig, hints = signature(fn)
    dims = dict(dims or {})
    values = dict(values or {})
    unknown = sorted(set(values) - set(sig.parameters))
    if unknown:
        raise ValueError(
            f"{what}: `values` names {', '.join(map(repr, unknown))}, which "
            f"{'are not parameters' if len(unknown) > 1 else 'is not a parameter'} "
            f"of {_name(fn)}."
        )
    unbound: dict[str, list[str]] = {}
    uneven: list[str] = []
    needs_value: list[str] = []
    used_dtypes: set = set()

    def leaf(annotation, where, default=None):
        if annotation is None:
            if default is None:
                needs_value.append(where)
            return default
        shape, missing = _dims.shape(annotation, dims)
        for name in missing:
            unbound.setdefault(name, []).append(where)
        if shape is None:
            return None
        spec = partition_spec(annotation)
        sharding = None
        if spec is not None:
            spec = _input_spec(spec)
            problems = _uneven(spec, shape, mesh, where)
            uneven.extend(problems)
            if not problems:
                sharding = NamedSharding(mesh, spec)
        key = where.split(".")[0].split("[")[0]
        dtype = _dtype(annotation, where, key, dtypes, used_dtypes)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    out = {}
    for p in sig.parameters.values():
        if p.name in values:
            out[p.name] = values[p.name]
        elif p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        elif p.default is not p.empty:
            continue  # parameters with defaults keep them
        else:
            out[p.name] = _tree(hints.get(p.name, Any), leaf, p.name)
    problems = []
    if unbound:
        problems.append(
            "these dimensions have no size: "
            + "; ".join(f"{n!r} (in {', '.join(w)})" for n, w in unbound.items())
            + ". Pass them in `dims`, e.g. dims={"
            + ", ".join(
                f"{n!r}: (2, 4)" if n == "..." else f"{n!r}: 8" for n in unbound
            )
            + "} (a tuple of sizes for a variadic dimension)"
        )
    if uneven:
        problems.append("; ".join(uneven))
    if dtypes is not None and not isinstance(dtypes, Mapping) and not used_dtypes:
        problems.append(
            f"`dtypes` asks for {np.dtype(dtypes).name}, which no array annotation of "
            f"{_name(fn)} allows"
        )
    if isinstance(dtypes, Mapping) and set(dtypes) - used_dtypes:
        stray = ", ".join(
            repr(getattr(k, "__name__", k)) for k in dtypes if k not in used_dtypes
        )
        problems.append(
            f"`dtypes` names {stray}, but no input of {_name(fn)} matches (a key is "
            "a parameter's name, a tree path such as p.w1, or a dtype class such as "
            "Float)"
        )
    if needs_value:
        problems.append(
            f"{_listing('parameter', needs_value)} no array annotation and no "
            "default, so there is nothing to build it from. Pass it in "
            "`values={...}`"
        )
    if problems:
        raise ValueError(f"{what}: " + ". Also, ".join(problems) + ".")
    return out


def _uneven(spec: PartitionSpec, shape: tuple, mesh: Any, where: str) -> list[str]:
    out = []
    for i, entry in enumerate(spec):
        axes = axes_of(entry)
        missing = [a for a in axes if a not in mesh.shape]
        if missing:
            out.append(
                f"{where} is sharded over mesh axis {', '.join(map(repr, missing))}, "
                f"which the mesh (axes {', '.join(map(repr, mesh.axis_names))}) lacks"
            )
            continue
        ways = math.prod(mesh.shape[a] for a in axes)
        if i < len(shape) and shape[i] % ways:
            out.append(
                f"{where}: dimension {i} has size {shape[i]}, which {format_spec(spec)}"
                f" splits {ways} ways over {'×'.join(axes)}; pick a size divisible by "
                f"{ways}"
            )
    return out


def abstract_args(
    fn: Callable,
    mesh: Any = None,
    dims: Mapping[str, Any] | None = None,
    dtypes: Any = None,
    *,
    values: Mapping[str, Any] | None = None,
) -> tuple:
    """Abstract inputs for `fn`, from its annotations: for `jit(fn).lower(*args)`.

    **Arguments:**

    - `fn`: a function with jaxtyping/jaxshard annotations.
    - `mesh`: the mesh the partition specs refer to; by default the one in context.
    - `dims`: sizes of the named dimensions, e.g. `{"batch": 1024, "seqlen": 2048}`;
        a tuple of sizes for a variadic dimension (`{"batch": (4, 8)}`, `{"...": ()}`).
        Symbolic dimensions (`seqlen-1`) are computed from these.
    - `dtypes`: which dtype to use where an annotation allows several. By default
        `Float` gives float32, `Int` int32, `UInt` uint32, `Complex` complex64 (JAX's
        defaults), else the annotation's first dtype. A single dtype applies wherever
        the annotation allows it; a dict maps a parameter name (or tree path such as
        `"params.w1"`), or a dtype class (`jaxshard.Float`, or its name `"Float"`), to a
        dtype.
    - `values`: values for parameters that are not arrays, or to use as given.

    **Returns:**

    A tuple with one entry per positional parameter: a `jax.ShapeDtypeStruct` (with the
    annotation's `NamedSharding` on `mesh`) for each array annotation, in the tree
    structure of the annotation (tuples, NamedTuples, dataclasses, equinox Modules).
    Parameters with defaults get their defaults.

    **Raises:**

    `ValueError` naming every dimension left without a size (and where it is used),
    every sharded dimension whose size the mesh axes don't divide, and every parameter
    with nothing to build it from. `jaxtyping.AnnotationError` for annotations that do
    not fix a tree's structure (`PyTree[...]`).

    !!! Example

        ```python
        args = jaxshard.abstract_args(step, mesh, dims={"batch": 1024, "seqlen": 2048})
        compiled = jax.jit(step).lower(*args).compile()
        ```
    """
    expect_callable("abstract_args", fn)
    mesh = _resolve_mesh(mesh, "jaxshard.abstract_args")
    what = f"jaxshard.abstract_args({_name(fn)})"
    sig, _ = signature(fn)
    bound = _bound_inputs(fn, mesh, dims, dtypes, values, what)
    out = []
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            out.append(bound[p.name] if p.name in bound else p.default)
        elif p.kind is p.KEYWORD_ONLY and p.name in bound:
            raise ValueError(
                f"{what}: parameter {p.name!r} is keyword-only and has no default, "
                "so it cannot be passed in a tuple of positional arguments. Give it a "
                "default, or use jaxshard.verify, which passes it by name."
            )
    return tuple(out)
