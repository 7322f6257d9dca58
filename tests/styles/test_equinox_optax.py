"""equinox and optax as their users write them: `eqx.Module`s whose fields carry
sharding contracts, `jaxtyped(typechecker=beartype)` on `__call__`, a train step under
`eqx.filter_jit` with `eqx.filter_value_and_grad` and `optax.adamw`, and the model
handed to `jaxshard.verify` as it is (Python fields and all)."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from beartype import beartype
from jax import Array
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import Float


X = Float[Array, "b d", P("dp", None)]
H = Float[Array, "b h", P("dp", "tp")]


@jaxshard.jaxtyped(typechecker=beartype)
class Dense(eqx.Module):
    """A layer with the Python fields equinox code keeps in a Module: a callable
    (static), an int and a float (leaves), and a submodule of Python values."""

    weight: Float[Array, "d h", P(None, "tp")]
    scale: float
    repeats: int
    dropout: eqx.nn.Dropout
    act: Callable = eqx.field(static=True, default=jax.nn.relu)

    @jaxshard.jaxtyped(typechecker=beartype)
    def __call__(self, x: X) -> H:
        return self.act(x @ self.weight) * self.scale * self.repeats


def _dense(mesh) -> Dense:
    w = jnp.full((16, 32), 0.01)
    w = jax.device_put(w, NamedSharding(mesh, P(None, "tp")))
    return Dense(w, 0.5, 2, eqx.nn.Dropout(0.1))


def _batch(mesh, nan: bool = False) -> Array:
    x = jnp.ones((8, 16)).at[0, 0].set(jnp.nan if nan else 1.0)
    return jax.device_put(x, NamedSharding(mesh, P("dp", None)))


OPTIMIZER = optax.adamw(1e-2)


@eqx.filter_jit
def _train_step(model, opt_state, x):
    loss_fn = lambda m, x: jnp.mean(m(x) ** 2)  # noqa: E731
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x)
    jaxshard.check_finite(grads, name="grads")
    params = eqx.filter(model, eqx.is_array)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, loss


def test_verify_keeps_a_modules_python_fields_as_filter_jit_does(mesh):
    """`verify(step, values={"model": model, ...})` on an `eqx.filter_jit` step:
    the model's float, int and bool leaves reach the step as the Python values they
    are, as they do in a real call. Traced, the float was differentiated and optax
    met a gradient where its state has None (a raw TypeError)."""
    model = _dense(mesh)
    with jax.set_mesh(mesh):
        opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
        x = _batch(mesh)
        _train_step(model, opt_state, x)  # the real call works
        values = {"model": model, "opt_state": opt_state, "x": x}
        report = jaxshard.verify(_train_step, mesh=mesh, values=values)
    assert report.ok
    rows = [(r.function, r.name, r.ok) for r in report.rows]
    assert ("Dense.__call__", "x", True) in rows, rows


@pytest.mark.parametrize("jit", [False, True], ids=["module", "filter_jit"])
def test_verify_a_module_as_its_forward_pass(mesh, jit):
    """`verify(model)` (or `verify(eqx.filter_jit(model))`): the module's
    `__call__`, with its weights as inputs laid out as they are. Its class's field
    annotations were read as `__call__`'s ('x' had "no array annotation"), and its
    weights, closed over, were replicated on Auto axes: a correct model failed."""
    model = _dense(mesh)
    fn = eqx.filter_jit(model) if jit else model
    report = jaxshard.verify(fn, mesh=mesh, dims={"b": 8, "d": 16})
    rows = [(r.function, r.name, r.ok) for r in report.rows]
    assert rows == [
        ("Dense.__call__", "x", True),
        ("Dense.__call__", "return", True),
    ], rows
    w = jax.device_put(model.weight, NamedSharding(mesh, P()))
    wrong = eqx.tree_at(lambda m: m.weight, model, w)
    fn = eqx.filter_jit(wrong) if jit else wrong
    with pytest.raises(jaxshard.ShardingError) as e:
        jaxshard.verify(fn, mesh=mesh, dims={"b": 8, "d": 16})
    assert str(e.value).startswith(
        "1 sharding contract violated when Dense.__call__ was compiled"
    ), str(e.value)
    assert "the return value is P('dp', None) where the annotation expects " in str(
        e.value
    )


def test_check_tree_of_a_model_and_its_optimizer_state_together(mesh):
    """`check_tree((model, opt_state))`, eagerly and in the step: a bare tuple (or
    list, or dict) is walked into, each item by its own type, as `device_put` walks
    it. It checked nothing: a misplaced weight passed."""
    model = _dense(mesh)
    w = jax.device_put(model.weight, NamedSharding(mesh, P()))
    wrong = eqx.tree_at(lambda m: m.weight, model, w)
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    jaxshard.check_tree((model, opt_state))
    jaxshard.check_tree({"model": model, "opt_state": opt_state})
    with pytest.raises(jaxshard.ShardingError) as e:
        jaxshard.check_tree((wrong, opt_state))
    assert str(e.value).startswith(
        "check_tree(tree): tree[0].weight: this array (float32[16,32]) is sharded "
        "as P(None, None)"
    ), str(e.value)
    with pytest.raises(jaxshard.ShardingError, match=r"\['model'\]\[1\]\.weight"):
        jaxshard.check_tree({"model": [model, wrong]})

    @eqx.filter_jit
    def step(model, opt_state):
        jaxshard.check_tree((model, opt_state))
        return model.weight.sum()

    with jax.set_mesh(mesh):
        step(model, opt_state)
        with pytest.raises(jaxshard.ShardingError, match=r"tree\[0\]\.weight"):
            step(wrong, opt_state)


def test_checked_filter_jit_step_between_raise_and_deferred_calls(mesh):
    """`checked(eqx.filter_jit(step))` (checks' state in Refs between calls), called
    in "raise" mode, then in a `deferred_checks()` block, then in "raise" mode
    again: each failure is said once, with no loop iteration (there is no loop).
    The call index started again from 0 at each block while a site's state kept the
    index of the last call it ran in, so a call was taken for a loop iteration of an
    earlier one ("iteration 2")."""
    step = jaxshard.checked(_train_step)
    model = _dense(mesh)
    with jax.set_mesh(mesh):
        opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
        x = _batch(mesh)
        bad = _batch(mesh, nan=True)
        step(model, opt_state, x)  # call 0 in "raise" mode
        with jaxshard.deferred_checks():
            step(model, opt_state, x)  # call 0 of the block
        with pytest.raises(jaxshard.CheckError) as e:
            step(model, opt_state, bad)  # call 0 after the flush
        assert [(f.call, f.iteration) for f in e.value.failures] == [(None, None)]
        assert "iteration" not in str(e.value)
        with pytest.raises(jaxshard.CheckError) as e:
            with jaxshard.deferred_checks():
                step(model, opt_state, x)
                step(model, opt_state, bad)
                step(model, opt_state, bad)
        failure = e.value.failures[0]
        assert (failure.call, failure.iteration, failure.calls) == (1, None, 2)


class _Block(eqx.Module):
    up: Float[Array, "d h", P(None, "tp")]
    down: Float[Array, "h d", P("tp", None)]

    def __init__(self, key):
        a, b = jax.random.split(key)
        self.up = jax.random.normal(a, (16, 32)) * 0.1
        self.down = jax.random.normal(b, (32, 16)) * 0.1

    @jaxshard.jaxtyped(typechecker=beartype)
    def __call__(self, x: X) -> X:
        h = jax.nn.relu(x @ self.up)
        jaxshard.check_finite(h, name="h")
        explicit = AxisType.Explicit in jax.sharding.get_abstract_mesh().axis_types
        out = P("dp", None) if explicit else None  # the contraction is over tp
        return x + jnp.einsum("bh,hd->bd", h, self.down, out_sharding=out)


def _stacked(mesh, layers: int = 3, inf_in: int | None = None) -> _Block:
    """`layers` blocks stacked by `eqx.filter_vmap`, each weight laid out as its
    field says with the layer dimension whole; `inf_in`: a layer whose `up`
    holds an infinity."""
    blocks = eqx.filter_vmap(_Block)(jax.random.split(jax.random.key(0), layers))
    up = np.array(blocks.up)
    if inf_in is not None:
        up[inf_in, 0, 0] = np.inf
    up = jax.device_put(up, NamedSharding(mesh, P(None, None, "tp")))
    down = jax.device_put(blocks.down, NamedSharding(mesh, P(None, "tp", None)))
    return eqx.tree_at(lambda b: (b.up, b.down), blocks, (up, down))


@eqx.filter_jit
def _scan_step(blocks, opt_state, x):
    def loss_fn(blocks, x):
        params, static = eqx.partition(blocks, eqx.is_array)
        layer = lambda x, p: (eqx.combine(p, static)(x), None)  # noqa: E731
        return jnp.mean(jax.lax.scan(layer, x, params)[0] ** 2)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(blocks, x)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, blocks)
    return eqx.apply_updates(blocks, updates), opt_state, loss


def test_scan_over_stacked_layers_says_the_failing_layer(mesh):
    """Layers stacked with `eqx.filter_vmap` and run by `lax.scan` in a
    `checked(eqx.filter_jit(step))` with adamw: the `jaxtyped` `__call__`'s
    contracts hold in every layer on both axis types, and a check failing in
    layer 1 only is said at iteration 1, in "raise" and in deferred mode."""
    step = jaxshard.checked(_scan_step)
    with jax.set_mesh(mesh):
        blocks, x = _stacked(mesh), _batch(mesh)
        opt_state = OPTIMIZER.init(blocks)
        blocks, opt_state, loss = step(blocks, opt_state, x)
        assert blocks.up.sharding.spec == P(None, None, "tp")
        bad = _stacked(mesh, inf_in=1)
        with pytest.raises(jaxshard.CheckError) as e:
            step(bad, opt_state, x)
        assert (e.value.failures[0].message, e.value.failures[0].iteration) == (
            "h holds NaN or infinity (first: inf)",
            1,
        )
        with pytest.raises(jaxshard.CheckError) as e:
            with jaxshard.deferred_checks():
                step(blocks, opt_state, x)
                step(bad, opt_state, x)
        failure = e.value.failures[0]
        assert (failure.call, failure.iteration) == (1, 1)


def test_a_stacked_weight_laid_out_wrong_is_named_on_auto_axes(auto_mesh):
    """On Auto axes, a stacked weight laid out over the wrong dimension breaks the
    scanned layers' contracts when XLA compiles the step; the message names the
    weight by its path, against its optimizer state laid out as annotated."""
    with jax.set_mesh(auto_mesh):
        blocks, x = _stacked(auto_mesh), _batch(auto_mesh)
        opt_state = OPTIMIZER.init(blocks)
        up = jax.device_put(blocks.up, NamedSharding(auto_mesh, P(None, "tp", None)))
        wrong = eqx.tree_at(lambda b: b.up, blocks, up)
        with pytest.raises(jaxshard.ShardingError) as e:
            _scan_step(wrong, opt_state, x)
    assert "the likely cause is blocks.up, laid out P(None, 'tp', None)" in str(
        e.value
    ), str(e.value)
    assert "its optimizer state" in str(e.value)
