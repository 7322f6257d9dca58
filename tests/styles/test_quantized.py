"""int8 weights as jax-llm-examples' llama3 and qwen3 keep them (tests/styles.py,
`QuantArray`): a dataclass of int8 values and a scale, in fields an adopter annotates
`Float[Array, "embed ffw", L(...)] | QuantArray` (issue 49)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from styles import (
    abstract_weights,
    decode_step,
    forward,
    KVCache,
    llama_config,
    LLAMA_MESH_AXES,
    misplaced,
    prefill,
    QuantArray,
    Weights,
)

import jaxshard


@pytest.fixture(scope="module")
def quantized():
    assert jax.device_count() == 8
    mesh = jax.make_mesh(
        (2, 2, 2), LLAMA_MESH_AXES, axis_types=(AxisType.Explicit,) * 3
    )
    cfg = llama_config(mesh, quant_layer=True, moe_layers=(1,))
    weights = Weights.init(jax.random.key(0), cfg)
    assert isinstance(weights.layers[0].ffw.w_up, QuantArray)
    assert isinstance(weights.layers[1].ffw.we_up, QuantArray)
    tokens = jax.random.randint(jax.random.key(1), (4, 8), 0, cfg.vocab_size)
    return cfg, weights, jax.device_put(tokens, NamedSharding(mesh, P("x", None)))


def test_check_tree_passes_when_the_quantarray_arm_holds(quantized):
    cfg, weights, _ = quantized
    with jax.set_mesh(cfg.mesh), jaxshard.axis_rules(cfg.rules):
        jaxshard.check_tree(weights)
        jax.jit(jaxshard.check_tree)(weights)


def test_check_tree_checks_the_array_arm_when_it_holds(quantized):
    """Layer 0's w_up dequantized into a plain array, placed transposed: the
    union's array arm holds it, and its annotation's layout is checked."""
    cfg, weights, _ = quantized
    w = weights.layers[0].ffw.w_up
    dense = w.quant.astype(jnp.float32) * w.scale
    weights.layers[0].ffw.w_up = jax.device_put(
        dense, NamedSharding(cfg.mesh, P(("y", "z"), None))
    )
    try:
        with jax.set_mesh(cfg.mesh), jaxshard.axis_rules(cfg.rules):
            with pytest.raises(jaxshard.ShardingError) as caught:
                jaxshard.check_tree(weights)
    finally:
        weights.layers[0].ffw.w_up = w
    message = str(caught.value)
    assert "layers[0].ffw.w_up" in message.splitlines()[0]
    assert "P(None, ('y', 'z'))" in message and "P(('y', 'z'), None)" in message
    assert "we_up" not in message and "w_down" not in message


def test_the_quantized_model_prefills_and_decodes_under_its_contracts(quantized):
    cfg, weights, tokens = quantized
    with jax.set_mesh(cfg.mesh), jaxshard.axis_rules(cfg.rules):
        jitted, _ = jax.jit(forward)(tokens, weights, cfg)
        cache = KVCache.init(jax.random.key(2), cfg, 4)
        logits, cache = prefill(tokens, weights, cache, cfg)
        last = jax.sharding.reshard(jnp.argmax(logits[:, -1:], -1), P("x", None))
        next_tokens, cache = decode_step(last, weights, cache, cfg)
    assert jnp.allclose(jitted, logits, atol=1e-4)
    assert next_tokens.shape == (4,) and int(cache.iter) == 9


def test_a_misplaced_int8_block_is_named_against_the_layout_tree(quantized):
    """Weights.shardings(cfg) holds a QuantArray of two shardings where a weight is
    quantized: the int8 values placed transposed are named by their path."""
    cfg, weights, _ = quantized
    path = ".layers[0].ffw.w_down.quant"
    bad = misplaced(weights, path, NamedSharding(cfg.mesh, P(None, ("y", "z"))))
    for layouts in (Weights.shardings(cfg), abstract_weights(cfg)):
        jaxshard.check_partitioning(weights, layouts, name="weights")
        with pytest.raises(jaxshard.ShardingError) as caught:
            jaxshard.check_partitioning(bad, layouts, name="weights")
        message = str(caught.value)
        assert path in message.splitlines()[0]
        assert f"weights{path} is" in message
        assert "the layout tree says P(('y', 'z'), None)" in message


@pytest.mark.tpu_topology
def test_the_quantized_model_verifies_for_a_v5e_slice(tpu_topology):
    mesh = tpu_topology("v5e:2x4", dict(zip(LLAMA_MESH_AXES, (2, 2, 2))))
    mesh = jax.sharding.Mesh(
        mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit,) * 3
    )
    cfg = llama_config(mesh, quant_layer=True, moe_layers=(1,))
    values = {"weights": abstract_weights(cfg), "cfg": cfg}
    report = jaxshard.verify(
        forward, mesh=mesh, dims={"batch": 8, "seq": 16}, values=values, rules=cfg.rules
    )
    assert report.ok
    checked = {row.name for row in report.rows if row.function == "check_tree"}
    assert "Weights.layers[0].attn.q" in checked  # the array arms, compared
