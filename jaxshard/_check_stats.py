"""What a check computes when it runs: the statistics of one evaluation of its
predicate (how many elements failed, the first one, the values there), at the cost
of one reduction per check when nothing failed.

On one device, and inside `shard_map`, that reduction finds the statistics
(`_details`). On a mesh of several devices each device finds those of its own share
of the array, and one collective of a few integers per check combines them
(`_split_statistics`, for many checks at once): nothing is gathered. Inside
`shard_map` the statistics are combined over the manual axes (`_combine_devices`).
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
from ._jax_internals import is_batched, varying_axes


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
        found = dict(zip(large, _unstacked(split, *_split_statistics(mesh, split))))
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


def _unstacked(items: list[Item], counts, firsts, words) -> list[tuple]:
    """`(count, first element, *values at it)` of each item from `_split_statistics`'s
    arrays."""
    out = []
    for i, item in enumerate(items):
        picked, at = [], 0
        for v in item.values:
            n = _words(v.dtype)
            if jnp.shape(v):
                v = _from_words([words[i, at + k] for k in range(n)], v.dtype)
            picked.append(v)
            at += n
        out.append((counts[i], firsts[i], *picked))
    return out


def _whole_on_each_device(x) -> bool:
    """Whether each device computing with `x` holds it whole: on no mesh, on one
    whose axes other than `shard_map`'s manual ones have one device each, or on
    Explicit axes that `x`'s type does not split (outside `vmap`, whose batch may
    be split over them)."""
    sharding = jax.typeof(x).sharding
    mesh = sharding.mesh
    if mesh.empty:
        return True
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    split = {a for a, n in mesh.shape.items() if n > 1 and types[a] != AxisType.Manual}
    if not split:
        return True
    explicit = all(types[a] == AxisType.Explicit for a in split)
    return explicit and not is_batched(x) and not split & _axes_of(sharding.spec)


def _split_statistics(mesh, items: list[Item]) -> tuple[Any, Any, Any]:
    """`(counts, first elements, value words)` of the items' predicates, all of
    whose operands lie on `mesh`, as int32 `[items]`, `[items]` and `[items,
    words]` arrays (`_shared_details`'s), in one per-device computation with no
    branch (`_on_blocks`): each device finds the statistics of its share of each
    operand (a slice of its block where the block is repeated on other devices),
    and one all-gather of those, a few int32 words per item, lets every device
    combine them alike (`_across_devices`; on many devices with many items, two
    rounds of one device's worth). Nothing else crosses devices.

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
    # The words of scalar values, known outside.
    scalars = [
        w
        for i, item in enumerate(items)
        for w in words_of(
            i,
            [v for j, v in enumerate(item.values) if j not in carried[i]],
            [j for j in range(len(item.values)) if j not in carried[i]],
        )
    ]
    words = found[:, 2:]
    if any(isinstance(w, jax.core.Tracer) for w in scalars):
        traced = [jnp.asarray(w, jnp.int32) for w in scalars]
        words = words + _stacked(traced).reshape(len(items), width)
    elif any(np.any(w) for w in scalars):
        words = words + np.asarray(scalars, np.int32).reshape(len(items), width)
    return found[:, 0], found[:, 1], words


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


def _located(checks: list[tuple]) -> list[tuple]:
    """`_locate` of each of `checks`, those of one shape (and sharding) sharing
    reductions (`_located_groups`)."""
    out: list[Any] = [None] * len(checks)
    for same in _by_layout([check[0] for check in checks]):
        for group in _located_groups([(i, checks[i]) for i in same]):
            for (i, _), found in zip(group, _locate([c for _, c in group])):
                out[i] = found
    return out


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
    device = _linear_index([(a, mesh.shape[a]) for a in names])
    start = lax.dynamic_index_in_dim(
        jnp.asarray(base, jnp.int32), device, keepdims=False
    )
    position = start
    for k in range(ndim):
        coordinate = lax.rem(
            lax.div(first, below[k].astype(np.int32)), size[k].astype(np.int32)
        )
        position = position + coordinate * stride[k].astype(np.int32)
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


def _shared_details(items: list[Item]) -> tuple[Any, Any, Any]:
    """`(count, first element, value words)` of each item (an array predicate, in
    the trace of a `checked` program, on one device), as int32 `[items]`,
    `[items]` and `[items, words]` arrays, in a few operations whatever the number
    of items: the failing elements of the predicates of each size class (the next
    power of two) are stacked into one matrix, padded, with their values' words in
    matrices alike, and one variadic reduction per class counts, locates and picks
    the values for every row at once.

    On every call: XLA's CPU backend compiles and runs that in less time than a
    `lax.cond` that would skip it when nothing failed; for up to `_SELECTED` items,
    the reduction only counts and locates, and the values are read after
    (`located`). The matrices hold every item's elements: keep the items small."""
    width = max(sum(_words(v.dtype) for v in item.values) for item in items)
    classes: dict[int, list[int]] = {}
    for i, item in enumerate(items):
        size = int(np.prod(item.shape))
        classes.setdefault(1 << (size - 1).bit_length(), []).append(i)
    lengths = sorted(classes)
    order = [i for length in lengths for i in classes[length]]

    def failing(operands, length):
        rows = [
            _row(~items[i].pred_fn(operands[i]), length, False) for i in classes[length]
        ]
        return _stacked(rows, fused=4)

    def in_order(parts):
        out = jnp.concatenate(parts)
        return out if order == sorted(order) else out[np.argsort(order)]

    def details(operands, values):
        counts, firsts, words = [], [], []
        for length in lengths:
            members = classes[length]
            fails = failing(operands, length)
            per_item = [
                _value_words(items[i], values[i], length, width) for i in members
            ]
            columns = [
                _stacked([c[k] for c in per_item], fused=4) for k in range(width)
            ]
            index = lax.broadcasted_iota(jnp.int32, fails.shape, 1)
            count, first, *at = _first_failure(fails, index, columns, axis=1)
            counts.append(count)
            firsts.append(first)
            none = jnp.zeros((len(members), 0), jnp.int32)  # no value words
            words.append(jnp.stack(at, axis=1) if at else none)
        return tuple(in_order(x) for x in (counts, firsts, words))

    def located(operands, values):
        # Carrying the values in the reduction takes their words stacked into
        # matrices, a kernel to compile per four items; read after, they go into
        # the words in one elementwise operation (`_selected`).
        counts, firsts = [], []
        words: list = [None] * len(items)
        for length in lengths:
            fails = failing(operands, length)
            index = lax.broadcasted_iota(jnp.int32, fails.shape, 1)
            ((count, first),) = _count_least([fails], [index], axes=(1,))
            counts.append(count)
            firsts.append(first)
            for j, i in enumerate(classes[length]):
                at = jnp.minimum(first[j], int(np.prod(items[i].shape)) - 1)
                picked = [
                    lax.dynamic_index_in_dim(jnp.ravel(v), at, keepdims=False)
                    if jnp.shape(v)
                    else v
                    for v in values[i]
                ]
                words[i] = _encode(picked)
        return in_order(counts), in_order(firsts), jnp.asarray(_selected(words))

    operands = [item.operand for item in items]
    values = [item.values for item in items]
    return (located if len(items) <= _SELECTED else details)(operands, values)


def _stacked(rows: list, fused: int = 8) -> Any:
    """`jnp.stack(rows)`, `fused` at a time behind an optimisation barrier: XLA's
    CPU compiler fuses the operations making up to eight rows into their
    concatenation (one kernel), but compiles a kernel per row when more are
    concatenated at once, and a kernel costs milliseconds to compile. Rows of
    arrays go four at a time: jax 0.12's XLA compiles a kernel making eight such
    rows in more time than two making four each."""
    if len(rows) <= fused:
        return jnp.stack(rows)
    return jnp.concatenate(
        [
            lax.optimization_barrier(jnp.stack(rows[i : i + fused]))
            for i in range(0, len(rows), fused)
        ]
    )


# Up to this many rows go into one operation, `_selected`: the selects grow with the
# square of the rows. More once-evaluated sites go into concatenations (`_stacked`),
# more checks on small arrays carry their values in their reduction
# (`_shared_details`).
_SELECTED = 16


def _selected(rows: list[list]) -> Any:
    """`rows` (of int32 scalars, traced or not; missing ones 0) as an int32 array,
    in one elementwise operation: each element picks its value from a chain of
    selects on where it is. XLA compiles that as one kernel, where concatenating
    the values would take several (see `_stacked`), each milliseconds to
    compile."""
    shape = (len(rows), max(map(len, rows)))
    fixed = np.zeros(shape, np.int32)
    traced = []
    for i, row in enumerate(rows):
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


def _row(x, length: int, fill) -> Any:
    """`x` flattened, on every device (to be stacked with others), padded with
    `fill` to `length`."""
    sharding = jax.typeof(x).sharding
    if AxisType.Explicit in sharding.mesh.axis_types and any(sharding.spec):
        x = jax.sharding.reshard(x, NamedSharding(sharding.mesh, PartitionSpec()))
    x = jnp.ravel(x)
    return jnp.pad(x, [(0, length - x.size)], constant_values=fill)


def _value_words(item: Item, values: list, length: int, width: int) -> list:
    """The values of `item` as `width` columns of int32 words, each `[length]`: an
    element per element of its predicate (padded), a column per word."""
    words = [jnp.broadcast_to(w, item.shape) for w in _encode(values)]
    columns = [_row(w, length, 0) for w in words]
    return columns + [jnp.zeros(length, jnp.int32)] * (width - len(columns))


def _by_layout(arrays: list) -> list[list[int]]:
    """The indices of `arrays`, in order, per shape and sharding: those that can
    share a reduction."""
    classes: dict[Any, list[int]] = {}
    for i, x in enumerate(arrays):
        classes.setdefault((x.shape, jax.typeof(x).sharding), []).append(i)
    return list(classes.values())


def _split_mesh(operands: list) -> Any:
    """The mesh to split the operands' screening over: theirs, if they share one of
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
    used = {a for entry in spec if entry is not None for a in _names(entry)}
    others = [(a, n) for a, n in axes if a not in used]
    copies = int(np.prod([n for _, n in others]))
    if copies == 1 or block.size % copies:
        return (block, jnp.zeros((), jnp.int32)) if start else block
    index = _linear_index(others)
    share = lax.dynamic_index_in_dim(block.reshape(copies, -1), index, keepdims=False)
    return (share, index * share.size) if start else share


def _linear_index(axes: list[tuple[str, int]]) -> Any:
    """This device's row-major index along the mesh axes `axes` (name, size)."""
    index = jnp.zeros((), jnp.int32)
    for a, n in axes:
        index = index * n + lax.axis_index(a)
    return index


def _axes_of(spec) -> set[str]:
    return {a for entry in spec if entry is not None for a in _names(entry)}


def _names(entry) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _details(items: list[Item]) -> list[tuple]:
    """`(count, first failing element, *values there)` of each item's predicate on
    whole arrays, in one pass over them: predicates of one shape (and sharding),
    up to `_LOCATED` of them and `_LOCATED_SIZE` elements in all, in one variadic
    reduction (`_locate`)."""
    out: list[Any] = [None] * len(items)
    located: list[tuple[int, tuple]] = []
    for i, item in enumerate(items):
        # Only values are checked: no tangents reach the reduction.
        operand = lax.stop_gradient(item.operand)
        values = [lax.stop_gradient(v) for v in item.values]
        fail = jnp.logical_not(item.pred_fn(operand))
        if not item.shape:  # a scalar's first failing element is not reported
            out[i] = (fail.astype(jnp.int32), np.int32(-1), *values)
        elif not _whole_on_each_device(fail):  # a vmapped batch split over the mesh
            out[i] = _first_failure(fail, _flat_index(fail), values)
        else:
            kinds = item.kinds
            if kinds is not None and fail.size * len(kinds[1]) <= _BIG:
                kinds = (kinds[0](operand), kinds[1])
            else:
                kinds = None
            located.append((i, (fail, values, kinds)))
    for (i, (_, _, kinds)), found in zip(located, _located([c for _, c in located])):
        # The values are read where the predicate first failed as soon as that is
        # known: fused into a later operation (the findings' rows), the reads would
        # keep every checked array alive until then. Even so, one more reader of a
        # large array makes XLA's CPU runtime order the program's other operations
        # after it (a 3x1024 MLP's step takes 5% longer for a read of each
        # gradient): where it can, the reduction finds the value too
        # (`Item.kinds`), and nothing is read.
        out[i] = found if kinds is not None else lax.optimization_barrier(found)
    return out


# Up to this many predicates of one shape, and this many elements in all, share one
# reduction (`_details`): XLA's CPU compiler compiles a kernel reducing eight arrays
# in about three times the time of one reducing one (a third of the time per check,
# where a check compiles in about checkify's time alone), and runs it in no more
# time than eight such kernels. A predicate's array may then live until the last of
# its reduction's is made: `_LOCATED_SIZE` elements at most.
_LOCATED = 8
_LOCATED_SIZE = 1 << 18


def _located_groups(members: list) -> list[list]:
    """`members`, `(index, (fail, ...))` in program order, in runs that share a
    reduction: up to `_LOCATED` of them and `_LOCATED_SIZE` elements."""
    groups: list[list] = []
    for member in members:
        size = member[1][0].size
        last = groups[-1] if groups else None
        if last and len(last) < _LOCATED and (len(last) + 1) * size <= _LOCATED_SIZE:
            last.append(member)
        else:
            groups.append([member])
    return groups


def _locate(checks: list[tuple]) -> list[tuple]:
    """`(count, first failing element, *values there)` of each of `checks`, `(fail,
    values, kinds)`: `fail` (booleans, true where an element failed, held whole by
    each device; the same shape for every check), `values` (each a scalar or of
    `fail`'s shape) and `kinds` (or `None`), for checks that run on every call.

    One variadic reduction of two int32s per check, how many elements failed and
    the least position that did, finds the first failures of all the checks; the
    values are then read there. XLA's CPU compiler vectorises that reduction: it
    runs in 0.3x to 0.8x the time of a float sum over the same array, where one
    that also carries the values (`_first_failure`) takes six times as long. With
    `kinds`, `(kind, table)` (see `Item.kinds`: `kind` an int32 array of `fail`'s
    shape), the least of `position * len(table) + kind` tells the value too, and
    nothing is read."""
    fail = checks[0][0]
    position = _flat_index(fail)
    keys = [
        position if kinds is None else position * len(kinds[1]) + kinds[0]
        for _, _, kinds in checks
    ]
    reduced = _count_least([c[0] for c in checks], keys, tuple(range(fail.ndim)))
    out = []
    for (count, first), (_, values, kinds) in zip(reduced, checks):
        # Scalar work per check, in `lax` (`jnp`'s adds operations): a program's
        # checks make many such operations, and on a mesh each costs compile time.
        if kinds is not None:
            size = np.int32(len(kinds[1]))
            kind = lax.rem(first, size)
            first = lax.select(count > 0, lax.div(first, size), np.int32(_BIG))
            out.append(
                (count, first, *(_select(kind, kinds[1], v.dtype) for v in values))
            )
            continue
        at = lax.min(first, np.int32(fail.size - 1))  # an element if none failed
        coordinates = []
        for n in reversed(fail.shape):
            coordinates.insert(0, lax.rem(at, np.int32(n)))
            at = lax.div(at, np.int32(n))

        def read(x, coordinates=coordinates):
            return lax.dynamic_slice(x, coordinates, (1,) * x.ndim).reshape(())

        out.append((count, first, *(read(v) if jnp.shape(v) else v for v in values)))
    return out


def _count_least(fails: list, keys: list, axes: tuple) -> list[tuple]:
    """For each of `fails`, how many elements are true, and the least of its `keys`
    among them (`_BIG` if none), over `axes`: one variadic reduction of two int32s
    per array, of them all."""
    n = len(fails)

    def combine(a, b):
        counts = [x + y for x, y in zip(a[:n], b[:n])]
        return (*counts, *(jnp.minimum(x, y) for x, y in zip(a[n:], b[n:])))

    reduced = lax.reduce(
        (
            *(lax.convert_element_type(f, jnp.int32) for f in fails),
            *(
                lax.select(f, key, lax.full_like(key, _BIG))
                for f, key in zip(fails, keys)
            ),
        ),
        (np.int32(0),) * n + (np.int32(_BIG),) * n,
        combine,
        axes,
    )
    return list(zip(reduced[:n], reduced[n:]))


def _select(index, table: tuple, dtype) -> Any:
    """`table[index]` as `dtype`, elementwise (a gather would need the shardings of
    a vmapped `index` spelled out)."""
    out = jnp.full(jnp.shape(index), table[-1], dtype)
    for i, value in enumerate(table[:-1]):
        here = index == np.int32(i)
        out = lax.select(here, jnp.full(jnp.shape(index), value, dtype), out)
    return out


def _first_failure(fail, index, values, axis: int | None = None) -> tuple:
    """`(count, first failing index, *values there)` of `fail` (booleans, true
    where an element failed), `index` (the index to report for each element) and
    `values` (each a scalar or of `fail`'s shape), over `axis` (or all of them), in
    one variadic reduction that carries the values: the fewest operations to
    compile, for statistics computed only when something failed, or of small
    arrays (see `_locate`). It keeps no temporary array of `fail`'s size."""
    # As int32 words: XLA refuses a reduction over several float precisions.
    words = [_encode([v]) for v in values if v.shape]

    def combine(a, b):
        (count_a, first_a, *va), (count_b, first_b, *vb) = a, b
        take_a = first_a <= first_b
        picked = [lax.select(take_a, x, y) for x, y in zip(va, vb)]
        return (count_a + count_b, jnp.minimum(first_a, first_b), *picked)

    flat = [w for ws in words for w in ws]
    operands = (fail.astype(jnp.int32), jnp.where(fail, index, _BIG), *flat)
    inits = (np.int32(0), np.int32(_BIG)) + (np.int32(0),) * len(flat)
    axes = tuple(range(fail.ndim)) if axis is None else (axis,)
    count, first, *at = lax.reduce(operands, inits, combine, axes)
    at = iter(at)
    picked = [
        _from_words([next(at) for _ in range(len(_encode([v])))], v.dtype)
        if v.shape
        else v
        for v in values
    ]
    return (count, first, *picked)


def _flat_index(like):
    """The row-major index of each element of `like`, laid out as `like` is."""
    shape = like.shape
    sharding = jax.typeof(like).sharding
    explicit = not sharding.mesh.empty and AxisType.Explicit in sharding.mesh.axis_types
    kwargs = {"out_sharding": sharding} if explicit else {}
    flat = None
    stride = 1
    for d in reversed(range(len(shape))):
        term = lax.broadcasted_iota(jnp.int32, shape, d, **kwargs) * stride
        flat = term if flat is None else flat + term
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
    if not manual:
        return x
    names = tuple(a for a, _ in manual)
    varying = varying_axes(x) or set(names)
    missing = tuple(a for a in names if a not in varying)
    if missing:
        x = lax.pcast(x, missing, to="varying")
    return op(x, names)


def _combine_devices(count, first, picked, manual):
    device = _linear_index(manual)
    failing = jnp.where(count > 0, device, _BIG)
    first_device = _all_reduce(failing, manual, lax.pmin)
    mine = device == first_device

    def pick(x):
        return _all_reduce(jnp.where(mine, x, jnp.zeros((), x.dtype)), manual, lax.psum)

    # Summed over the axes the predicate differs across: along the others each device
    # holds the same elements, which count once.
    distinct = [(a, n) for a, n in manual if a in varying_axes(count)]
    total = _all_reduce(count, distinct, lax.psum) if distinct else count
    total = _all_reduce(total, manual, lax.pmax)  # the same on every device
    first_device = jnp.where(total > 0, first_device, -1).astype(jnp.int32)
    return total, pick(first), first_device, [pick(v) for v in picked]
