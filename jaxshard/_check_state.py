"""What a check computes and keeps on the device: the statistics of one evaluation
(how many elements failed, where the first one is, the values there), and the state
each check site accumulates them into, one or two small `jax.Ref`s.

Everything here runs while a function is traced, except `State.read` and `_decode`,
which run on the host when the flags are read.
"""

import dataclasses
from collections.abc import Callable
from functools import reduce as functools_reduce
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType

from ._jax_internals import ref_contents


BATCH_DEPTH = 4  # vmap levels whose batch index a failure reports
# The int32 state of a check site. The first three fields are updated on every
# evaluation; the others keep the first failure.
COUNT, EVALS, LAST_CALL, CALL, ITERATION, ELEMENT, DEVICE, BATCH = range(8)
STATE_SIZE = BATCH + BATCH_DEPTH
_INITIAL = np.array([0, 0, -1, -1, -1, -1, -1] + [-1] * BATCH_DEPTH, np.int32)
_BIG = np.iinfo(np.int32).max


# --- the state on the device: one or two small Refs per site --------------------------
#
# Each check costs compile time for every operation it adds (about a millisecond each
# on XLA's CPU compiler): the update below is a handful of vector operations on the
# site's own Refs. (Sharing one Ref between sites is slower to compile: XLA's
# dynamic-update-slice chains cost more than separate buffers.)


@dataclasses.dataclass(eq=False)
class State:
    """A site's state: int32[STATE_SIZE + integer values] and, if the site has
    floating-point values, float32[their columns]."""

    ints: Any
    floats: Any
    placement: Any

    @classmethod
    def new(cls, dtypes, placement: Any, make: Callable) -> "State":
        n_ints, n_floats = _columns(dtypes)
        ints = np.concatenate([_INITIAL, np.zeros(n_ints, np.int32)])
        floats = make(np.zeros(n_floats, np.float32)) if n_floats else None
        return cls(ints=make(ints), floats=floats, placement=placement)

    def refs(self) -> tuple:
        return (self.ints,) if self.floats is None else (self.ints, self.floats)

    def read(self) -> tuple[np.ndarray, np.ndarray | None] | None:
        """The contents if the site failed (and then clears them)."""
        ints = np.asarray(ref_contents(self.ints))
        if ints[COUNT] == 0:
            return None
        floats = None
        if self.floats is not None:
            floats = np.asarray(ref_contents(self.floats))
        reset = np.concatenate([_INITIAL, np.zeros(len(ints) - STATE_SIZE, np.int32)])
        with _on(self.placement):
            self.ints[...] = jnp.asarray(reset)
        return ints, floats


def _kind(dtype) -> str:
    """How a value is stored: in float32 ("f"; "c", two of them, for complex) or in
    int32 ("i"); the message shows it in its own dtype."""
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return "c"
    return "f" if jnp.issubdtype(dtype, jnp.floating) else "i"


def _columns(dtypes) -> tuple[int, int]:
    kinds = [_kind(d) for d in dtypes]
    return kinds.count("i"), kinds.count("f") + 2 * kinds.count("c")


def _encode(values: list) -> tuple[list, list]:
    """Values as int32 and float32 scalars."""
    ints, floats = [], []
    for v in values:
        v = jnp.asarray(v)
        kind = _kind(v.dtype)
        if kind == "c":
            floats += [
                lax.convert_element_type(jnp.real(v), jnp.float32),
                lax.convert_element_type(jnp.imag(v), jnp.float32),
            ]
        elif kind == "f":
            floats.append(lax.convert_element_type(v, jnp.float32))
        elif v.dtype == jnp.uint32:
            ints.append(lax.bitcast_convert_type(v, jnp.int32))
        else:
            ints.append(lax.convert_element_type(v, jnp.int32))
    return ints, floats


def _decode(dtypes, ints: np.ndarray, floats: np.ndarray | None) -> list:
    out, i, f = [], 0, 0
    for dtype in dtypes:
        kind = _kind(dtype)
        if kind == "c":
            out.append(np.asarray(complex(floats[f], floats[f + 1])))
            f += 2
        elif kind == "f":
            value = floats[f]
            out.append(
                np.asarray(value if dtype == jnp.bfloat16 else value.astype(dtype))
            )
            f += 1
        else:
            raw = ints[i : i + 1]
            value = raw.view(np.uint32) if dtype == np.uint32 else raw.astype(dtype)
            out.append(np.asarray(value[0]))
            i += 1
    return out


def _decode_traced(dtypes, ints, floats) -> list:
    out, i, f = [], 0, 0
    for dtype in dtypes:
        kind = _kind(dtype)
        if kind == "c":
            out.append(lax.complex(floats[f], floats[f + 1]).astype(dtype))
            f += 2
        elif kind == "f":
            out.append(floats[f].astype(dtype))
            f += 1
        else:
            raw = ints[i]
            out.append(
                lax.bitcast_convert_type(raw, dtype)
                if dtype == jnp.uint32
                else raw.astype(dtype)
            )
            i += 1
    return out


def _merge(refs, stats):
    """Merges one evaluation's statistics into a site's state.

    Written as elementwise selects over the state vector, so that XLA fuses the
    whole update into one kernel: on the CPU each kernel costs milliseconds of
    compile time, and a program may hold a thousand checks."""
    flag, ints, *floats = refs
    count, element, batch, device, call, iteration, *values = stats
    fails = count > 0
    first = (ints[COUNT] == 0) & fails
    evals = lax.select(ints[LAST_CALL] == call, ints[EVALS], jnp.int32(0))
    iteration = lax.select(iteration >= 0, iteration, evals)
    new_ints, new_floats = _encode(values)
    first_failure = [call, iteration, element, device, *batch, *new_ints]
    index = lax.broadcasted_iota(jnp.int32, ints.shape, 0)
    new = lax.select(first, _assemble(index, CALL, first_failure, ints), ints)
    new = _put(index, COUNT, ints[COUNT] + count, new)
    new = _put(index, EVALS, evals + 1, new)
    new = _put(index, LAST_CALL, call, new)
    out = [flag | fails, new]
    if floats:
        (old,) = floats
        index = lax.broadcasted_iota(jnp.int32, old.shape, 0)
        out.append(lax.select(first, _assemble(index, 0, new_floats, old), old))
    return tuple(out)


def _put(index, i: int, value, vector):
    return lax.select(index == i, jnp.broadcast_to(value, vector.shape), vector)


def _assemble(index, start: int, scalars: list, vector):
    """`vector` with `scalars` from position `start` on, by elementwise selects."""
    for i, value in enumerate(scalars):
        vector = _put(index, start + i, jnp.asarray(value, vector.dtype), vector)
    return vector


def _on(placement: Any):
    """Host-side reads and writes of the state happen in the context of its mesh (no
    mesh for state on one device), whatever mesh the caller has set."""
    return jax.set_mesh(placement.mesh if placement is not None else None)


def _statistics(items: list[tuple]) -> list[tuple]:
    """For each `(pred_fn, operands, values, shape)`: `((count, first element,
    device, *values at it), manual axes)` of one evaluation of the predicate
    `pred_fn(*operands)`; inside `shard_map`, combined over the manual mesh axes so
    every device agrees.

    For large predicates the passing case costs one fused reduction each, as for
    `jnp.all(pred)`: the rest (the first failing element and the values there) is
    computed only when something failed, in one `lax.cond` for all of them, whose
    operands are the predicates' inputs rather than materialised boolean arrays."""
    manual = _manual_axes(items[0][1][0])
    # A scalar predicate's details cost nothing; an array's cost passes over it and,
    # when it is sharded, collectives: those wait for a failure, behind one branch.
    large = [i for i, item in enumerate(items) if item[3]]
    out: list[Any] = [None] * len(items)
    for i, item in enumerate(items):
        if i not in large:
            out[i] = _details(*item)
    if large:
        any_fail = functools_reduce(
            jnp.logical_or,
            [jnp.logical_not(jnp.all(items[i][0](*items[i][1]))) for i in large],
        )
        if manual:
            any_fail = _all_reduce(any_fail, manual, lax.pmax)
        group = [items[i] for i in large]
        inputs = [(item[1], item[2]) for item in group]

        def details(inputs):
            return [
                _details(f, ops, vals, shape)
                for (f, _, _, shape), (ops, vals) in zip(group, inputs)
            ]

        def passing(inputs):
            return [_passing(ops, vals) for ops, vals in inputs]

        for i, stats in zip(large, lax.cond(any_fail, details, passing, inputs)):
            out[i] = stats
    result = []
    for count, first, *picked in out:
        device = jnp.full((), -1, jnp.int32)
        if manual:
            count, first, device, picked = _combine_devices(
                count, first, picked, manual
            )
        result.append(((count, first, device, *picked), tuple(manual)))
    return result


def _details(pred_fn, operands, values, shape):
    fail = jnp.logical_not(pred_fn(*operands))
    if not shape:
        count = fail.astype(jnp.int32)
        return (count, count - 1, *values)
    flat = _flat_index(fail)
    first = jnp.min(lax.select(fail, flat, jnp.full_like(flat, _BIG)))
    at = flat == first
    picked = [
        v if not v.shape else jnp.sum(lax.select(at, v, jnp.zeros_like(v)))
        for v in values
    ]
    return (jnp.sum(fail, dtype=jnp.int32), first, *picked)


def _passing(operands, values):
    # Inside shard_map the outputs vary over the same mesh axes as the inputs.
    zero = _varying_like(operands[0], jnp.zeros((), jnp.int32))
    return (zero, zero - 1, *(_varying_like(v, jnp.zeros((), v.dtype)) for v in values))


def _varying_like(source, x):
    vma = tuple(sorted(_varying(source)))
    return lax.pcast(x, vma, to="varying") if vma else x


def _varying(x) -> set[str]:
    """The shard_map mesh axes over which `x` differs from device to device."""
    manual_type = getattr(jax.typeof(x), "manual_axis_type", None)
    return set(getattr(manual_type, "varying", ()))


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
    names = tuple(a for a, _ in manual)
    varying = _varying(x) or set(names)
    missing = tuple(a for a in names if a not in varying)
    if missing:
        x = lax.pcast(x, missing, to="varying")
    return op(x, names)


def _combine_devices(count, first, picked, manual):
    device = jnp.zeros((), jnp.int32)
    for a, n in manual:
        device = device * n + lax.axis_index(a)
    failing = jnp.where(count > 0, device, _BIG)
    first_device = _all_reduce(failing, manual, lax.pmin)
    mine = device == first_device

    def pick(x):
        return _all_reduce(jnp.where(mine, x, jnp.zeros((), x.dtype)), manual, lax.psum)

    total = _all_reduce(count, manual, lax.psum)
    first_device = jnp.where(total > 0, first_device, -1).astype(jnp.int32)
    return total, pick(first), first_device, [pick(v) for v in picked]


def _reduce(count, element, batch, device, call, iteration, *values):
    has = count > 0
    first = jnp.argmax(has).astype(jnp.int32)
    index = jnp.where(jnp.any(has), first, -1).astype(jnp.int32)
    batch = jnp.concatenate([index[None], batch[first][: BATCH_DEPTH - 1]])
    return (
        jnp.sum(count, dtype=jnp.int32),
        element[first],
        batch,
        device[first],
        call[0],
        iteration[first],
        *(v[first] for v in values),
    )
