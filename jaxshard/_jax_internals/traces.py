"""What a trace holds: a jitted function's parameters, `jax.Ref`s made and read
inside and outside traces, the axes a value varies over in `shard_map`, and
ShardingTypeError by name; and the frames JAX leaves out of its tracebacks."""

import os
import sys
from typing import Any

import jax
from jax._src.core import (  # jax.extend.core's; see __init__
    find_top_trace,
    set_current_trace,
)
from jax.experimental.layout import Format


def jit_parameters(fn: Any) -> dict[str, Any] | None:
    """What `jax.jit` was given for `fn`, or `None` if `fn` is not a `jax.jit`
    function: `fun` (the function it wraps), `static_argnums`, `static_argnames`,
    `donate_argnums`, `donate_argnames`, and `keep_unused`, `compiler_options`,
    `device`, `backend`, `in_shardings` and `out_shardings` when they were given
    (the shardings as pytrees; an unspecified leaf is `None`, a leaf given a layout
    a `jax.experimental.layout.Format` again). Not `inline`, which only matters to a
    call inside a trace.

    Read from jit's own record of its parameters (`_jit_info`), which has no public
    equivalent; the same on jax 0.10.2 to 0.12.0.1.
    """
    info = getattr(fn, "_jit_info", None)
    fun = getattr(fn, "__wrapped__", None)
    if info is None or fun is None or not callable(getattr(fn, "trace", None)):
        return None
    names = ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames")
    try:
        out: dict[str, Any] = {name: tuple(getattr(info, name)) for name in names}
        out["fun"] = fun
        if info.keep_unused:
            out["keep_unused"] = True
        if info.compiler_options_kvs:
            out["compiler_options"] = dict(info.compiler_options_kvs)
        for name in ("device", "backend"):
            if getattr(info, name) is not None:
                out[name] = getattr(info, name)
        for side in ("in", "out"):
            shardings = getattr(info, f"{side}_shardings_leaves")
            layouts = getattr(info, f"{side}_layouts_leaves")
            given = (
                info.user_specified_in_shardings
                if side == "in"
                else not all(_unspecified(x) for x in shardings)
            )
            if not given and all(x is None for x in layouts):
                continue
            leaves = [
                x if layout is None else Format(layout, x)
                for x, layout in zip(
                    [None if _unspecified(x) else x for x in shardings], layouts
                )
            ]
            treedef = getattr(info, f"{side}_shardings_treedef")
            out[f"{side}_shardings"] = jax.tree_util.tree_unflatten(treedef, leaves)
    except (AttributeError, TypeError, ValueError):
        return None
    return out


def _unspecified(x: Any) -> bool:
    return type(x).__name__ == "UnspecifiedValue"


def is_sharding_type_error(e: BaseException) -> bool:
    """Whether `e` is JAX's `ShardingTypeError` (raised on Explicit axes where a
    result's sharding cannot be inferred), which JAX does not export; the same class
    on jax 0.10.2 to 0.12.0.1."""
    return any(c.__name__ == "ShardingTypeError" for c in type(e).__mro__)


# The trace JAX runs op by op in: `find_top_trace(())` is the current trace.
with jax.core.eval_context():
    _EVAL_TRACE = type(find_top_trace(()))


def in_trace() -> bool:
    """Whether JAX is tracing (inside jit, vmap, grad, ...) rather than running op by
    op."""
    return type(find_top_trace(())) is not _EVAL_TRACE


def new_ref_outside_traces(value, sharding=None) -> Any:
    """A `jax.Ref` holding `value` (placed with `sharding`), made outside every trace
    even while tracing (`jax.ensure_compile_time_eval` leaves vmap's trace in
    place)."""
    with jax.core.eval_context():
        return jax.new_ref(jax.device_put(value, sharding))


def current_trace() -> Any:
    """The innermost trace JAX is recording into."""
    return find_top_trace(())


def new_ref_in(trace: Any, value) -> Any:
    """A `jax.Ref` holding `value`, made in `trace` (an enclosing trace: a shard_map
    body, while the current one is, say, a scan body inside it)."""
    with set_current_trace(trace):
        return jax.new_ref(jax.numpy.asarray(value))


def ref_contents(ref) -> Any:
    """The array a `jax.Ref` holds, without running an operation (reading with
    `ref[...]` costs a dispatch per Ref, which adds up over a thousand checks)."""
    return ref._refs._buf


def set_ref_contents(ref, value) -> None:
    """Replaces the array a `jax.Ref` holds with `value` (of the same type and
    placement), without running an operation.

    From jax 0.11 on a Ref's buffer is committed to its devices, and the runtime
    refuses an uncommitted replacement: `value` is committed to the same placement
    first (no copy when it is already there).
    """
    old = ref._refs._buf
    if old.committed and not value.committed:
        value = jax.device_put(value, old.sharding)
    ref._refs._buf = value


def varying_axes(x) -> set[str]:
    """The `shard_map` mesh axes over which `x` differs from device to device (its
    vma): `jax.typeof(x).manual_axis_type.varying` on jax 0.10.2 to 0.12.0.1."""
    manual_type = getattr(jax.typeof(x), "manual_axis_type", None)
    return set(getattr(manual_type, "varying", ()))


def hide_from_jax_tracebacks() -> None:
    """Leaves jaxshard's frames out of the tracebacks JAX filters (an error raised
    by a check while JAX traces or compiles, out of a `jax.jit` call), as JAX leaves
    out its own, and the frames of `jax.monitoring`, through which JAX calls the
    listener that reports a compile's violations. flax and equinox do the same for
    their frames: `jax._src.traceback_util.register_exclusion`, the same on jax
    0.10.2 to 0.12.0.1; jaxshard's own errors leave those frames out too (see
    `_errors.hide_frames`)."""
    from jax._src import traceback_util

    from .._errors import hide_files

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    listener = jax.monitoring.record_event_duration_secs  # where JAX defines it
    monitoring = os.path.abspath(sys.modules[listener.__module__].__file__ or "")
    traceback_util.register_exclusion(package)
    traceback_util.register_exclusion(monitoring)
    hide_files(monitoring)
