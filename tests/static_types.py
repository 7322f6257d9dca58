"""Checked by mypy (`nox -s lint`), not run: what static type checkers see of
jaxshard's annotations. Each `assert_type` fails the lint if the type differs."""

from typing import assert_type

import jax.numpy as jnp
from jax import Array
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard import Float, Int32


X = Float[Array, "[batch/dp] d"]  # the compact syntax, as a type alias
Tokens = Int32[Array, "batch seq", P("dp", None)]


@jaxshard.jaxtyped
def f(
    x: Float[Array, "b d", P("dp", None)],
    y: X,
    t: Tokens,
    z: jaxshard.Shaped[Array, ""],
) -> Float[Array, "b d", P("dp", None)]:
    assert_type(x, Array)
    assert_type(y, Array)
    assert_type(t, Array)
    assert_type(z, Array)
    return x + y


assert_type(
    f(jnp.ones((2, 3)), jnp.ones((2, 3)), jnp.ones((2, 3), int), jnp.ones(())), Array
)
assert_type(jaxshard.Array, type[Array])
