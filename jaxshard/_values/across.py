"""From each device's findings to the whole array's, on a mesh: where a device's
share starts in the whole array, a block repeated on several devices counted once
(`_in_whole`), and the devices' rows combined in one all-reduce (`_across_devices`).
"""

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from .state import _BIG
from .stats import (
    _all_reduce,
    _axes_of,
    _linear_index,
    _names,
)


def _in_whole(count, first, blocks: list[tuple], mesh) -> tuple[Any, Any]:
    """`(count, first)` of each item (int32 vectors, over this device's share of
    its block) as they count in the whole array: `first`, a row-major position in
    the share, becomes one in the whole array (`_BIG` where nothing failed), and a
    block repeated on other devices counts once, on the first of them. `blocks`
    holds, per item, `(block shape, spec, whether the share is a slice)`.

    All in a few vector operations: per device and item, where its block starts in
    the whole array (and whether it counts), and where its share starts in the
    block, are constants of a table, and the rest is arithmetic on the block's
    shape."""
    names = mesh.axis_names
    grid = np.indices([mesh.shape[a] for a in names]).reshape(len(names), -1)
    place = dict(zip(names, grid))  # each device's coordinate along each axis
    ndim = max(len(shape) for shape, _, _ in blocks)
    # Per item (dimensions aligned right, padded with ones): the block's sizes, the
    # size of the block below each dimension, and the strides of the whole array.
    size = np.ones((ndim, len(blocks)), np.int64)
    below, stride = np.ones_like(size), np.ones_like(size)
    base = np.zeros((grid.shape[1], len(blocks)), np.int64)  # where each block starts
    offset = np.zeros_like(base)  # where each share starts in its block
    for i, (shape, spec, sliced) in enumerate(blocks):
        entries = tuple(spec) + (None,) * (len(shape) - len(spec))
        whole = 1  # the whole array's stride along the dimension
        for d in reversed(range(len(shape))):
            k = ndim - len(shape) + d
            index, parts = np.zeros(grid.shape[1], np.int64), 1  # the block's
            for a in _names(entries[d]) if entries[d] is not None else ():
                index, parts = index * mesh.shape[a] + place[a], parts * mesh.shape[a]
            size[k, i], below[k, i] = shape[d], int(np.prod(shape[d + 1 :]))
            stride[k, i] = whole
            base[:, i] += index * shape[d] * whole
            whole *= shape[d] * parts
        # The device's index among those holding the same block (`_share`).
        others = [a for a in names if a not in _axes_of(spec)]
        repeat = np.zeros(grid.shape[1], np.int64)
        for a in others:
            repeat = repeat * mesh.shape[a] + place[a]
        if sliced:  # its share starts there in the block
            offset[:, i] = repeat * (np.prod(shape) // (repeat.max() + 1))
        else:
            base[repeat > 0, i] = -1  # a copy: counts nothing

    def constant(x):
        # One number where all items share it: a vector would be an operand of
        # the per-device computation, which costs its compile time.
        x = x.astype(np.int32)
        return x[0] if (x == x[0]).all() else x

    device = _linear_index([(a, mesh.shape[a]) for a in names])
    # A table even if its columns are alike: indexing a vector to a scalar start
    # made XLA's CPU compiler fail on some programs (jax 0.12).
    n = len(blocks)
    sliced = offset.any()
    table = np.concatenate([base, offset] if sliced else [base], 1).astype(np.int32)
    row = lax.dynamic_slice(
        table, (device, np.int32(0)), (1, table.shape[1]), allow_negative_indices=False
    )
    start = lax.reshape(lax.slice(row, (0, 0), (1, n)), (n,))
    if sliced:
        first = lax.add(first, lax.reshape(lax.slice(row, (0, n), (1, 2 * n)), (n,)))
    position = start
    for k in range(ndim):
        at = lax.div(first, constant(below[k]))
        coordinate = lax.rem(at, constant(size[k]))
        position = lax.add(position, lax.mul(coordinate, constant(stride[k])))
    counted = lax.ge(start, np.int32(0))
    failed = lax.bitwise_and(counted, lax.gt(count, np.int32(0)))
    return (
        lax.select(counted, count, lax.full_like(count, 0)),
        lax.select(failed, position, lax.full_like(position, _BIG)),
    )


# Up to this many int32 words (devices x words per device) cross the devices in one
# all-reduce; more, in two rounds of one device's worth each (`_across_devices`).
_GATHERED = 1 << 16


def _across_devices(count, first, words, axes) -> Any:
    """`[count, first failing element, *value words]` of each item in the whole
    arrays, an int32 `[items, 2 + words]` matrix, the same on every device, from
    each device's `count` and `first` (`[items]`, from `_in_whole`) and `words`
    (`[items, words]`): counts summed, the least first elements, and the values
    from the device holding it.

    Every device's statistics, each in its own place, in one all-reduce (an
    all-gather whose result JAX knows is the same on every device), where that is
    at most `_GATHERED` words, then combined in one reduction over the devices.
    Else one device's worth at a time in two rounds: the counts and the least
    first elements, then the values from the device holding it."""
    n, width = words.shape
    devices = int(np.prod([size for _, size in axes]))

    def column(x):
        return lax.reshape(x, (n, 1))

    if width:  # the words of a device that found nothing: 0
        found = lax.broadcast_in_dim(lax.lt(first, np.int32(_BIG)), words.shape, (0,))
        words = lax.select(found, words, lax.full_like(words, 0))
    if devices * n * (2 + width) <= _GATHERED:
        row = lax.concatenate([column(count), column(first), words], 1)
        places = lax.broadcasted_iota(jnp.int32, (devices, n, 2 + width), 0)
        mine = lax.eq(places, lax.broadcast(_linear_index(axes), places.shape))
        mine = lax.select(
            mine, lax.broadcast(row, (devices,)), lax.full_like(places, 0)
        )
        rows = _all_reduce(mine, axes, lax.psum)
        # Per item, in one reduction over the devices: the counts summed, the
        # least first element and the words of the device that found it (of
        # one that found nothing, 0, if none did).
        parts = [
            lax.reshape(lax.slice_in_dim(rows, c, c + 1, axis=2), (devices, n))
            for c in range(2 + width)
        ]

        def combine(a, b):
            take = lax.le(a[1], b[1])
            words = (lax.select(take, x, y) for x, y in zip(a[2:], b[2:]))
            return (lax.add(a[0], b[0]), lax.min(a[1], b[1]), *words)

        inits = (np.int32(0), np.int32(_BIG)) + (np.int32(0),) * width
        reduced = lax.reduce(tuple(parts), inits, combine, (0,))
        return lax.concatenate([column(x) for x in reduced], 1)
    counts = _all_reduce(count, axes, lax.psum)
    least = _all_reduce(first, axes, lax.pmin)
    holds = lax.bitwise_and(lax.eq(first, least), lax.lt(least, np.int32(_BIG)))
    holds = lax.broadcast_in_dim(holds, words.shape, (0,))
    values = lax.select(holds, words, lax.full_like(words, 0))
    values = _all_reduce(values, axes, lax.psum)
    return lax.concatenate([column(counts), column(least), values], 1)
