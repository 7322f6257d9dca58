"""MaxText's rule table (tests/styles.py, `MAXTEXT_RULES`: lists of lists as its YAML
loads, [] for unsharded, a name given twice as a fallback) on a mesh that names
every parallelism, most axes of size 1, with a linen decoder of MLP and MoE blocks in
MaxText's logical names (issue 49)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax import Array
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from styles import (
    make_maxtext,
    MAXTEXT_MESH_AXES,
    MAXTEXT_MESH_SHAPE,
    MAXTEXT_RULES,
    misplaced,
    MtDecoder,
    MtTokens,
)

import jaxshard
from jaxshard import Float, L


WO = "['params']['mlp_1']['wo']"  # ("mlp", "embed"): P('tensor', 'fsdp') on this mesh


@pytest.fixture(scope="module")
def maxtext():
    assert jax.device_count() == 8
    mesh = jax.make_mesh(
        MAXTEXT_MESH_SHAPE, MAXTEXT_MESH_AXES, axis_types=(AxisType.Auto,) * 9
    )
    return mesh, *make_maxtext(mesh)


@pytest.mark.parametrize(
    "names",
    [
        ("embed", "mlp"),
        ("mlp", "embed"),
        ("exp", "embed_moe", "mlp_moe"),
        ("exp", "mlp_moe", "embed_moe"),
        ("vocab", "embed"),
        ("embed", None),
        ("norm",),
        ("embed", "heads", "kv"),
        ("activation_batch", "activation_length", "activation_embed"),
        ("activation_batch", "activation_length", "activation_mlp"),
        ("activation_batch", "activation_kv_length", "activation_embed"),
        ("cache_batch", "heads"),
    ],
)
def test_the_table_resolves_as_flax_resolves_it(names):
    annotation = Float[Array, " ".join(f"d{i}" for i in range(len(names))), L(*names)]
    with jaxshard.axis_rules(MAXTEXT_RULES):
        spec = jaxshard.partition_spec(annotation)
    assert spec == nn.logical_to_mesh_axes(names, MAXTEXT_RULES)


def test_the_decoder_holds_its_contracts(maxtext):
    mesh, model, params, batch = maxtext
    with jax.set_mesh(mesh), jaxshard.axis_rules(MAXTEXT_RULES):
        jaxshard.check_partitioning(params)
        eager = model.apply(params, batch)
        jitted = jax.jit(model.apply)(params, batch)
    assert jnp.allclose(eager, jitted, atol=1e-4)


def test_a_weight_laid_out_without_its_size_one_axes_passes(maxtext):
    """P('tensor', 'fsdp') is the metadata's P(('fsdp_transpose', 'tensor',
    'tensor_sequence', 'autoregressive'), ('fsdp', 'context', 'expert')) on this
    mesh, where only fsdp and tensor have more than one device."""
    mesh, model, params, batch = maxtext
    short = misplaced(params, WO, NamedSharding(mesh, P("tensor", "fsdp")))
    with jax.set_mesh(mesh), jaxshard.axis_rules(MAXTEXT_RULES):
        jaxshard.check_partitioning(short)
        jax.jit(model.apply)(short, batch)


def test_a_misplaced_weight_is_named_by_its_path(maxtext):
    mesh, _, params, _ = maxtext
    wrong = misplaced(params, WO, NamedSharding(mesh, P("fsdp", "tensor")))
    with jax.set_mesh(mesh), jaxshard.axis_rules(MAXTEXT_RULES):
        with pytest.raises(jaxshard.ShardingError) as caught:
            jaxshard.check_partitioning(wrong)
    message = str(caught.value)
    assert f"params{WO}" in message.splitlines()[0]
    assert "P('fsdp', 'tensor')" in message
    assert "L('mlp', 'embed')" in message


def test_a_name_from_another_tables_is_named_on_the_expert_weight(maxtext):
    """moe_1's wi names an axis 'moe_e_up_embed' (qwen3's): flax leaves it unsharded
    without a word; under jaxshard's rules the weight is named, with the name."""
    mesh = maxtext[0]
    _, params, _ = make_maxtext(mesh, wrong_moe_layer=1)
    with jax.set_mesh(mesh), jaxshard.axis_rules(MAXTEXT_RULES):
        with pytest.raises(jaxshard.ShardingError) as caught:
            jaxshard.check_partitioning(params)
    message = str(caught.value)
    assert "params['params']['moe_1']['wi']" in message.splitlines()[0]
    assert "'moe_e_up_embed'" in message
    assert "moe_0" not in message and "moe_2" not in message


def test_a_name_the_table_lacks_in_an_annotation_names_the_parameter(maxtext):
    mesh = maxtext[0]
    Moe = Float[
        Array,
        "batch length embed",
        L("activation_batch", "activation_length", "activation_embed_moe"),
    ]

    @jaxshard.jaxtyped
    def combine(x: Moe) -> Moe:
        return x * 2

    x = jax.device_put(jnp.ones((8, 16, 32)), NamedSharding(mesh, P("fsdp")))
    with jax.set_mesh(mesh), jaxshard.axis_rules(MAXTEXT_RULES):
        with pytest.raises(jaxshard.ShardingError) as caught:
            combine(x)
    message = str(caught.value)
    assert "combine" in message and "parameter 'x'" in message
    assert "'activation_embed_moe'" in message


def forward(params: jaxshard.Partitioned, tokens: MtTokens):
    return MtDecoder().apply(params, tokens)


@pytest.mark.tpu_topology
def test_the_decoder_verifies_for_a_v5e_slice(tpu_topology):
    mesh = tpu_topology("v5e:2x4", dict(zip(MAXTEXT_MESH_AXES, MAXTEXT_MESH_SHAPE)))
    tokens = jnp.zeros((8, 16), jnp.int32)
    with nn.logical_axis_rules(MAXTEXT_RULES):
        abstract = jax.eval_shape(MtDecoder().init, jax.random.key(0), tokens)
        shardings = nn.logical_to_mesh_sharding(
            nn.get_partition_spec(abstract), mesh, MAXTEXT_RULES
        )
    params = jax.tree.map(
        lambda box, sharding: box.replace_boxed(
            jax.ShapeDtypeStruct(box.value.shape, box.value.dtype, sharding=sharding)
        ),
        abstract,
        shardings,
        is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned),
    )
    report = jaxshard.verify(
        forward,
        mesh=mesh,
        dims={"batch": 8, "length": 16},
        values={"params": params},
        rules=MAXTEXT_RULES,
    )
    assert report.ok
    blocks = {row.function for row in report.rows}
    assert {"MtMlpBlock.__call__", "MtMoeBlock.__call__"} <= blocks
