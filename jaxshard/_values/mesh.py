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

from .._jax_internals import is_batched
from .across import _across_devices, _in_whole
from .state import _BIG, _encode, _from_words, _words, Item
from .stats import (
    _axes_of,
    _by_layout,
    _combine_devices,
    _details,
    _first_failure,
    _flat_index,
    _linear_index,
    _locate,
    _manual_axes,
    _select,
    _stacked,
)


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
    block is repeated on other devices; `_share_statistics`), and one all-gather
    of those, a few int32 words per item, lets every device combine them alike
    (`_across_devices`; on many devices with many items, two rounds of one
    device's worth). Nothing else crosses devices.

    That costs a passing call one reduction over the shares of each shape and one
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
    keyed = [_keyed(item) for item in items]
    operands, starts, reads, like = _operands(items, keyed, carried, explicit)

    def words_of(i: int, values: list, which: list) -> list:
        """Item `i`'s values at the indices `which` (its `values`) as its row of
        `width` words, 0 elsewhere."""
        words: list = [np.int32(0)] * width
        for j, v in zip(which, values):
            words[columns[i][j] : columns[i][j + 1]] = _encode([v])
        return words

    # Where each item's carried values' words start in its row of words.
    places = [[int(columns[i][j]) for j in c] for i, c in enumerate(carried)]

    def local(mesh, specs):
        def on_blocks(*blocks):
            axes = [(a, mesh.shape[a]) for a in mesh.axis_names]
            checks = [
                _share_check(
                    item, key, c, blocks[at : at + 1 + len(read)], specs[at], axes
                )
                for item, key, at, read, c in zip(items, keyed, starts, reads, carried)
            ]
            count, first, words = _share_statistics(checks, places, width)
            blocks_of = [
                (blocks[at].shape, specs[at], check[0].size < blocks[at].size)
                for at, check in zip(starts, checks)
            ]
            count, first = _in_whole(count, first, blocks_of, mesh)
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
    return _plus_scalars(found, scalars, shape)


def _operands(items: list[Item], keyed: list[bool], carried: list, explicit: bool):
    """`(operands, starts, reads, like)`: per item, its operand, then the array
    values read where it fails (none for a keyed item, whose key tells them); where
    its operand is among the operands; the indices of the values it reads; and for
    each operand, the operand it is laid out as."""
    operands, starts, reads, like = [], [], [], []
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
    return operands, starts, reads, like


def _plus_scalars(found: Any, scalars: list, shape: tuple[int, int]) -> Any:
    """The matrix `found` with the words of scalar values added in their places."""
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
    """`(fail, values, kinds)`: what `_locate` takes to find the statistics of
    `item` over this device's share of its block (`blocks[0]`; the others, those of
    its array values, unless `keyed`; see `_share`)."""
    share = _share(blocks[0], spec, axes)
    fail = lax.bitwise_not(item.pred_fn(share))
    if keyed:
        kind, table = item.kinds
        shown = [np.zeros((), item.values[i].dtype) for i in carried]  # dtypes
        return fail, shown, (kind(share), table)
    return fail, [_share(p, spec, axes) for p in blocks[1:]], None


# On shares of up to this many elements, a check's reduction carries its values
# (see `_share_statistics`).
_CARRIED = 1 << 12


def _share_statistics(checks: list[tuple], places: list[list[int]], width: int):
    """`(count, first, words)` of `checks` (`(fail, values, kinds)` on this
    device's shares, as `_locate` takes them): how many elements failed and the
    first that did (row-major in the share, `_BIG` if none), int32 `[checks]`,
    and the values there, an int32 `[checks, width]` matrix, check `i`'s `j`-th
    value's words from column `places[i][j]` (0 elsewhere).

    XLA's CPU compiler spends about ten milliseconds on each kernel it makes, and
    a third of one on each operation in a kernel, so this makes few of both. The
    checks on shares of one shape share one variadic reduction, fused with their
    predicates (`_reduced`); the scalars it returns go straight into vectors,
    which costs no kernel (a concatenation of computed scalars costs one per
    scalar), and the rest is a few vector operations for all the checks."""
    n = len(checks)
    counts: list = [None] * n
    keys: list = [None] * n
    words: list = [np.int32(0)] * (n * width)  # row-major
    for same in _by_layout([check[0] for check in checks]):
        for i, (count, key, *picked) in zip(same, _reduced([checks[i] for i in same])):
            counts[i], keys[i] = count, key
            _, values, _ = checks[i]
            at = [
                p + w for v, p in zip(values, places[i]) for w in range(_words(v.dtype))
            ]
            for column, word in zip(at, picked):
                words[i * width + column] = word
    count, key = _vector(counts), _vector(keys)
    words = (
        lax.reshape(_vector(words), (n, width)) if width else np.zeros((n, 0), np.int32)
    )
    size = np.asarray([1 if k is None else len(k[1]) for _, _, k in checks], np.int32)
    if (size == 1).all():
        return count, key, words
    # With `kinds`: the least key tells the first failing element and the value
    # there, for every check at once.
    failed = lax.gt(count, np.int32(0))
    first = lax.select(failed, lax.div(key, size), lax.full_like(key, _BIG))
    kind = lax.rem(key, size)
    shown: dict = {}  # per table and dtype: the words there, and where each goes
    for i, (_, values, kinds) in enumerate(checks):
        for v, place in zip(values if kinds is not None else [], places[i]):
            if (kinds[1], v.dtype) not in shown:
                picked = _encode([_select(kind, kinds[1], v.dtype)])
                where = np.zeros((len(picked), n, width), bool)
                shown[kinds[1], v.dtype] = (picked, where)
            for w, here in enumerate(shown[kinds[1], v.dtype][1]):
                here[i, place + w] = True
    for picked, where in shown.values():
        for vector, here in zip(picked, where):
            vector = lax.broadcast_in_dim(vector, (n, width), (0,))
            words = lax.select(here, vector, words)
    return count, first, words


def _vector(scalars: list) -> Any:
    """int32 scalars, traced or not, as a vector: one concatenation."""
    parts = [
        lax.reshape(x, (1,))
        if isinstance(x, jax.core.Tracer)
        else np.full(1, x, np.int32)
        for x in scalars
    ]
    return lax.concatenate(parts, 0)


def _reduced(checks: list[tuple]) -> list[tuple]:
    """`(count, least key, *value words)` of each of `checks`, on shares of one
    shape: how many elements failed, the least key among them (the position, or
    with `kinds` the position and the kind: see `_locate`) and, for a check
    without `kinds`, the words of its values where it first failed (`_encode`).

    One variadic reduction counts and locates for all the checks; on shares of up
    to `_CARRIED` elements it also carries the values' words, and on larger ones
    a second reduction picks them where each check first failed (a reduction that
    carries values runs several times slower than one that only counts and
    locates)."""
    fail = checks[0][0]
    position = _flat_index(fail)
    axes = tuple(range(fail.ndim))
    carry = fail.size <= _CARRIED
    operands, inits, sizes = [], [], []
    for fail, values, kinds in checks:
        key = position
        if kinds is not None:
            key = lax.add(lax.mul(position, np.int32(len(kinds[1]))), kinds[0])
        words = _encode(values) if carry and kinds is None else []
        sizes.append(len(words))
        operands += [
            lax.convert_element_type(fail, jnp.int32),
            lax.select(fail, key, lax.full_like(key, _BIG)),
            *words,
        ]
        inits += [np.int32(0), np.int32(_BIG)] + [np.int32(0)] * len(words)

    def combine(a, b):
        out, at = [], 0
        for size in sizes:
            out += [lax.add(a[at], b[at]), lax.min(a[at + 1], b[at + 1])]
            if size:
                take = lax.le(a[at + 1], b[at + 1])
                out += [
                    lax.select(take, a[k], b[k]) for k in range(at + 2, at + 2 + size)
                ]
            at += 2 + size
        return tuple(out)

    reduced = lax.reduce(tuple(operands), tuple(inits), combine, axes)
    out, at = [], 0
    for size in sizes:
        out.append(list(reduced[at : at + 2 + size]))
        at += 2 + size
    if carry:
        return out
    # The values' words where each check first failed, in one more reduction.
    hot, rows = [], []
    for k, (fail, values, kinds) in enumerate(checks):
        if kinds is not None or not values:
            continue
        first = lax.min(out[k][1], np.int32(fail.size - 1))  # one if none failed
        here = lax.eq(position, lax.broadcast(first, fail.shape))
        for word in _encode(values):
            hot.append(lax.select(here, word, lax.full_like(word, 0)))
            rows.append(k)
    if hot:

        def add(a, b):
            return tuple(lax.add(x, y) for x, y in zip(a, b))

        zeros = (np.int32(0),) * len(hot)
        for k, word in zip(rows, lax.reduce(tuple(hot), zeros, add, axes)):
            out[k].append(word)
    return out


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


def _share(block, spec, axes):
    """This device's share of `block`: a slice of it (flattened) when the devices
    along the mesh axes `spec` does not use hold the same block, the `index`-th of
    as many slices as there are such devices (`index`, this device's row-major
    index along those axes: `_in_whole` knows the same)."""
    used = _axes_of(spec)
    others = [(a, n) for a, n in axes if a not in used]
    copies = int(np.prod([n for _, n in others]))
    if copies == 1 or block.size % copies:
        return block
    index = _linear_index(others)
    size = block.size // copies
    rows = lax.reshape(block, (copies, size))
    share = lax.dynamic_slice(
        rows, (index, np.int32(0)), (1, size), allow_negative_indices=False
    )
    return lax.reshape(share, (size,))
