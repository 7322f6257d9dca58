"""What a check computes when it runs: the statistics of one evaluation of its
predicate (how many elements failed, the first one, the values there), at the cost
of one reduction per check when nothing failed.

On one device, and inside `shard_map`, that reduction finds the statistics
(`_details`), shared by the checks on arrays of one shape (`_located`); on one
device, checks on small arrays share a few for all of them (`_shared_details`).
Inside `shard_map` the statistics are combined over the manual axes
(`_combine_devices`). On a mesh of several devices, see `_check_mesh`.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from .._jax_internals import is_batched, varying_axes
from .state import _BIG, _encode, _from_words, _words, Item


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


def _located(checks: list[tuple]) -> list[tuple]:
    """`_locate` of each of `checks`, those of one shape (and sharding) sharing
    reductions (`_located_groups`)."""
    out: list[Any] = [None] * len(checks)
    for same in _by_layout([check[0] for check in checks]):
        for group in _located_groups([(i, checks[i]) for i in same]):
            for (i, _), found in zip(group, _locate([c for _, c in group])):
                out[i] = found
    return out


def _shared_details(items: list[Item]) -> Any:
    """`[count, first failing element, *value words]` of each item (an array
    predicate, in the trace of a `checked` program, on one device), as an int32
    `[items, 2 + words]` matrix (`_split_statistics`'s on a mesh), in a few
    operations whatever the number of items: the failing elements of the
    predicates of each size class (the next power of two) are stacked into one
    matrix, padded, with their values' words in matrices alike, and one variadic
    reduction per class counts, locates and picks the values for every row at
    once.

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
        return _found(in_order(counts), in_order(firsts), in_order(words))

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
        words = jnp.asarray(_selected(words))
        return _found(in_order(counts), in_order(firsts), words)

    operands = [item.operand for item in items]
    values = [item.values for item in items]
    return (located if len(items) <= _SELECTED else details)(operands, values)


def _found(counts, firsts, words) -> Any:
    """The `[count, first failing element, *value words]` rows of checks' statistics,
    from their columns."""
    return jnp.concatenate([jnp.stack([counts, firsts], axis=1), words], axis=1)


def _stacked(rows: list, fused: int = 8) -> Any:
    """`jnp.stack(rows)`, `fused` at a time behind an optimisation barrier: XLA's
    CPU compiler fuses the operations making up to eight rows into their
    concatenation (one kernel), but compiles a kernel per row when more are
    concatenated at once, and a kernel costs milliseconds to compile. Rows of
    arrays go four at a time: jax 0.12's XLA compiles a kernel making eight such
    rows in more time than two making four each."""

    def stack(rows):  # `jnp.stack` in `lax`: see `_locate`
        return lax.concatenate([lax.broadcast(r, (1,)) for r in rows], 0)

    if len(rows) <= fused:
        return stack(rows)
    return lax.concatenate(
        [
            lax.optimization_barrier(stack(rows[i : i + fused]))
            for i in range(0, len(rows), fused)
        ],
        0,
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
    # In `lax`: see `_locate`. (Comparing one flat position per element instead
    # compiled slower.)
    rows_at = lax.broadcasted_iota(jnp.int32, shape, 0)
    columns_at = lax.broadcasted_iota(jnp.int32, shape, 1)
    out = fixed
    for i, j, v in traced:
        here = lax.eq(rows_at, np.int32(i))
        here = lax.bitwise_and(here, lax.eq(columns_at, np.int32(j)))
        v = lax.broadcast(lax.convert_element_type(v, jnp.int32), shape)
        out = lax.select(here, v, out)
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


def _linear_index(axes: list[tuple[str, int]]) -> Any:
    """This device's row-major index along the mesh axes `axes` (name, size)."""
    index = None
    for a, n in axes:
        i = lax.axis_index(a)
        index = i if index is None else lax.add(lax.mul(index, np.int32(n)), i)
    return jnp.zeros((), jnp.int32) if index is None else index


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
            one = (1,) * x.ndim
            at = lax.dynamic_slice(x, coordinates, one, allow_negative_indices=False)
            return lax.reshape(at, ())

        out.append((count, first, *(read(v) if jnp.shape(v) else v for v in values)))
    return out


def _count_least(fails: list, keys: list, axes: tuple) -> list[tuple]:
    """For each of `fails`, how many elements are true, and the least of its `keys`
    among them (`_BIG` if none), over `axes`: one variadic reduction of two int32s
    per array, of them all."""
    n = len(fails)

    def combine(a, b):
        counts = [lax.add(x, y) for x, y in zip(a[:n], b[:n])]
        return (*counts, *(lax.min(x, y) for x, y in zip(a[n:], b[n:])))

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
    out = np.full(jnp.shape(index), table[-1], dtype)
    for i, value in enumerate(table[:-1]):
        here = lax.eq(index, np.int32(i))
        out = lax.select(here, np.full(jnp.shape(index), value, dtype), out)
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
        term = lax.broadcasted_iota(jnp.int32, shape, d, **kwargs)
        if stride != 1:
            term = lax.mul(term, np.int32(stride))
        flat = term if flat is None else lax.add(flat, term)
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
