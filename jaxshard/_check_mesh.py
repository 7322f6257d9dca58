"""What checks compute on a mesh of several devices, and where each check's
statistics are found (`_statistics`).

Each device finds the statistics of its own share of each checked array, and one
collective of a few integers per check combines them (`_split_statistics`, for many
checks at once): nothing is gathered. On Explicit axes the shares are known when the
function is traced (a `shard_map`); on Auto axes, once XLA has laid the arrays out
(a custom partitioning): see `_on_blocks`.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ._check_state import _BIG, _encode, _from_words, _words, Item
from ._check_stats import (
    _all_reduce,
    _axes_of,
    _combine_devices,
    _details,
    _first_failure,
    _flat_index,
    _linear_index,
    _locate,
    _located,
    _manual_axes,
    _names,
    _stacked,
)
from ._jax_internals import is_batched


def _statistics(items: list[Item]) -> list[tuple]:
    """For each item: `((count, first element, device, *values at it), manual
    axes)` of one evaluation of its predicate; inside `shard_map`, combined over the
    manual mesh axes so every device agrees.

    On a mesh of several devices each device reduces its own share of each input,
    and one collective combines the devices' statistics (`_split_statistics`).
    Elsewhere (one device, inside `shard_map`, under `vmap`) a predicate's
    statistics cost one variadic reduction over it, shared with up to
    `_LOCATED` other predicates of its shape (`_details`). Neither has a
    branch."""
    manual = _manual_axes(items[0].operand)
    large = [i for i, item in enumerate(items) if item.shape]
    mesh = _split_mesh([items[i].operand for i in large]) if large else None
    found: dict[int, Any] = {}
    if mesh is not None:  # with no manual axes
        split = [items[i] for i in large]
        found = dict(zip(large, _unstacked(split, _split_statistics(mesh, split))))
    rest = [i for i in range(len(items)) if i not in found]
    found.update(zip(rest, _details([items[i] for i in rest])))
    result = []
    for count, first, *picked in (found[i] for i in range(len(items))):
        device = np.int32(-1)
        if manual:
            count, first, device, picked = _combine_devices(
                count, first, picked, manual
            )
        result.append(((count, first, device, *picked), tuple(manual)))
    return result


def _unstacked(items: list[Item], found) -> list[tuple]:
    """`(count, first element, *values at it)` of each item from
    `_split_statistics`'s matrix."""
    out = []
    for i, item in enumerate(items):
        picked, at = [], 2
        for v in item.values:
            n = _words(v.dtype)
            if jnp.shape(v):
                v = _from_words([found[i, at + k] for k in range(n)], v.dtype)
            picked.append(v)
            at += n
        out.append((found[i, 0], found[i, 1], *picked))
    return out


def _split_statistics(mesh, items: list[Item]) -> Any:
    """`[count, first failing element, *value words]` of each item's predicate,
    all of whose operands lie on `mesh`, as an int32 `[items, 2 + words]` matrix,
    in one per-device computation with no branch (`_on_blocks`): each device finds
    the statistics of its share of each operand (a slice of its block where the
    block is repeated on other devices), and one all-gather of those, a few int32
    words per item, lets every device combine them alike (`_across_devices`; on
    many devices with many items, two rounds of one device's worth). Nothing else
    crosses devices.

    That costs a passing call one reduction per item over its share and one
    collective. Screening the shares, combining the screens and computing the
    statistics behind a `lax.cond` on them cost the same collective, and 5% to 6%
    more of an MLP's training step on 8 of XLA's CPU devices (on jax 0.10.2 and
    0.12): its runtime runs the rest of the step around a branch less well than
    around a reduction.

    Whatever is per item is scalar work inside the computation; what it returns,
    and all that follows, is a few array operations for all the items: on a mesh,
    each operation outside costs XLA's compiler (its sharding propagation) a
    millisecond or more, whatever its size."""
    explicit = set(mesh.axis_types) == {AxisType.Explicit}
    # The values each item's row carries: its array values.
    carried = [[i for i, v in enumerate(item.values) if jnp.shape(v)] for item in items]
    # Where each value's words go in its item's row of words.
    columns = [
        np.cumsum([0, *(_words(v.dtype) for v in item.values)]) for item in items
    ]
    width = max(int(c[-1]) for c in columns)
    # Per item: its operand, then the array values read where it fails (none for a
    # keyed item, whose key tells them); where its operand is among them.
    operands, starts, reads, like = [], [], [], []
    keyed = [_keyed(item) for item in items]
    for item, key, c in zip(items, keyed, carried):
        operand = lax.stop_gradient(item.operand)
        sharding = jax.typeof(operand).sharding
        arrays = [] if key else c
        starts.append(len(operands))
        reads.append(arrays)
        like += [len(operands)] * (1 + len(arrays))
        operands.append(operand)
        for i in arrays:
            # Laid out as the operand, so that its blocks and theirs match.
            v = lax.stop_gradient(item.values[i])
            if explicit and jax.typeof(v).sharding.spec != sharding.spec:
                v = jax.sharding.reshard(v, sharding)
            operands.append(v)

    def words_of(i: int, values: list, which: list) -> list:
        """Item `i`'s values at the indices `which` (its `values`) as its row of
        `width` words, 0 elsewhere."""
        words: list = [np.int32(0)] * width
        for j, v in zip(which, values):
            words[columns[i][j] : columns[i][j + 1]] = _encode([v])
        return words

    def local(mesh, specs):
        def on_blocks(*blocks):
            axes = [(a, mesh.shape[a]) for a in mesh.axis_names]
            shares = [
                _share_check(
                    item, key, c, blocks[at : at + 1 + len(read)], specs[at], axes
                )
                for item, key, at, read, c in zip(items, keyed, starts, reads, carried)
            ]
            found = _located([check for check, _ in shares])
            n = len(items)
            row = _stacked(
                [f[0] for f in found]
                + [start + f[1] for (_, start), f in zip(shares, found)]
                + [
                    w
                    for i, f in enumerate(found)
                    for w in words_of(i, f[2:], carried[i])
                ]
            )
            blocks_of = [
                (blocks[at].shape, specs[at], check[0].size < blocks[at].size)
                for at, (check, _) in zip(starts, shares)
            ]
            count, first = _in_whole(row[:n], row[n : 2 * n], blocks_of, mesh)
            words = row[2 * n :].reshape(n, width)
            return (_across_devices(count, first, words, axes),)

        return on_blocks

    def whole(*operands):
        rows = []
        for i, (item, key, at, read) in enumerate(zip(items, keyed, starts, reads)):
            operand = operands[at]
            fail = jnp.logical_not(item.pred_fn(operand))
            if key:
                kind, table = item.kinds
                shown = [jnp.zeros((), item.values[j].dtype) for j in carried[i]]
                (found,) = _locate([(fail, shown, (kind(operand), table))])
            else:
                picked = list(operands[at + 1 : at + 1 + len(read)])
                found = _first_failure(fail, _flat_index(fail), picked)
            count, first, *values = found
            rows += [count, first, *words_of(i, values, carried[i])]
        return (_stacked(rows).reshape(len(items), 2 + width),)

    shape = (len(items), 2 + width)
    (found,) = _on_blocks(mesh, local, whole, operands, [shape], like)
    # The words of scalar values, known outside, in the matrix's places (with 0
    # for the count and first element).
    scalars = [
        w
        for i, item in enumerate(items)
        for w in [np.int32(0)] * 2
        + words_of(
            i,
            [v for j, v in enumerate(item.values) if j not in carried[i]],
            [j for j in range(len(item.values)) if j not in carried[i]],
        )
    ]
    if any(isinstance(w, jax.core.Tracer) for w in scalars):
        traced = [jnp.asarray(w, jnp.int32) for w in scalars]
        return found + _stacked(traced).reshape(shape)
    if any(np.any(w) for w in scalars):
        return found + np.asarray(scalars, np.int32).reshape(shape)
    return found


def _keyed(item: Item) -> bool:
    """Whether the least key of `item` (`Item.kinds`) tells both its first failing
    element and the value there, in int32."""
    return item.kinds is not None and np.prod(item.shape) * len(item.kinds[1]) <= _BIG


def _share_check(
    item: Item, keyed: bool, carried: list, blocks: tuple, spec, axes
) -> tuple:
    """`((fail, values, kinds), start)`: what `_locate` takes to find the
    statistics of `item` over this device's share of its block (`blocks[0]`; the
    others, those of its array values, unless `keyed`), and where the share starts
    in the block (row-major)."""
    share, start = _share(blocks[0], spec, axes, start=True)
    fail = lax.bitwise_not(item.pred_fn(share))
    if keyed:
        kind, table = item.kinds
        shown = [jnp.zeros((), item.values[i].dtype) for i in carried]  # dtypes
        return (fail, shown, (kind(share), table)), start
    return (fail, [_share(p, spec, axes) for p in blocks[1:]], None), start


def _in_whole(count, first, blocks: list[tuple], mesh) -> tuple[Any, Any]:
    """`(count, first)` of each item (int32 vectors, over this device's share of
    its block) as they count in the whole array: `first`, a row-major position in
    the block, becomes one in the whole array (`_BIG` where nothing failed), and a
    block repeated on other devices counts once, on the first of them. `blocks`
    holds, per item, `(block shape, spec, whether the share is a slice)`.

    All in a few vector operations: per device and item, where its block starts in
    the whole array (and whether it counts) is a constant of a table, and the rest
    is arithmetic on the block's shape."""
    names = mesh.axis_names
    grid = np.indices([mesh.shape[a] for a in names]).reshape(len(names), -1)
    place = dict(zip(names, grid))  # each device's coordinate along each axis
    ndim = max(len(shape) for shape, _, _ in blocks)
    # Per item (dimensions aligned right, padded with ones): the block's sizes, the
    # size of the block below each dimension, and the strides of the whole array.
    size = np.ones((ndim, len(blocks)), np.int64)
    below, stride = np.ones_like(size), np.ones_like(size)
    base = np.zeros((grid.shape[1], len(blocks)), np.int64)  # where each block starts
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
        if not sliced:
            others = [a for a in names if a not in _axes_of(spec)]
            repeat = np.zeros(grid.shape[1], np.int64)
            for a in others:
                repeat = repeat * mesh.shape[a] + place[a]
            base[repeat > 0, i] = -1  # a copy: counts nothing

    def constant(x):
        # One number where all items share it: a vector would be an operand of
        # the per-device computation, which costs its compile time.
        x = x.astype(np.int32)
        return x[0] if (x == x[0]).all() else x

    device = _linear_index([(a, mesh.shape[a]) for a in names])
    # A table even if its columns are alike: indexing a vector to a scalar start
    # made XLA's CPU compiler fail on some programs (jax 0.12).
    table = jnp.asarray(base.astype(np.int32))
    start = lax.dynamic_index_in_dim(table, device, keepdims=False)
    position = start
    for k in range(ndim):
        at = lax.div(first, constant(below[k]))
        coordinate = lax.rem(at, constant(size[k]))
        position = position + coordinate * constant(stride[k])
    counted = start >= 0
    failed = counted & (count > 0)
    return (
        lax.select(counted, count, jnp.zeros_like(count)),
        lax.select(failed, position, jnp.full_like(position, _BIG)),
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
    at most `_GATHERED` words. Else one device's worth at a time in two rounds: the
    counts and the least first elements, then the values from the device holding
    it."""
    n = count.shape[0]
    devices = int(np.prod([size for _, size in axes]))
    row = jnp.concatenate([count, first, words.reshape(-1)])
    if devices * row.size <= _GATHERED:
        places = lax.broadcasted_iota(jnp.int32, (devices, 1), 0)
        mine = jnp.where(places == _linear_index(axes), row, 0)
        rows = _all_reduce(mine, axes, lax.psum)
        counts = jnp.sum(rows[:, :n], axis=0)
        firsts = rows[:, n : 2 * n]
        least = jnp.min(firsts, axis=0)
        holds = (firsts == least) & (least < _BIG)
        words = rows[:, 2 * n :].reshape(devices, n, -1)
        values = jnp.sum(jnp.where(holds[:, :, None], words, 0), axis=0)
    else:
        counts = _all_reduce(count, axes, lax.psum)
        least = _all_reduce(first, axes, lax.pmin)
        holds = (first == least) & (least < _BIG)
        values = _all_reduce(jnp.where(holds[:, None], words, 0), axes, lax.psum)
    return jnp.concatenate([counts[:, None], least[:, None], values], axis=1)


def _split_mesh(operands: list) -> Any:
    """The mesh to split the operands' statistics over: theirs, if they share one of
    several devices with no manual axes, and none is batched by `vmap`."""
    meshes = {jax.typeof(x).sharding.mesh for x in operands}
    if len(meshes) != 1:
        return None
    (mesh,) = meshes
    if mesh.empty or mesh.size == 1 or AxisType.Manual in mesh.axis_types:
        return None
    if any(map(is_batched, operands)):
        return None
    return mesh


def _on_blocks(
    mesh,
    local: Callable,
    whole: Callable,
    operands: list,
    outputs: list[tuple],
    like: list[int] | None = None,
):
    """`local(mesh, specs)(*blocks)` on each device's blocks of `operands`, which
    returns arrays of the shapes `outputs` that are the same on every device;
    `whole` computes the same on whole arrays.

    On Explicit axes the blocks are known at trace time: a `shard_map`. On Auto
    axes XLA lays the operands out after tracing: a custom-partitioned operation,
    which constrains no operand's layout (every dimension is a reduction factor) and
    which the partitioner calls back with the layouts it chose. Operand `i` is laid
    out as operand `like[i]` (of the same shape), if given."""
    if set(mesh.axis_types) == {AxisType.Explicit}:
        specs = tuple(jax.typeof(x).sharding.spec for x in operands)
        out_specs = (PartitionSpec(),) * len(outputs)
        return jax.shard_map(
            local(mesh, specs), mesh=mesh, in_specs=specs, out_specs=out_specs
        )(*operands)

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        shardings = tuple(s.sharding for s in arg_shapes)
        replicated = (NamedSharding(mesh, PartitionSpec()),) * len(outputs)
        return mesh, local(mesh, [s.spec for s in shardings]), replicated, shardings

    names = iter(f"d{i}" for i in range(sum(x.ndim for x in operands)))
    factors: list[str] = []
    for i, x in enumerate(operands):
        j = i if like is None else like[i]
        tied = j < i and operands[j].shape == x.shape
        factors.append(factors[j] if tied else " ".join(next(names) for _ in x.shape))
    made = [[f"o{k}_{d}" for d in range(len(shape))] for k, shape in enumerate(outputs)]
    op = custom_partitioning(whole)
    op.def_partition(
        partition,
        sharding_rule=", ".join(factors) + " -> " + ", ".join(map(" ".join, made)),
        reduction_factors=tuple(dict.fromkeys(" ".join(factors).split())),
        need_replication_factors=tuple(f for names in made for f in names),
    )
    return op(*operands)


def _share(block, spec, axes, start: bool = False):
    """This device's share of `block`: a slice of it when the devices along the mesh
    axes `spec` does not use hold the same block. With `start`, `(share, where it
    starts in the block, row-major)`."""
    used = _axes_of(spec)
    others = [(a, n) for a, n in axes if a not in used]
    copies = int(np.prod([n for _, n in others]))
    if copies == 1 or block.size % copies:
        return (block, jnp.zeros((), jnp.int32)) if start else block
    index = _linear_index(others)
    share = lax.dynamic_index_in_dim(block.reshape(copies, -1), index, keepdims=False)
    return (share, index * share.size) if start else share
