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
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from . import _config
from ._jax_internals import (
    accumulate,
    context_mesh,
    current_trace,
    in_trace,
    new_ref_in,
    new_ref_outside_traces,
)


BATCH_DEPTH = 4  # vmap levels whose batch index a failure reports
# The int32 state of a check site:
COUNT, CALL, ITERATION, ELEMENT, DEVICE, EVALS, LAST_CALL, BATCH = range(8)
STATE_SIZE = BATCH + BATCH_DEPTH
_INITIAL = np.array([0, -1, -1, -1, -1, 0, -1] + [-1] * BATCH_DEPTH, np.int32)
_BIG = np.iinfo(np.int32).max


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


# --- sites --------------------------------------------------------------------------


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
    state: Any = None  # Ref of int32[STATE_SIZE]
    placement: Any = None  # its sharding, None for the default device
    values: tuple = ()  # Refs, one per value

    def failure(self, state: np.ndarray, values: list[Any], deferred: bool) -> Failure:
        values_at = dict(zip(self.names, (v.item() for v in values)))
        size = int(np.prod(self.shape))
        element = None
        if self.shape and state[ELEMENT] >= 0:
            element = tuple(int(i) for i in np.unravel_index(state[ELEMENT], self.shape))
        batch = tuple(int(b) for b in state[BATCH:] if b >= 0) or None
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
            f"{', '.join(map(repr, missing))}, which {'is' if len(missing) == 1 else 'are'}"
            " not among the values passed: pass them as keyword arguments, e.g. "
            f"check(pred, {message!r}, {missing[0]}=...)."
        )


# --- scopes: who reads the flags --------------------------------------------------------


class Scope:
    """The flags of one `checked` function: its sites and, for each placement of its
    state (the devices its programs run on), a flag raised by any of its checks and a
    call counter."""

    def __init__(self, name: str):
        self.name = name
        self.sites: list[Site] = []
        self.placement: Any = None  # where this call's programs run
        self._refs: dict[Any, tuple[Any, Any]] = {}
        self._generation = -1
        self._lock = threading.Lock()

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
        with _on(self.placement):
            if self._generation != _generation[0]:
                self._generation = _generation[0]
                for placement, (_, old) in self._refs.items():
                    with _on(placement):
                        old[...] = jnp.full((), -1, jnp.int32)
            calls[...] = calls[...] + 1

    def add(self, site: Site) -> None:
        with self._lock:
            site.order = len(self.sites)
            self.sites.append(site)

    def take_failures(self, deferred: bool) -> list[Failure]:
        """The failures recorded so far, in program order; clears them."""
        raised = []
        for placement, (flag, _) in self._refs.items():
            with _on(placement):
                if bool(flag[...]):
                    raised.append(placement)
        if not raised:
            return []
        failures = []
        for site in self.sites:
            if site.placement not in raised:
                continue
            with _on(site.placement):
                state = np.asarray(site.state[...])
                if state[COUNT] == 0:
                    continue
                values = [np.asarray(v[...]) for v in site.values]
                site.state[...] = jnp.asarray(_INITIAL)
            failures.append(site.failure(state, values, deferred))
        for placement in raised:
            flag, _ = self._refs[placement]
            with _on(placement):
                flag[...] = jnp.zeros((), bool)
        return failures


def _on(placement: Any):
    """Host-side reads and writes of state placed on a mesh happen in its context."""
    if isinstance(placement, NamedSharding):
        return jax.set_mesh(placement.mesh)
    return contextlib.nullcontext()


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


# --- check --------------------------------------------------------------------------


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
    settings = _config.current()
    if settings.checks == "off":
        return
    _check_message(msg, values)
    filename, lineno = _caller()
    if not isinstance(pred, jax.core.Tracer):
        _check_now(pred, msg, values, filename, lineno)
        return
    if not jnp.issubdtype(pred.dtype, jnp.bool_):
        raise TypeError(
            f"jaxshard.check: the predicate must be boolean; got {pred.dtype}. Write "
            "a comparison, e.g. `x > 0`."
        )
    values = {k: _broadcast(k, v, pred.shape) for k, v in values.items()}
    scope = settings.check_scope
    stats, axes = _statistics(pred, values)
    site = Site(
        message=msg,
        filename=filename,
        lineno=lineno,
        names=tuple(values),
        shape=tuple(pred.shape),
        device_axes=axes,
        order=0,
    )
    frame = _frames.stack[-1] if _frames.stack else None
    if frame is not None and axes:
        frame.add(site, stats)
    elif scope is None:
        _fallback(site, stats)
    else:
        _record(scope, site, (*stats[:3], -1, *stats[3:]))


def _record(scope: Scope, site: Site, stats: tuple) -> None:
    """Adds `site` to `scope` and accumulates one evaluation's `stats` (count,
    element, device, iteration, *values) into its state."""
    flag, calls = scope.refs()
    site.placement = scope.placement
    site.state = new_ref_outside_traces(_INITIAL, scope.placement)
    site.values = tuple(
        new_ref_outside_traces(np.zeros((), v.dtype), scope.placement)
        for v in stats[4:]
    )
    scope.add(site)
    count, element, device, iteration, *picked = stats
    batch = jnp.full((BATCH_DEPTH,), -1, jnp.int32)
    accumulate(
        (site.state, flag, *site.values),
        (count, element, batch, device, calls[...], jnp.int32(iteration), *picked),
        _merge,
        _reduce,
    )


class _Frames(threading.local):
    def __init__(self):
        self.stack: list["ShardMapFrame"] = []


_frames = _Frames()


class ShardMapFrame:
    """The checks inside one `jaxshard.shard_map` body. JAX cannot close a shard_map
    body over Refs from outside it, so the checks write to Refs made in the body, and
    the body returns their contents (the same on every device), which are then
    recorded outside as if the check had been made there."""

    def __init__(self):
        self.trace = current_trace()
        self.flag = new_ref_in(self.trace, np.zeros((), bool))
        self.sites: list[Site] = []

    def add(self, site: Site, stats) -> None:
        site.state = new_ref_in(self.trace, _INITIAL)
        site.values = tuple(new_ref_in(self.trace, np.zeros((), v.dtype)) for v in stats[3:])
        self.sites.append(site)
        count, element, device, *picked = stats
        batch = jnp.full((BATCH_DEPTH,), -1, jnp.int32)
        call = jnp.zeros((), jnp.int32)
        accumulate(
            (site.state, self.flag, *site.values),
            (count, element, batch, device, call, jnp.int32(-1), *picked),
            _merge,
            _reduce,
        )

    def contents(self) -> list:
        """What the body returns: every site's state, read at the end of the body."""
        return [(s.state[...], tuple(v[...] for v in s.values)) for s in self.sites]

    def forward(self, contents: list) -> None:
        """Records, outside the shard_map, what its body found."""
        scope = _config.current().check_scope
        for site, (state, values) in zip(self.sites, contents):
            stats = (
                state[COUNT],
                state[ELEMENT],
                state[DEVICE],
                jnp.where(state[EVALS] > 1, state[ITERATION], -1),
                *values,
            )
            outer = dataclasses.replace(site)
            if scope is None:
                _fallback(outer, (stats[0], stats[1], stats[2], *stats[4:]))
            else:
                _record(scope, outer, stats)


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
            shown[name] = np.broadcast_to(v, ok.shape)[index].item() if v.shape else v.item()
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


def _broadcast(name: str, value: Any, shape: tuple[int, ...]) -> Any:
    value = jnp.asarray(value)
    try:
        return jnp.broadcast_to(value, shape) if value.shape != shape else value
    except ValueError:
        raise ValueError(
            f"jaxshard.check: value {name!r} has shape {value.shape}, which does not "
            f"broadcast to the predicate's shape {shape}."
        ) from None


def _statistics(pred, values: dict[str, Any]):
    """(count, first element, device, *values at it) of one evaluation; inside
    `shard_map`, combined over the manual mesh axes so every device agrees."""
    fail = jnp.logical_not(pred)
    shape = pred.shape
    manual = _manual_axes(pred)

    def details(fail, *values):
        flat = _flat_index(shape)
        first = jnp.min(jnp.where(fail, flat, _BIG)).astype(jnp.int32)
        at = flat == first
        picked = [jnp.sum(jnp.where(at, v, jnp.zeros((), v.dtype))) for v in values]
        return (jnp.sum(fail, dtype=jnp.int32), first, *picked)

    def passing(fail, *values):
        # Inside shard_map the outputs vary over the same mesh axes as the inputs.
        zero = _varying_like(fail, jnp.zeros((), jnp.int32))
        return (
            zero,
            zero - 1,
            *(_varying_like(v, jnp.zeros((), v.dtype)) for v in values),
        )

    any_fail = jnp.any(fail)
    if manual:
        any_fail = _all_reduce(any_fail, manual, lax.pmax)
    # The details cost a few passes over the data: only when something failed.
    count, first, *picked = lax.cond(
        any_fail, details, passing, fail, *values.values()
    )
    device = jnp.full((), -1, jnp.int32)
    if manual:
        count, first, device, picked = _combine_devices(count, first, picked, manual)
    axes = tuple((a, n) for a, n in manual)
    return (count, first, device, *picked), axes


def _varying_like(source, x):
    vma = tuple(sorted(_varying(source)))
    return lax.pcast(x, vma, to="varying") if vma else x


def _varying(x) -> set[str]:
    """The shard_map mesh axes over which `x` differs from device to device."""
    manual_type = getattr(jax.typeof(x), "manual_axis_type", None)
    return set(getattr(manual_type, "varying", ()))


def _flat_index(shape: tuple[int, ...]):
    if not shape:
        return jnp.zeros((), jnp.int32)
    flat = jnp.zeros(shape, jnp.int32)
    stride = 1
    for d in reversed(range(len(shape))):
        flat = flat + lax.broadcasted_iota(jnp.int32, shape, d) * stride
        stride *= shape[d]
    return flat


def _manual_axes(x) -> list[tuple[str, int]]:
    mesh = jax.typeof(x).sharding.mesh
    if mesh.empty:
        return []
    return [
        (a, mesh.shape[a])
        for a, t in zip(mesh.axis_names, mesh.axis_types)
        if t == AxisType.Manual
    ]


def _all_reduce(x, manual, op):
    names = tuple(a for a, _ in manual)
    varying = _varying(x) or set(names)
    missing = tuple(a for a in names if a not in varying)
    if missing:
        x = lax.pcast(x, missing, to="varying")
    return op(x, names)


def _combine_devices(count, first, picked, manual):
    names = tuple(a for a, _ in manual)
    device = jnp.zeros((), jnp.int32)
    for a, n in manual:
        device = device * n + lax.axis_index(a)
    failing = jnp.where(count > 0, device, _BIG)
    first_device = _all_reduce(failing, manual, lax.pmin)
    mine = device == first_device

    def pick(x):
        return _all_reduce(jnp.where(mine, x, jnp.zeros((), x.dtype)), manual, lax.psum)

    total = _all_reduce(count, manual, lax.psum)
    first_device = jnp.where(total > 0, first_device, -1).astype(jnp.int32)
    return total, pick(first), first_device, [pick(v) for v in picked]


def _merge(refs, stats):
    state, flag, *olds = refs
    count, element, batch, device, call, iteration, *values = stats
    fails = count > 0
    first = (state[COUNT] == 0) & fails
    evals = jnp.where(state[LAST_CALL] == call, state[EVALS], 0)
    iteration = jnp.where(iteration >= 0, iteration, evals)
    new = jnp.stack(
        [
            state[COUNT] + count,
            jnp.where(first, call, state[CALL]),
            jnp.where(first, iteration, state[ITERATION]),
            jnp.where(first, element, state[ELEMENT]),
            jnp.where(first, device, state[DEVICE]),
            evals + 1,
            call,
        ]
    )
    new = jnp.concatenate([new, jnp.where(first, batch, state[BATCH:])])
    values = [jnp.where(first, v, old) for v, old in zip(values, olds)]
    return (new.astype(jnp.int32), flag | fails, *values)


def _reduce(count, element, batch, device, call, iteration, *values):
    has = count > 0
    first = jnp.argmax(has).astype(jnp.int32)
    index = jnp.where(jnp.any(has), first, -1).astype(jnp.int32)
    batch = jnp.concatenate([index[None], batch[first][: BATCH_DEPTH - 1]])
    return (
        jnp.sum(count, dtype=jnp.int32),
        element[first],
        batch,
        device[first],
        call[0],
        iteration[first],
        *(v[first] for v in values),
    )


# --- checks no `checked` call owns ------------------------------------------------------


def _fallback(site: Site, stats) -> None:
    count, element, device, *picked = stats
    jax.debug.callback(
        ft.partial(_raise_from_callback, site), count, element, device, *picked
    )


def _raise_from_callback(site: Site, count, element, device, *values) -> None:
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
    values = [np.asarray(v).ravel()[flat] for v in values]
    failure = site.failure(state, values, deferred=False)
    if batch is not None:
        failure = dataclasses.replace(failure, batch_index=batch)
    raise CheckError([failure], when=" (in a host callback: no jaxshard.checked call)")

