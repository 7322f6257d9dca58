"""Real-shaped models (tests/decoders.py: flax linen, flax nnx and equinox decoders
with logical rules, optax state and a jitted train step with shardings and donation):
their own code paths keep working with contracts on, and a mistake is traced to its
cause."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from decoders import (
    BATCH,
    LENGTH,
    LinenDecoder,
    make_equinox,
    make_linen,
    make_nnx,
    RULES,
)
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxshard


MAKERS = {"linen": make_linen, "nnx": make_nnx, "equinox": make_equinox}


def pod(kind=AxisType.Auto):
    return jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(kind,) * 3)


@pytest.mark.parametrize("name", list(MAKERS))
def test_a_decoder_trains_with_its_contracts_on(name):
    mesh = pod()
    decoder = MAKERS[name](mesh)
    with jax.set_mesh(mesh), jaxshard.axis_rules(RULES):
        state, first = decoder.step(decoder.state, decoder.batch)
        state, second = decoder.step(state, decoder.batch)
    assert jnp.isfinite(first) and jnp.isfinite(second)


def test_linen_init_path_checks_no_dummy_batch():
    """flax's init, eagerly, jitted or under eval_shape, with or without rules in
    force: the dummy batch of an init is not data, so activation contracts say
    nothing there; the same contracts hold the model's real batches to account."""
    mesh = pod()
    model = LinenDecoder()
    dummy = jnp.ones((BATCH, LENGTH), jnp.int32)  # uncommitted: on one device
    key = jax.random.key(0)
    abstract = jax.eval_shape(model.init, key, dummy)  # no rules, no mesh
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        assert jax.eval_shape(model.init, key, dummy) == abstract
        model.init(key, dummy)  # eagerly
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh)
        variables = jax.jit(model.init, out_shardings=shardings)(key, dummy)
        jaxshard.check_partitioning(variables)  # what init made, as its metadata says
        with pytest.raises(jaxshard.ShardingError, match="parameter 'tokens'"):
            model.apply(variables, dummy)  # a real call: the batch must be split
        placed = jax.device_put(dummy, NamedSharding(mesh, P(("data", "fsdp"))))
        assert model.apply(variables, placed).shape == (BATCH, LENGTH, 64)
