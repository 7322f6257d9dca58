"""What a check keeps on the device: the state each check site accumulates the
statistics of its evaluations into (how many elements failed, on how many calls,
where the first failure was and the values there), as int32 rows in small
`jax.Ref`s, and how values become int32 words and back.

Everything here runs while a function is traced, except `State.read` and `_decode`,
which run on the host when the flags are read.
"""

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from .._jax_internals import ref_contents


BATCH_DEPTH = 4  # vmap levels whose batch index a failure reports
# The int32 state of a check site. The first five fields are updated on every
# evaluation (CALLS counts the calls on which the site failed, LAST_FAILED is the last
# of them); the others keep the first failure.
COUNT, EVALS, LAST_CALL, CALLS, LAST_FAILED = range(5)
CALL, ITERATION, ELEMENT, DEVICE, BATCH = range(5, 10)
STATE_SIZE = BATCH + BATCH_DEPTH
_INITIAL = np.array([0, 0, -1, 0, -1, -1, -1, -1, -1] + [-1] * BATCH_DEPTH, np.int32)
_BIG = np.iinfo(np.int32).max


# --- the state on the device: one small Ref per group of sites ------------------------
#
# The sites of one `check` call (one site) or one `check_finite` call (a site per
# leaf) share an int32[sites, STATE_SIZE + value words] Ref, updated by one operation:
# every Ref is an input and output buffer of the program on every device, and costs
# dispatch time on every call. The update below is a few fused vector operations
# (each costs compile time too, about a millisecond on XLA's CPU compiler, and a
# program may hold a thousand checks).


@dataclasses.dataclass(eq=False)
class State:
    """The state of a group of sites: each row holds a site's statistics and the
    values at its first failure, as int32 words (a float as a float32's bits)."""

    held: Any  # the Ref, until `release`
    placement: Any
    weak: Any = None  # the Ref, after `release`

    @classmethod
    def new(cls, words: list[int], placement: Any, make: Callable) -> "State":
        """For sites whose values take `words` int32 words each."""
        return cls(held=make(_initial(len(words), max(words))), placement=placement)

    @property
    def ref(self) -> Any:
        """The Ref, or `None` once released and no program holds it."""
        return self.held if self.weak is None else self.weak()

    def release(self) -> None:
        """From now on the Ref lives only as long as a program holds it (one in
        JAX's caches, that closed over it when traced)."""
        if self.weak is None:
            self.weak, self.held = weakref.ref(self.held), None

    def read(self) -> np.ndarray | None:
        """The contents if a site failed (and then clears them)."""
        contents = np.asarray(ref_contents(self.ref))
        if not contents[:, COUNT].any():
            return None
        with _on(self.placement):
            sites, width = contents.shape
            self.ref[...] = jnp.asarray(_initial(sites, width - STATE_SIZE))
        return contents


def _initial(sites: int, words: int) -> np.ndarray:
    """The state of `sites` sites, with `words` value words each, that have not
    failed."""
    row = np.concatenate([_INITIAL, np.zeros(words, np.int32)])
    return np.tile(row, (sites, 1))


def _words(dtype) -> int:
    """How many int32 words a value of `dtype` takes in the state."""
    return 2 if jnp.issubdtype(dtype, jnp.complexfloating) else 1


def _encode(values: list) -> list:
    """Values as int32 words: integers converted, floating point through float32's
    bits, complex numbers as two float32s. The message shows each in its own dtype."""
    words = []
    for v in values:
        v = jnp.asarray(v)
        if jnp.issubdtype(v.dtype, jnp.complexfloating):
            parts = [jnp.real(v), jnp.imag(v)]
        elif jnp.issubdtype(v.dtype, jnp.floating):
            parts = [v]
        elif v.dtype == jnp.uint32:
            words.append(lax.bitcast_convert_type(v, jnp.int32))
            continue
        else:
            words.append(lax.convert_element_type(v, jnp.int32))
            continue
        for part in parts:
            part = lax.convert_element_type(part, jnp.float32)
            words.append(lax.bitcast_convert_type(part, jnp.int32))
    return words


def _decode(dtypes, words: np.ndarray) -> list:
    words = np.asarray(words, np.int32)
    floats = words.view(np.float32)
    out, i = [], 0
    for dtype in dtypes:
        if jnp.issubdtype(dtype, jnp.complexfloating):
            out.append(np.asarray(complex(floats[i], floats[i + 1])))
        elif jnp.issubdtype(dtype, jnp.floating):
            value = floats[i]
            out.append(
                np.asarray(value if dtype == jnp.bfloat16 else value.astype(dtype))
            )
        elif dtype == np.uint32:
            out.append(np.asarray(words[i : i + 1].view(np.uint32)[0]))
        else:
            out.append(np.asarray(words[i].astype(dtype)))
        i += _words(dtype)
    return out


def _merge(refs, stats):
    """Merges one evaluation's statistics, a row per site, into a group's state."""
    flag, state = refs
    count, element, batch, device, call, iteration, words = stats
    fails = count > 0
    first = (state[:, COUNT] == 0) & fails
    evals = jnp.where(state[:, LAST_CALL] == call, state[:, EVALS], 0)
    # An iteration given: a shard_map body's check in a loop (`ShardMapFrame.forward`),
    # which counts as two evaluations, so that its iteration shows.
    looped = iteration >= 0
    iteration = jnp.where(looped, iteration, evals)
    sites = count.shape[0]

    def column(x):
        return jnp.broadcast_to(x, (sites,))[:, None].astype(jnp.int32)

    first_failure = jnp.concatenate(
        [
            column(call),
            column(iteration),
            column(element),
            column(device),
            batch,
            words,
        ],
        axis=1,
    )
    kept = jnp.where(first[:, None], first_failure, state[:, CALL:])
    new_call = fails & (state[:, LAST_FAILED] != call)
    counts = [
        column(state[:, COUNT] + count),
        column(evals + 1 + looped),
        column(call),
        column(state[:, CALLS] + new_call),
        column(jnp.where(fails, call, state[:, LAST_FAILED])),
    ]
    return flag | jnp.any(fails), jnp.concatenate([*counts, kept], axis=1)


def _on(placement: Any):
    """Host-side reads and writes of the state happen in the context of its mesh (no
    mesh for state on one device), whatever mesh the caller has set."""
    return jax.set_mesh(placement.mesh if placement is not None else None)


class Item(NamedTuple):
    """One check's predicate, `pred_fn(operand)`, elementwise over `operand`; the
    `values` its message shows; `shape`, that of the predicate; and `kinds`, for a
    check whose one value is its operand and whose failing elements hold one of a
    few values (`check_finite`'s: NaN, inf or -inf), `(kind, table)`:
    `kind(operand)` is, elementwise, the index in `table` of the value there if it
    fails."""

    pred_fn: Callable
    operand: Any
    values: list
    shape: tuple
    kinds: tuple[Callable, tuple] | None = None


def _from_words(words: list, dtype) -> Any:
    """A traced value of `dtype` from the int32 words `_encode` made of it."""
    if jnp.issubdtype(dtype, jnp.complexfloating):
        real, imag = (lax.bitcast_convert_type(w, jnp.float32) for w in words)
        return lax.convert_element_type(lax.complex(real, imag), dtype)
    (word,) = words
    if jnp.issubdtype(dtype, jnp.floating):
        return lax.convert_element_type(
            lax.bitcast_convert_type(word, jnp.float32), dtype
        )
    if dtype == jnp.uint32:
        return lax.bitcast_convert_type(word, jnp.uint32)
    return lax.convert_element_type(word, dtype)


def _unsharded(x):
    """`x`, on every device if it is sharded over Explicit mesh axes."""
    sharding = jax.typeof(x).sharding
    if AxisType.Explicit in sharding.mesh.axis_types and any(sharding.spec):
        return jax.sharding.reshard(x, NamedSharding(sharding.mesh, PartitionSpec()))
    return x


def _reduce(count, element, batch, device, call, iteration, words):
    """A vmapped evaluation's statistics (each with a leading batch dimension) as one
    evaluation: per site, the counts summed and the rest from the first failing batch
    element, whose index joins the batch indices. (A few integers per batch element,
    put on every device first where the batch is sharded over Explicit mesh axes.)"""
    count, element, batch, device, call, iteration, words = map(
        _unsharded, (count, element, batch, device, call, iteration, words)
    )
    has = count > 0
    first = jnp.argmax(has, axis=0)
    index = jnp.where(jnp.any(has, axis=0), first, -1).astype(jnp.int32)

    def at_first(x):
        where = first.reshape((1, -1) + (1,) * (x.ndim - 2))
        return jnp.take_along_axis(x, where, axis=0)[0]

    batch = jnp.concatenate([index[:, None], at_first(batch)[:, : BATCH_DEPTH - 1]], 1)
    return (
        jnp.sum(count, axis=0, dtype=jnp.int32),
        at_first(element),
        batch,
        at_first(device),
        call[0],
        at_first(iteration),
        at_first(words),
    )
