"""Where value checks record what they found, and who reads it.

A `checked` function has a `Scope`. A jitted one runs as a program whose checks
record into a `Frame`, which the program returns as rows (`_compiled`,
`_check_rows`); any other keeps its checks' state in Refs that live between calls. A
`jaxshard.shard_map` body has a `ShardMapFrame`. Checks that no `checked` call owns
raise from a host callback. See `_jax_internals.accumulate` for how the writes leave
jit, scan, vmap and autodiff.
"""

import atexit
import dataclasses
import functools as ft
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._jax_internals import accumulate, drop_callback_errors
from .flags import Flags, thread
from .rows import _read, _traced
from .sites import CheckError, Failure, Site
from .state import (
    _INITIAL,
    _merge,
    _reduce,
    BATCH_DEPTH,
    COUNT,
    DEVICE,
    ELEMENT,
    State,
)
from .stats import _linear_index


# --- scopes: who reads the flags ------------------------------------------------------


class _Deferred(threading.local):
    """Per thread: the `Flags` each `checked` function lent it in deferred mode,
    until its flush."""

    def __init__(self):
        self.flags: dict["Scope", Flags] = {}


_deferred = _Deferred()


class Scope:
    """A `checked` function's flags: it lends a `Flags` to each call in "raise" mode
    and to each thread in "deferred" mode (see `flags`), and reads what the calls of
    a jitted one return (see `frames._compiled`)."""

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self._first: Any = None  # the first frame traced (see `first`)
        self._idle: list[Flags] = []  # lent and given back

    @property
    def sites(self) -> list[Site]:
        """The sites of every `Flags` not lent, and this thread's."""
        with self._lock:
            flags = [*self._idle]
        if self in _deferred.flags:
            flags.append(_deferred.flags[self])
        return [site for f in flags for site in f.sites]

    def first(self, frame: Any) -> bool:
        """Whether `frame` is the first traced for this function (see
        `frames._compiled`); called while its program is traced."""
        with self._lock:
            if self._first is None:
                self._first = frame
            return self._first is frame

    def lend(self) -> Flags:
        """A `Flags` for one call in "raise" mode, to `give_back` once read."""
        with self._lock:
            return self._idle.pop() if self._idle else Flags(self.name)

    def give_back(self, flags: Flags) -> None:
        with self._lock:
            self._idle.append(flags)

    def deferred(self) -> Flags:
        """This thread's `Flags` in deferred mode, kept until its flush."""
        flags = _deferred.flags.get(self)
        if flags is None:
            flags = _deferred.flags[self] = self.lend()
        return flags

    def found(self, found: Any, mode: str) -> None:
        """Takes what a compiled call found, the first frame's rows or `{frame:
        rows}` (see `_compiled`): in "raise" mode reads the rows at once; in
        "deferred" mode keeps them (`Flags.found`). Every call pays for this: it is
        written for speed."""
        if type(found) is tuple:
            frame, packed = self._first, found
        else:
            ((frame, packed),) = found.items()
        if _traced(packed):
            raise _inside_a_trace(self.name)
        if mode == "raise":
            rows, failed = _read(packed)
            if failed:
                failures = frame.failures(rows, deferred=False)
                raise CheckError(failures, when=f" in {self.name}")
            return
        flags = _deferred.flags.get(self) or self.deferred()
        flags.found(frame, packed)


def take_deferred() -> list[Failure]:
    """The failures of every `checked` function this thread called in deferred mode
    since its last flush, which gives their `Flags` back; call indices start again
    from 0."""
    lent, _deferred.flags = _deferred.flags, {}
    thread.generation = object()
    failures = []
    for scope, flags in sorted(lent.items(), key=lambda item: item[0].name):
        failures += flags.take_failures(deferred=True)
        scope.give_back(flags)
    return failures


def _inside_a_trace(name: str) -> RuntimeError:
    return RuntimeError(
        f"jaxshard.checked({name}) was called inside a trace (inside jax.jit?). Call "
        "the checked function from outside jit, or put the jit inside: "
        "jaxshard.checked(jax.jit(f))."
    )


def _record(scope: Flags, sites: list[Site], rows: list[tuple]) -> None:
    """Adds `sites` to `scope` (a call's `Flags`) and accumulates one evaluation
    into their state: for each, `(count, element, device, iteration, value
    words)`."""
    flag, calls = scope.refs()
    _accumulate(scope.add(sites), flag, calls[...], rows)


def _accumulate(state: State, flag: Any, call: Any, rows: list[tuple]) -> None:
    count, element, device, iteration = (
        jnp.stack([jnp.asarray(row[i], jnp.int32) for row in rows]) for i in range(4)
    )
    width = max(len(row[4]) for row in rows)
    words = jnp.stack(
        [
            jnp.stack([*row[4], *[jnp.int32(0)] * (width - len(row[4]))])
            if width
            else jnp.zeros((0,), jnp.int32)
            for row in rows
        ]
    )
    batch = jnp.full((len(rows), BATCH_DEPTH), -1, jnp.int32)
    accumulate(
        (flag, state.ref),
        (count, element, batch, device, call, iteration, words),
        _merge,
        _reduce,
    )


# --- checks no `checked` call owns ----------------------------------------------------


def _fallback(site: Site, row: tuple, in_shard_map: bool = False) -> None:
    count, element, device, _, words = row
    # Inside shard_map every device has the same statistics: one of them reports.
    me = _linear_index(list(site.device_axes) if in_shard_map else [])
    jax.debug.callback(
        ft.partial(_raise_from_callback, site), me, count, element, device, *words
    )


_callback_raised = [False]


@atexit.register
def _at_exit() -> None:
    # JAX keeps a failed callback's error and raises it again at exit (its own exit
    # handler runs after this one): the failure was raised already, at the program's
    # first sync after the call.
    if _callback_raised[0]:
        drop_callback_errors()


def _raise_from_callback(site: Site, me, count, element, device, *words) -> None:
    count = np.asarray(count)
    if not count.any() or np.asarray(me).ravel()[0] != 0:
        return
    _callback_raised[0] = True
    # Under vmap the callback sees the batch: report its first failing element.
    flat = np.flatnonzero(count.ravel() > 0)[0]
    batch = tuple(int(i) for i in np.unravel_index(flat, count.shape)) or None
    state = _INITIAL.copy()
    state[COUNT] = count.sum()
    state[ELEMENT] = np.asarray(element).ravel()[flat]
    state[DEVICE] = np.asarray(device).ravel()[flat]
    words = [np.asarray(w).ravel()[flat] for w in words]
    state = np.concatenate([state, np.asarray(words, np.int32)])
    failure = site.failure(state, deferred=False)
    if batch is not None:
        failure = dataclasses.replace(failure, batch_index=batch)
    raise CheckError([failure], when=" (in a host callback: no jaxshard.checked call)")
