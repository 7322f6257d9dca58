"""`jaxshard.checked`: a function whose value checks are read, and the modes:
"raise" reads the findings after each call, "deferred" keeps them until
`flush_checks()` (or the end of `deferred_checks()`), "off" compiles no check. Where
the findings live, and who reads them, is in `records`."""

import functools as ft
from collections.abc import Callable, Sequence
from typing import Any, overload

from .. import _config
from .._annotations import tensors
from .._errors import expect_callable, hide_frames, ShardingError, user_facing
from .._jax_internals import in_trace, jit_parameters
from .._sharding import diagnosis
from .._sharding.signature import _name
from .flags import thread
from .frames import _compiled, recording_into
from .inputs import with_input_checks
from .records import _inside_a_trace, Scope, take_deferred
from .sites import CheckError


@overload
def checked(
    fn: Callable, *, inputs_finite: bool | Sequence[str] = False
) -> Callable: ...


@overload
def checked(
    fn: None = None, *, inputs_finite: bool | Sequence[str] = False
) -> Callable[[Callable], Callable]: ...


def checked(fn: Any = None, *, inputs_finite: Any = False) -> Any:
    """Turns the `jaxshard.check`s made while running `fn` into error flags.

    Each check made while `fn` runs (inside `jax.jit`, `vmap`, loops, `grad`, ...)
    computes its predicate in the same compiled program and records what it found on
    the device. After the call, in the default "raise" mode, the checks' findings
    are read and a `jaxshard.CheckError` is raised listing every failed check, in
    program order. In "deferred" mode (`jaxshard.config(checks="deferred")`, or inside
    `jaxshard.deferred_checks()`) nothing is read: failures accumulate on the device
    until `jaxshard.flush_checks()`. In "off" mode checks are not even traced.

    Checks inside a `shard_map` body (`jax.shard_map`, also one that library code
    made before `fn` was wrapped, or `jaxshard.shard_map`) report too, with the
    failing device: while `fn` is traced, each shard_map body whose checks JAX traces
    returns what they found as an extra output (a shard_map without checks is left
    as it is; one run eagerly is jitted).

    A `jax.jit` function (`checked(jax.jit(f))`) runs as one program that also
    returns what its checks found, dispatched by JAX like any jitted function, with
    `f`'s static and donated arguments kept. For any other `fn`, the checks' state
    lives on the device between calls, as `jax.Ref`s its programs take.

    With donated arguments (`jax.jit(f, donate_argnums=...)`), a call that fails in
    "raise" mode has already consumed them: keep a copy of the state before the
    call (`jax.tree.map(jnp.copy, state)`) to roll back to, or use deferred mode with
    checkpoints (see "Donated arguments" in the value contracts guide).

    **Arguments:**

    - `fn`: any function, jitted or not. Put the jit inside: `checked(jax.jit(f))`.
        The checked function itself must be called outside `jax.jit`:
        `jax.jit(checked(f))` raises a `RuntimeError` when it is traced.
    - `inputs_finite`: `True` (every parameter) or a list of parameter names: their
        floating-point inputs are checked for NaN and infinity as the call starts
        (`check_finite`, in the same program). A report whose inputs failed names
        them as the origin in its first line ("the input 'batch' was not finite
        (origin); 9 checks after it failed and may follow from it") and lists them
        first: a bad batch, not a NaN loss and its gradients. Each such `Failure`
        has the parameter as its `origin`.

    **Returns:**

    A function with `fn`'s signature and return value.

    !!! Example

        ```python
        @jaxshard.checked(inputs_finite=["batch"])
        @jax.jit
        def step(params, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            jaxshard.check(jnp.isfinite(loss), "loss is {loss}", loss=loss)
            return update(params, grads)
        ```
    """
    if fn is None:  # `@jaxshard.checked(inputs_finite=...)`
        return ft.partial(checked, inputs_finite=inputs_finite)
    expect_callable("checked", fn)
    named = tensors.compiled_function(fn) or fn  # torchax.compile(f): f
    scope = Scope(_name(named))  # `train_step`, not `make.<locals>.train_step`
    run = with_input_checks(fn, inputs_finite, scope.name)
    compiled = _compiled(run, scope)

    @ft.wraps(fn)
    def wrapper(*args, **kwargs):
        __tracebackhide__ = True
        checks = _config.checks_mode()
        if checks == "off":
            return fn(*args, **kwargs)
        try:
            if compiled is not None:
                # The call on the host's fast path: every call pays for this, so no
                # scope is set (the program sets its own while it is traced, and an
                # unchanged context keeps the call on jit's fast path), and a call
                # from inside a trace is recognised by what it returns.
                out, found = compiled(*args, **kwargs)
                scope.found(found, checks)
                return out
            if in_trace():
                raise _inside_a_trace(scope.name)
            return _call(scope, run, checks == "deferred", args, kwargs)
        except ValueError as e:
            if not diagnosis.is_jit_mismatch(e):
                raise
            error = _jit_mismatch(scope.name, fn, args, kwargs)
            try:
                raise error from None
            except ShardingError:
                hide_frames(error)
                raise
        except Exception as e:
            hide_frames(e)  # a violation or a failed check: it ends at the call
            raise

    if compiled is not None:

        def lower(*args, **kwargs):
            """The program a call with these arguments runs in the mode in force,
            lowered, as `jax.jit(f).lower` (e.g. to read its HLO)."""
            if _config.current().checks == "off":
                return fn.lower(*args, **kwargs)
            return compiled.lower(*args, **kwargs)

        wrapper.lower = lower  # pyright: ignore[reportAttributeAccessIssue]
    wrapper.scope = scope  # pyright: ignore[reportAttributeAccessIssue]
    return wrapper


def _call(scope: Scope, run: Callable, deferred: bool, args, kwargs) -> Any:
    """A call of a `checked` function that is not a jit: its checks record into
    Refs of a `Flags` the scope lends (to the call, or in deferred mode to the
    thread until its flush). A call ending in an exception notes on it the checks
    it failed before it."""
    flags = scope.deferred() if deferred else scope.lend()
    call = flags.begin_call(args, kwargs)
    try:
        with recording_into(flags):
            out = run(*args, **kwargs)
    except Exception as e:
        flags.note(e, call, deferred)
        if not deferred:
            scope.give_back(flags)
        raise
    if deferred:
        return out
    failures = flags.take_failures(deferred=False)
    scope.give_back(flags)
    if failures:
        raise CheckError(failures, when=f" in {scope.name}")
    return out


def _jit_mismatch(name: str, fn: Callable, args: tuple, kwargs: dict) -> ShardingError:
    """jit's refusal of an argument laid out otherwise than its in_shardings, as an
    error naming the argument by its path."""
    params = jit_parameters(fn) or {}
    function = params.get("fun", fn)
    shardings = params.get("in_shardings")
    static = params.get("static_argnums", ())
    what = f"jaxshard.checked({name})"
    return ShardingError(
        diagnosis.jit_mismatch(what, function, shardings, args, kwargs, static)
    )


@user_facing
def flush_checks() -> None:
    """Reads the flags of every `checked` function this thread called in deferred
    mode since its last flush, and raises `jaxshard.CheckError` listing every
    failure (with the call where each first failed). Call indices start again from 0
    afterwards. Each thread has its own: a flush reads none of another thread's
    calls."""
    failures = take_deferred()
    if failures:
        raise CheckError(failures, when=" (deferred)")


class deferred_checks:
    """`with jaxshard.deferred_checks():` runs `checked` functions in deferred mode
    and flushes when the block ends: failures raise `jaxshard.CheckError` there, each
    with the index of the call (from 0 at the start of the block) where it first
    failed. The block is this thread's: calls from other threads are theirs. An
    exception leaving the block is not masked: the block's failures become a note
    on it, and none surfaces later."""

    def __enter__(self):
        thread.generation = object()
        self._config = _config.config(checks="deferred")
        self._config.__enter__()
        return self

    def __exit__(self, kind, value, traceback):
        self._config.__exit__(kind, value, traceback)
        if kind is None:
            try:
                flush_checks()
            except CheckError as e:
                hide_frames(e)  # it ends at the user's `with` block
                raise
        elif isinstance(value, Exception):
            _note_deferred(value)
        return False


def _note_deferred(error: Exception) -> None:
    """Notes on `error`, which left a `deferred_checks()` block, the block's
    failures (dropped if they cannot be read)."""
    try:
        failures = take_deferred()
    except Exception:  # the device's state is lost with the block's error
        return
    if failures:
        when = " (deferred) in the block before this exception"
        error.add_note(str(CheckError(failures, when=when)))
