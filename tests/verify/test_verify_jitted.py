"""`jaxshard.verify` of `jax.jit` functions as users write them (static and donated
arguments, in_shardings as a tuple, a single sharding, a PartitionSpec, with None
and pytree prefixes; partial(jax.jit) decorators, a flax TrainState step), each
verdict compared with a checked call's."""

import functools as ft

import beartype
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training import train_state
from jax import Array
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import Float


DIMS = {"b": 8, "d": 4}
PARAMS = {
    "w": jax.ShapeDtypeStruct((4, 4), jnp.float32),
    "b": jax.ShapeDtypeStruct((4,), jnp.float32),
}


def layer(
    n: int, x: Float[Array, "b d", P("dp", None)], p: dict, *, k: int = 1
) -> Float[Array, "b d", P("dp", None)]:
    return x * n + (p["w"] @ p["b"]).sum() * k


def _call(fn, x=None):
    """A checked call of `fn`, with `x` laid out by a sharding (on Explicit axes a
    jit's in_shardings must be the argument's), else as JAX places it."""
    p = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}
    x = jnp.ones((8, 4)) if x is None else jax.device_put(jnp.ones((8, 4)), x)
    called = jaxshard.jaxtyped(fn, typechecker=beartype.beartype)
    return jax.block_until_ready(called(2, x, p))


def _verify(fn, mesh):
    values = {"n": 2, "p": PARAMS}
    return jaxshard.verify(fn, mesh=mesh, dims=DIMS, values=values)


@pytest.mark.parametrize(
    "given",
    [
        lambda s: {"in_shardings": s["dp"]},  # a 2-d spec for p['b'] too
        lambda s: {"in_shardings": (s["dp"], {"w": s["tp"], "c": None})},
        lambda s: {"in_shardings": (s["dp"], (s["tp"], None))},
        lambda s: {"in_shardings": (s["dp"],)},
        lambda s: {"in_shardings": (s["dp"], None, None)},
    ],
    ids=["rank", "keys", "tuple-for-dict", "too-few", "too-many"],
)
def test_in_shardings_a_call_refuses_are_refused_by_verify(given, mesh):
    """in_shardings that do not fit the arguments (a spec longer than an array's
    rank, not a prefix of a parameter's value, too few or too many) make a call
    fail: verify says so, naming them, where it passed or blamed a parameter."""
    shardings = {"dp": NamedSharding(mesh, P("dp", None)), "tp": P(None, "tp")}
    with jax.set_mesh(mesh):
        step = jax.jit(layer, static_argnums=0, **given(shardings))
        with pytest.raises(ValueError):
            _call(step)
    with pytest.raises(ValueError, match=r"verify\(layer\): the jax.jit's in_shard"):
        _verify(step, mesh)


@pytest.mark.parametrize(
    "wrap",
    [
        lambda s: jax.jit(layer, static_argnums=0, in_shardings=(s, None)),
        lambda s: jax.jit(
            layer, static_argnames="n", in_shardings=(s, {"w": None, "b": None})
        ),
        lambda s: jax.jit(
            layer,
            static_argnums=0,
            static_argnames="k",
            donate_argnames="x",
            in_shardings=(s, None),
        ),
        lambda s: ft.partial(jax.jit, static_argnums=0, in_shardings=(s, None))(layer),
        lambda s: jaxshard.checked(
            jax.jit(layer, static_argnums=0, in_shardings=(s, None))
        ),
        lambda s: jaxshard.jaxtyped(
            jax.jit(
                layer, static_argnums=(0,), donate_argnums=1, in_shardings=(s, None)
            ),
            typechecker=beartype.beartype,
        ),
    ],
    ids=["tuple-none", "dict-prefix", "donated", "partial", "checked", "jaxtyped"],
)
def test_jits_in_shardings_as_users_give_them(wrap, mesh):
    """Each way of giving in_shardings lays out what the program receives, as in a
    call: row-sharded x passes, column-sharded x is parameter x's violation."""
    rows, columns = P("dp", None), P(None, "tp")
    with jax.set_mesh(mesh):
        good, bad = wrap(NamedSharding(mesh, rows)), wrap(columns)
        _call(good, NamedSharding(mesh, rows))
        with pytest.raises(jaxshard.ShardingError, match="parameter 'x'"):
            _call(bad, NamedSharding(mesh, columns))
    assert _verify(good, mesh).ok
    with pytest.raises(jaxshard.ShardingError) as e:
        _verify(bad, mesh)
    assert "x" in [row.name for row in e.value.report.violations]


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(x)


class _Config(dict):
    def __hash__(self):
        return hash(tuple(sorted(self.items())))


def _train_step(
    state, batch: Float[Array, "b d", P("dp", None)], cfg
) -> tuple[train_state.TrainState, Float[Array, ""]]:
    def loss(params):
        return (state.apply_fn(params, batch) ** 2).mean() * cfg["scale"]

    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), value


def test_a_flax_train_step_jitted_with_state_shardings(auto_mesh):
    """`jax.jit(train_step, in_shardings=(state_shardings, data_sharding),
    static_argnums=(2,), donate_argnums=0)`: the batch's sharding is checked as a
    call checks it. A None for the static `cfg` too (three shardings) is refused
    by a call, and by verify, which passed it."""
    model = _MLP()
    with jax.set_mesh(auto_mesh):
        params = model.init(jax.random.key(0), jnp.ones((8, 4)))
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.adam(1e-3)
    )
    replicated = jax.tree.map(lambda _: NamedSharding(auto_mesh, P()), state)
    cfg = _Config(scale=1.0)
    values = {"state": state, "cfg": cfg}

    def step(data, *more):
        return jax.jit(
            _train_step,
            in_shardings=(replicated, NamedSharding(auto_mesh, data), *more),
            static_argnums=(2,),
            donate_argnums=0,
        )

    def call(jitted):
        called = jaxshard.jaxtyped(jitted, typechecker=beartype.beartype)
        copy = jax.tree.map(jnp.copy, state)  # donated
        return jax.block_until_ready(called(copy, jnp.ones((8, 4)), cfg))

    for spec, ok in ((P("dp", None), True), (P(None, "tp"), False)):
        report = jaxshard.verify(
            step(spec), mesh=auto_mesh, dims=DIMS, values=values, raise_on_error=False
        )
        assert [(r.name, r.ok) for r in report.rows] == [("batch", ok)]
        if ok:
            call(step(spec))
        else:
            with pytest.raises(jaxshard.ShardingError, match="parameter 'batch'"):
                call(step(spec))
    with pytest.raises(ValueError, match="tree prefix"):
        call(step(P("dp", None), None))
    with pytest.raises(ValueError, match=r"give 3 shardings.*2 \(state, batch\)"):
        jaxshard.verify(
            step(P("dp", None), None), mesh=auto_mesh, dims=DIMS, values=values
        )


def pair(
    x: Float[Array, "b d", P("dp", None)],
) -> tuple[Float[Array, "b d", P("dp", None)], Float[Array, "b"]]:
    return x * 2, x.sum(1)


def _pair(fn, mesh):
    """`(verified, called)`: verify's report of `fn`, and a checked call's result."""
    report = jaxshard.verify(fn, mesh=mesh, dims=DIMS, raise_on_error=False)
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("dp", None)))
        return report, jaxshard.jaxtyped(fn, typechecker=beartype.beartype)(x)


def test_out_shardings_as_users_give_them(mesh):
    """out_shardings as a tree of the return value, with None leaves: the layout a
    call returns is the report's."""
    rows, dp = NamedSharding(mesh, P("dp", None)), NamedSharding(mesh, P("dp"))
    for given, second in (((rows, dp), P("dp")), ((rows, None), None)):
        report, (_, out) = _pair(jax.jit(pair, out_shardings=given), mesh)
        assert report.ok
        assert report.outputs["return[0]"].sharding.spec == P("dp", None)
        if second is not None:
            assert out.sharding.spec == report.outputs["return[1]"].sharding.spec


def test_out_shardings_that_clash_with_the_return_annotation(auto_mesh):
    columns = NamedSharding(auto_mesh, P(None, "tp"))
    step = jax.jit(pair, out_shardings=(columns, None))
    report = jaxshard.verify(step, mesh=auto_mesh, dims=DIMS, raise_on_error=False)
    assert [r.name for r in report.violations] == ["return[0]"]
    with pytest.raises(jaxshard.ShardingError, match="return value's leaf '\\[0\\]'"):
        _pair(step, auto_mesh)


@pytest.mark.parametrize(
    "given",
    [
        lambda s: s,  # a 2-d spec for the 1-d second output too
        lambda s: {"a": s},
        lambda s: (s, None, None),
    ],
    ids=["rank", "not-a-prefix", "too-many"],
)
def test_out_shardings_a_call_refuses_are_refused_by_verify(given, mesh):
    """out_shardings that do not fit the return value make a call fail: verify
    says so in its own words, not only in JAX's."""
    step = jax.jit(pair, out_shardings=given(NamedSharding(mesh, P("dp", None))))
    with jax.set_mesh(mesh), pytest.raises(ValueError):
        step(jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("dp", None))))
    with pytest.raises(ValueError, match=r"verify\(pair\): the jax.jit's out_sh"):
        jaxshard.verify(step, mesh=mesh, dims=DIMS)
