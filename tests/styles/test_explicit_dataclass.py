"""Plain JAX on Explicit axes as jax-llm-examples' llama3 writes it (tests/styles.py,
`Weights`, `forward`, `prefill`, `decode_step`): registered dataclass weights whose
fields an adopter annotates in the model's logical names, a `ShardingRules`
dataclass for the rules, `Weights.shardings(cfg)` for the layouts (issue 49)."""

import dataclasses
import os
import traceback

import jax
import jax.numpy as jnp
import pytest
from jax import Array
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
    rule_pairs,
    ShardingRules,
    Weights,
    WUp,
)

import jaxshard
from jaxshard import Float, L


# Placed P(None, ('y', 'z')) in the tests, where its rules say P(('y', 'z'), None).
W_DOWN = ".layers[1].ffw.w_down"


@pytest.fixture(scope="module")
def llama():
    assert jax.device_count() == 8
    mesh = jax.make_mesh(
        (2, 2, 2), LLAMA_MESH_AXES, axis_types=(AxisType.Explicit,) * 3
    )
    cfg = llama_config(mesh)
    weights = Weights.init(jax.random.key(0), cfg)
    tokens = jax.random.randint(jax.random.key(1), (4, 8), 0, cfg.vocab_size)
    tokens = jax.device_put(tokens, NamedSharding(mesh, P("x", None)))
    return cfg, weights, tokens


def wrong(llama):
    cfg, weights, _ = llama
    return misplaced(weights, W_DOWN, NamedSharding(cfg.mesh, P(None, ("y", "z"))))


def _ends_in_this_file(error: BaseException) -> bool:
    last = traceback.extract_tb(error.__traceback__)[-1]
    return os.path.samefile(last.filename, __file__)


# --- the rules: the config's dataclass ------------------------------------------------


@pytest.mark.parametrize("form", ["dataclass", "mapping", "pairs"])
def test_axis_rules_takes_the_configs_sharding_rules(form):
    rules = ShardingRules()
    table = {
        "dataclass": rules,
        "mapping": dataclasses.asdict(rules),
        "pairs": rule_pairs(rules),
    }[form]
    with jaxshard.axis_rules(table):
        assert jaxshard.partition_spec(WUp) == P(None, ("y", "z"))
        down = Float[Array, "e f d", L("moe_e_experts", "moe_e_down_ffw", None)]
        assert jaxshard.partition_spec(down) == P("z", "y", None)


def test_rules_from_the_config_at_the_entry_point(llama):
    """axis_rules(lambda cfg: cfg.rules) on the entry point: the rules the call's
    own config carries, with no table in force around the call."""
    cfg, weights, tokens = llama
    entry = jaxshard.axis_rules(lambda cfg: cfg.rules)(forward)
    with jax.set_mesh(cfg.mesh):
        logits, _ = jax.jit(entry)(tokens, weights, cfg)
        with pytest.raises(jaxshard.ShardingError) as caught:
            jax.jit(entry)(tokens, wrong(llama), cfg)
    assert logits.shape == (4, 8, cfg.vocab_size)
    assert W_DOWN in str(caught.value)


# --- (1) the contracts hold on the code as written ------------------------------------


def test_forward_holds_its_contracts_eagerly_and_jitted(llama):
    cfg, weights, tokens = llama
    with jax.set_mesh(cfg.mesh), jaxshard.axis_rules(cfg.rules):
        eager, _ = forward(tokens, weights, cfg)
        jitted, _ = jax.jit(forward)(tokens, weights, cfg)
    assert jax.typeof(jitted).sharding.spec == P("x", None, ("y", "z"))
    assert jnp.allclose(eager, jitted, atol=1e-4)


def test_prefill_then_decode_hold_their_contracts(llama):
    """llama3's serving path: prefill jitted with the cache donated and out_shardings
    from KVCache.shardings(cfg), then decode steps with the cache donated."""
    cfg, weights, tokens = llama
    with jax.set_mesh(cfg.mesh), jaxshard.axis_rules(cfg.rules):
        cache = KVCache.init(jax.random.key(2), cfg, 4)
        logits, cache = prefill(tokens, weights, cache, cfg)
        last = jax.sharding.reshard(jnp.argmax(logits[:, -1:], -1), P("x", None))
        for _ in range(2):
            next_tokens, cache = decode_step(last, weights, cache, cfg)
            last = jax.sharding.reshard(next_tokens[:, None], P("x", None))
        jaxshard.check_tree(cache)
    assert int(cache.iter) == 10
    assert jax.typeof(cache.k[0]).sharding.spec == P("x", "y", None, None)


# --- (2) a misplaced weight -----------------------------------------------------------


def test_a_misplaced_weight_is_named_by_its_path(llama):
    cfg, _, tokens = llama
    with jax.set_mesh(cfg.mesh), jaxshard.axis_rules(cfg.rules):
        for run in (jaxshard.check_tree, lambda w: jax.jit(forward)(tokens, w, cfg)):
            with pytest.raises(jaxshard.ShardingError) as caught:
                run(wrong(llama))
            message = str(caught.value)
            assert W_DOWN in message.splitlines()[0]
            assert "P(None, ('y', 'z'))" in message and "P(('y', 'z'), None)" in message


def test_a_misplaced_weight_is_named_on_the_first_line(llama):
    cfg, _, _ = llama
    with jax.set_mesh(cfg.mesh), jaxshard.axis_rules(cfg.rules):
        with pytest.raises(jaxshard.ShardingError) as caught:
            jaxshard.check_tree(wrong(llama))
    assert W_DOWN in str(caught.value).splitlines()[0]


def test_the_traceback_of_check_tree_ends_at_the_users_call(llama):
    cfg, _, _ = llama
    with jax.set_mesh(cfg.mesh), jaxshard.axis_rules(cfg.rules):
        with pytest.raises(jaxshard.ShardingError) as caught:
            jaxshard.check_tree(wrong(llama))
    assert _ends_in_this_file(caught.value)


# --- check_partitioning against a layout tree -----------------------------------------


@pytest.mark.parametrize(
    "layouts", ["Weights.shardings", "x.sharding", "ShapeDtypeStruct"]
)
def test_check_partitioning_takes_a_layout_tree(llama, layouts):
    cfg, weights, _ = llama
    tree = {
        "Weights.shardings": lambda: Weights.shardings(cfg),
        "x.sharding": lambda: jax.tree.map(lambda x: x.sharding, weights),
        "ShapeDtypeStruct": lambda: abstract_weights(cfg),
    }[layouts]()
    jaxshard.check_partitioning(weights, tree, name="weights")
    with pytest.raises(jaxshard.ShardingError) as caught:
        jaxshard.check_partitioning(wrong(llama), tree, name="weights")
    message = str(caught.value)
    assert W_DOWN in message.splitlines()[0]
    assert f"weights{W_DOWN} is" in message
    assert "P(None, ('y', 'z'))" in message
    assert "the layout tree says P(('y', 'z'), None)" in message
    assert "annotation" not in message


# --- verify, for a TPU slice ----------------------------------------------------------


@pytest.mark.tpu_topology
def test_forward_verifies_for_a_v5e_slice(tpu_topology):
    mesh = tpu_topology("v5e:2x4", dict(zip(LLAMA_MESH_AXES, (2, 2, 2))))
    mesh = jax.sharding.Mesh(
        mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit,) * 3
    )
    cfg = llama_config(mesh)
    values = {"weights": abstract_weights(cfg), "cfg": cfg}
    dims = {"batch": 8, "seq": 16}
    report = jaxshard.verify(
        forward, mesh=mesh, dims=dims, values=values, rules=cfg.rules
    )
    assert report.ok
    functions = {row.function for row in report.rows}
    assert {"forward", "check_tree", "mlp_block", "attention_block"} <= functions

    wrong_down = jax.ShapeDtypeStruct(
        (cfg.ffw_size, cfg.embed),
        jnp.float32,
        sharding=NamedSharding(mesh, P(None, ("y", "z"))),
    )
    values["weights"].layers[1].ffw.w_down = wrong_down
    with pytest.raises(jaxshard.ShardingError) as caught:
        jaxshard.verify(forward, mesh=mesh, dims=dims, values=values, rules=cfg.rules)
    assert W_DOWN in str(caught.value).splitlines()[0]
    assert _ends_in_this_file(caught.value)


@jaxshard.jaxtyped
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CheckedMlp:
    """A registered dataclass whose fields are checked when it is made, as the docs
    suggest for modules (`@jaxshard.jaxtyped` on the class)."""

    w_up: WUp
    w_down: Float[Array, "ffw embed", L("ffw_down", "embed_down")]


def test_a_checked_registered_dataclass_goes_through_jax_tree_functions(llama):
    cfg, weights, _ = llama
    ffw = weights.layers[0].ffw
    with jax.set_mesh(cfg.mesh), jaxshard.axis_rules(cfg.rules):
        mlp = CheckedMlp(ffw.w_up, ffw.w_down)
        shardings = jax.tree.map(lambda x: x.sharding, mlp)
        jax.eval_shape(lambda m: m, mlp)
        jax.jit(lambda m: m, out_shardings=shardings)(mlp)
