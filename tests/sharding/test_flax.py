"""flax nnx and linen modules with sharded annotations."""

import beartype
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import put
from jax import Array
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

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


# --- a decoder as flax's NNX examples write one ---------------------------------------

EMBED, MLP = 16, 32
RULES = (("batch", "data"), ("embed", "fsdp"), ("mlp", "model"))


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.norm = nnx.LayerNorm(EMBED, rngs=rngs)  # no partitioning: replicated
        self.up = nnx.Linear(
            EMBED,
            MLP,
            kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
            use_bias=False,
            rngs=rngs,
        )
        self.down = nnx.Linear(
            MLP,
            EMBED,
            kernel_init=nnx.with_partitioning(init, ("mlp", "embed")),
            use_bias=False,
            rngs=rngs,
        )

    def __call__(self, x):
        return x + self.down(jax.nn.relu(self.up(self.norm(x))))


class Decoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, layers: int = 3):
        self.blocks = nnx.List([Block(rngs) for _ in range(layers)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def lm_mesh():
    assert jax.device_count() == 8
    return jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"), (AxisType.Auto,) * 3)


def unplaced_decoder() -> Decoder:
    """Made outside any mesh, as flax's docs allow: every array on device 0."""
    with nnx.use_eager_sharding(False):
        return Decoder(nnx.Rngs(0))


def test_device_put_replicates_an_nnx_models_unpartitioned_weights():
    """The kernels as their metadata says; the LayerNorms' scale and bias, which
    carry no partitioning, replicated over the mesh rather than left on device 0."""
    mesh, model = lm_mesh(), unplaced_decoder()
    assert len(model.blocks[0].norm.scale[...].sharding.device_set) == 1
    with nnx.logical_axis_rules(RULES):
        placed = jaxshard.device_put(model, mesh)
        table = str(jaxshard.summary(placed))
    block = placed.blocks[2]
    assert block.up.kernel[...].sharding == NamedSharding(mesh, P("fsdp", "model"))
    assert block.down.kernel[...].sharding == NamedSharding(mesh, P("model", "fsdp"))
    for x in (block.norm.scale[...], block.norm.bias[...]):
        assert x.sharding == NamedSharding(mesh, P())
    assert all(
        len(x.sharding.device_set) == 8 for x in jax.tree.leaves(nnx.state(placed))
    )
    assert "one device" not in table and "Decoder.blocks[0].norm.scale" in table
    assert len(model.blocks[0].norm.scale[...].sharding.device_set) == 1  # unchanged
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        y = nnx.jit(lambda m, x: m(x))(placed, jnp.ones((4, EMBED)))
    assert y.shape == (4, EMBED)
