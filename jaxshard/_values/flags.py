"""The flags of a `checked` function's calls, as one thread makes them between two
reads: a `Flags` is what those calls' checks record into, and what reads them.

A `checked` function (its `records.Scope`) lends a `Flags` to each call in "raise"
mode and takes it back once the call's findings are read, and lends one to each
thread in "deferred" mode until that thread's flush: two threads never share one, so
each call, and each thread's deferred block, reports exactly its own failures.

A jitted function's calls return what their checks found, which a `Flags` keeps in
deferred mode until they are read. Any other function's checks keep their state on
the device, in Refs its programs close over: a `Flags` is then part of those
programs' jit cache key (the `check_scope` setting), so each `Flags` has programs of
its own. A site's state lives as long as a program holds it: once read, it is held
only weakly, so the sites go when JAX's caches drop (or `jax.clear_caches()`
clears) the programs that made them.
"""

import collections
import contextlib
import dataclasses
import functools as ft
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .._jax_internals import (
    context_mesh,
    new_ref_outside_traces,
    ref_contents,
    set_ref_contents,
)
from .rows import _add_found, _full, _read
from .sites import CheckError, Failure, Site
from .state import _on, COUNT, State


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


class _Thread(threading.local):
    """Per thread: its deferred generation (a new object at each flush and at the
    start of each `deferred_checks()` block: call indices start again from 0)."""

    def __init__(self):
        self.generation = object()


thread = _Thread()


class Flags:
    """What the calls of the `checked` function `name` found, as one thread makes
    them between reads. For a jitted function, the findings of its calls in deferred
    mode not read yet. For any other, its sites and, for each placement of their
    state (the devices its programs run on), a flag raised by any of its checks and
    a call counter, in Refs that live between calls."""

    def __init__(self, name: str):
        self.name = name
        self._sites: list[Site] = []
        self._fresh = False  # sites added since the last read
        self.placement: Any = None  # where this call's programs run
        self._refs: dict[Any, tuple[Any, Any]] = {}
        self._generation: object = None
        self._call = -1
        # The calls made in earlier generations: the device's call counter goes on
        # from there (a site's state keeps the index of the last call it ran in, and
        # an index used again would count the new call's evaluation as a loop
        # iteration of that one); a deferred failure's call is said from 0.
        self._base = 0
        self._lock = threading.Lock()  # sites added from other threads' traces
        # Compiled calls in deferred mode: the findings not read yet, `(call index,
        # frame, rows)`, and per frame (trace) the failures read so far, as whole
        # states (`_add_found`).
        self._pending: collections.deque[tuple[int, Any, Any]] = collections.deque()
        # Batches of pending calls asked whether any check failed: (the answer, or
        # `None` for a batch read call by call; the calls).
        self._asked: collections.deque[tuple[Any, list]] = collections.deque()
        self._found: dict[Any, np.ndarray] = {}  # by `frames.Frame`
        self._copy: bool | None = None  # whether findings are copied to the host
        self._per_call = 0  # inside `per_call`
        self._dropped: set[int] = set()  # sites to drop once read (`per_call`)
        self._kept: list[Failure] = []  # read, to report at the flush (`note`)

    @property
    def sites(self) -> list[Site]:
        """The sites whose state a program may still write."""
        self._prune()
        return list(self._sites)

    def next_call(self) -> int:
        if self._generation is not thread.generation:
            self._generation = thread.generation
            self._base += self._call + 1
            self._call = -1
        self._call += 1
        return self._call

    # --- a jitted function's calls, in deferred mode ----------------------------------

    def found(self, frame: Any, packed: tuple[Any, Any]) -> None:
        """Keeps what a compiled call found, `frame`'s rows `packed`, reading only
        those of calls the device has finished, so the host never waits. Every
        call pays for this: it is written for speed."""
        call = self.next_call()
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
        pending = self._pending
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

    # --- any other function's calls: state in Refs ------------------------------------

    def refs(self) -> tuple[Any, Any]:
        """The flag and call counter for the current placement."""
        if self.placement not in self._refs:
            self._refs[self.placement] = (
                new_ref_outside_traces(np.zeros((), bool), self.placement),
                new_ref_outside_traces(np.zeros((), np.int32), self.placement),
            )
        return self._refs[self.placement]

    def begin_call(self, args: tuple, kwargs: dict) -> int:
        """Starts a call with these arguments; returns its index."""
        self.placement = _placement(args, kwargs)
        call = self.next_call()
        self._send_call(call)
        return call

    def _send_call(self, call: int) -> None:
        """Puts the call index in the counter Ref of the current placement: as a
        transfer, not as an operation, so a `checked` call costs one host-to-device
        copy before the program."""
        _, calls = self.refs()
        index = np.int32(self._base + call)
        set_ref_contents(calls, jax.device_put(index, self.placement))

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
            self._fresh = True
            for row, site in enumerate(sites):
                site.state, site.row, site.order = state, row, len(self._sites)
                self._sites.append(site)
                if self._per_call:
                    self._dropped.add(id(site))
        return state

    # --- reading ----------------------------------------------------------------------

    def take_failures(self, deferred: bool) -> list[Failure]:
        """The failures recorded so far, in program order; clears them."""
        self._read_pending(wait=True)  # the one wait for the device
        failures, self._kept = self._kept, []
        for frame in sorted(self._found, key=lambda frame: frame.number):
            failures += frame.failures(self._found[frame], deferred)
        self._found.clear()
        failures += self._take_ref_failures(deferred)
        if self._dropped:
            with self._lock:
                self._sites = [s for s in self._sites if id(s) not in self._dropped]
                self._dropped.clear()
        if self._fresh:
            self._prune()
        return failures

    def note(self, error: BaseException, call: int | None, deferred: bool) -> None:
        """Adds to `error`, which ended call number `call` (`None`: a deferred block),
        the failures of the checks it made before it, as a note. In deferred mode,
        failures first made by earlier calls are kept for the flush. A failure that
        cannot be read is dropped: nothing surfaces in a later call."""
        try:
            failures = self.take_failures(deferred)
        except Exception:  # the device's state is lost with the call's error
            return
        if deferred and call is not None:
            self._kept = [f for f in failures if f.call != call]
            failures = [f for f in failures if f.call == call]
        if failures:
            when = f" in {self.name} before this exception"
            error.add_note(str(CheckError(failures, when=when)))

    def _take_ref_failures(self, deferred: bool) -> list[Failure]:
        raised = []
        for placement, (flag, _) in self._refs.items():
            if bool(ref_contents(flag)):  # the call's one wait for the device
                raised.append(placement)
                with _on(placement):
                    flag[...] = jnp.zeros((), bool)
        failures, read = [], {}
        for site in self._sites if raised else ():
            state = site.state
            if state.placement not in raised or state.ref is None:
                continue
            if id(state) not in read:
                read[id(state)] = state.read()
            found = read[id(state)]
            if found is not None and found[site.row, COUNT] > 0:
                failure = site.failure(found[site.row], deferred)
                if failure.call is not None:
                    failure = dataclasses.replace(
                        failure, call=failure.call - self._base
                    )
                failures.append(failure)
        return failures

    def _prune(self) -> None:
        """Holds the sites read at least once only as long as a program holds their
        state (see `State.release`), and forgets those whose programs are gone."""
        with self._lock:
            for site in self._sites:
                site.state.release()
            self._sites = [s for s in self._sites if s.state.ref is not None]
            self._fresh = False


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
