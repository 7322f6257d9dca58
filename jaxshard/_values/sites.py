"""What a failed value check says: `CheckError`, its `Failure`s, and the `Site` of each
check in a trace, which turns the check's state into a `Failure`."""

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from .state import (
    _decode,
    _words,
    BATCH,
    CALL,
    CALLS,
    COUNT,
    DEVICE,
    ELEMENT,
    EVALS,
    ITERATION,
    State,
    STATE_SIZE,
)


class CheckError(Exception):
    """One or more value checks failed.

    The message lists every failed check in program order. `failures` holds them as
    `Failure`s, each with `.message`, `.filename`, `.lineno` and `.count`.
    """

    def __init__(self, failures: list["Failure"], *, when: str = ""):
        # The inputs' checks (`checked(..., inputs_finite=True)`) of the first call
        # where one failed come first: what failed at the start of that call is the
        # likely origin of what failed after it, in that call and later ones (an
        # input made non-finite by an earlier call among them).
        inputs = [f for f in failures if f.origin is not None]
        first = min((f.call for f in inputs if f.call is not None), default=None)
        origins = [f for f in inputs if f.call == first]
        later = [f for f in inputs if f.call != first]
        failures = origins + [f for f in failures if f.origin is None] + later
        self.failures = failures
        count = len(failures)
        head = f"{count} check{'s' if count > 1 else ''} failed{when}:"
        if origins:
            head = _origin_head(origins, count - len(origins), when)
        super().__init__("\n".join([head, *(f"- {f}" for f in failures)]))


def _origin_head(origins: list["Failure"], after: int, when: str) -> str:
    """The first line of a report whose inputs were not finite: they are named as
    the origin, and the failures after them as what may follow from them."""
    names = list(dict.fromkeys(f.origin for f in origins))
    shown = ", ".join(map(repr, names))
    call = origins[0].call
    origin = "origin" if call is None else f"origin, call {call}"
    head = (
        f"the input {shown} was not finite ({origin}){when}"
        if len(names) == 1
        else f"the inputs {shown} were not finite ({origin}){when}"
    )
    if after:
        it = "it" if len(names) == 1 else "them"
        head += (
            f"; {after} check{'s' if after > 1 else ''} after {it} failed and may "
            f"follow from {it}"
        )
    return head + ":"


CheckError.__module__ = "jaxshard"


@dataclasses.dataclass(frozen=True)
class Failure:
    """A failed check.

    **Attributes:**

    - `message`: the check's message, formatted with the values of the first failing
        element.
    - `filename`, `lineno`: where `jaxshard.check` was called.
    - `count`: how many elements failed (summed over every evaluation: all vmap
        batch elements, loop iterations and calls since the flags were last read;
        inside `shard_map`, over every device's block, a block that several devices
        hold counted once).
    - `size`: how many elements the predicate has, per evaluation.
    - `element`: the index of the first failing element in the predicate, or `None`
        for a scalar predicate; inside `shard_map`, in the block of `device`.
    - `batch_index`: the `vmap` batch indices of the first failure, outermost first,
        or `None` outside vmap.
    - `iteration`: how many times the check had run in its call before it first
        failed (the scan or loop iteration), or `None` if it runs once per call.
    - `device`: `{mesh axis: index}` of the first failing device inside `shard_map`,
        or `None`.
    - `call`: in deferred mode, the index of the call where the check first failed,
        counted from 0 at the start of `deferred_checks()` or the last flush.
    - `calls`: in deferred mode, on how many calls the check failed.
    - `values`: the values the message was formatted with.
    - `origin`: for a check of an input that `checked(fn, inputs_finite=...)` makes
        before `fn` runs, the parameter checked (the likely origin of the failures
        after it, which a report lists it before); else `None`.
    """

    message: str
    filename: str
    lineno: int
    count: int
    size: int = 1
    element: tuple[int, ...] | None = None
    batch_index: tuple[int, ...] | None = None
    iteration: int | None = None
    device: dict[str, int] | None = None
    call: int | None = None
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    calls: int | None = None
    origin: str | None = dataclasses.field(default_factory=lambda: _origin.name)

    def __str__(self):
        where = []
        calls = self.calls or 1
        device = ", ".join(f"{a}={i}" for a, i in (self.device or {}).items())
        if self.size > 1:
            s = "s" if self.count != 1 else ""
            # Inside shard_map the count is the blocks' together; the element, one's.
            blocks = " across the blocks" if device else ""
            where.append(f"{self.count} element{s} failed{blocks}")
        elif self.count > calls:  # a scalar check evaluated in a loop or under vmap
            where.append(f"failed {self.count} times")
        if self.element is not None:
            block = f" of the block on device {device}" if device else ""
            where.append(f"first at element {list(self.element)}{block}")
        if self.batch_index is not None:
            where.append(f"vmap batch index {list(self.batch_index)}")
        if self.iteration is not None:
            where.append(f"iteration {self.iteration}")
        if device and self.element is None:
            where.append(f"device {device}")
        if self.call is not None and calls > 1:
            where.append(f"failed on {calls} calls, first at call {self.call}")
        elif self.call is not None:
            where.append(f"call {self.call}")
        place = f" [{'; '.join(where)}]" if where else ""
        return f"{self.message} ({self.filename}:{self.lineno}){place}"


# --- sites ----------------------------------------------------------------------------


class _Origin(threading.local):
    name: str | None = None


_origin = _Origin()


@contextlib.contextmanager
def checking_input(name: str) -> Iterator[None]:
    """The checks made (and eager failures raised) inside are of the input `name`:
    their sites and failures have it as their `origin`."""
    before, _origin.name = _origin.name, name
    try:
        yield
    finally:
        _origin.name = before


@dataclasses.dataclass(eq=False)
class Site:
    """One `check` call in one trace, and its state on the device."""

    message: str
    filename: str
    lineno: int
    names: tuple[str, ...]
    shape: tuple[int, ...]  # of the predicate, per evaluation
    device_axes: tuple[tuple[str, int], ...]  # manual axes, inside shard_map
    order: int
    dtypes: tuple = ()  # of the values
    state: "State | None" = None  # shared with the other sites of its `check` call
    row: int = 0  # in the state
    # The parameter, for the check of an input (`inputs_finite`), made inside
    # `checking_input`.
    origin: str | None = dataclasses.field(default_factory=lambda: _origin.name)

    @property
    def words(self) -> int:
        return sum(_words(d) for d in self.dtypes)

    def failure(self, state: np.ndarray, deferred: bool) -> Failure:
        """The failure recorded in `state`, this site's row of its state."""
        values = _decode(self.dtypes, state[STATE_SIZE:])
        values_at = dict(zip(self.names, (v.item() for v in values)))
        size = int(np.prod(self.shape))
        element = None
        if self.shape and state[ELEMENT] >= 0:
            element = tuple(
                int(i) for i in np.unravel_index(state[ELEMENT], self.shape)
            )
        batch = tuple(int(b) for b in state[BATCH:STATE_SIZE] if b >= 0) or None
        device = None
        if self.device_axes and state[DEVICE] >= 0:
            sizes = [n for _, n in self.device_axes]
            index = np.unravel_index(state[DEVICE], sizes)
            device = {a: int(i) for (a, _), i in zip(self.device_axes, index)}
        iteration = int(state[ITERATION]) if state[EVALS] > 1 else None
        return Failure(
            message=_format(self.message, values_at),
            filename=self.filename,
            lineno=self.lineno,
            count=int(state[COUNT]),
            size=size,
            element=element,
            batch_index=batch,
            iteration=iteration,
            device=device,
            call=int(state[CALL]) if deferred else None,
            values=values_at,
            calls=int(state[CALLS]) if deferred else None,
            origin=self.origin,
        )


def _format(message: str, values: dict[str, Any]) -> str:
    try:
        return message.format(**values)
    except (KeyError, IndexError, ValueError):
        return message
