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
from typing import Any, TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ._check_rows import _from_accumulated
from ._check_sites import CheckError, Failure, Site
from ._check_state import (
    _INITIAL,
    _merge,
    _on,
    _reduce,
    BATCH_DEPTH,
    COUNT,
    DEVICE,
    ELEMENT,
    State,
    STATE_SIZE,
)
from ._check_stats import _linear_index
from ._jax_internals import (
    accumulate,
    context_mesh,
    drop_callback_errors,
    is_device_mismatch,
    new_ref_outside_traces,
    ref_contents,
    set_ref_contents,
)


if TYPE_CHECKING:
    from ._check_frames import Frame


_generation = [0]  # bumped when deferred counting restarts: call indices start at 0


# --- scopes: who reads the flags ------------------------------------------------------


class Scope:
    """The flags of one `checked` function. For a jitted function, the findings its
    calls returned (see `_compiled`). For any other, its sites and, for each
    placement of their state (the devices its programs run on), a flag raised by any
    of its checks and a call counter, in Refs that live between calls."""

    def __init__(self, name: str):
        self.name = name
        self.sites: list[Site] = []
        self.placement: Any = None  # where this call's programs run
        self._refs: dict[Any, tuple[Any, Any]] = {}
        self._generation = -1
        self._call = -1
        self._lock = threading.Lock()
        # Compiled calls in deferred mode: the accumulated states of every site of
        # every trace, as rows of one array (row 0 counts the calls), and where each
        # trace's rows begin.
        self._accumulated: Any = None
        self._rows: dict["Frame", tuple[int, int, int]] = {}
        # Its shape, which changes only when a trace does not fit (each shape is
        # part of the programs' cache keys).
        self._shape = (16, STATE_SIZE + 2)

    def next_call(self) -> int:
        if self._generation != _generation[0]:
            self._generation = _generation[0]
            self._call = -1
        self._call += 1
        return self._call

    def run_compiled(self, programs: tuple, mode: str, args, kwargs) -> Any:
        """Calls one of `programs` (see `_compiled`) and reads, or keeps, what it
        found."""
        raising, deferred = programs
        if mode == "raise":
            out, findings = raising(*args, **kwargs)
            rows, failed = findings.read()
            if failed:
                failures = findings.frame.failures(rows, deferred=False)
                raise CheckError(failures, when=f" in {self.name}")
            return out
        accumulated = self._accumulated
        if accumulated is None:
            accumulated = self._fresh(args, kwargs)
        elif self._generation != _generation[0]:  # call indices start again
            accumulated = _restart_count(accumulated)
        self._generation = _generation[0]
        try:
            out, self._accumulated = deferred(accumulated, *args, **kwargs)
        except _Grow as grow:
            self._grow(accumulated, grow)
            return self.run_compiled(programs, mode, args, kwargs)
        except ValueError as e:
            if not is_device_mismatch(e):
                raise
            # The program runs on other devices than the last: take the states
            # there (a read and a copy, once).
            kept = np.asarray(accumulated)
            self._accumulated = jax.device_put(kept, _placement(args, kwargs))
            return self.run_compiled(programs, mode, args, kwargs)
        return out

    def place(
        self, frame: "Frame", rows: int, once: int, width: int, shape: tuple
    ) -> int:
        """Where the accumulated rows of a trace begin (called while it is traced,
        with the shape of the accumulated states it is given): after the rows of
        the traces before it. The first `once` rows are those of sites evaluated
        once per call (see `_add_call`). Raises `_Grow` if they do not fit."""
        if frame not in self._rows:
            start = 1 + sum(n for _, n, _ in self._rows.values())
            if start + rows > shape[0] or width > shape[1]:
                raise _Grow(start + rows, width)
            self._rows[frame] = (start, rows, once)
        return self._rows[frame][0]

    def abstract_states(self, args: tuple, kwargs: dict) -> Any:
        """The accumulated states a call with these arguments would be given, as an
        abstract array (their shape, and where they would be)."""
        sharding = _placement(args, kwargs)
        return jax.ShapeDtypeStruct(self._shape, np.int32, sharding=sharding)

    def _fresh(self, args: tuple, kwargs: dict) -> Any:
        """Zero states, where the call's program runs."""
        zeros = np.zeros(self._shape, np.int32)
        return jax.device_put(zeros, _placement(args, kwargs))

    def _grow(self, accumulated: Any, grow: "_Grow") -> None:
        """Room for `grow`'s rows and width, twice what is needed, with the states
        so far if there are any (a read and a copy: when a new trace does not
        fit)."""
        rows = self._shape[0] if grow.rows <= self._shape[0] else 2 * grow.rows
        self._shape = (rows, max(self._shape[1], grow.width))
        if accumulated is not None:
            old = np.asarray(accumulated)
            new = np.zeros(self._shape, np.int32)
            new[: old.shape[0], : old.shape[1]] = old
            self._accumulated = jax.device_put(new, accumulated.sharding)

    def lower_deferred(self, deferred: Any, args: tuple, kwargs: dict) -> Any:
        """The deferred program for these arguments, lowered, with room for its
        rows in the accumulated states."""
        try:
            states = self.abstract_states(args, kwargs)
            return deferred.lower(states, *args, **kwargs)
        except _Grow as grow:
            self._grow(self._accumulated, grow)
            return self.lower_deferred(deferred, args, kwargs)

    def refs(self) -> tuple[Any, Any]:
        """The flag and call counter for the current placement."""
        if self.placement not in self._refs:
            self._refs[self.placement] = (
                new_ref_outside_traces(np.zeros((), bool), self.placement),
                new_ref_outside_traces(np.zeros((), np.int32), self.placement),
            )
        return self._refs[self.placement]

    def begin_call(self, args: tuple, kwargs: dict) -> None:
        self.placement = _placement(args, kwargs)
        _, calls = self.refs()
        # The call index goes to the device as a transfer, not as an operation: a
        # `checked` call then costs one host-to-device copy before the program.
        call = np.int32(self.next_call())
        set_ref_contents(calls, jax.device_put(call, self.placement))

    def add(self, sites: list[Site]) -> State:
        """Gives `sites` (those of one `check` call) their state, placed where this
        call's programs run."""
        make = ft.partial(new_ref_outside_traces, sharding=self.placement)
        state = State.new([s.words for s in sites], self.placement, make)
        with self._lock:
            for row, site in enumerate(sites):
                site.state, site.row, site.order = state, row, len(self.sites)
                self.sites.append(site)
        return state

    def take_failures(self, deferred: bool) -> list[Failure]:
        """The failures recorded so far, in program order; clears them."""
        failures = []
        if self._accumulated is not None:
            accumulated = np.asarray(self._accumulated)  # the one wait for the device
            self._accumulated = None
            for frame, (start, rows, once) in self._rows.items():
                if start + rows <= accumulated.shape[0]:
                    block = accumulated[start : start + rows]
                    failures += frame.failures(_from_accumulated(block, once), deferred)
        return failures + self._take_ref_failures(deferred)

    def _take_ref_failures(self, deferred: bool) -> list[Failure]:
        raised = []
        for placement, (flag, _) in self._refs.items():
            if bool(ref_contents(flag)):  # the call's one wait for the device
                raised.append(placement)
                with _on(placement):
                    flag[...] = jnp.zeros((), bool)
        failures, read = [], {}
        for site in self.sites if raised else ():
            state = site.state
            if state.placement not in raised:
                continue
            if id(state) not in read:
                read[id(state)] = state.read()
            found = read[id(state)]
            if found is not None and found[site.row, COUNT] > 0:
                failures.append(site.failure(found[site.row], deferred))
        return failures


def _placement(args: tuple, kwargs: dict) -> Any:
    """Where the programs of a call run, so that the check state lives there too (a
    program's arguments, the state among them, must share its devices): the mesh in
    context, else that of the first array spread over several devices, else that of
    the first array on a mesh (as the program returns the state: given anywhere
    else, the next call would trace anew), else the default device."""
    mesh = context_mesh()
    if mesh is not None:
        return _replicated(mesh)
    meshes = [
        sharding.mesh
        for leaf in jax.tree.leaves((args, kwargs))
        if isinstance(sharding := getattr(leaf, "sharding", None), NamedSharding)
    ]
    spread = [mesh for mesh in meshes if mesh.size > 1]
    return _replicated((spread or meshes)[0]) if meshes else None


@ft.lru_cache(maxsize=64)
def _replicated(mesh: Any) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


class _Grow(Exception):
    """Raised while a trace is made, when its rows do not fit in the accumulated
    states it is given: the wrapper makes room and calls again."""

    def __init__(self, rows: int, width: int):
        self.rows, self.width = rows, width


@jax.jit
def _restart_count(accumulated: Any) -> Any:
    return accumulated.at[0, 0].set(0)


def _record(scope: Scope, sites: list[Site], rows: list[tuple]) -> None:
    """Adds `sites` to `scope` and accumulates one evaluation into their state: for
    each, `(count, element, device, iteration, value words)`."""
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
