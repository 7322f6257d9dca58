"""Where value checks record what they found, and who reads it.

A `checked` function has a `Scope`. A jitted one runs as a program that makes its
checks' Refs itself, in a `Frame`, and returns their contents (`_compiled`); any other
keeps its checks' state in Refs that live between calls. A `jaxshard.shard_map` body
has a `ShardMapFrame`. Checks that no `checked` call owns raise from a host callback.
See `_jax_internals.accumulate` for how the writes leave jit, scan, vmap and autodiff.
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
from jax.sharding import NamedSharding, PartitionSpec

from . import _config
from ._check_state import (
    _any_failure,
    _decode,
    _encode,
    _INITIAL,
    _merge,
    _on,
    _reduce,
    _shared_details,
    _stacked,
    _statistics,
    _words,
    BATCH,
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
    jit_parameters,
    new_ref_in,
    new_ref_outside_traces,
    ref_contents,
    set_ref_contents,
)


class CheckError(Exception):
    """One or more value checks failed.

    The message lists every failed check in program order. `failures` holds them as
    `Failure`s, each with `.message`, `.filename`, `.lineno` and `.count`.
    """

    def __init__(self, failures: list["Failure"], *, when: str = ""):
        self.failures = failures
        count = len(failures)
        head = f"{count} check{'s' if count > 1 else ''} failed{when}:"
        super().__init__("\n".join([head, *(f"- {f}" for f in failures)]))


CheckError.__module__ = "jaxshard"


@dataclasses.dataclass(frozen=True)
class Failure:
    """A failed check.

    **Attributes:**

    - `message`: the check's message, formatted with the values of the first failing
        element.
    - `filename`, `lineno`: where `jaxshard.check` was called.
    - `count`: how many elements failed (summed over every evaluation: all vmap
        batch elements, loop iterations and calls since the flags were last read).
    - `size`: how many elements the predicate has, per evaluation.
    - `element`: the index of the first failing element in the predicate, or `None`
        for a scalar predicate.
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

    def __str__(self):
        where = []
        calls = self.calls or 1
        if self.size > 1:
            where.append(f"{self.count} element{'s' if self.count != 1 else ''} failed")
        elif self.count > calls:  # a scalar check evaluated in a loop or under vmap
            where.append(f"failed {self.count} times")
        if self.element is not None:
            where.append(f"first at element {list(self.element)}")
        if self.batch_index is not None:
            where.append(f"vmap batch index {list(self.batch_index)}")
        if self.iteration is not None:
            where.append(f"iteration {self.iteration}")
        if self.device is not None:
            where.append(
                "device " + ", ".join(f"{a}={i}" for a, i in self.device.items())
            )
        if self.call is not None and calls > 1:
            where.append(f"failed on {calls} calls, first at call {self.call}")
        elif self.call is not None:
            where.append(f"call {self.call}")
        place = f" [{'; '.join(where)}]" if where else ""
        return f"{self.message} ({self.filename}:{self.lineno}){place}"


# --- sites ----------------------------------------------------------------------------


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
        )


def _format(message: str, values: dict[str, Any]) -> str:
    try:
        return message.format(**values)
    except (KeyError, IndexError, ValueError):
        return message


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
        # Compiled calls: what each returned, not yet folded, and the folded state of
        # each of their frames (one per trace).
        self._pending: list[tuple[int, "Findings"]] = []
        self._folded: dict["Frame", Any] = {}

    def next_call(self) -> int:
        if self._generation != _generation[0]:
            self._generation = _generation[0]
            self._call = -1
        self._call += 1
        return self._call

    def run_compiled(self, compiled: Callable, mode: str, args, kwargs) -> Any:
        """Calls `compiled` (see `_compiled`) and keeps or reads what it found."""
        if mode == "raise":
            out, findings = compiled(*args, **kwargs)
            # The call's one wait for the device (`np.asarray` reads a flag in a
            # fraction of the time `bool` takes).
            if np.asarray(findings.flag):
                failures = findings.frame.failures(findings.states, deferred=False)
                raise CheckError(failures, when=f" in {self.name}")
            return out
        # The call's index stays on the host, with its findings, until they are
        # folded: nothing goes to the device with the call.
        call = self.next_call()
        out, findings = compiled(*args, **kwargs)
        self._pending.append((call, findings))
        if len(self._pending) == _FOLD_EVERY:
            self._fold()
        return out

    def _fold(self) -> None:
        """Merges the pending calls' findings, on the device, into one state per
        frame: a small program every few calls rather than a read per call."""
        by_frame: dict["Frame", list] = {}
        for call, findings in self._pending:
            by_frame.setdefault(findings.frame, []).append((call, findings.states))
        self._pending = []
        for frame, calls in by_frame.items():
            # Always _FOLD_EVERY calls, so that the merging program compiles once
            # per frame: the calls, then padding (a call index of -1).
            folded = self._folded.get(frame)
            if folded is None:  # nothing has failed yet
                zeros = (
                    x if x is None else np.zeros(x.shape, np.int32) for x in calls[0][1]
                )
                folded = _full(*zeros, np)
            padding = [(-1, calls[0][1])] * (_FOLD_EVERY - len(calls))
            index = np.array([c for c, _ in calls + padding], np.int32)
            merged = tuple(packed for _, packed in calls + padding)
            self._folded[frame] = _fold_calls(folded, merged, index)

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
        """The failures recorded so far, in program order; clears them. What the
        calls since the last fold found is merged here, on the host, where it is
        read anyway (no program to compile for the first flush)."""
        pending, self._pending = self._pending, []
        folded = {frame: np.asarray(x) for frame, x in self._folded.items()}
        self._folded = {}
        pending = [
            (call, frame, jax.device_get(packed))
            for call, frame, packed in (
                (call, findings.frame, findings.states) for call, findings in pending
            )
        ]
        frames = list(folded) + [f for _, f, _ in pending if f not in folded]
        failures = []
        for frame in dict.fromkeys(frames):
            calls = [(c, packed) for c, f, packed in pending if f is frame]
            merged = folded.get(frame)
            if calls:
                index = np.array([c for c, _ in calls], np.int32)
                packed = tuple(p for _, p in calls)
                merged = _merge_calls(merged, packed, index, np)
            failures += frame.failures(merged, deferred)
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
# `checked(jax.jit(f))` runs as `jax.jit(run)`, where `run` calls the jitted `f` with
# its checks writing to Refs made inside the trace (a `Frame`), and returns their
# contents with `f`'s outputs. The program then has no Refs among its inputs, so JAX
# dispatches it through its C++ fast path, and nothing waits for the device: in
# "deferred" mode the findings of each call are merged on the device every few calls.


_FOLD_EVERY = 64


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


def _compiled(fn: Callable) -> Callable | None:
    """`fn` as a program that also returns its checks' findings, if `fn` is a
    `jax.jit` function; else `None`.

    The program is `jax.jit` of the function `fn` wraps, with `fn`'s static and
    donated arguments and its `in_shardings` and `out_shardings` (a jitted function
    called inside it would close over the checks' Refs, and JAX cannot discharge
    those from a jit with shardings). It takes exactly `fn`'s arguments: the call's
    index stays on the host (see `Scope.run_compiled`)."""
    params = jit_parameters(fn)
    if params is None:
        return None
    fun = params["fun"]

    def run(*args, **kwargs):
        frame = Frame()
        with _config.overriding(check_scope=frame):
            out = fun(*args, **kwargs)
        # Deferred mode reads no flag (the settings are part of jit's cache key:
        # each mode is its own program), so its program has one output fewer.
        raising = _config.current().checks == "raise"
        packed = frame.packed()
        flag = frame.failed(packed) if raising else None
        return out, Findings(frame, flag, packed)

    kept = {k: v for k, v in params.items() if k not in ("fun", "out_shardings")}
    if "out_shardings" in params:
        kept["out_shardings"] = (params["out_shardings"], None)
    return jax.jit(run, **kept)


def _merge_calls(folded: Any, calls: tuple, index: Any, xp=jnp) -> Any:
    """`folded`, the merged state of a frame's sites (or `None`), merged with what
    several calls of its program found (each as `Frame.packed()` made it): per
    site, the counts summed and the first failure from the earliest call that
    failed. `index` holds the calls' indices, -1 for padding. `xp` is `jnp` on
    the device, `np` on the host."""
    once, states = (
        None if parts[0] is None else xp.stack(parts) for parts in zip(*calls)
    )
    stacked = _set(_full(once, states, xp), CALL, index[:, None], xp)
    valid = index != -1
    if folded is not None:
        stacked = xp.concatenate([folded[None], stacked])
        valid = xp.concatenate([xp.ones(1, bool), valid])
    counts = xp.where(valid[:, None], stacked[:, :, COUNT], 0)
    failed_calls = xp.where(valid[:, None], stacked[:, :, CALLS], 0)
    first = xp.argmax(counts > 0, axis=0)
    picked = xp.take_along_axis(stacked, first[None, :, None], axis=0)[0]
    picked = _set(picked, CALLS, xp.sum(failed_calls, axis=0), xp)
    return _set(picked, COUNT, xp.sum(counts, axis=0), xp)


def _set(x: Any, column: int, value: Any, xp=jnp) -> Any:
    """`x` with its last dimension's `column` set to `value` (broadcast)."""
    value = xp.broadcast_to(xp.asarray(value, np.int32), x.shape[:-1])[..., None]
    return xp.concatenate([x[..., :column], value, x[..., column + 1 :]], axis=-1)


# The merge on the device, between flushes: a small program every few calls.
_fold_calls = jax.jit(ft.partial(_merge_calls, xp=jnp))


_generation = [0]  # bumped when deferred counting restarts: call indices start at 0


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
        per check (`Item.screen`), made now on its own layout; or, for arrays of
        up to `_STACKED_SIZE` elements where no mesh of several devices is in
        context, one `any` over all of them, stacked. Other checks are evaluated
        now."""
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
            elif size <= _STACKED_SIZE and (mesh.empty or mesh.size == 1):
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
        """The failures in `packed` (what `packed()` or `_fold_calls` returned), in
        program order."""
        if isinstance(packed, tuple):
            packed = _full(*packed, np)
        packed = np.asarray(packed)
        failed = [
            (site, row) for site, row in zip(self.sites(), packed) if row[COUNT] > 0
        ]
        failed.sort(key=lambda pair: pair[0].order)
        return [site.failure(row, deferred) for site, row in failed]


def _rows(arrays: list) -> Any:
    """int32 matrices as one, their rows padded to the widest; `None` for none."""
    if not arrays:
        return None
    width = max(x.shape[1] for x in arrays)
    return jnp.concatenate(
        [jnp.pad(x, ((0, 0), (0, width - x.shape[1]))) for x in arrays]
    )


# A once-evaluated site's row: its statistics, then its value words.
_ONCE = 4  # COUNT, ELEMENT, DEVICE, ITERATION
# Checks on arrays of at most this many elements share their details, up to this
# many elements in all in one program (the branch that computes the details holds
# a copy of them); those on up to this many are tested together where they can be
# (see `Frame.add_checks`).
_SHARED_SIZE = 1 << 18
_SHARED_TOTAL = 1 << 20
_STACKED_SIZE = 4096


def _evaluated_once(rows: list[tuple]) -> Any:
    """The statistics of sites evaluated once, `(count, element, device,
    iteration, words)` each, as one int32[sites, 4 + words] array.

    Each statistic of a site goes into one column and nothing else, and everything
    derived from them waits for `_full`: XLA then fuses each site's few operations
    into the columns' concatenations, rather than compiling a kernel per site (the
    compile time of a thousand checks)."""
    sites = len(rows)
    columns = [_column([r[i] for r in rows]) for i in range(_ONCE)]
    width = max(len(row[4]) for row in rows)
    words = _column(
        [w for row in rows for w in [*row[4], *[0] * (width - len(row[4]))]]
    )
    return jnp.concatenate(
        [jnp.stack(columns, axis=1), jnp.reshape(words, (sites, width))], axis=1
    )


def _full(once: Any, states: Any, xp=jnp) -> Any:
    """The whole states (a row per site, in `Frame.sites()` order) from a frame's
    `(once, states)` (either may be `None`, and both may have leading dimensions,
    calls): a once-evaluated site's state is `_merge` of the initial state with its
    one evaluation. `xp` is `jnp` on the device, `np` on the host."""
    parts = []
    if once is not None:
        count, element, device, iteration = (once[..., i] for i in range(_ONCE))
        fails = (count > 0).astype(np.int32)
        zeros = xp.zeros_like(count)
        columns = [
            count,
            zeros + 1,  # EVALS
            zeros,  # LAST_CALL: the frame's call
            fails,  # CALLS
            fails - 1,  # LAST_FAILED: 0 (the call) if failed, else -1
            zeros,  # CALL
            xp.maximum(iteration, 0),  # ITERATION: the first evaluation if not given
            element,
            device,
        ]
        batch = xp.full(count.shape + (BATCH_DEPTH,), -1, np.int32)
        parts.append(
            xp.concatenate([xp.stack(columns, -1), batch, once[..., _ONCE:]], -1)
        )
    if states is not None:
        parts.append(states)
    width = max(x.shape[-1] for x in parts)
    pad = [(0, 0)] * (parts[0].ndim - 1)
    return xp.concatenate(
        [xp.pad(x, pad + [(0, width - x.shape[-1])]) for x in parts], axis=-2
    )


def _column(values: list) -> Any:
    """`values` (int32 scalars) as a vector: a NumPy constant if none is traced."""
    if not any(isinstance(v, jax.core.Tracer) for v in values):
        return np.asarray([np.asarray(v) for v in values], np.int32).reshape(-1)
    return _stacked([jnp.asarray(v, jnp.int32) for v in values])


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
