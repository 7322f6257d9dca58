"""Where value checks record what they found, and who reads it.

A `checked` function has a `Scope`. A jitted one runs as a program whose checks
record into a `Frame`, which the program returns as rows (`_compiled`,
`_check_rows`); any other keeps its checks' state in Refs that live between calls. A
`jaxshard.shard_map` body has a `ShardMapFrame`. Checks that no `checked` call owns
raise from a host callback. See `_jax_internals.accumulate` for how the writes leave
jit, scan, vmap and autodiff.
"""

import atexit
import contextlib
import dataclasses
import functools as ft
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from . import _config
from ._check_rows import _evaluated_once, _full, _ONCE, _rows
from ._check_sites import CheckError, Failure, Site
from ._check_state import (
    _any_failure,
    _encode,
    _INITIAL,
    _merge,
    _on,
    _reduce,
    _shared_details,
    _statistics,
    BATCH_DEPTH,
    CALL,
    CALLS,
    COUNT,
    DEVICE,
    ELEMENT,
    EVALS,
    Item,
    ITERATION,
    State,
    STATE_SIZE,
)
from ._jax_internals import (
    accumulate,
    context_mesh,
    current_trace,
    drop_callback_errors,
    is_device_mismatch,
    jit_parameters,
    new_ref_in,
    new_ref_outside_traces,
    ref_contents,
    set_ref_contents,
)


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
        self._rows: dict["Frame", tuple[int, int]] = {}
        self._width = STATE_SIZE + 2

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
            # The call's one wait for the device (`np.asarray` reads a flag in a
            # fraction of the time `bool` takes).
            if np.asarray(findings.flag):
                failures = findings.frame.failures(findings.states, deferred=False)
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

    def place(self, frame: "Frame", rows: int, width: int, shape: tuple) -> int:
        """Where the accumulated rows of a trace begin (called while it is traced,
        with the shape of the accumulated states it is given): after the rows of
        the traces before it. Raises `_Grow` if they do not fit."""
        if frame not in self._rows:
            start = 1 + sum(n for _, n in self._rows.values())
            self._rows[frame] = (start, rows)
        start, _ = self._rows[frame]
        if start + rows > shape[0] or width > shape[1]:
            raise _Grow(start + rows, width)
        return start

    def abstract_states(self) -> Any:
        """The shape of the accumulated states the next call would be given."""
        rows = max(16, 1 + sum(n for _, n in self._rows.values()))
        if self._accumulated is not None:
            rows = self._accumulated.shape[0]
        return jax.ShapeDtypeStruct((rows, self._width), np.int32)

    def _fresh(self, args: tuple, kwargs: dict) -> Any:
        """Zero states for the rows placed so far (or a few), where the call's
        program runs."""
        rows = max(16, 1 + sum(n for _, n in self._rows.values()))
        zeros = np.zeros((rows, self._width), np.int32)
        return jax.device_put(zeros, _placement(args, kwargs))

    def _grow(self, accumulated: Any, grow: "_Grow") -> None:
        """Room for `grow`'s rows and width, twice what is needed, with the states
        so far (a read and a copy: when a new trace does not fit)."""
        self._width = max(self._width, grow.width)
        old = np.asarray(accumulated)
        rows = old.shape[0] if grow.rows <= old.shape[0] else 2 * grow.rows
        new = np.zeros((rows, self._width), np.int32)
        new[: old.shape[0], : old.shape[1]] = old
        self._accumulated = jax.device_put(new, accumulated.sharding)

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
            for frame, (start, rows) in self._rows.items():
                if start + rows <= accumulated.shape[0]:
                    failures += frame.failures(
                        accumulated[start : start + rows], deferred
                    )
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
    context, else that of the first array spread over several devices, else the
    default device."""
    mesh = context_mesh()
    if mesh is not None:
        return _replicated(mesh)
    for leaf in jax.tree.leaves((args, kwargs)):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and len(sharding.device_set) > 1:
            return NamedSharding(sharding.mesh, PartitionSpec())
    return None


@ft.lru_cache(maxsize=64)
def _replicated(mesh: Any) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


# --- compiled calls -------------------------------------------------------------------
#
# `checked(jax.jit(f))` runs as a `jax.jit` program that calls the function `f` wraps
# with its checks recording into a `Frame`, and returns what they found with `f`'s
# outputs. The program has no Refs among its inputs, so JAX dispatches it through
# its C++ fast path. In "raise" mode it returns a flag, read after each call; in
# "deferred" mode it adds what it found to the accumulated states it is given and
# returns them, and nothing waits for the device until a flush.


class Findings:
    """What one compiled call found: its frame's flag and its sites' states (as
    `Frame.packed()` made them). A pytree whose structure holds the frame, so the
    jit cache gives it back."""

    def __init__(self, frame: "Frame", flag: Any, states: Any):
        self.frame, self.flag, self.states = frame, flag, states


jax.tree_util.register_pytree_node(
    Findings,
    lambda f: ((f.flag, f.states), f.frame),
    lambda frame, children: Findings(frame, *children),
)


def _compiled(fn: Callable, scope: Scope) -> tuple[Callable, Callable] | None:
    """`fn` as programs that also return what its checks found, if `fn` is a
    `jax.jit` function; else `None`.

    Two programs, `jax.jit` of the function `fn` wraps, with `fn`'s static and
    donated arguments and its `in_shardings` and `out_shardings` (a jitted function
    called inside it would close over the checks' Refs, and JAX cannot discharge
    those from a jit with shardings):

    - for "raise" mode, one that takes `fn`'s arguments and also returns a flag
      and its checks' findings, `Findings`;
    - for "deferred" mode, one that also takes the accumulated states of the
      scope's checks (donated), adds what this call found, and returns them: no
      output to keep per call, nothing to merge between calls.
    """
    params = jit_parameters(fn)
    if params is None:
        return None
    fun = params["fun"]

    def traced(*args, **kwargs):
        frame = Frame()
        with _config.overriding(check_scope=frame):
            out = fun(*args, **kwargs)
        return frame, out

    def raising(*args, **kwargs):
        frame, out = traced(*args, **kwargs)
        packed = frame.packed()
        return out, Findings(frame, frame.failed(packed), packed)

    def deferred(accumulated, *args, **kwargs):
        frame, out = traced(*args, **kwargs)
        states = _full(*frame.packed(), jnp)
        if not states.shape[0]:  # no check
            return out, accumulated
        start = scope.place(frame, *states.shape, accumulated.shape)
        return out, _add_call(accumulated, start, states)

    kept = {k: v for k, v in params.items() if k not in ("fun", "out_shardings")}
    if "out_shardings" in params:
        kept["out_shardings"] = (params["out_shardings"], None)
    shifted = {
        "static_argnums": tuple(i + 1 for i in params["static_argnums"]),
        "donate_argnums": (0,) + tuple(i + 1 for i in params["donate_argnums"]),
    }
    if "in_shardings" in params:
        given = params["in_shardings"]
        # One per argument, or one for all: the accumulated states lie where the
        # program runs.
        shifted["in_shardings"] = (None, *given) if isinstance(given, tuple) else given
    return jax.jit(raising, **kept), jax.jit(deferred, **{**kept, **shifted})


class _Grow(Exception):
    """Raised while a trace is made, when its rows do not fit in the accumulated
    states it is given: the wrapper makes room and calls again."""

    def __init__(self, rows: int, width: int):
        self.rows, self.width = rows, width


def _add_call(accumulated: Any, start: int, states: Any) -> Any:
    """`accumulated` with one call's `states` (a trace's rows, from `start`) merged
    in: per site, counts and failing calls summed, and the call's failure kept if
    it is the site's first; and the call counted (row 0). One fused update."""
    rows, width = states.shape
    old = accumulated[start : start + rows, :width]
    column = np.arange(width)[None, :]
    summed = (column == COUNT) | (column == CALLS)
    states = jnp.where(column == CALL, accumulated[0, 0], states)
    first = (old[:, COUNT] == 0) & (states[:, COUNT] > 0)
    new = jnp.where(summed, old + states, jnp.where(first[:, None], states, old))
    accumulated = lax.dynamic_update_slice(accumulated, new, (start, 0))
    return accumulated.at[0, 0].add(1)


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


class _Frames(threading.local):
    def __init__(self):
        self.stack: list["ShardMapFrame"] = []


_frames = _Frames()


class Frame:
    """Checks whose state lives in one trace, which returns it (see `ShardMapFrame`
    and `_compiled`).

    A check made in the trace itself runs once per call: its statistics are its
    state, gathered with the others' into rows when the trace ends, at the cost of a
    few operations per check. One made deeper (in a loop, `vmap`, `cond`, an inner
    `jit` or autodiff) may run any number of times: it accumulates into a Ref made in
    the trace."""

    def __init__(self):
        self.trace = current_trace()
        self.flag = new_ref_in(self.trace, np.zeros((), bool))
        # The call index, 0 here: a compiled call's is set when its findings are
        # folded, and a shard_map body's findings take the call's outside.
        self.call = jnp.zeros((), jnp.int32)
        self.once: list[tuple[Site, tuple]] = []  # checks made in the trace itself
        self.shared: list[tuple[Site, Item]] = []  # ...on small arrays (see below)
        self.screened: list[tuple[Site, Item]] = []  # ...the same, on a mesh
        self.screens: list = []  # whether any of those failed, per check call
        self.groups: list[list[Site]] = []  # the others, a Ref per `check` call
        self.calls: list[list[Site]] = []  # the sites of each `check` call, in order
        self.sites_made = 0

    def owns_trace(self) -> bool:
        """Whether JAX is tracing the frame's own function (not a loop, a `vmap`, a
        `cond`, an inner `jit` or autodiff inside it)."""
        return current_trace() is self.trace

    def add_checks(self, sites: list[Site], items: list[Item]) -> None:
        """The checks of one `check` call made in the frame's own trace, with no
        manual mesh axes (see `owns_trace`).

        A check on an array of up to `_SHARED_SIZE` elements keeps only its test
        of whether anything failed in the passing program: the rest of its
        statistics wait for the end of the trace, where one `lax.cond` computes
        them for every such check (`_shared_details`), so that a program with many
        checks compiles a few operations for all of them. The test is a reduction
        per check (`Item.screen`), made now on its own layout on a mesh of several
        devices; elsewhere, one `any` over all of them, stacked. Other checks are
        evaluated now."""
        budget = _SHARED_TOTAL - sum(
            np.prod(item.shape) for _, item in self.shared + self.screened
        )
        mesh = jax.typeof(items[0].operand).sharding.mesh
        stacked, screened, now = [], [], []
        for i, item in enumerate(items):
            size = np.prod(item.shape)
            budget -= size
            if not item.shape or size > _SHARED_SIZE or budget < 0:
                now.append(i)
            elif mesh.empty or mesh.size == 1:
                stacked.append(i)
            else:
                screened.append(i)
        self.shared += [(sites[i], items[i]) for i in stacked]
        if screened:
            self.screens.append(_any_failure([items[i] for i in screened], []))
            self.screened += [(sites[i], items[i]) for i in screened]
        rows: list = [None] * len(items)
        if now:
            for i, ((count, element, device, *picked), _) in zip(
                now, _statistics([items[i] for i in now])
            ):
                rows[i] = (count, element, device, np.int32(-1), _encode(picked))
        self.add(sites, rows)

    def add(self, sites: list[Site], rows: list) -> None:
        """Sites and their statistics (`None` for those `add_checks` shares)."""
        for site in sites:
            site.order, self.sites_made = self.sites_made, self.sites_made + 1
        self.calls.append(sites)
        if current_trace() is self.trace:
            self.once += [(s, row) for s, row in zip(sites, rows) if row is not None]
            return
        make = ft.partial(new_ref_in, self.trace)
        state = State.new([s.words for s in sites], None, make)
        for row, site in enumerate(sites):
            site.state, site.row = state, row
        self.groups.append(sites)
        _accumulate(state, self.flag, self.call, rows)

    def sites(self) -> list[Site]:
        """Every site, in the order of `_full`'s rows."""
        once = [site for site, _ in self.once + self.shared + self.screened]
        return once + [s for g in self.groups for s in g]

    def packed(self) -> tuple[Any, Any]:
        """What the checks found, as the trace's output: `(once, states)`, int32
        arrays with a row per site (or `None`, for no site). `once` holds the
        statistics of the checks made in the trace itself (see `_evaluated_once`),
        `states` those of the others' Refs; `_full` makes them whole states."""
        contents = [sites[0].state.ref[...] for sites in self.groups]
        once = [_evaluated_once([row for _, row in self.once])] if self.once else []
        # Screened together, or (on a mesh) one by one (see `add_checks`).
        for shared, screens in ((self.shared, None), (self.screened, self.screens)):
            if not shared:
                continue
            any_fail = screens and ft.reduce(jnp.logical_or, screens)
            count, first, words = _shared_details([i for _, i in shared], any_fail)
            minus_one = np.full(len(shared), -1, np.int32)
            columns = [count, first, minus_one, minus_one]  # device, iteration
            once.append(jnp.concatenate([jnp.stack(columns, axis=1), words], axis=1))
        return _rows(once), _rows(contents)

    def failed(self, packed: tuple[Any, Any]) -> Any:
        """Whether any check failed, from what `packed()` returned."""
        counts = [x[:, i] for x, i in zip(packed, (0, COUNT)) if x is not None]
        return ft.reduce(jnp.logical_or, [jnp.any(c > 0) for c in counts], False)

    def failures(self, packed: tuple[Any, Any], deferred: bool) -> list[Failure]:
        """The failures in `packed` (what `packed()` returned, or whole states), in
        program order."""
        if isinstance(packed, tuple):
            packed = _full(*packed, np)
        packed = np.asarray(packed)
        failed = [
            (site, row) for site, row in zip(self.sites(), packed) if row[COUNT] > 0
        ]
        failed.sort(key=lambda pair: pair[0].order)
        return [site.failure(row, deferred) for site, row in failed]


# Checks on arrays of at most this many elements share their details (see
# `Frame.add_checks`), up to this many elements in all in one program: the branch
# that computes the details holds a copy of them.
_SHARED_SIZE = 1 << 12
_SHARED_TOTAL = 1 << 18


class ShardMapFrame(Frame):
    """The checks inside one `jaxshard.shard_map` body. JAX cannot close a shard_map
    body over Refs from outside it, so the checks write to Refs made in the body, and
    the body returns their contents (the same on every device), which are then
    recorded outside as if the check had been made there."""

    def forward(self, packed: tuple[Any, Any]) -> None:
        """Records, outside the shard_map, what its body found (its `packed()`)."""
        scope = _config.current().check_scope
        once, states = packed
        at = {id(site): i for i, (site, _) in enumerate(self.once)}
        deeper = {id(s): i for i, s in enumerate(s for g in self.groups for s in g)}
        for sites in self.calls:
            outer = [dataclasses.replace(site, state=None) for site in sites]
            rows = []
            for site in sites:
                words = range(site.words)
                if id(site) in at:
                    row = once[at[id(site)]]
                    rows.append((*row[:_ONCE], [row[_ONCE + w] for w in words]))
                    continue
                state = states[deeper[id(site)]]
                rows.append(
                    (
                        state[COUNT],
                        state[ELEMENT],
                        state[DEVICE],
                        jnp.where(state[EVALS] > 1, state[ITERATION], -1),
                        [state[STATE_SIZE + w] for w in words],
                    )
                )
            if scope is None:
                for site, row in zip(outer, rows):
                    _fallback(site, row)
            elif isinstance(scope, Frame):
                scope.add(outer, rows)
            else:
                _record(scope, outer, rows)


@contextlib.contextmanager
def shard_map_checks() -> Iterator[ShardMapFrame]:
    """Inside a `jaxshard.shard_map` body: collects its checks (see `ShardMapFrame`)."""
    frame = ShardMapFrame()
    _frames.stack.append(frame)
    try:
        yield frame
    finally:
        _frames.stack.pop()


# --- checks no `checked` call owns ----------------------------------------------------


def _fallback(site: Site, row: tuple, in_shard_map: bool = False) -> None:
    count, element, device, _, words = row
    # Inside shard_map every device has the same statistics: one of them reports.
    me = jnp.zeros((), jnp.int32)
    for axis, size in site.device_axes if in_shard_map else ():
        me = me * size + jax.lax.axis_index(axis)
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
