"""`checked(fn, inputs_finite=...)`: a NaN that comes in through an input is
reported as the origin of what failed after it."""

import functools as ft

import jax
import jax.numpy as jnp
import pytest

import jaxshard


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params["w1"] @ params["w2"]) ** 2)


def _step(params, batch, lr=0.1):
    loss, grads = jax.value_and_grad(_loss)(params, batch)
    jaxshard.check(jnp.isfinite(loss), "loss is {loss}", loss=loss)
    jaxshard.check_finite(grads, name="grads")
    return jax.tree.map(lambda p, g: p - lr * g, params, grads)


PARAMS = {"w1": jnp.ones((4, 4)), "w2": jnp.ones((4, 4))}
BATCH = {"x": jnp.ones((2, 4)), "label": jnp.arange(2)}
BAD = {"x": BATCH["x"].at[1, 2].set(jnp.nan), "label": BATCH["label"]}


@pytest.mark.parametrize("inputs_finite", [True, ["batch"]])
def test_a_bad_batch_is_named_as_the_origin(inputs_finite):
    step = jaxshard.checked(jax.jit(_step), inputs_finite=inputs_finite)
    step(PARAMS, BATCH)
    with pytest.raises(jaxshard.CheckError) as e:
        step(PARAMS, BAD)
    head, first, *rest = str(e.value).splitlines()
    assert head == (
        "the input 'batch' was not finite (origin) in _step; 3 checks after it "
        "failed and may follow from it:"
    )
    assert first.startswith("- input batch['x'] holds NaN or infinity (first: nan)")
    assert first.endswith("[1 element failed; first at element [1, 2]]")
    assert [f.origin for f in e.value.failures] == ["batch", None, None, None]
    assert "loss is nan" in rest[0]


def test_without_the_option_nothing_is_an_origin():
    step = jaxshard.checked(jax.jit(_step))
    with pytest.raises(jaxshard.CheckError, match=r"^3 checks failed in _step:"):
        step(PARAMS, BAD)


def test_as_a_decorator_with_static_arguments():
    @jaxshard.checked(inputs_finite=True)
    @ft.partial(jax.jit, static_argnames="scale")
    def f(x, n, scale="mean"):
        jaxshard.check(x < 100, "x is {x}", x=x)
        return x * n

    f(jnp.ones(3), 2)
    with pytest.raises(jaxshard.CheckError) as e:
        f(jnp.array([1.0, jnp.inf, 3.0]), jnp.int32(2))
    head = str(e.value).splitlines()[0]
    assert head.startswith("the input 'x' was not finite (origin) in ")
    assert head.endswith("f; 1 check after it failed and may follow from it:")
    assert [f.origin for f in e.value.failures] == ["x", None]  # not n, an int


def test_a_function_that_is_not_jitted_and_deferred_mode():
    @jax.jit
    def inner(params, batch):
        loss = _loss(params, batch)
        jaxshard.check(jnp.isfinite(loss), "loss is {loss}", loss=loss)
        return loss

    step = jaxshard.checked(
        lambda params, batch: inner(params, batch), inputs_finite=True
    )
    with pytest.raises(jaxshard.CheckError, match="the input 'batch' was not finite"):
        step(PARAMS, BAD)
    with pytest.raises(jaxshard.CheckError) as e:
        with jaxshard.deferred_checks():
            step(PARAMS, BATCH)
            step(PARAMS, BAD)
    assert str(e.value).startswith(
        "the input 'batch' was not finite (origin, call 1) (deferred)"
    )
    assert e.value.failures[0].call == 1


@pytest.mark.parametrize("jitted", [True, False])
def test_deferred_the_origin_is_the_first_calls_input(jitted):
    """An input made non-finite at call 2 makes the state non-finite from call 3 on:
    the origin is the input of call 2, and the state's failure later follows it."""

    @jax.jit
    def update(w, s):
        y = w * s
        jaxshard.check(jnp.isfinite(y).all(), "y is {y}", y=y.sum())
        return w + s

    step = jaxshard.checked(
        update if jitted else lambda w, s: update(w, s), inputs_finite=True
    )
    w, s = jnp.ones(3), jnp.ones(3)
    with pytest.raises(jaxshard.CheckError) as e:
        with jaxshard.deferred_checks():
            for i in range(4):
                w = step(w, s.at[0].set(jnp.nan) if i == 2 else s)
    head = str(e.value).splitlines()[0]
    assert head.startswith("the input 's' was not finite (origin, call 2) (deferred)")
    assert head.endswith("2 checks after it failed and may follow from it:")
    found = [(f.origin, f.call) for f in e.value.failures]
    assert found == [("s", 2), (None, 2), ("w", 3)]


def test_a_misnamed_input():
    with pytest.raises(ValueError, match="names 'bacth'.*Did you mean 'batch'"):
        jaxshard.checked(_step, inputs_finite=["bacth"])
    with pytest.raises(TypeError, match="inputs_finite"):
        jaxshard.checked(_step, inputs_finite="batch")
