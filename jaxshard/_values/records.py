"""Where value checks record what they found, and who reads it.

A `checked` function has a `Scope`. A jitted one runs as a program whose checks
record into a `Frame`, which the program returns as rows (`_compiled`,
`_check_rows`); any other keeps its checks' state in Refs that live between calls. A
`jaxshard.shard_map` body has a `ShardMapFrame`. Checks that no `checked` call owns
raise from a host callback. See `_jax_internals.accumulate` for how the writes leave
jit, scan, vmap and autodiff.
"""

import atexit
import collections
import contextlib
import dataclasses
import functools as ft
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .._jax_internals import (
    accumulate,
    context_mesh,
    drop_callback_errors,
    new_ref_outside_traces,
    ref_contents,
    set_ref_contents,
)
from .rows import _add_found, _full, _read, _traced
from .sites import CheckError, Failure, Site
from .state import (
    _INITIAL,
    _merge,
    _on,
    _reduce,
    BATCH_DEPTH,
    COUNT,
    DEVICE,
    ELEMENT,
    State,
)
from .stats import _linear_index


_generation = [0]  # bumped when deferred counting restarts: call indices start at 0
# The scopes called in deferred mode since the last flush.
deferred_scopes: "weakref.WeakSet[Scope]" = weakref.WeakSet()


# --- scopes: who reads the flags ------------------------------------------------------


# In deferred mode, the findings of this many calls are kept, then asked at once
# whether any check failed: one small program over them all (`_any_failed`) and, once
# the device has answered, one read of its answer. Reading a device array costs more
# host time than dispatching a call; only a batch in which a check failed is read
# call by call.
_READ_AFTER = 64


def _failed(packed: list[tuple[Any, Any]]) -> Any:
    """Whether any check failed in any of the calls whose rows are `packed` (each
    `Frame.packed()`'s)."""
    counts = [once[:, 0] for once, _ in packed if once is not None]
    counts += [states[:, COUNT] for _, states in packed if states is not None]
    return jnp.any(jnp.concatenate(counts) != 0)


_any_failed = jax.jit(_failed)


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
        # Compiled calls in deferred mode: the findings not read yet, `(call index,
        # frame, rows)`, and per frame (trace) the failures read so far, as whole
        # states (`_add_found`).
        self._pending: collections.deque[tuple[int, Any, Any]] = collections.deque()
        # Batches of pending calls asked whether any check failed: (the answer, or
        # `None` for a batch read call by call; the calls).
        self._asked: collections.deque[tuple[Any, list]] = collections.deque()
        self._found: dict[Any, np.ndarray] = {}  # by `frames.Frame`
        self._first: Any = None  # the first frame traced (see `first`)
        self._copy: bool | None = None  # whether findings are copied to the host
        self._per_call = 0  # inside `per_call`
        self._dropped: set[int] = set()  # sites to drop once read (`per_call`)

    def next_call(self) -> int:
        if self._generation != _generation[0]:
            self._generation = _generation[0]
            self._call = -1
        self._call += 1
        return self._call

    def first(self, frame: Any) -> bool:
        """Whether `frame` is the first traced for this function (see
        `frames._compiled`); called while its program is traced."""
        with self._lock:
            if self._first is None:
                self._first = frame
            return self._first is frame

    def found(self, found: Any, mode: str) -> None:
        """Takes what a compiled call found, the first frame's rows or `{frame:
        rows}` (see `_compiled`): in "raise" mode reads the rows at once; in
        "deferred" mode reads only those of calls the device has finished, so the
        host never waits. Every call pays for this: it is written for speed."""
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
        call = self.next_call()
        if call == 0:  # the first since the last flush
            deferred_scopes.add(self)
        if packed[0] is None and packed[1] is None:
            return  # a program with no checks
        pending = self._pending
        pending.append((call, frame, packed))
        if len(pending) >= _READ_AFTER:
            self._ask()
        if self._asked:
            self._read_pending(wait=False)

    def _ask(self) -> None:
        """Asks the device whether any check failed in the oldest `_READ_AFTER`
        pending calls (see `_READ_AFTER`)."""
        with self._lock:  # calls from several threads
            pending = self._pending
            if len(pending) < _READ_AFTER:
                return
            batch = [pending.popleft() for _ in range(_READ_AFTER)]
        answer = None
        if len({id(frame) for _, frame, _ in batch}) == 1:
            # One trace: one placement, and one `_any_failed` program for them all.
            answer = _any_failed([packed for _, _, packed in batch])
            if self._copy is None:
                devices = answer.sharding.device_set
                self._copy = not all(d.platform == "cpu" for d in devices)
            if self._copy:
                # Off the CPU, copied to the host as soon as it is made: the read
                # at a later call then does not wait for the copy.
                answer.copy_to_host_async()
        self._asked.append((answer, batch))

    def _read_pending(self, wait: bool) -> None:
        """Reads the answers of the batches the device has finished (of every
        batch, and every call not asked about yet, if `wait`), in call order, and
        keeps their failures."""
        asked, pending = self._asked, self._pending
        with self._lock:  # calls from several threads
            while asked and (wait or asked[0][0] is None or asked[0][0].is_ready()):
                answer, batch = asked.popleft()
                if answer is None or bool(np.asarray(answer)):
                    for call in batch:
                        self._keep(*call)
            while wait and pending:
                self._keep(*pending.popleft())

    def _keep(self, call: int, frame: Any, packed: tuple[Any, Any]) -> None:
        """Reads what call number `call` found, and keeps its failures."""
        rows, failed = _read(packed)
        if failed:
            found = _full(*rows, np)
            self._found[frame] = _add_found(self._found.get(frame), found, call)

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
        self._send_call(self.next_call())

    def _send_call(self, call: int) -> None:
        """Puts the call index in the counter Ref of the current placement: as a
        transfer, not as an operation, so a `checked` call costs one host-to-device
        copy before the program."""
        _, calls = self.refs()
        set_ref_contents(calls, jax.device_put(np.int32(call), self.placement))

    def move_to(self, mesh: Any) -> None:
        """The current call's checks' state goes on `mesh` (replicated), if no
        mesh held it: the call runs a shard_map over `mesh` on arguments that were on
        none (a program mixing the two placements would be refused)."""
        if self.placement is not None:
            return
        self.placement = _replicated(mesh)
        self._send_call(self._call)

    @contextlib.contextmanager
    def per_call(self) -> Iterator[None]:
        """Sites added in the block belong to one call's program (an eager
        shard_map's, traced at each call): dropped once their failures are read."""
        self._per_call += 1
        try:
            yield
        finally:
            self._per_call -= 1

    def add(self, sites: list[Site]) -> State:
        """Gives `sites` (those of one `check` call) their state, placed where this
        call's programs run."""
        make = ft.partial(new_ref_outside_traces, sharding=self.placement)
        state = State.new([s.words for s in sites], self.placement, make)
        with self._lock:
            for row, site in enumerate(sites):
                site.state, site.row, site.order = state, row, len(self.sites)
                self.sites.append(site)
                if self._per_call:
                    self._dropped.add(id(site))
        return state

    def take_failures(self, deferred: bool) -> list[Failure]:
        """The failures recorded so far, in program order; clears them."""
        self._read_pending(wait=True)  # the one wait for the device
        failures = []
        for frame in sorted(self._found, key=lambda frame: frame.number):
            failures += frame.failures(self._found[frame], deferred)
        self._found.clear()
        failures += self._take_ref_failures(deferred)
        if self._dropped:
            with self._lock:
                self.sites = [s for s in self.sites if id(s) not in self._dropped]
                self._dropped.clear()
        return failures

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


def _inside_a_trace(name: str) -> RuntimeError:
    return RuntimeError(
        f"jaxshard.checked({name}) was called inside a trace (inside jax.jit?). Call "
        "the checked function from outside jit, or put the jit inside: "
        "jaxshard.checked(jax.jit(f))."
    )


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
