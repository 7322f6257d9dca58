"""The findings of a checked program, as rows: what its checks made in its own trace
return (`_evaluated_once`), made whole states (`_full`), and the findings of several
calls merged (`_merge_calls`: on the device every few calls, on the host at a flush).

A row per check site; the columns are those of `_check_state`'s state. Everything
here runs with `xp` either `jax.numpy` (inside a program) or `numpy` (on the host).
"""

import functools as ft
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._check_state import _stacked, BATCH_DEPTH, CALL, CALLS, COUNT, STATE_SIZE


# A once-evaluated site's row: its statistics, then its value words.
_ONCE = 4  # COUNT, ELEMENT, DEVICE, ITERATION


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
    if not parts:  # a program with no checks
        return xp.zeros((0, STATE_SIZE), np.int32)
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


def _rows(arrays: list) -> Any:
    """int32 matrices as one, their rows padded to the widest; `None` for none."""
    if not arrays:
        return None
    width = max(x.shape[1] for x in arrays)
    return jnp.concatenate(
        [jnp.pad(x, ((0, 0), (0, width - x.shape[1]))) for x in arrays]
    )


def _merge_calls(folded: Any, calls: tuple, index: Any, xp=jnp) -> Any:
    """`folded`, the merged state of a frame's sites (or `None`), merged with what
    several calls of its program found (each as `Frame.packed()` made it): per
    site, the counts summed and the first failure from the earliest call that
    failed. `index` holds the calls' indices, -1 for padding. `xp` is `jnp` on
    the device, `np` on the host."""
    once, states = (
        None if parts[0] is None else xp.stack(parts) for parts in zip(*calls)
    )
    if once is None and states is None:  # a program with no checks
        return xp.zeros((0, STATE_SIZE), np.int32)
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
