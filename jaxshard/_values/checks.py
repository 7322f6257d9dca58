"""Value contracts inside compiled code: `check` and the ready-made checks,
`check_finite` and `check_range`.

A check inside a `checked` call is an error flag: it computes its predicate, and
records what it found (how many elements failed, where the first one is, the values
there) on the device, in the same program. Nothing waits for the device: what reads
the findings is in `checked`.
"""

import os
import string
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from .. import _config
from .._annotations import tensors
from .._errors import expect
from .frames import _frames, Frame
from .mesh import _statistics
from .records import _fallback, _record
from .sites import _format, CheckError, Failure, Site
from .state import _encode, _INITIAL, COUNT, ELEMENT, Item
from .stats import _manual_axes


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


# --- check ----------------------------------------------------------------------------


def check(pred: Any, msg: str, /, **values: Any) -> None:
    """Asserts that `pred` holds, eagerly or inside compiled code.

    Eagerly, and wherever `pred` is known when the function is traced, a false
    predicate raises `jaxshard.CheckError` at once and a true one costs nothing.
    Otherwise the check becomes part of the compiled program: inside a
    `jaxshard.checked` call it is an error flag read after the call (see `checked`),
    inside a `shard_map` body too (`jax.shard_map` or `jaxshard.shard_map`: the
    report names the failing device); elsewhere it falls back to raising through a
    host callback, which is slower and meant as a debugging aid.

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
    expect(_is_array_like(pred), "check", "pred", "a boolean scalar or array", pred)
    pred = _jax_value("check", "pred", pred)
    values = {k: _jax_value("check", k, v) for k, v in values.items()}
    _check(pred, msg, values)


def _check(
    pred: Any,
    msg: str,
    values: dict[str, Any],
    shape=None,
    pred_fn: Callable | None = None,
    operand: Any = None,
) -> None:
    """`check`. `shape` is that of the array the predicate was computed from, when
    the predicate is a reshaped view of it (for the failing element's index). With
    `pred_fn`, `pred` is `pred_fn(operand)`, which can be computed again where
    that is cheaper than keeping `pred`."""
    _check_many([(pred, msg, values, shape, pred_fn, operand, None)], *_caller())


def _check_many(entries: list[tuple], filename: str, lineno: int) -> None:
    """Several checks made at one place (`check_finite`'s leaves): on a mesh of
    several devices their statistics cross the devices together."""
    settings = _config.current()
    if settings.checks == "off":
        return
    traced = []
    for pred, msg, values, shape, pred_fn, operand, kinds in entries:
        _check_message(msg, values)
        if pred_fn is not None:
            # Unused below when traced (so removed as dead code): for shape and layout.
            pred = pred_fn(operand)
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
        if pred.size == 0:  # no element can fail (and values would have none)
            continue
        values = {k: _broadcast(k, v, pred) for k, v in values.items()}
        if pred_fn is None:
            pred_fn, operand = _identity, pred
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
        item = Item(pred_fn, operand, list(values.values()), pred.shape, kinds)
        traced.append((site, item))
    if not traced:
        return
    sites = [site for site, _ in traced]
    scope = settings.check_scope
    items = [item for _, item in traced]
    if (
        isinstance(scope, Frame)
        and scope.owns_trace()
        and not _manual_axes(items[0].operand)
    ):
        scope.add_checks(sites, items)
        return
    rows = []
    for site, ((count, element, device, *picked), axes) in zip(
        sites, _statistics(items)
    ):
        site.device_axes = axes
        rows.append((count, element, device, jnp.int32(-1), _encode(picked)))
    frame = _frames.stack[-1] if _frames.stack else None
    if frame is not None and sites[0].device_axes:
        frame.add(sites, rows)
    elif sites[0].device_axes and scope is not None:
        raise RuntimeError(
            f"jaxshard.check at {filename}:{lineno} is inside a shard_map body that "
            "JAX traced where jaxshard could not give it an extra output for the "
            "check's flags, so they cannot leave the shard_map and "
            f"{getattr(scope, 'name', 'the jaxshard.checked function')} cannot "
            "report them. Under `jaxshard.checked`, jaxshard adds that output to "
            "every shard_map body that JAX traces into a jaxpr (under `jax.jit`, "
            "`scan`, `vmap`, autodiff) or runs eagerly, in the thread of the checked "
            "call; this one was traced otherwise (by a transformation that traces "
            "the body itself). Call the shard_map under `jax.jit` inside the checked "
            "function, or make the check outside the shard_map."
        )
    elif isinstance(scope, Frame):
        scope.add(sites, rows)
    elif scope is None:
        for site, row in zip(sites, rows):
            _fallback(site, row, in_shard_map=bool(site.device_axes))
    else:
        _record(scope, sites, rows)


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
        ((stats, _),) = _statistics([Item(_identity, pred, values, pred.shape)])
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


# --- ready-made checks ----------------------------------------------------------------


def _jax_value(function: str, name: str, x: Any) -> Any:
    """`x`, or the jax.Array behind it if it is a tensor on torchax's 'jax'
    device; a torch tensor elsewhere is refused."""
    value = tensors.jax_value(x)
    if value is tensors.ELSEWHERE:
        raise TypeError(
            f"jaxshard.{function}: {name} is a torch.Tensor on device "
            f"{str(x.device)!r}; checks run on JAX's devices. Put it on torchax's "
            "'jax' device (`t.to('jax')` inside `with torchax.default_env():`), or "
            "check it inside `torchax.compile`."
        )
    return value


def _is_array_like(x: Any) -> bool:
    """An array, a tracer, or a Python or NumPy number: what JAX takes as an array."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
        return True
    return hasattr(x, "shape") and hasattr(x, "dtype")


def check_finite(tree: Any, name: str | None = None) -> None:
    """Checks that no leaf of `tree` holds NaN or infinity.

    Each floating-point leaf is its own check, so a failure names the leaves that hold
    non-finite values, by tree path, with how many they hold and the first one. Leaves
    that are not floating point are skipped.

    On a mesh of several devices (Explicit or Auto axes), a replicated leaf is
    checked a slice per device rather than whole on every device: each device looks
    at its share, and the devices' findings for the whole tree cross in one
    all-reduce of a few integers per leaf (and one of an integer for leaves of up
    to 4,096 elements, whose details are computed only if one failed).

    **Arguments:**

    - `tree`: a pytree of arrays, e.g. gradients.
    - `name`: what to call the tree in messages (default `"tree"`).

    !!! Example

        ```python
        jaxshard.check_finite(grads, name="grads")
        ```
    """
    expect(name is None or isinstance(name, str), "check_finite", "name", "a str", name)
    name = "tree" if name is None else name
    entries = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        leaf = _jax_value("check_finite", name + jax.tree_util.keystr(path), leaf)
        expect(
            _is_array_like(leaf),
            "check_finite",
            "tree",
            f"a pytree of arrays; its leaf {name}{jax.tree_util.keystr(path)} is not",
            leaf,
        )
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            continue
        where = name + jax.tree_util.keystr(path)
        message = f"{where} holds NaN or infinity (first: {{value}})"
        kinds = _NON_FINITE if jnp.isrealobj(leaf) else None
        values = {"value": leaf}
        entries.append(
            (None, message, values, jnp.shape(leaf), jnp.isfinite, leaf, kinds)
        )
    _check_many(entries, *_caller())


def _non_finite_kind(x):
    """0 where `x` is NaN, 1 where it is inf, 2 where -inf (or finite)."""
    return jnp.where(jnp.isnan(x), 0, jnp.where(x > 0, 1, 2)).astype(jnp.int32)


# What a real leaf holds where `check_finite` fails, and which (`Item.kinds`).
_NON_FINITE = (_non_finite_kind, (float("nan"), float("inf"), float("-inf")))


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
    x = _jax_value("check_range", "x", x)
    lo = _jax_value("check_range", "lo", lo)
    hi = _jax_value("check_range", "hi", hi)
    for parameter, value in (("x", x), ("lo", lo), ("hi", hi)):
        if parameter == "x" or value is not None:
            expect(
                _is_array_like(value) and jnp.result_type(value) != jnp.bool_,
                "check_range",
                parameter,
                "a number or an array of numbers",
                value,
            )
    expect(name is None or isinstance(name, str), "check_range", "name", "a str", name)
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
    message = f"{name} {{x}} is outside [{lo_text}, {hi_text}]"
    if not all(map(_is_number, bounds.values())):
        # Array or traced bounds: the predicate is computed here, where they are,
        # not again on each device's block of `x`.
        _check(within(x), message, {"x": x, **bounds})
        return
    _check(None, message, {"x": x, **bounds}, pred_fn=within, operand=x)


def _is_number(x: Any) -> bool:
    """A Python or NumPy number: a constant that any block of an array can be
    compared with."""
    return isinstance(x, (int, float, np.generic)) or (
        isinstance(x, np.ndarray) and x.ndim == 0
    )
