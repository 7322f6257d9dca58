"""The findings of a checked program, as rows: what its checks made in its own trace
return (`_evaluated_once`), and those made whole states (`_full`).

A row per check site; the columns are those of `_check_state`'s state. Everything
here runs with `xp` either `jax.numpy` (inside a program) or `numpy` (on the host).
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._check_state import BATCH_DEPTH, CALL, CALLS, COUNT, STATE_SIZE
from ._check_stats import _stacked


# A once-evaluated site's row: its statistics, then its value words.
_ONCE = 4  # COUNT, ELEMENT, DEVICE, ITERATION


def _evaluated_once(rows: list[list]) -> Any:
    """The statistics of sites evaluated once, `[count, element, device,
    iteration, *words]` each (int32 scalars, traced or not), as one
    int32[sites, 4 + words] array.

    Each statistic of a site goes into one element and nothing else, and everything
    derived from them waits for `_full`: XLA then fuses each site's few operations
    into the one operation making the matrix (`_selected`, for a few sites) or the
    columns' concatenations, rather than compiling a kernel per site (the compile
    time of a thousand checks)."""
    if len(rows) <= _SELECTED:
        return _selected(rows)
    width = max(map(len, rows))
    rows = [[*r, *[0] * (width - len(r))] for r in rows]
    columns = [_column([r[i] for r in rows]) for i in range(_ONCE)]
    words = _column([w for r in rows for w in r[_ONCE:]])
    words = jnp.reshape(words, (len(rows), width - _ONCE))
    return jnp.concatenate([jnp.stack(columns, axis=1), words], axis=1)


# Up to this many once-evaluated sites go into one operation, `_selected`; more,
# into concatenations (`_stacked`): the selects grow with the square of the sites.
_SELECTED = 16


def _selected(rows: list[list], shape: tuple | None = None, start: int = 0) -> Any:
    """`rows` (of int32 scalars, traced or not; missing ones 0) as an int32 array
    of `shape`, from its row `start` (the rest 0), in one elementwise operation:
    each element picks its value from a chain of selects on where it is. XLA
    compiles that as one kernel, where concatenating the values would take
    several (see `_stacked`), each milliseconds to compile."""
    if shape is None:
        shape = (len(rows), max(map(len, rows)))
    fixed = np.zeros(shape, np.int32)
    traced = []
    for i, row in enumerate(rows, start):
        for j, v in enumerate(row):
            if isinstance(v, jax.core.Tracer):
                traced.append((i, j, v))
            else:
                fixed[i, j] = np.asarray(v)
    if not traced:
        return fixed
    rows_at = lax.broadcasted_iota(jnp.int32, shape, 0)
    columns_at = lax.broadcasted_iota(jnp.int32, shape, 1)
    out = jnp.asarray(fixed)
    for i, j, v in traced:
        here = (rows_at == i) & (columns_at == j)
        out = jnp.where(here, jnp.asarray(v, jnp.int32), out)
    return out


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


# In deferred mode the rows of a compiled call are added into states accumulated
# over calls (`_add_call`). A once-evaluated site's accumulated row is its `_ONCE`
# row with two columns inserted after the count: the calls on which it failed, and
# the call of its first failure. It becomes a whole state only on the host
# (`_from_accumulated`): the program merges a few columns, not whole states.
_SUMMED_ONCE = [0, 1]  # the count, and the calls that failed
_SUMMED_STATE = [COUNT, CALLS]
_CALL_ONCE = 2  # the call of the first failure


def _add_call(
    accumulated: Any, start: int, rows: list, matrices: list, states: Any
) -> Any:
    """`accumulated` with one call's findings (`Frame.parts()`) merged in, from
    row `start`: per site, counts and failing calls summed, and the call's failure
    kept if it is the site's first; and the call counted (row 0).

    One elementwise operation over the whole of `accumulated` (a few small
    rows) rather than slices and updates of it. A few once-evaluated sites' rows,
    lists of scalars, go straight into it (`_selected`)."""
    call = accumulated[0, 0]
    height, width = accumulated.shape
    if len(rows) > _SELECTED:
        rows, matrices = [], [_evaluated_once(rows), *matrices]
    summed = np.zeros(accumulated.shape, bool)  # where the columns summed are
    calls = np.zeros(accumulated.shape, bool)  # where the call goes
    fresh: Any = 0
    if rows:
        rows = [[r[0], _failed(r[0]), 0, *r[1:]] for r in rows]
        summed[start : start + len(rows), _SUMMED_ONCE] = True
        calls[start : start + len(rows), _CALL_ONCE] = True
        fresh = _selected(rows, accumulated.shape, start)
    # Rows of the accumulated layout, the columns summed, and the call's column.
    blocks = []
    for once in matrices:
        count = once[:, :1]
        zero = jnp.zeros_like(count)
        laid = jnp.concatenate([count, _failed(count), zero, once[:, 1:]], axis=1)
        blocks.append((laid, _SUMMED_ONCE, _CALL_ONCE))
    if states is not None:
        blocks.append((states, _SUMMED_STATE, CALL))
    if blocks:
        at = begin = start + len(rows)
        parts = []
        for block, columns, column in blocks:
            summed[at : at + block.shape[0], columns] = True
            calls[at : at + block.shape[0], column] = True
            parts.append(jnp.pad(block, ((0, 0), (0, width - block.shape[1]))))
            at += block.shape[0]
        padding = ((begin, height - at), (0, 0))
        fresh = fresh + jnp.pad(jnp.concatenate(parts), padding)
    fresh = jnp.where(calls, call, fresh)
    # A site that has not failed takes the call's row whole: if the call did not
    # fail either, the row is still one of a site that has not failed.
    first = accumulated[:, :1] == 0  # the count is column 0
    merged = jnp.where(
        summed, accumulated + fresh, jnp.where(first, fresh, accumulated)
    )
    counted = np.zeros(accumulated.shape, np.int32)
    counted[0, 0] = 1
    return merged + counted


def _failed(count: Any) -> Any:
    """1 where `count` (traced or not) is positive, else 0, as int32."""
    if isinstance(count, jax.core.Tracer):
        return (count > 0).astype(jnp.int32)
    return (np.asarray(count) > 0).astype(np.int32)


def _accumulated_width(rows: list, matrices: list, states: Any) -> int:
    """The columns `_add_call` writes for these findings (`Frame.parts()`)."""
    widths = [len(r) + 2 for r in rows] + [m.shape[1] + 2 for m in matrices]
    return max(widths + [0 if states is None else states.shape[1]])


def _from_accumulated(rows: np.ndarray, once: int) -> np.ndarray:
    """Whole states (as `_full` makes them) from a frame's accumulated rows, the
    first `once` of which are once-evaluated sites' (see `_add_call`)."""
    acc, states = rows[:once], rows[once:]
    compact = np.concatenate([acc[:, :1], acc[:, 3:]], axis=1)  # an `_ONCE` row
    full = _full(compact if once else None, states if len(states) else None, np)
    full[:once, CALLS] = acc[:, 1]
    full[:once, CALL] = acc[:, 2]
    return full


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
