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


def misplaced_decoder(mesh) -> Decoder:
    """The decoder placed by its metadata, then block 0's up kernel placed with
    jax.device_put P('model', 'fsdp'), where its metadata says ('embed', 'mlp'):
    P('fsdp', 'model') under RULES."""
    with nnx.logical_axis_rules(RULES):
        model = jaxshard.device_put(unplaced_decoder(), mesh)
    kernel = model.blocks[0].up.kernel
    kernel.set_value(
        jax.device_put(kernel[...], NamedSharding(mesh, P("model", "fsdp")))
    )
    return model


@pytest.mark.parametrize("rules", ["nnx", "jaxshard"])
def test_check_tree_checks_nnx_weights_against_their_metadata(rules):
    """No annotation reaches a weight an nnx layer makes: `check_tree` checks it
    against its `with_partitioning` metadata, under flax's rules or jaxshard's."""
    mesh = lm_mesh()
    model = misplaced_decoder(mesh)
    scope = nnx.logical_axis_rules if rules == "nnx" else jaxshard.axis_rules
    with scope(RULES):
        with pytest.raises(jaxshard.ShardingError) as e:
            jaxshard.check_tree(model, name="model")
        jaxshard.check_tree(misplaced_decoder(mesh).blocks[1])  # its own are right
    message = str(e.value)
    assert message.startswith("check_tree(model): model.blocks[0].up.kernel is ")
    assert "sharded as P('model', 'fsdp')" in message
    assert "where its metadata says P('fsdp', 'model')" in message
    assert len(message.splitlines()) == 1  # one weight is wrong, no other


def test_check_tree_without_the_rules_says_to_use_them():
    mesh = lm_mesh()
    with nnx.logical_axis_rules(RULES):
        model = jaxshard.device_put(unplaced_decoder(), mesh)
    with pytest.raises(jaxshard.ShardingError) as e:
        jaxshard.check_tree(model)
    message = str(e.value)
    assert "6 arrays are not partitioned as their metadata says" in message
    assert "its metadata's spec P('embed', 'mlp') names mesh axes 'embed', 'mlp'" in (
        message
    )
    assert message.splitlines()[-1].startswith("No axis rules are in force")


class Tied(nnx.Module):
    """A Param both annotated and carrying metadata: the annotation says."""

    w: nnx.Param[Float[Array, "d f", P(None, "model")]]

    def __init__(self, w):
        self.w = nnx.Param(w, out_sharding=("model", None))


def test_check_tree_an_annotation_wins_over_metadata():
    mesh = lm_mesh()
    x = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P(None, "model")))
    with nnx.use_eager_sharding(False):  # flax leaves it as it is given
        model = Tied(x)
    jaxshard.check_tree(model)  # as annotated, whatever the metadata says
    model.w.set_value(jax.device_put(x, NamedSharding(mesh, P("model", None))))
    with pytest.raises(jaxshard.ShardingError, match="but the annotation expects"):
        jaxshard.check_tree(model)


def step(model: Decoder, x: Float[Array, "b d"]) -> Float[Array, ""]:
    return model(x).sum()


loss = checked(step)


def test_a_jaxtyped_parameter_annotated_as_an_nnx_module_checks_its_weights():
    """`model: Decoder` is checked whole in an eager call, each Variable against its
    metadata. Inside `jit` its weights are tracers, laid out as the step's inputs:
    they add no check (and no probe) to the program; `check_tree` checks them
    there."""
    mesh = lm_mesh()
    x = jnp.ones((4, EMBED))

    def checking(model, x):
        jaxshard.check_tree(model, name="model")
        return step(model, x)

    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        good = jaxshard.device_put(unplaced_decoder())
        assert loss(good, x).shape == ()
        model = misplaced_decoder(mesh)
        with pytest.raises(jaxshard.ShardingError) as eager:
            loss(model, x)
        assert nnx.jit(loss)(model, x).shape == ()
        with pytest.raises(jaxshard.ShardingError) as jitted:
            nnx.jit(checking)(model, x)
    first = str(eager.value).splitlines()[0]
    assert first.startswith(f"{__name__}.step, parameter 'model': ")
    assert "model.blocks[0].up.kernel is sharded as P('model', 'fsdp')" in first
    assert "where its metadata says P('fsdp', 'model')" in first
    assert "model.blocks[0].up.kernel" in str(jitted.value)


def test_typechecker_none_checks_no_module_parameter():
    mesh = lm_mesh()

    @jaxshard.jaxtyped(typechecker=None)
    def unchecked(model: Decoder, x: Float[Array, "b d"]):
        return model(x).sum()

    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        assert unchecked(misplaced_decoder(mesh), jnp.ones((4, EMBED))).shape == ()
