"""Checks inside a compiled program: a `Frame` collects those made while the
program is traced and makes what they found part of its outputs (`_compiled`); a
`ShardMapFrame` does the same for a `jaxshard.shard_map` body.

A check made in the frame's own trace runs once per call: its statistics are its
state, a few fused operations. A check on a small array also waits for the end of
the trace, where a few operations compute the details of every such check. A check
deeper in the program (a loop, `vmap`, `cond`, an inner `jit`, autodiff) may run any
number of times: it accumulates into a Ref made in the trace.
"""

import contextlib
import dataclasses
import functools as ft
import itertools
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _config
from .._jax_internals import (
    current_trace,
    jit_parameters,
    new_ref_in,
    shard_map_outputs,
)
from .mesh import _split_mesh, _split_statistics, _statistics
from .records import _accumulate, _fallback, _record
from .rows import _evaluated_once, _full, _ONCE, _rows
from .sites import Failure, Site
from .state import (
    _encode,
    COUNT,
    DEVICE,
    ELEMENT,
    EVALS,
    Item,
    ITERATION,
    State,
    STATE_SIZE,
)
from .stats import _LOCATED_SIZE, _shared_details


# --- compiled calls -------------------------------------------------------------------
#
# `checked(jax.jit(f))` runs as a `jax.jit` program that calls the function `f` wraps
# with its checks recording into a `Frame`, and returns what they found with `f`'s
# outputs. The program has no Refs among its inputs, so JAX dispatches it through
# its C++ fast path. It returns its checks' rows: in "raise" mode they are read after
# each call; in "deferred" mode the wrapper keeps them and reads those of calls the
# device has finished, at later calls, so the host never waits until a flush.


class Findings:
    """What a `jaxshard.shard_map` body found: its frame's rows (what
    `Frame.packed()` made), `once` and `states`. A pytree whose structure holds the
    frame, so the jit cache gives it back."""

    __slots__ = ("frame", "once", "states")

    def __init__(self, frame: "Frame", packed: tuple[Any, Any]):
        self.frame = frame
        self.once, self.states = packed

    @property
    def packed(self) -> tuple[Any, Any]:
        return self.once, self.states


jax.tree_util.register_pytree_node(
    Findings, lambda f: ((f.once, f.states), f.frame), Findings
)


def _compiled(fn: Callable, scope: Any) -> Callable | None:
    """`fn` as a program that also returns what its checks found, if `fn` is a
    `jax.jit` function; else `None`. What they found is `(once, states)` (see
    `Frame.packed`) for the first frame of the `checked` function's `scope` (its
    first trace: `Scope.first`), and `{frame: (once, states)}` for the others.

    A function is usually traced once: its rows alone are the cheapest output (a
    dict costs JAX's dispatch half a microsecond more). The frame of any later
    trace is the dict's key, the tree's structure, which the jit cache gives back
    with each call's rows, and which JAX makes without calling into Python (a class
    of ours would cost a microsecond a call).

    `jax.jit` of the function `fn` wraps, with what `fn` was given (see
    `jit_parameters`): static and donated arguments, shardings and layouts, device,
    ... (a jitted function called inside it would close over the checks' Refs, and
    JAX cannot discharge those from a jit with shardings). Both modes run it (see
    `Scope.found`)."""
    params = jit_parameters(fn)
    if params is None:
        return None
    fun = params["fun"]

    # Named and signed as `fun`: jit names the program after it (`jit(train_step)`
    # in messages and profiles), binds static_argnames by its signature, and the
    # diagnosis names the arguments by its parameters.
    @ft.wraps(fun)
    def program(*args, **kwargs):
        frame = Frame()
        with recording_into(frame):
            out = fun(*args, **kwargs)
        if scope.first(frame):
            return out, frame.packed()
        return out, {frame: frame.packed()}

    kept = {k: v for k, v in params.items() if k not in ("fun", "out_shardings")}
    if "out_shardings" in params:
        kept["out_shardings"] = (params["out_shardings"], None)
    with warnings.catch_warnings():
        # `device` and `backend`, deprecated: `jax.jit(fn, ...)` warned already.
        warnings.simplefilter("ignore", DeprecationWarning)
        return jax.jit(program, **kept)


class _Frames(threading.local):
    def __init__(self):
        self.stack: list["ShardMapFrame"] = []


_frames = _Frames()
_numbers = itertools.count()


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
        self.number = next(_numbers)  # frames report in the order they were made
        self._flag = None  # made by the first check that needs it (`flag`)
        # The call index, 0 here: a compiled call's is set when its findings are
        # folded, and a shard_map body's findings take the call's outside.
        self.call = jnp.zeros((), jnp.int32)
        self.once: list[tuple[Site, tuple]] = []  # checks made in the trace itself
        self.later: list[tuple[Site, Item]] = []  # ...on larger arrays (see below)
        self.shared: list[tuple[Site, Item]] = []  # ...on small arrays
        self.groups: list[list[Site]] = []  # the others, a Ref per `check` call
        self.calls: list[list[Site]] = []  # the sites of each `check` call, in order
        self.sites_made = 0

    @property
    def flag(self) -> Any:
        """A Ref raised by any check deeper in the trace: made in the trace when
        first needed, so that a trace with no such check has no Ref (an unused one in
        a shard_map body is not discharged under a `jit` that closes over Refs)."""
        if self._flag is None:
            self._flag = new_ref_in(self.trace, np.zeros((), bool))
        return self._flag

    def owns_trace(self) -> bool:
        """Whether JAX is tracing the frame's own function (not a loop, a `vmap`, a
        `cond`, an inner `jit` or autodiff inside it)."""
        return current_trace() is self.trace

    def add_checks(self, sites: list[Site], items: list[Item]) -> None:
        """The checks of one `check` call made in the frame's own trace, with no
        manual mesh axes (see `owns_trace`).

        On one device, a check on an array of up to `_SHARED_SIZE` elements waits
        for the end of the trace, where its statistics are computed with those of
        every such check (`_shared_details`), so that a program with many checks
        compiles a few operations for all of them. A check on a larger array (on a
        mesh of several devices, on any array), of up to half `_LOCATED_SIZE`
        elements, waits for the end of the trace too, where such checks are found
        in runs of up to `_LOCATED_SIZE` elements (`_runs`): on a mesh, in one
        per-device operation and one collective per run (`_split_statistics`);
        those of one shape share reductions. Other checks are evaluated now, on a
        mesh with the call's others on larger arrays."""
        budget = _SHARED_TOTAL - sum(np.prod(item.shape) for _, item in self.shared)
        mesh = jax.typeof(items[0].operand).sharding.mesh
        one_device = mesh.empty or mesh.size == 1
        stacked, later, now = [], [], []
        for i, item in enumerate(items):
            size = np.prod(item.shape)
            if one_device and item.shape and size <= min(_SHARED_SIZE, budget):
                budget -= size
                stacked.append(i)
            elif item.shape and 2 * size <= _LOCATED_SIZE:
                later.append(i)
            else:
                now.append(i)
        if not one_device and now and later:
            # One operation, and one collective, for the call's larger arrays.
            now, later = sorted(now + later), []
        self.shared += [(sites[i], items[i]) for i in stacked]
        self.later += [(sites[i], items[i]) for i in later]
        rows: list = [None] * len(items)
        if now:
            for i, (stats, _) in zip(now, _statistics([items[i] for i in now])):
                rows[i] = _once_row(stats)
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
        once = self.once + self.later + self.shared
        once = [site for site, _ in once]
        return once + [s for g in self.groups for s in g]

    def parts(self) -> tuple[list, Any]:
        """What the checks found, in parts: `(matrices, states)`. `matrices`, the
        rows of the checks made in the trace itself, int32[sites, 4 + words] each
        (`[count, element, device, iteration, *words]`, in `sites()` order);
        `states`, those of the others' Refs (an int32 array with a row per site, or
        `None`)."""
        contents = [sites[0].state.ref[...] for sites in self.groups]
        matrices, rows = [], [row for _, row in self.once]

        def flush():
            if rows:
                matrices.append(
                    _evaluated_once([[*row[:_ONCE], *row[_ONCE]] for row in rows])
                )
                rows.clear()

        for run in _runs([item for _, item in self.later]):
            mesh = _split_mesh([item.operand for item in run])
            if mesh is None:
                rows += [_once_row(stats) for stats, _ in _statistics(run)]
            else:
                flush()
                matrices.append(_matrix(_split_statistics(mesh, run)))
        flush()
        if self.shared:
            matrices.append(_matrix(_shared_details([i for _, i in self.shared])))
        return matrices, _rows(contents)

    def packed(self) -> tuple[Any, Any]:
        """What the checks found, as the trace's output: `(once, states)`, int32
        arrays with a row per site (or `None`, for no site). `once` holds the
        statistics of the checks made in the trace itself (see `_evaluated_once`)
        and of those on small arrays, `states` those of the others' Refs; `_full`
        makes them whole states."""
        matrices, states = self.parts()
        return _rows(matrices), states

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


# Up to this many checks in a run (`_runs`): XLA compiles a per-device operation of a
# thousand checks' operands in more time than sixteen of 64 (on 8 devices, 10.4
# against 7.2 ms per check on Explicit axes, 6.8 and 6.7 on Auto ones).
_RUN = 64


def _runs(items: list[Item]) -> list[list[Item]]:
    """`items`, in program order, in runs on one mesh of up to `_LOCATED_SIZE`
    elements and `_RUN` items: those whose statistics are found together (see
    `Frame.add_checks`). A check's array may live until the last of its run's is
    made."""
    runs: list[list[Item]] = []
    mesh, size = None, 0
    for item in items:
        n = int(np.prod(item.shape))
        on = jax.typeof(item.operand).sharding.mesh
        if runs and on == mesh and size + n <= _LOCATED_SIZE and len(runs[-1]) < _RUN:
            runs[-1].append(item)
            size += n
        else:
            runs.append([item])
            mesh, size = on, n
    return runs


def _matrix(found) -> Any:
    """Rows of `Frame.parts()` from checks' statistics, an int32 `[checks, 2 +
    words]` matrix of `[count, first failing element, *value words]` rows (what
    `_shared_details` and `_split_statistics` return)."""
    minus_one = np.full((found.shape[0], 2), -1, np.int32)  # device, iteration
    return jnp.concatenate([found[:, :2], minus_one, found[:, 2:]], axis=1)


def _once_row(stats: tuple) -> tuple:
    """A check's row in `Frame.once` from its statistics (from `_statistics`)."""
    count, element, device, *picked = stats
    return (count, element, device, np.int32(-1), _encode(picked))


class ShardMapFrame(Frame):
    """The checks inside one `jaxshard.shard_map` body. JAX cannot close a shard_map
    body over Refs from outside it, so the checks write to Refs made in the body, and
    the body returns their contents (the same on every device), which are then
    recorded outside as if the check had been made there."""

    def forward(self, packed: tuple[Any, Any]) -> None:
        """Records, outside the shard_map, what its body found (its `packed()`)."""
        scope = _config.current().check_scope
        enclosing = _frames.stack[-1] if _frames.stack else None
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
            if enclosing is not None:  # inside another shard_map's body
                enclosing.add(outer, rows)
            elif scope is None:
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


@contextlib.contextmanager
def recording_into(scope: Any) -> Iterator[None]:
    """Checks made in the block record into `scope` (a `Frame`, or a `checked`
    function's `Scope`), those inside any shard_map body JAX traces meanwhile too
    (`jax.shard_map` too, not only `jaxshard.shard_map`): see `_through_frame`."""
    with (
        _config.overriding(check_scope=scope),
        shard_map_outputs(_through_frame, _on_eager_shard_map),
    ):
        yield


@contextlib.contextmanager
def _on_eager_shard_map(mesh: Any) -> Iterator[None]:
    """An un-jitted `checked` function calls a shard_map over `mesh`, traced anew
    at each call: its checks' state goes there, if the call's arguments put it on no
    mesh, and lives until it is read (see `Scope.per_call`)."""
    scope = _config.current().check_scope
    if isinstance(scope, Frame) or scope is None:
        yield
        return
    scope.move_to(mesh)
    with scope.per_call():
        yield


def _through_frame(body: Callable) -> tuple[Any, Any, Callable | None]:
    """Traces a shard_map body (`body()`) with a `ShardMapFrame` collecting its
    checks: what they found leaves the shard_map as an extra output (the same on
    every device), recorded outside by `ShardMapFrame.forward`. A body without
    checks is left as it is (see `shard_map_outputs`)."""
    with shard_map_checks() as frame:
        out = body()
    if not frame.calls:
        return out, None, None
    return out, frame.packed(), frame.forward
