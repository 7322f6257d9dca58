"""What a failed check of a call says about its arguments, for `jaxshard.jaxtyped`'s
error: the dimension two arguments bind to different sizes (jaxtyping says only
which parameter failed), and the arguments cut to a line each (jaxtyping prints
every leaf of every argument: a whole optimizer state).

Only called on the error path: nothing here costs a passing call anything.
"""

import inspect
import re
import typing
from collections.abc import Callable, Iterator
from typing import Any, get_args, get_origin

import jax
import jaxtyping

from .._annotations import dims as _dims
from .._annotations.hints import type_hints


_union_types = (typing.Union, type(int | str))
_WIDEST = 80  # characters: a value shown wider than this is summarised


# --- the dimension bound twice ------------------------------------------------------


def dimension_conflict(fn: Callable, args: tuple, kwargs: dict, message: str) -> str:
    """The first named dimension that `fn`'s arguments (in parameter order, then its
    return value as jaxtyping's `message` shows it) bind to two sizes, as "dimension
    'd' is 16 from parameter 'x' (shape (8, 16)) but 17 in parameter 'y' (shape
    (8, 17))"; "" if there is none, or the annotations cannot be read."""
    try:
        return _dimension_conflict(fn, args, kwargs, message)
    except Exception:  # never in place of the user's error: unresolvable annotations,
        return ""  # arguments that do not bind, a type whose fields cannot be read


def _dimension_conflict(fn: Callable, args: tuple, kwargs: dict, message: str) -> str:
    sig = inspect.signature(fn)
    hints = type_hints(fn)
    arguments = sig.bind(*args, **kwargs).arguments
    bound: dict[str, tuple[int, str, tuple]] = {}
    held = _held(message)
    conflict = ""
    for name, value in arguments.items():
        for where, annotation, shape in _arrays(hints.get(name), value, name):
            conflict = conflict or _bind(
                annotation, shape, f"parameter {where!r}", bound, held
            )
    returned = _returned_shape(message)
    annotation = hints.get("return")
    if not conflict and returned is not None and _is_array_annotation(annotation):
        conflict = _bind(annotation, returned, "the return value", bound, held)
    if not conflict:
        return ""
    return (
        f"{conflict}. Annotations that share a dimension's name must agree on its "
        "size: pass arrays that agree, or name the dimensions differently where "
        "they may differ."
    )


def _is_array_annotation(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(
        annotation, jaxtyping.AbstractArray
    )


def _arrays(annotation: Any, value: Any, where: str) -> Iterator[tuple]:
    """`(where, array annotation, shape)` for each array in `value` whose annotation
    `annotation` states: through unions, fixed tuples and NamedTuples (typeguard
    checks their fields); containers whose structure it leaves open are skipped, and
    a dataclass's fields, which no typechecker checks against the call's dims."""
    if _is_array_annotation(annotation):
        shape = getattr(value, "shape", None)
        if isinstance(shape, tuple):
            yield where, annotation, shape
        return
    if get_origin(annotation) in _union_types:
        arrays = [a for a in get_args(annotation) if _is_array_annotation(a)]
        if len({a.dim_str for a in arrays}) == 1 and hasattr(value, "shape"):
            yield from _arrays(arrays[0], value, where)
        return
    if get_origin(annotation) is tuple and isinstance(value, tuple):
        members = get_args(annotation)
        if Ellipsis not in members and len(members) == len(value):
            for i, (a, v) in enumerate(zip(members, value)):
                yield from _arrays(a, v, f"{where}[{i}]")
        return
    if not isinstance(annotation, type) or isinstance(
        annotation, type(jaxtyping.PyTree)
    ):
        return  # `PyTree[...]`, whose `isinstance` would check (and bind) its leaves
    fields: list[str] = []
    if issubclass(annotation, tuple) and hasattr(annotation, "_fields"):
        fields = list(annotation._fields)
    if fields and isinstance(value, annotation):
        try:
            hints = type_hints(annotation)
        except Exception:
            return
        for field in fields:
            yield from _arrays(
                hints.get(field), getattr(value, field, None), f"{where}.{field}"
            )


def _bind(annotation: Any, shape: tuple, where: str, bound: dict, held: dict) -> str:
    """Binds the named dimensions of `annotation` to the sizes in `shape`, into
    `bound` (name -> size, where, shape); why one is bound already to another size,
    or "". A conflict is said only where jaxtyping's own bindings (`held`, name ->
    size as its message shows them) hold the first size: a typechecker need not
    have checked each array read here (beartype does not look into a NamedTuple)."""
    dims = _dims.dimensions(annotation)
    variadic = [i for i, d in enumerate(dims) if d.kind == "variadic"]
    if len(variadic) > 1 or len(shape) < len(dims) - len(variadic):
        return ""  # a rank jaxtyping reports itself
    if not variadic and len(shape) != len(dims):
        return ""
    for i, dim in enumerate(dims):
        if dim.kind != "named" or not dim.checked:  # `_d`: not checked
            continue
        size = shape[i] if not variadic or i < variadic[0] else shape[i - len(dims)]
        if dim.broadcastable and size == 1:  # broadcasts against any size
            continue
        if dim.name not in bound:
            bound[dim.name] = (size, where, shape)
            continue
        first, first_where, first_shape = bound[dim.name]
        if first == 1 and dim.broadcastable:
            continue
        if first != size and held.get(dim.name) == str(first):
            if first_where == where:
                return (
                    f"dimension {dim.name!r} is both {first} and {size} in {where} "
                    f"(shape {shape})"
                )
            return (
                f"dimension {dim.name!r} is {first} from {first_where} (shape "
                f"{first_shape}) but {size} in {where} (shape {shape})"
            )
    return ""


def _held(message: str) -> dict[str, str]:
    """The dimensions jaxtyping's `message` shows bound, name -> size as text."""
    _, found, rest = message.partition(
        "The current values for each jaxtyping axis annotation are as follows.\n"
    )
    pairs = (line.partition("=") for line in rest.splitlines() if found)
    return {name: size for name, sep, size in pairs if sep}


def _returned_shape(message: str) -> tuple[int, ...] | None:
    """The return value's shape in jaxtyping's message, when it shows one array
    (`Actual value: f32[8,17]`)."""
    if "checking the return value" not in message:
        return None
    found = re.search(r"\nActual value: [a-z]+\d*\[([\d,]*)\]\n", message)
    if found is None:
        return None
    return tuple(int(n) for n in found[1].split(",") if n)


# --- the arguments, a line each -----------------------------------------------------


class _Shown:
    """Stands in for a leaf in a container's `repr`: shows `text`."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


_DTYPE = re.compile(r"^(bfloat|float|uint|int|complex)(\d+)")
_SHORT = {"bfloat": "bf", "float": "f", "uint": "u", "int": "i", "complex": "c"}


def _is_array(x: Any) -> bool:
    return isinstance(getattr(x, "shape", None), tuple) and hasattr(x, "dtype")


def short_array(x: Any) -> str:
    """An array as jaxtyping shows it: `f32[8,16]`."""
    name = _DTYPE.sub(lambda m: _SHORT[m[1]] + m[2], str(getattr(x.dtype, "name", x)))
    return f"{name}[{','.join(map(str, x.shape))}]"


def shown(value: Any) -> str:
    """`value` on one line: arrays as `f32[8,16]`, a container as its `repr` with
    its arrays so, or if that is wider than a line, as `AdamState(21 arrays)`."""
    if _is_array(value):
        return short_array(value)
    try:
        leaves = jax.tree.leaves(value)
        text = (
            repr(jax.tree.map(lambda x: _Shown(short_array(x)), value))
            if all(map(_is_array, leaves))
            else repr(value)
        )
    except Exception:
        leaves, text = [], "\n"
    if "\n" not in text and len(text) <= _WIDEST:
        return text
    arrays = sum(map(_is_array, leaves))
    kind = type(value).__name__
    if arrays:
        return f"{kind}({arrays} array{'s' if arrays != 1 else ''})"
    return f"{kind}(...)" if "\n" in text else text[: _WIDEST - 3] + "..."


def cut_dumps(message: str, fn: Callable, args: tuple, kwargs: dict) -> str:
    """jaxtyping's `message` with its dumps of the arguments (`Called with
    parameters:`) and of the failing value (`Actual value:`) cut to a line each."""
    try:
        return _cut_dumps(message, fn, args, kwargs)
    except Exception:  # never in place of the user's error
        return message


def _cut_dumps(message: str, fn: Callable, args: tuple, kwargs: dict) -> str:
    arguments = inspect.signature(fn).bind(*args, **kwargs).arguments
    head, sep, rest = message.partition("\nCalled with parameters: ")
    if sep:
        _, sep2, tail = rest.partition("\nParameter annotations: ")
        if sep2:
            listed = ", ".join(f"{k!r}: {shown(v)}" for k, v in arguments.items())
            message = f"{head}{sep}{{{listed}}}{sep2}{tail}"
    failing = re.search(r"typechecking parameter '(\w+)'\.\n", message)
    start = message.find("\nActual value: ")
    end = message.find("\nExpected type: ")
    if 0 <= start < end:
        value = message[start + len("\nActual value: ") : end]
        if failing and failing[1] in arguments:
            value = shown(arguments[failing[1]])
        elif "\n" in value or len(value) > _WIDEST:
            value = value.splitlines()[0][: _WIDEST - 3] + "..."
        message = f"{message[:start]}\nActual value: {value}{message[end:]}"
    return message
