"""flax nnx and linen modules with sharded annotations."""

import beartype
import flax.linen as nn
import jax
import pytest
from flax import nnx
from helpers import put
from jax import Array
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard import Float


checked = jaxshard.jaxtyped(typechecker=beartype.beartype)


@checked
def dense(
    x: Float[Array, "b d", P("dp", None)], w: Float[Array, "d f", P(None, "tp")]
) -> Float[Array, "b f", P("dp", "tp")]:
    return x @ w


class Linear(nnx.Module):
    def __init__(self, w):
        self.w = nnx.Param(w)

    @checked
    def __call__(self, x: Float[Array, "b d", P("dp", None)]) -> Float[Array, "b f"]:
        return dense(x, self.w[...])


def test_nnx_module_under_nnx_jit(mesh):
    x = put((8, 4), mesh, P("dp"))
    forward = nnx.jit(lambda m, x: m(x))
    with jax.set_mesh(mesh):
        assert forward(Linear(put((4, 8), mesh, P(None, "tp"))), x).shape == (8, 8)
        with pytest.raises(jaxshard.ShardingError, match="parameter 'w'"):
            forward(Linear(put((4, 8), mesh, P("tp", None))), x)


class LinenDense(nn.Module):
    features: int

    @checked
    @nn.compact
    def __call__(self, x: Float[Array, "b d", P("dp", None)]) -> Float[Array, "b f"]:
        w = self.param("w", nn.initializers.ones, (x.shape[1], self.features))
        return dense(x, w)


def test_linen_module_under_jit(mesh):
    model = LinenDense(8)
    x = put((8, 4), mesh, P("dp"))
    params = {"params": {"w": put((4, 8), mesh, P(None, "tp"))}}
    apply = jax.jit(model.apply)
    with jax.set_mesh(mesh):
        assert apply(params, x).shape == (8, 8)
        bad = {"params": {"w": put((4, 8), mesh, P("tp", None))}}
        with pytest.raises(jaxshard.ShardingError, match="parameter 'w'"):
            apply(bad, x)


class Annotated(nnx.Module):
    w: nnx.Param[Float[Array, "d f", P(None, "tp")]]
    b: Float[Array, "f", P("tp")]

    def __init__(self, w, b):
        self.w = nnx.Param(w)
        self.b = b


def test_check_tree_on_an_nnx_module(mesh):
    """nnx Modules are not dataclasses: jaxtyping checks nothing when one is made.
    `check_tree` reads their annotated attributes, and the arrays Params hold."""
    good = Annotated(put((4, 8), mesh, P(None, "tp")), put((8,), mesh, P("tp")))
    jaxshard.check_tree(good)
    bad = Annotated(put((4, 8), mesh, P("tp", None)), put((8,), mesh, P()))
    with pytest.raises(jaxshard.ShardingError) as e:
        jaxshard.check_tree(bad)
    assert "- Annotated.w: " in str(e.value) and "- Annotated.b: " in str(e.value)

    @nnx.jit
    def forward(m, x):
        jaxshard.check_tree(m)
        return x @ m.w[...]

    x = put((8, 4), mesh, P("dp"))
    with jax.set_mesh(mesh):
        forward(good, x)
        with pytest.raises(jaxshard.ShardingError, match="Annotated.w"):
            forward(bad, x)
