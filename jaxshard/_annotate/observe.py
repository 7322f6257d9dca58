"""What `annotate` sees: each call of the user's functions made while a program is
traced, with the shape, dtype and layout of each array it takes and returns, and the
array fields of the user's dataclasses and NamedTuples it takes and returns.

The calls are seen through a profile function (`sys.setprofile`), in the thread that
traces, for the functions of the files asked about only. A layout on Explicit axes is
in the array's type; on Auto axes XLA chooses it when it compiles, and a probe (the
one jaxshard's contracts use) reports it then.
"""

import collections
import dataclasses
import inspect
import os
import sys
import threading
from collections.abc import Iterable
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from .._annotations.dims import dimension
from .._annotations.hints import type_hints
from .._jax_internals import bind_probe, context_mesh


@dataclasses.dataclass
class Seen:
    """One array a call took (a parameter) or returned (`name` "return"), and the
    layout it had: `spec` is `None` until XLA has said (on Auto axes), and stays
    `None` if it never does (a value that compiled away)."""

    filename: str
    qualname: str
    lineno: int  # the function's first line (its `def`, or its first decorator)
    call: int  # the call's number among this function's calls
    name: str
    position: int  # the parameter's place in the signature; -1 for "return"
    shape: tuple[int, ...]
    dtype: Any
    spec: PartitionSpec | None = None
    # The names its existing annotation gives its dimensions (`None` for one it
    # gives no name), if it has one.
    named: tuple[str | None, ...] | None = None
    # "parameter" (or the return value) of a function; or "field" of a class, whose
    # `filename`, `qualname` and `lineno` are the class's (the one declaring the
    # field), and `call` the instance's number (unique among all instances seen).
    kind: str = "parameter"


@dataclasses.dataclass(frozen=True)
class Held:
    """A parameter (or return value) that held an instance of one of the user's
    dataclasses or NamedTuples with arrays in it: `type` is the class's name where
    the function's module binds that name to it (so it can be written there)."""

    filename: str
    qualname: str
    lineno: int
    name: str
    position: int
    type: str | None
    instance: int  # the instance's number, as its fields' `Seen.call`
    kind: str = "parameter"  # as `Seen.kind`: a function's parameter


class Observer:
    """While in force (`with Observer(files):`), records each call of a function
    defined in one of `files` (absolute paths), in this thread."""

    def __init__(self, files: Iterable[str]):
        self.files = frozenset(files)
        self.seen: list[Seen] = []
        self.held: list[Held] = []
        # Parameters (and fields) that held a pytree of arrays that no class of
        # `files` describes: `(qualname, name)`.
        self.trees: dict[tuple[str, str], None] = {}
        self.blocks: dict[str, None] = {}  # functions called in shard_map bodies
        self._lock = threading.Lock()  # probes report from XLA's threads
        self._calls: collections.Counter = collections.Counter()
        self._open: dict[int, tuple[Any, int]] = {}  # frame id -> (code, call)
        self._hints: dict[Any, dict[str, Any]] = {}  # code or class -> type hints
        self._classes: dict[type, tuple | None] = {}  # class -> where it is defined
        # id -> each instance whose fields are seen (kept alive while observed, so
        # that its id stays its), and its number.
        self._instances: dict[int, tuple[Any, int]] = {}
        self._previous: Any = None

    def __enter__(self) -> "Observer":
        self._previous = sys.getprofile()
        sys.setprofile(self._event)
        return self

    def __exit__(self, *exc_info) -> None:
        sys.setprofile(self._previous)

    def _event(self, frame: Any, event: str, arg: Any) -> None:
        if self._previous is not None:  # another profiler's, kept in force
            self._previous(frame, event, arg)
        code = frame.f_code
        if code.co_filename not in self.files or code.co_name.startswith("<"):
            return
        if event == "call":
            call = self._calls[code]
            self._calls[code] += 1
            self._open[id(frame)] = (code, call)
            if code not in self._hints:
                self._hints[code] = _hints(code, frame.f_globals)
            for position, name in enumerate(_parameters(code)):
                if name in frame.f_locals:
                    value = frame.f_locals[name]
                    self._value(code, call, name, position, value, frame.f_globals)
        elif event == "return" and id(frame) in self._open:
            code, call = self._open.pop(id(frame))
            self._value(code, call, "return", -1, arg, frame.f_globals)

    def _value(
        self, code: Any, call: int, name: str, position: int, x: Any, scope: dict
    ) -> None:
        """Records `x`, a parameter or return value of a call of `code`, if it is an
        array, or holds some as an instance of a class of `files`."""
        where = (code.co_filename, code.co_qualname, code.co_firstlineno)
        if isinstance(x, jax.Array):
            hint = self._hints.get(code, {}).get(name)
            self._array(where, call, name, position, x, hint)
            return
        if not any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(x)):
            return
        instance = self._instance(x)
        if instance is not None:
            cls = type(x)
            named = cls.__name__ if scope.get(cls.__name__) is cls else None
            self.held.append(Held(*where, name, position, named, instance))
        else:  # not annotated, though instances in it (a list of them) are
            self._described(x)
            self.trees[(code.co_qualname, name)] = None

    def _instance(self, x: Any) -> int | None:
        """Records the array fields of `x` (and of the instances in its fields) if
        `x` is an instance of a dataclass or NamedTuple of `files`, and returns its
        number; `None` for anything else."""
        if id(x) in self._instances:  # the same instance, passed on: seen already
            return self._instances[id(x)][1]
        fields = _fields(x)
        if fields is None or self._class(type(x)) is None:
            return None
        number = len(self._instances)
        self._instances[id(x)] = (x, number)
        for owner, position, name, value in fields:
            where = self._class(owner)
            if where is None:
                continue
            if isinstance(value, jax.Array):
                if owner not in self._hints:
                    self._hints[owner] = type_hints(owner)
                hint = self._hints[owner].get(name)
                self._array(where, number, name, position, value, hint, "field")
            elif not self._described(value):
                self.trees[(owner.__qualname__, name)] = None
        return number

    def _described(self, value: Any) -> bool:
        """Whether each array in `value`, a field's value, is in an instance of a
        class of `files` (recorded): `value` is one, or a list or tuple of them
        (`blocks: list[Block]`), or holds no array."""
        if not any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(value)):
            return True
        if isinstance(value, (list, tuple)) and _fields(value) is None:
            return all([self._described(item) for item in value])
        return self._instance(value) is not None

    def _class(self, cls: type) -> tuple[str, str, int] | None:
        """Where `cls` is defined, `(filename, qualname, lineno)`, if in `files`."""
        if cls not in self._classes:
            self._classes[cls] = _defined(cls, self.files)
        return self._classes[cls]

    def _array(
        self,
        where: tuple[str, str, int],
        call: int,
        name: str,
        position: int,
        x: Any,
        hint: Any,
        kind: str = "parameter",
    ) -> None:
        """Records the array `x`, being traced (or a concrete one)."""
        aval = jax.typeof(x)
        if AxisType.Manual in aval.sharding.mesh.axis_types:
            # A shard_map body's block, which an annotation describes as the whole
            # array it is a block of: not told here.
            self.blocks[where[1]] = None
            return
        seen = Seen(
            *where,
            call=call,
            name=name,
            position=position,
            shape=tuple(aval.shape),
            dtype=aval.dtype,
            named=_named(hint, len(aval.shape)),
            kind=kind,
        )
        with self._lock:
            self.seen.append(seen)
        if not isinstance(x, jax.core.Tracer):  # a concrete array: its own layout
            if isinstance(x.sharding, NamedSharding):
                seen.spec = _spec(x.sharding, (), len(seen.shape))
            return
        mesh, context = aval.sharding.mesh, context_mesh()
        if not mesh.empty and set(mesh.axis_types) == {AxisType.Explicit}:
            seen.spec = _spec(aval.sharding, (), len(seen.shape))  # in the type
            return
        if mesh.empty and context is None:
            return  # on no mesh
        bind_probe(x, lambda s, batch, _: self._layout(seen, s, batch), context)

    def _layout(self, seen: Seen, sharding: Any, batch_dims: tuple) -> None:
        """What a probe reports (on an XLA thread, or at once op by op): never
        raises there."""
        try:
            seen.spec = _spec(sharding, batch_dims, len(seen.shape))
        except Exception:  # never raised on an XLA thread: the layout stays unknown
            seen.spec = None


def _hints(code: Any, scope: dict) -> dict[str, Any]:
    """The type hints of the function whose code is `code`, found by its qualified
    name in its module's globals (none for a function defined in another's body)."""
    obj: Any = scope
    for part in code.co_qualname.split("."):
        if part == "<locals>":
            return {}
        obj = obj.get(part) if isinstance(obj, dict) else getattr(obj, part, None)
        if obj is None:
            return {}
    function = inspect.unwrap(getattr(obj, "__func__", obj))
    if getattr(function, "__code__", None) is not code:
        return {}
    return type_hints(function)


def _named(hint: Any, ndim: int) -> tuple[str | None, ...] | None:
    """The names a jaxtyping annotation gives the dimensions of an array of `ndim`
    dimensions (`None` for a size, an expression or an unnamed one), if it gives
    one per dimension."""
    text = getattr(hint, "dim_str", None)
    if not isinstance(text, str):
        return None
    found = [dimension(token, i) for i, token in enumerate(text.split())]
    if len(found) != ndim or any(d.kind == "variadic" for d in found):
        return None
    return tuple(d.name if d.kind == "named" and d.checked else None for d in found)


def _fields(x: Any) -> list[tuple[type, int, str, Any]] | None:
    """The fields of a dataclass or NamedTuple instance, each with the class that
    declares it (a base class, for an inherited field) and its place; `None` for
    anything else."""
    cls = type(x)
    if isinstance(x, tuple) and hasattr(cls, "_fields"):
        names = list(cls._fields)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        names = [f.name for f in dataclasses.fields(x)]
    else:
        return None
    declared = [inspect.get_annotations(k) for k in cls.__mro__]
    return [
        (next((k for k, a in zip(cls.__mro__, declared) if n in a), cls), i, n,
         getattr(x, n, None))
        for i, n in enumerate(names)
    ]  # fmt: skip


def _defined(cls: type, files: frozenset[str]) -> tuple[str, str, int] | None:
    """Where `cls` is defined, `(filename, qualname, lineno)` (its first line,
    decorators included), if in one of `files`."""
    module = sys.modules.get(cls.__module__)
    filename = getattr(module, "__file__", None)
    if filename is None or os.path.abspath(filename) not in files:
        return None
    lineno = getattr(cls, "__firstlineno__", None)  # Python 3.13
    if lineno is None:
        try:
            lineno = inspect.getsourcelines(cls)[1]
        except (OSError, TypeError):
            return None
    return os.path.abspath(filename), cls.__qualname__, lineno


def _parameters(code: Any) -> tuple[str, ...]:
    """The names of a function's parameters, positional and keyword-only, without
    `*args` and `**kwargs`."""
    count = code.co_argcount + code.co_kwonlyargcount
    return code.co_varnames[:count]


def _spec(sharding: Any, batch_dims: tuple, ndim: int) -> PartitionSpec:
    """The spec of `sharding` over the array's own `ndim` dimensions (`vmap`'s
    removed), padded to its rank: `P()` on one device."""
    if not isinstance(sharding, NamedSharding):
        if len(sharding.device_set) == 1 or sharding.is_fully_replicated:
            return PartitionSpec(*[None] * ndim)
        raise ValueError(f"{sharding} names no mesh axes")
    entries = list(sharding.spec) + [None] * (
        ndim + len(batch_dims) - len(sharding.spec)
    )
    return PartitionSpec(*[e for i, e in enumerate(entries) if i not in batch_dims])
