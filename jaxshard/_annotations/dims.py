"""The shape an annotation describes, given sizes for its named dimensions.

Used to build abstract inputs (`abstract_args`) and to draw arrays (`strategies`).
"""

import dataclasses
from collections.abc import Callable, MutableMapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Dim:
    """One dimension of an annotation's shape string, read as jaxtyping reads it.

    `kind` is "fixed" (`3`), "named" (`batch`, `#batch`, `_batch`), "symbolic"
    (`batch-1`), "variadic" (`*batch`, `...`) or "anonymous" (`_`). `name` is the key
    looked up in `dims`: the dimension's name without modifiers, the expression of a
    symbolic dimension, "..." for `...`, and "_" for `_`. A `name=` prefix only
    documents (`rows=4` is the fixed size 4, `n=a+b` the expression `a+b`).
    """

    token: str
    kind: str
    name: str
    position: int  # index in the shape string
    size: int | None = None  # of a fixed dimension
    broadcastable: bool = False  # `#batch`: a size of 1 matches any
    checked: bool = True  # False for `_batch`: named only to document it


def dimensions(annotation: Any) -> list[Dim]:
    """The dimensions of a jaxtyping annotation, in order."""
    return [dimension(t, i) for i, t in enumerate(annotation.dim_str.split())]


def dimension(token: str, position: int = 0) -> Dim:
    """One token of a shape string that jaxtyping accepted: its modifiers (`#`
    broadcastable, `*` variadic, `_` unchecked, `?` tree path) and `name=` prefixes,
    in any order, then a name, a size or an expression (jaxtyping 0.3's grammar)."""
    if "..." in token:
        return Dim(token, "variadic", "...", position)
    rest, seen = token, ""
    while rest:
        if rest[0] in "#*_?" and rest[0] not in seen:
            seen, rest = seen + rest[0], rest[1:]
        elif rest.count("=") == 1:
            rest = rest.split("=")[1]
        else:
            break
    flags = {"broadcastable": "#" in seen, "checked": "_" not in seen}
    if "*" in seen:
        return Dim(token, "variadic", rest, position, **flags)
    if not rest:
        return Dim(token, "anonymous", "_", position)
    if rest.isidentifier():
        return Dim(token, "named", rest, position, **flags)
    try:
        size = int(rest)
    except ValueError:
        return Dim(token, "symbolic", rest, position, **flags)
    return Dim(token, "fixed", str(size), position, size, **flags)


def _names(expression: str) -> tuple[str, ...]:
    return compile(expression, "<dimension>", "eval").co_names


Fill = Callable[[Dim, str], Any]


def shape(
    annotation: Any, dims: MutableMapping[str, Any], fill: Fill | None = None
) -> tuple[tuple[int, ...] | None, list[str]]:
    """The shape `annotation` describes with the sizes in `dims`.

    **Arguments:**

    - `annotation`: a jaxtyping array annotation.
    - `dims`: sizes of named dimensions (`{"batch": 8}`) and tuples of sizes for
        variadic ones (`{"batch": (2, 4)}`, `{"...": ()}`).
    - `fill`: called as `fill(dim, name)` for each name `dims` lacks; returns a size
        (a tuple for a variadic dimension) or `None`. What it returns for a named
        dimension is stored in `dims`, so later shapes agree; anonymous dimensions
        (`_`) are filled afresh each time.

    **Returns:**

    `(shape, missing)`: the shape, or `None` if some names stayed unbound, and the
    names that did.
    """
    out: list[int] = []
    missing: list[str] = []

    def lookup(dim: Dim, name: str):
        if name in dims:
            return dims[name]
        value = fill(dim, name) if fill is not None else None
        if value is None:
            missing.append(dim.token if dim.kind == "anonymous" else name)
        elif dim.kind != "anonymous":
            dims[name] = value
        return value

    for dim in dimensions(annotation):
        if dim.kind == "fixed":
            out.append(dim.size)  # pyright: ignore[reportArgumentType]
        elif dim.kind == "variadic":
            value = lookup(dim, dim.name)
            if value is not None:
                out.extend(_sizes(dim, value))
        elif dim.kind == "symbolic":
            scope = {}
            for name in _names(dim.name):
                scope[name] = lookup(dim, name)
            if None not in scope.values():
                out.append(int(eval(dim.name, {"__builtins__": {}}, scope)))
        else:
            value = lookup(dim, dim.name)
            if value is not None:
                out.append(_size(dim, value))
    return (None if missing else tuple(out)), list(dict.fromkeys(missing))


def _size(dim: Dim, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"dims[{dim.name!r}] is {value!r}, but dimension {dim.token!r} takes a "
            "non-negative int."
        )
    return value


def _sizes(dim: Dim, value: Any) -> tuple[int, ...]:
    if not isinstance(value, tuple):
        raise ValueError(
            f"dims[{dim.name!r}] is {value!r}, but the variadic dimension "
            f"{dim.token!r} takes a tuple of sizes, e.g. (2, 4), or () for none."
        )
    return tuple(_size(dim, v) for v in value)
