"""What `annotate` sees: each call of the user's functions made while a program is
traced, with the shape, dtype and layout of each array it takes and returns.

The calls are seen through a profile function (`sys.setprofile`), in the thread that
traces, for the functions of the files asked about only. A layout on Explicit axes is
in the array's type; on Auto axes XLA chooses it when it compiles, and a probe (the
one jaxshard's contracts use) reports it then.
"""

import collections
import dataclasses
import sys
import threading
from collections.abc import Iterable
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

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


class Observer:
    """While in force (`with Observer(files):`), records each call of a function
    defined in one of `files` (absolute paths), in this thread."""

    def __init__(self, files: Iterable[str]):
        self.files = frozenset(files)
        self.seen: list[Seen] = []
        # Parameters that held a pytree of arrays: `(qualname, name)`.
        self.trees: dict[tuple[str, str], None] = {}
        self._lock = threading.Lock()  # probes report from XLA's threads
        self._calls: collections.Counter = collections.Counter()
        self._open: dict[int, tuple[Any, int]] = {}  # frame id -> (code, call)
        self._previous: Any = None

    def __enter__(self) -> "Observer":
        self._previous = sys.getprofile()
        sys.setprofile(self._event)
        return self

    def __exit__(self, *exc_info) -> None:
        sys.setprofile(self._previous)

    def _event(self, frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if code.co_filename not in self.files or code.co_name.startswith("<"):
            return
        if event == "call":
            call = self._calls[code]
            self._calls[code] += 1
            self._open[id(frame)] = (code, call)
            for position, name in enumerate(_parameters(code)):
                if name in frame.f_locals:
                    self._array(code, call, name, position, frame.f_locals[name])
        elif event == "return" and id(frame) in self._open:
            code, call = self._open.pop(id(frame))
            self._array(code, call, "return", -1, arg)

    def _array(self, code: Any, call: int, name: str, position: int, x: Any) -> None:
        """Records `x` if it is an array being traced (or a concrete one)."""
        if not isinstance(x, jax.Array):
            if any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(x)):
                self.trees[(code.co_qualname, name)] = None
            return
        aval = jax.typeof(x)
        seen = Seen(
            filename=code.co_filename,
            qualname=code.co_qualname,
            lineno=code.co_firstlineno,
            call=call,
            name=name,
            position=position,
            shape=tuple(aval.shape),
            dtype=aval.dtype,
        )
        with self._lock:
            self.seen.append(seen)
        if not isinstance(x, jax.core.Tracer):  # a concrete array: its own layout
            if isinstance(x.sharding, NamedSharding):
                seen.spec = _spec(x.sharding, (), len(seen.shape))
            return
        mesh = aval.sharding.mesh
        if mesh.empty:
            return
        if set(mesh.axis_types) == {AxisType.Explicit}:  # in the type
            seen.spec = _spec(aval.sharding, (), len(seen.shape))
            return
        bind_probe(x, lambda s, batch, _: self._layout(seen, s, batch), context_mesh())

    def _layout(self, seen: Seen, sharding: Any, batch_dims: tuple) -> None:
        """What a probe reports (on an XLA thread, or at once op by op): never
        raises there."""
        try:
            seen.spec = _spec(sharding, batch_dims, len(seen.shape))
        except Exception:  # never raised on an XLA thread: the layout stays unknown
            seen.spec = None


def _parameters(code: Any) -> tuple[str, ...]:
    """The names of a function's parameters, positional and keyword-only, without
    `*args` and `**kwargs`."""
    count = code.co_argcount + code.co_kwonlyargcount
    return code.co_varnames[:count]


def _spec(sharding: Any, batch_dims: tuple, ndim: int) -> PartitionSpec:
    """The spec of `sharding` over the array's own `ndim` dimensions (`vmap`'s
    removed), padded to its rank: `P()` on one device."""
    if not isinstance(sharding, NamedSharding):
        if len(sharding.device_set) == 1:
            return PartitionSpec(*[None] * ndim)
        raise ValueError(f"{sharding} names no mesh axes")
    entries = list(sharding.spec) + [None] * (
        ndim + len(batch_dims) - len(sharding.spec)
    )
    return PartitionSpec(*[e for i, e in enumerate(entries) if i not in batch_dims])
