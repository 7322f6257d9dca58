"""How messages say things: meshes, devices, bytes, arrays and layouts, and which
value of which function is being checked (`where`)."""

import contextlib
import dataclasses
import re
import threading
import typing
from collections.abc import Iterator
from typing import Any

import jax
import jax.monitoring
from jax.sharding import NamedSharding

from .._annotations.hints import type_hints
from .._annotations.spec import format_spec, padded
from .._jax_internals import (
    checked_call,
)


# --- descriptions -------------------------------------------------------------------


def describe_mesh(mesh) -> str:
    sizes = ", ".join(f"{name!r}: {size}" for name, size in mesh.shape.items())
    types = {t.name for t in mesh.axis_types}
    return "{" + sizes + "}" + (f" ({'/'.join(sorted(types))} axes)" if types else "")


def describe_devices(mesh) -> str:
    """`256 × TPU v5 lite`."""
    kind = getattr(mesh.devices.flat[0], "device_kind", "?")
    return f"{mesh.devices.size} × {kind}"


def describe_bytes(n: float) -> str:
    """`512 B`, `1.5 KiB`, ..., `16.0 GiB`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def describe_array(dtype, shape) -> str:
    return f"{dtype}[{','.join(map(str, shape))}]"


def describe_sharding(sharding, ndim: int) -> str:
    """How an array is laid out, as the end of "this array is ..."."""
    if isinstance(sharding, NamedSharding):
        return f"sharded as {format_spec(padded(sharding.spec, ndim))}"
    devices = sharding.device_set
    if len(devices) == 1:
        return f"on one device ({next(iter(devices))})"
    return f"laid out by {sharding!r}"


class _Naming(threading.local):
    current: tuple[str, str] | None = None


_naming = _Naming()


@contextlib.contextmanager
def naming(function: str, name: str) -> Iterator[None]:
    """Checks inside the block are reported as `function`'s `name`."""
    outer, _naming.current = _naming.current, (function, name)
    try:
        yield
    finally:
        _naming.current = outer


def subject(function: Any, name: str | None) -> str:
    """How messages name a checked value: `f, parameter 'x'`, `f, field 'x.w'`,
    `f, the return value`, or an `isinstance` check outside any function
    (`function` is `None`)."""
    if function is None:
        return "a value checked with isinstance outside any jaxtyped function"
    return f"{function}, {value_name(name)}"


def value_name(name: str | None) -> str:
    """`parameter 'x'`; a path into one is no parameter: `field 'x.w'` (a
    dataclass's, NamedTuple's or Module's), `leaf "x['w']"` (a dict's or list's);
    `the return value` (and `the return value's leaf '[0]'`)."""
    if name is None:
        return "a value"
    if name == "return":
        return "the return value"
    if name.startswith("return") and name[6:7] in (".", "["):
        noun = value_name(name[6:]).split(" ", 1)[0]
        return f"the return value's {noun} {name[6:]!r}"
    if not re.search(r"[.\[]", name):
        return f"parameter {name!r}"
    noun = "field" if re.search(r"[.]\w+$", name) else "leaf"
    return f"{noun} {name!r}"


def where(obj: Any, annotation: Any = None) -> tuple[str | None, str | None]:
    """`(function, parameter)` naming the value being checked against `annotation`,
    for error messages; `(None, None)` outside any `jaxtyped` function.

    The value is found by identity among the call's parameters and, once the body
    has returned, first in its return value; where the same value was passed twice
    (or returned as it came in), the place whose annotation is `annotation` is the one
    being checked."""
    if _naming.current is not None:
        return _naming.current
    call = checked_call()
    if call is None:
        return None, None
    places = list(call.arguments.items())
    if call.returned:
        places.insert(0, ("return", call.out))
    found = []
    for name, value in places:
        if value is obj:
            found.append(name)
            continue
        try:
            leaves = jax.tree_util.tree_flatten_with_path(value)[0]
        except Exception:
            continue
        found += [name + jax.tree_util.keystr(p) for p, leaf in leaves if leaf is obj]
    if not found:
        return call.function, "<a value checked inside the function>"
    if annotation is not None and len(found) > 1:
        for name in found:
            hint = call.hints.get(name.split("[", 1)[0].split(".", 1)[0])
            if _mentions(hint, annotation):
                return call.function, name
    return call.function, found[0]


def _mentions(hint: Any, annotation: Any, depth: int = 0) -> bool:
    """Whether the type `hint` is `annotation` or has it inside (a union member, a
    tuple's element, a `PyTree`'s leaf type, a NamedTuple's or dataclass's field)."""
    if hint is annotation:
        return True
    if depth > 8 or hint is None:
        return False
    inner = list(typing.get_args(hint))
    leaf = getattr(hint, "leaftype", None)
    if leaf is not None:
        inner.append(leaf)
    if isinstance(hint, type) and (
        dataclasses.is_dataclass(hint) or hasattr(hint, "_fields")
    ):
        try:
            inner += type_hints(hint).values()
        except Exception:
            pass
    return any(_mentions(h, annotation, depth + 1) for h in inner)


def named_value() -> tuple[str, str] | None:
    """The `(function, name)` that `naming` gives the checks inside it, if any."""
    return _naming.current
