"""Value contracts inside compiled code: `check`, `checked`, `CheckError`.

A check inside a `checked` call is an error flag: it computes its predicate, and
writes what it found (how many elements failed, where the first one is, the values
there) into a small `jax.Ref` of its own, on the device, in the same program. Nothing
waits for the device: in "raise" mode the `checked` wrapper reads one flag after each
call; in "deferred" mode nothing is read until `flush_checks()`. See
`_jax_internals.accumulate` for how the writes leave jit, scan, vmap and autodiff.
"""

import contextlib
import dataclasses
import functools as ft
import os
import string
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from . import _config
from ._check_state import (
    _decode,
    _encode,
    _INITIAL,
    _merge,
    _on,
    _reduce,
    _statistics,
    _words,
    BATCH,
    BATCH_DEPTH,
    CALL,
    COUNT,
    DEVICE,
    ELEMENT,
    EVALS,
    ITERATION,
    State,
    STATE_SIZE,
)
from ._jax_internals import (
    accumulate,
    context_mesh,
    current_trace,
    in_trace,
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

    def __str__(self):
        where = []
        if self.size > 1 or self.count > 1:
            where.append(f"{self.count} element{'s' if self.count != 1 else ''} failed")
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
        if self.call is not None:
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
        )


def _format(message: str, values: dict[str, Any]) -> str:
    try:
        return message.format(**values)
    except (KeyError, IndexError, ValueError):
        return message


def _caller() -> tuple[str, int]:
    """The file and line of the first frame outside jaxshard."""
    here = os.path.dirname(__file__)
    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(frame.f_code.co_filename) == here:
        frame = frame.f_back
    if frame is None:
        return "<unknown>", 0
    return frame.f_code.co_filename, frame.f_lineno


def _check_message(message: Any, values: dict[str, Any]) -> None:
    if not isinstance(message, str):
        raise TypeError(f"jaxshard.check: the message must be a str; got {message!r}.")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(message) if f]
    except ValueError as e:
        raise ValueError(f"jaxshard.check: cannot parse message {message!r}: {e}")
    missing = sorted({f.split(".")[0].split("[")[0] for f in fields} - set(values))
    if missing:
        raise ValueError(
            f"jaxshard.check: the message {message!r} refers to "
            f"{', '.join(map(repr, missing))}, which "
            f"{'is' if len(missing) == 1 else 'are'} not among the values passed: pass "
            "them as keyword arguments, e.g. "
            f"check(pred, {message!r}, {missing[0]}=...)."
        )


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
        self._pending: list["Findings"] = []
        self._folded: dict["Frame", Any] = {}
        self._counters: dict[Any, tuple[int, Any]] = {}

    def next_call(self) -> int:
        if self._generation != _generation[0]:
            self._generation = _generation[0]
            self._call = -1
        self._call += 1
        return self._call

    def run_compiled(self, compiled: Callable, mode: str, args, kwargs) -> Any:
        """Calls `compiled` (see `_compiled`) and keeps or reads what it found."""
        call = self.next_call()
        # The call index: the previous call's, plus one, computed on the device (a
        # transfer from the host would cost more than the rest of the wrapper).
        placement = _placement(args, kwargs)
        counted, counter = self._counters.get(placement, (None, None))
        if counted != call:
            counter = call if placement is None else jax.device_put(call, placement)
        out, findings = compiled(counter, *args, **kwargs)
        if placement is not None:
            self._counters[placement] = (call + 1, findings.next_call)
        if mode == "raise":
            if bool(findings.flag):  # the call's one wait for the device
                failures = findings.frame.failures(findings.states, deferred=False)
                raise CheckError(failures, when=f" in {self.name}")
            return out
        self._pending.append(findings)
        if len(self._pending) == _FOLD_EVERY:
            self._fold()
        return out

    def _fold(self) -> None:
        """Merges the pending calls' findings, on the device, into one state per
        frame: a small program every few calls rather than a read per call."""
        by_frame: dict["Frame", list] = {}
        for findings in self._pending:
            by_frame.setdefault(findings.frame, []).append(findings.states)
        self._pending = []
        for frame, calls in by_frame.items():
            if frame in self._folded:
                calls = [self._folded[frame], *calls]
            self._folded[frame] = (
                _fold_calls(tuple(calls)) if len(calls) > 1 else calls[0]
            )

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
        self._fold()
        failures = []
        for frame, states in self._folded.items():
            failures += frame.failures(states, deferred)
        self._folded = {}
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
        return NamedSharding(mesh, PartitionSpec())
    for leaf in jax.tree.leaves((args, kwargs)):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and len(sharding.device_set) > 1:
            return NamedSharding(sharding.mesh, PartitionSpec())
    return None


# --- compiled calls -------------------------------------------------------------------
#
# `checked(jax.jit(f))` runs as `jax.jit(run)`, where `run` calls the jitted `f` with
# its checks writing to Refs made inside the trace (a `Frame`), and returns their
# contents with `f`'s outputs. The program then has no Refs among its inputs, so JAX
# dispatches it through its C++ fast path, and nothing waits for the device: in
# "deferred" mode the findings of each call are merged on the device every few calls.


_FOLD_EVERY = 16


class Findings:
    """What one compiled call found: its frame's flag and its sites' states (packed
    in one array; a `jaxshard.shard_map` body returns them a group at a time). A
    pytree whose structure holds the frame, so the jit cache gives it back."""

    def __init__(self, frame: "Frame", flag: Any, states: Any, next_call: Any):
        self.frame, self.flag, self.states = frame, flag, states
        self.next_call = next_call  # the index of the next call, on the device


jax.tree_util.register_pytree_node(
    Findings,
    lambda f: ((f.flag, f.states, f.next_call), f.frame),
    lambda frame, children: Findings(frame, *children),
)


def _compiled(fn: Callable) -> Callable | None:
    """`fn` as a program that also returns its checks' findings, if `fn` is a
    `jax.jit` function (with the same static and donated arguments); else `None`."""
    params = jit_parameters(fn)
    if params is None:
        return None

    def run(call, *args, **kwargs):
        frame = Frame(call)
        with _config.overriding(check_scope=frame):
            out = fn(*args, **kwargs)
        findings = Findings(frame, frame.flag[...], frame.packed(), call + 1)
        return out, findings

    shift = lambda numbers: tuple(i + 1 for i in numbers)  # noqa: E731
    return jax.jit(
        run,
        static_argnums=shift(params["static_argnums"]),
        static_argnames=params["static_argnames"],
        donate_argnums=shift(params["donate_argnums"]),
        donate_argnames=params["donate_argnames"],
    )


@jax.jit
def _fold_calls(calls: tuple) -> Any:
    """The packed states of several calls of one program, merged: per site, the
    counts summed and the first failure from the earliest call that failed."""
    stacked = jnp.stack(calls)
    counts = stacked[:, :, COUNT]
    first = jnp.argmax(counts > 0, axis=0)
    picked = jnp.take_along_axis(stacked, first[None, :, None], axis=0)[0]
    return picked.at[:, COUNT].set(jnp.sum(counts, axis=0))


_generation = [0]  # bumped when deferred counting restarts: call indices start at 0
_deferred_scopes: "weakref.WeakSet[Scope]" = weakref.WeakSet()


def checked(fn: Callable) -> Callable:
    """Turns the `jaxshard.check`s made while running `fn` into error flags.

    Each check made while `fn` runs (inside `jax.jit`, `vmap`, loops, `grad`, ...)
    computes its predicate in the same compiled program and records what it found on
    the device. After the call, in the default "raise" mode, one flag is read and a
    `jaxshard.CheckError` is raised listing every failed check, in program order. In
    "deferred" mode (`jaxshard.config(checks="deferred")`, or inside
    `jaxshard.deferred_checks()`) nothing is read: failures accumulate on the device
    until `jaxshard.flush_checks()`. In "off" mode checks are not even traced.

    A `jax.jit` function (`checked(jax.jit(f))`) runs as one program that also
    returns what its checks found, dispatched by JAX like any jitted function, with
    `f`'s static and donated arguments kept. For any other `fn`, the checks' state
    lives on the device between calls, as `jax.Ref`s its programs take.

    **Arguments:**

    - `fn`: any function, jitted or not; `checked(jax.jit(f))` and
        `jax.jit(checked(f))`'s inner use both work. The wrapper itself must be called
        outside `jax.jit`.

    **Returns:**

    A function with `fn`'s signature and return value.

    !!! Example

        ```python
        @jaxshard.checked
        @jax.jit
        def step(params, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            jaxshard.check(jnp.isfinite(loss), "loss is {loss}", loss=loss)
            return update(params, grads)
        ```
    """
    scope = Scope(getattr(fn, "__qualname__", repr(fn)))
    compiled = _compiled(fn)

    @ft.wraps(fn)
    def wrapper(*args, **kwargs):
        __tracebackhide__ = True
        settings = _config.current()
        if settings.checks == "off":
            return fn(*args, **kwargs)
        if in_trace():
            raise RuntimeError(
                f"jaxshard.checked({scope.name}) was called inside a trace (inside "
                "jax.jit?). Call the checked function from outside jit, or put the "
                "jit inside: jaxshard.checked(jax.jit(f))."
            )
        if compiled is not None:
            with _config.overriding(check_scope=scope):
                out = scope.run_compiled(compiled, settings.checks, args, kwargs)
            if settings.checks != "raise":
                _deferred_scopes.add(scope)
            return out
        scope.begin_call(args, kwargs)
        with _config.overriding(check_scope=scope):
            out = fn(*args, **kwargs)
        if settings.checks == "raise":
            failures = scope.take_failures(deferred=False)
            if failures:
                raise CheckError(failures, when=f" in {scope.name}")
        else:
            _deferred_scopes.add(scope)
        return out

    wrapper.scope = scope  # pyright: ignore[reportAttributeAccessIssue]
    return wrapper


def flush_checks() -> None:
    """Reads the flags of every `checked` function called in deferred mode since the
    last flush, and raises `jaxshard.CheckError` listing every failure (with the call
    where each first failed). Call indices start again from 0 afterwards."""
    failures = []
    for scope in sorted(_deferred_scopes, key=lambda s: s.name):
        failures += scope.take_failures(deferred=True)
    _deferred_scopes.clear()
    _generation[0] += 1
    if failures:
        raise CheckError(failures, when=" (deferred)")


class deferred_checks:
    """`with jaxshard.deferred_checks():` runs `checked` functions in deferred mode
    and flushes when the block ends: failures raise `jaxshard.CheckError` there, each
    with the index of the call (from 0 at the start of the block) where it first
    failed. An exception leaving the block is not masked."""

    def __enter__(self):
        _generation[0] += 1
        self._config = _config.config(checks="deferred")
        self._config.__enter__()
        return self

    def __exit__(self, kind, value, traceback):
        self._config.__exit__(kind, value, traceback)
        if kind is None:
            flush_checks()
        return False


# --- check ----------------------------------------------------------------------------


def check(pred: Any, msg: str, /, **values: Any) -> None:
    """Asserts that `pred` holds, eagerly or inside compiled code.

    Eagerly, and wherever `pred` is known when the function is traced, a false
    predicate raises `jaxshard.CheckError` at once and a true one costs nothing.
    Otherwise the check becomes part of the compiled program: inside a
    `jaxshard.checked` call it is an error flag read after the call (see `checked`);
    elsewhere it falls back to raising through a host callback, which is slower and
    meant as a debugging aid.

    **Arguments:**

    - `pred`: a boolean scalar or array; an array means "every element is true".
    - `msg`: a message, a format string over `values`, e.g. `"loss is {loss}"`.
    - `**values`: arrays or scalars to show in the message: each is broadcast to
        `pred`'s shape, and the message shows them at the first failing element.

    !!! Example

        ```python
        jaxshard.check(tokens < vocab, "token {t} is out of range", t=tokens)
        ```
    """
    __tracebackhide__ = True
    _check(pred, msg, values)


def _check(
    pred: Any,
    msg: str,
    values: dict[str, Any],
    shape=None,
    pred_fn: Callable | None = None,
    operands: tuple = (),
) -> None:
    """`check`. `shape` is that of the array the predicate was computed from, when
    the predicate is a reshaped view of it (for the failing element's index). With
    `pred_fn`, `pred` is `pred_fn(*operands)`, which can be computed again where
    that is cheaper than keeping `pred`."""
    _check_many([(pred, msg, values, shape, pred_fn, operands)], *_caller())


def _check_many(entries: list[tuple], filename: str, lineno: int) -> None:
    """Several checks made at one place (`check_finite`'s leaves): their details
    share one `lax.cond`, so that passing costs one branch for all of them."""
    settings = _config.current()
    if settings.checks == "off":
        return
    traced = []
    for pred, msg, values, shape, pred_fn, operands in entries:
        _check_message(msg, values)
        if pred_fn is not None:
            # Unused below when traced (so removed as dead code): for shape and layout.
            pred = pred_fn(*operands)
        if not isinstance(pred, jax.core.Tracer):
            if any(map(_spans_processes, (pred, *values.values()))):
                _check_across_processes(pred, msg, values, filename, lineno)
            else:
                _check_now(pred, msg, values, filename, lineno)
            continue
        if not jnp.issubdtype(pred.dtype, jnp.bool_):
            raise TypeError(
                f"jaxshard.check: the predicate must be boolean; got {pred.dtype}. "
                "Write a comparison, e.g. `x > 0`."
            )
        values = {k: _broadcast(k, v, pred) for k, v in values.items()}
        if pred_fn is None:
            pred_fn, operands = _identity, (pred,)
        site = Site(
            message=msg,
            filename=filename,
            lineno=lineno,
            names=tuple(values),
            shape=tuple(pred.shape if shape is None else shape),
            device_axes=(),
            order=0,
            dtypes=tuple(v.dtype for v in values.values()),
        )
        traced.append((site, (pred_fn, operands, list(values.values()), pred.shape)))
    if not traced:
        return
    sites = [site for site, _ in traced]
    rows = []
    for site, ((count, element, device, *picked), axes) in zip(
        sites, _statistics([item for _, item in traced])
    ):
        site.device_axes = axes
        rows.append((count, element, device, jnp.int32(-1), _encode(picked)))
    scope = settings.check_scope
    frame = _frames.stack[-1] if _frames.stack else None
    if frame is not None and sites[0].device_axes:
        frame.add(sites, rows)
    elif isinstance(scope, Frame):
        scope.add(sites, rows)
    elif scope is None:
        for site, row in zip(sites, rows):
            _fallback(site, row)
    else:
        _record(scope, sites, rows)


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
    """Checks whose state lives in one trace: Refs made in it, whose contents the
    traced function returns. See `ShardMapFrame` and `_compiled`."""

    def __init__(self, call: Any = None):
        self.trace = current_trace()
        self.flag = new_ref_in(self.trace, np.zeros((), bool))
        self.call = jnp.zeros((), jnp.int32) if call is None else call
        self.groups: list[list[Site]] = []

    def add(self, sites: list[Site], rows: list[tuple]) -> None:
        make = ft.partial(new_ref_in, self.trace)
        state = State.new([s.words for s in sites], None, make)
        for row, site in enumerate(sites):
            site.state, site.row = state, row
        self.groups.append(sites)
        _accumulate(state, self.flag, self.call, rows)

    def contents(self) -> list:
        """The state of each group of sites, read at the end of the trace."""
        return [sites[0].state.ref[...] for sites in self.groups]

    def packed(self) -> Any:
        """Every site's state as one int32[sites, columns] array, a row per site (in
        program order) padded to the widest: one output of the program."""
        contents = self.contents()
        width = max((c.shape[1] for c in contents), default=STATE_SIZE)
        return jnp.concatenate(
            [jnp.zeros((0, width), jnp.int32)]
            + [jnp.pad(c, ((0, 0), (0, width - c.shape[1]))) for c in contents]
        )

    def failures(self, packed: Any, deferred: bool) -> list[Failure]:
        """The failures in `packed` (what `packed()` became), in program order."""
        packed = np.asarray(packed)
        sites = [site for group in self.groups for site in group]
        return [
            site.failure(row, deferred)
            for site, row in zip(sites, packed)
            if row[COUNT] > 0
        ]


class ShardMapFrame(Frame):
    """The checks inside one `jaxshard.shard_map` body. JAX cannot close a shard_map
    body over Refs from outside it, so the checks write to Refs made in the body, and
    the body returns their contents (the same on every device), which are then
    recorded outside as if the check had been made there."""

    def forward(self, contents: list) -> None:
        """Records, outside the shard_map, what its body found."""
        scope = _config.current().check_scope
        for sites, state in zip(self.groups, contents):
            outer = [dataclasses.replace(site, state=None) for site in sites]
            rows = [
                (
                    state[i, COUNT],
                    state[i, ELEMENT],
                    state[i, DEVICE],
                    jnp.where(state[i, EVALS] > 1, state[i, ITERATION], -1),
                    [state[i, STATE_SIZE + w] for w in range(site.words)],
                )
                for i, site in enumerate(sites)
            ]
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


def _check_now(pred, msg, values, filename, lineno) -> None:
    ok = np.asarray(pred)
    if ok.dtype != np.bool_:
        raise TypeError(
            f"jaxshard.check: the predicate must be boolean; got {ok.dtype}. Write a "
            "comparison, e.g. `x > 0`."
        )
    if ok.all():
        return
    fail = ~ok
    first = int(np.flatnonzero(fail.ravel())[0])
    index = np.unravel_index(first, ok.shape) if ok.shape else ()
    shown = {}
    for name, value in values.items():
        if isinstance(value, jax.core.Tracer):
            shown[name] = f"<{name}: traced>"
        else:
            v = np.asarray(value)
            shown[name] = (
                np.broadcast_to(v, ok.shape)[index].item() if v.shape else v.item()
            )
    raise CheckError(
        [
            Failure(
                message=_format(msg, shown),
                filename=filename,
                lineno=lineno,
                count=int(fail.sum()),
                size=int(ok.size),
                element=tuple(int(i) for i in index) if ok.shape else None,
                values=shown,
            )
        ]
    )


def _spans_processes(x: Any) -> bool:
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def _check_across_processes(pred, msg, values, filename, lineno) -> None:
    """An eager check of arrays spread over several processes. No process can read
    the others' data, so a compiled program computes the check's statistics, and
    every process gets the same scalars back, and raises the same error."""
    if not jnp.issubdtype(pred.dtype, jnp.bool_):
        raise TypeError(
            f"jaxshard.check: the predicate must be boolean; got {pred.dtype}. Write a "
            "comparison, e.g. `x > 0`."
        )
    names = tuple(values)

    def statistics(pred, values):
        values = [_broadcast(k, v, pred) for k, v in zip(names, values)]
        ((stats, _),) = _statistics([(_identity, (pred,), values, pred.shape)])
        count, element, _, *picked = stats
        return count, element, _encode(picked)

    count, element, words = jax.jit(statistics)(pred, list(values.values()))
    if int(count) == 0:
        return
    state = _INITIAL.copy()
    state[COUNT], state[ELEMENT] = int(count), int(element)
    site = Site(
        message=msg,
        filename=filename,
        lineno=lineno,
        names=names,
        shape=tuple(pred.shape),
        device_axes=(),
        order=0,
        dtypes=tuple(jnp.result_type(v) for v in values.values()),
    )
    row = np.concatenate([state, np.array([int(w) for w in words], np.int32)])
    raise CheckError([site.failure(row, deferred=False)])


def _identity(x):
    return x


def _broadcast(name: str, value: Any, pred) -> Any:
    """`value` as a scalar, or as an array of `pred`'s shape laid out as `pred` is."""
    value = jnp.asarray(value)
    if not value.shape:
        return value
    try:
        value = jnp.broadcast_to(value, pred.shape)
    except ValueError:
        raise ValueError(
            f"jaxshard.check: value {name!r} has shape {value.shape}, which does not "
            f"broadcast to the predicate's shape {pred.shape}."
        ) from None
    sharding = jax.typeof(pred).sharding
    if not sharding.mesh.empty and AxisType.Explicit in sharding.mesh.axis_types:
        if jax.typeof(value).sharding.spec != sharding.spec:
            value = jax.sharding.reshard(value, sharding)
    return value


# --- checks no `checked` call owns ----------------------------------------------------


def _fallback(site: Site, row: tuple) -> None:
    count, element, device, _, words = row
    jax.debug.callback(
        ft.partial(_raise_from_callback, site), count, element, device, *words
    )


def _raise_from_callback(site: Site, count, element, device, *words) -> None:
    count = np.asarray(count)
    if not count.any():
        return
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


# --- ready-made checks ----------------------------------------------------------------


def check_finite(tree: Any, name: str | None = None) -> None:
    """Checks that no leaf of `tree` holds NaN or infinity.

    Each floating-point leaf is its own check, so a failure names the leaves that hold
    non-finite values, by tree path, with how many they hold and the first one. Leaves
    that are not floating point are skipped.

    On a mesh whose axes are all Explicit, a replicated leaf is checked a slice per
    device rather than whole on every device: each device looks at its share, and
    one integer is combined across devices for the whole tree.

    **Arguments:**

    - `tree`: a pytree of arrays, e.g. gradients.
    - `name`: what to call the tree in messages (default `"tree"`).

    !!! Example

        ```python
        jaxshard.check_finite(grads, name="grads")
        ```
    """
    name = "tree" if name is None else name
    entries = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            continue
        where = name + jax.tree_util.keystr(path)
        message = f"{where} holds NaN or infinity (first: {{value}})"
        entries.append(
            (None, message, {"value": leaf}, jnp.shape(leaf), jnp.isfinite, (leaf,))
        )
    _check_many(entries, *_caller())


def check_range(
    x: Any, lo: Any = None, hi: Any = None, name: str | None = None
) -> None:
    """Checks `lo <= x <= hi` elementwise (either bound may be `None`).

    **Arguments:**

    - `x`: an array.
    - `lo`, `hi`: bounds, scalars or arrays broadcastable to `x`'s shape.
    - `name`: what to call `x` in the message (default `"value"`).

    !!! Example

        ```python
        jaxshard.check_range(tokens, 0, vocab_size - 1, name="token id")
        ```
    """
    if lo is None and hi is None:
        raise ValueError("jaxshard.check_range: give `lo`, `hi` or both.")
    name = "value" if name is None else name
    x = jnp.asarray(x)

    def within(x):
        ok = jnp.ones(x.shape, bool)
        if lo is not None:
            ok = ok & (x >= lo)
        if hi is not None:
            ok = ok & (x <= hi)
        return ok

    lo_text = "-inf" if lo is None else "{lo}"
    hi_text = "inf" if hi is None else "{hi}"
    bounds = {}
    if lo is not None:
        bounds["lo"] = lo
    if hi is not None:
        bounds["hi"] = hi
    _check(
        None,
        f"{name} {{x}} is outside [{lo_text}, {hi_text}]",
        {"x": x, **bounds},
        pred_fn=within,
        operands=(x,),
    )
