"""The findings of a checked program, as rows: what its checks made in its own trace
return (`_evaluated_once`), those made whole states (`_full`), and the states of
calls in deferred mode added up on the host (`_add_found`); a call's rows read on the
host (`_read`).

A row per check site; the columns are those of `_check_state`'s state. `_full` runs
with `xp` either `jax.numpy` (inside a program) or `numpy` (on the host).
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._jax_internals import in_trace
from .state import BATCH_DEPTH, CALL, CALLS, COUNT, STATE_SIZE
from .stats import _SELECTED, _selected, _stacked


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
            # EVALS: 2 for a shard_map body's check in a loop, whose row gives the
            # iteration (`ShardMapFrame.forward`), so that the iteration shows.
            1 + (iteration >= 0).astype(np.int32),
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


def _add_found(found: np.ndarray | None, call_found: np.ndarray, call: int) -> Any:
    """The whole states `found` of a frame's sites over earlier calls (or `None`),
    with those of call number `call` (`_full` of what it returned) added, on the
    host: per site, the elements and the calls that failed summed, and the rest
    kept from its first failing call."""
    call_found[:, CALL] = np.where(call_found[:, COUNT] > 0, call, -1)
    if found is None:
        return call_found
    first = found[:, COUNT] == 0
    added = np.where(first[:, None], call_found, found)
    for column in (COUNT, CALLS):
        added[:, column] = found[:, column] + call_found[:, column]
    return added


def _read(packed: tuple[Any, Any]) -> tuple[tuple[Any, Any], bool]:
    """A call's rows, `(once, states)` (see `Frame.packed`), read from the device
    (the call's one wait: returning their count column too would be one more kernel
    to compile), and whether any check failed."""
    # `np.asarray` per array: `jax.device_get` of the pair takes 10 us more;
    # `np.count_nonzero`, a microsecond less than `.any()`.
    once, states = packed
    failed = False
    if once is not None:
        once = np.asarray(once)
        failed = np.count_nonzero(once[:, 0]) > 0
    if states is not None:
        states = np.asarray(states)
        failed = failed or np.count_nonzero(states[:, COUNT]) > 0
    return (once, states), failed


# The types of rows a call made outside every trace returns (see `_traced`).
_concrete: set[type] = {type(None)}


def _traced(packed: tuple[Any, Any]) -> bool:
    """Whether the call that returned the rows `packed` was traced (made inside
    `jax.jit`): asked after every compiled call, so a type lookup first."""
    once, states = packed
    if type(once) in _concrete and type(states) in _concrete:
        return once is None and states is None and in_trace()
    if isinstance(once, jax.core.Tracer) or isinstance(states, jax.core.Tracer):
        return True
    _concrete.update((type(once), type(states)))
    return False


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
    padded = [
        x if x.shape[1] == width else jnp.pad(x, ((0, 0), (0, width - x.shape[1])))
        for x in arrays
    ]
    return padded[0] if len(padded) == 1 else jnp.concatenate(padded)
