"""jaxshard's errors end at the user's call: its own frames, and the checkers'
(jaxtyping's, beartype's), are left out of their tracebacks, as JAX leaves out its
internals; `JAX_TRACEBACK_FILTERING=off` keeps them."""

import traceback

import beartype
import jax
import jax.numpy as jnp
import pytest
from helpers import put
from jax import Array
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard import Float


Row = Float[Array, "b d", P("dp", None)]


@jaxshard.jaxtyped(typechecker=beartype.beartype)
def rows(x: Row) -> Row:
    return x * 2


@jaxshard.jaxtyped(typechecker=beartype.beartype)
def outer(x: Float[Array, "b d"]) -> Float[Array, "b d"]:
    return rows(x)  # the call that fails, in the user's code


@jaxshard.checked
@jax.jit
def positive(x):
    jaxshard.check(jnp.all(x > 0), "x has {n} entries <= 0", n=jnp.sum(x <= 0))
    return x


def deferred(x):
    with jaxshard.deferred_checks():
        positive(x)


def frames(call) -> list[tuple[str, str]]:
    """`(file name, function)` of each frame of what `call` raises."""
    with pytest.raises(Exception) as caught:
        call()
    assert isinstance(caught.value, (jaxshard.TypeCheckError, jaxshard.CheckError))
    tb = traceback.extract_tb(caught.value.__traceback__)
    return [(f.filename.rsplit("/", 1)[-1], f.name) for f in tb]


def calls(mesh):
    wrong = put((8, 4), mesh, P(None, "tp"))
    negative = -put((8, 4), mesh, P("dp", None))
    return {
        "eager": (lambda: rows(wrong), "<lambda>"),
        "nested": (lambda: outer(wrong), "outer"),
        "jit": (lambda: jax.jit(rows)(wrong), "<lambda>"),
        "checked": (lambda: jaxshard.checked(jax.jit(rows))(wrong), "<lambda>"),
        "check": (lambda: positive(negative), "<lambda>"),
        "deferred": (lambda: deferred(negative), "deferred"),
        "check_tree": (lambda: jaxshard.check_tree([wrong], list[Row]), "<lambda>"),
        "check_partitioning": (
            lambda: jaxshard.check_partitioning([wrong], [P("dp")]),
            "<lambda>",
        ),
        "constrain": (
            lambda: jax.jit(jaxshard.constrain, static_argnums=1)(
                jnp.ones((3, 4)), Row
            ),
            "<lambda>",
        ),  # fmt: skip
        "verify": (
            lambda: jaxshard.verify(outer, mesh=mesh, values={"x": wrong}),
            "<lambda>",
        ),
    }


ENTRIES = ["eager", "nested", "jit", "checked", "check", "deferred", "check_tree",
           "check_partitioning", "constrain", "verify"]  # fmt: skip


@pytest.mark.parametrize("entry", ENTRIES)
def test_the_last_frame_is_the_users_call(mesh, entry):
    call, function = calls(mesh)[entry]
    with jax.set_mesh(mesh):
        found = frames(call)
    assert found[-1] == ("test_tracebacks.py", function), found
    assert not any("jaxshard" in f or "jaxtyping" in f for f, _ in found), found


def test_jax_traceback_filtering_off_keeps_every_frame(mesh, monkeypatch):
    monkeypatch.setenv("JAX_TRACEBACK_FILTERING", "off")
    wrong = put((8, 4), mesh, P(None, "tp"))
    found = frames(lambda: rows(wrong))
    assert ("decorator.py", "wrapper") in found
