"""What each process runs in the multi-process tests
(`tests/values/test_multihost.py`), through `jaxshard.launch`. Every function here
runs in every process, on a mesh over every process's devices; arrays are built a
shard at a time, so each process holds only its own rows."""

import json

import beartype
import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import Float


ROWS, COLS = 16, 8
BAD_ROW, BAD_COL = ROWS - 1, 3  # held by the last process only


def mesh(kind: str):
    return jax.make_mesh(
        (jax.device_count(),), ("dp",), axis_types=(getattr(AxisType, kind),)
    )


def global_array(mesh, spec, bad: float | None = None):
    """float32[ROWS, COLS] laid out by `spec`, built shard by shard; `bad` at
    (BAD_ROW, BAD_COL) if given."""
    full = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) / 100
    if bad is not None:
        full[BAD_ROW, BAD_COL] = bad
    sharding = NamedSharding(mesh, spec)
    x = jax.make_array_from_callback(full.shape, sharding, lambda index: full[index])
    assert not x.is_fully_addressable
    return x


@jaxshard.jaxtyped(typechecker=beartype.beartype)
def rows(x: Float[Array, "b d", P("dp", None)]) -> Float[Array, "b d", P("dp", None)]:
    return x * 2


@jaxshard.jaxtyped(typechecker=beartype.beartype)
def columns(
    x: Float[Array, "b d", P(None, "dp")],
) -> Float[Array, "b d", P(None, "dp")]:
    return x * 2


def local_rows(
    x: Float[Array, "b d", P("dp", None)],
) -> Float[Array, "b d", P("dp", None)]:
    return x + 1


def local_replicated(x: Float[Array, "b d", P()]) -> Float[Array, "b d", P()]:
    return x + 1


def mislabeled(
    x: Float[Array, "b d", P("dp", None)],
) -> Float[Array, "b d", P(None, "dp")]:
    return x * 2  # XLA keeps the rows' layout


def step(x):
    jaxshard.check(x < 50, "x is {v}", v=x)
    jaxshard.check_finite({"x": x})
    return x * 2


def _sharding_cases():
    """Each way a sharding contract is checked, as (name, mesh, a call that keeps
    the contract and returns the output's spec, a call that breaks it)."""
    cases = []
    dims = {"b": ROWS, "d": COLS}
    for kind in ("Explicit", "Auto"):
        m = mesh(kind)
        x = global_array(m, P("dp", None))
        cases += [
            (f"eager, {kind}", m, lambda x=x: rows(x), lambda x=x: columns(x)),
            (
                f"jit, {kind}",
                m,
                lambda x=x: jax.jit(rows)(x),
                lambda x=x: jax.jit(columns)(x),
            ),
            (
                f"shard_map, {kind}",
                m,
                lambda x=x, m=m: jaxshard.shard_map(local_rows, mesh=m)(x),
                lambda x=x, m=m: jax.jit(
                    jaxshard.shard_map(local_replicated, mesh=m, in_specs=P("dp", None))
                )(x),
            ),
            (
                f"verify, {kind}",
                m,
                lambda m=m: jaxshard.verify(rows, mesh=m, dims=dims).rows[-1].actual,
                lambda m=m: jaxshard.verify(mislabeled, mesh=m, dims=dims),
            ),
        ]
    return cases


def passing() -> dict:
    """Every contract holds: sharding contracts eagerly, in jit on Explicit and Auto
    meshes, in shard_map and in verify; value checks in raise and deferred mode."""
    done = {}
    for name, m, good, _ in _sharding_cases():
        with jax.set_mesh(m):
            out = good()
        sharding = getattr(out, "sharding", out)
        done[name] = sharding.spec in (P("dp", None), P("dp")) or str(sharding)
    m = mesh("Auto")
    with jax.set_mesh(m):
        x = global_array(m, P("dp", None))
        checked = jaxshard.checked(jax.jit(step))
        checked(x)
        with jaxshard.deferred_checks():
            for _ in range(3):
                x = checked(x / 2)
        done["values"] = float(jnp.max(x))
        jaxshard.check(x < 50, "x is {v}", v=x)  # eagerly, across processes
        # A checked function that is not itself jitted keeps its state in Refs.
        stepping = jaxshard.checked(lambda x: jax.jit(step)(x))
        stepping(x)
    return done


def sharding_violation() -> None:
    """Each way of checking a sharding contract, on an array laid out against its
    annotation. The last raises out of the process."""
    messages = {}
    cases = _sharding_cases()
    for i, (name, m, _, bad) in enumerate(cases):
        with jax.set_mesh(m):
            if i == len(cases) - 1:
                print("MESSAGES", json.dumps(messages), flush=True)
                bad()
            try:
                bad()
            except jaxshard.ShardingError as e:
                messages[name] = str(e)
            else:
                raise AssertionError(f"{name}: no ShardingError")
    raise AssertionError("the last case did not raise")


def value_violation(mode: str) -> None:
    """A value only the last process holds fails a check: in "raise" mode at the call
    that sees it, in "deferred" mode at the flush, naming that call ("deferred-70":
    over 70 calls, where from the 64th on every process reads what the calls the
    devices have finished found); "python" is "raise" for a checked function that is
    not itself jitted."""
    m = mesh("Auto")
    with jax.set_mesh(m):
        good = global_array(m, P("dp", None))
        bad = global_array(m, P("dp", None), bad=float("nan"))
        checked = jaxshard.checked(jax.jit(step))
        if mode == "python":  # a checked function that calls a jitted one
            checked = jaxshard.checked(lambda x: jax.jit(step)(x))
            mode = "raise"
        if mode == "raise":
            checked(good)
            checked(bad)
        else:
            with jaxshard.deferred_checks():
                for i in range(70 if mode == "deferred-70" else 5):
                    out = checked(bad if i == 3 else good)
                    if i % 4 == 3:  # XLA's CPU runtime can deadlock on a long queue
                        jax.block_until_ready(out)
        checked(good)


def local_step(
    x: Float[Array, "b d", P("dp", None)],
) -> Float[Array, "b d", P("dp", None)]:
    jaxshard.check(x < 50, "block value {v}", v=x)
    return x * 2


def shard_map_value_violation() -> None:
    """A value only the last process holds fails a check inside shard_map: the
    devices' flags are combined, so every process reports the failing device."""
    m = mesh("Explicit")
    with jax.set_mesh(m):
        checked = jaxshard.checked(jax.jit(jaxshard.shard_map(local_step, mesh=m)))
        checked(global_array(m, P("dp", None)))
        checked(global_array(m, P("dp", None), bad=77.0))


def eager_value_violation() -> None:
    """An eager check of an array spread over every process."""
    m = mesh("Explicit")
    with jax.set_mesh(m):
        x = global_array(m, P("dp", None), bad=99.0)
        jaxshard.check(x < 50, "x is {v}", v=x)


def hang() -> None:
    """Process 1 raises; process 0 then waits forever in a collective."""
    if jax.process_index() == 1:
        raise RuntimeError("process 1 stops here")
    m = mesh("Auto")
    jax.block_until_ready(jax.jit(jnp.sum)(global_array(m, P("dp", None))))


def describe(x: int) -> dict:
    return {"processes": jax.process_count(), "devices": jax.device_count(), "x": x}
