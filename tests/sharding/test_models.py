"""Real-shaped models (tests/decoders.py: flax linen, flax nnx and equinox decoders
with logical rules, optax state and a jitted train step with shardings and donation):
their own code paths keep working with contracts on, and a mistake is traced to its
cause."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from decoders import (
    BATCH,
    LENGTH,
    linen_init,
    linen_train_step,
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


@pytest.mark.parametrize("name", list(MAKERS))
def test_a_wrong_layer_is_named_by_its_weight(name):
    """One layer's MLP weight named (linen, nnx) or placed (equinox) wrongly re-lays
    the residual stream in every layer: the message names that weight by its path
    first, then the first value laid out wrong, and summarises the rest in a line
    per function."""
    mesh = pod()
    decoder = MAKERS[name](mesh, wrong_layer=1)
    with jax.set_mesh(mesh), jaxshard.axis_rules(RULES):
        with pytest.raises(jaxshard.ShardingError) as caught:
            decoder.step(decoder.state, decoder.batch)
    lines = str(caught.value).splitlines()
    weight = {
        "linen": "state.params['LinenBlock_1']['LinenMlp_0']['Dense_0']['kernel']",
        "nnx": "state[0]['blocks'][1]['mlp']['up']",
        "equinox": "state[0].blocks[1].mlp.up",
    }[name]
    assert re.fullmatch(
        r"\d+ sharding contracts violated in jit\(\w*train_step\), found when XLA "
        rf"compiled it: the likely cause is {re.escape(weight)}, laid out "
        r"P\('tensor', 'fsdp'\) where 3 of its siblings \(the same weight in the "
        r"other layers\) are P\('fsdp', 'tensor'\)\.",
        lines[0],
    )
    # (Its optimizer state is laid out as it is: said once, summarised.)
    assert lines[1] == "Also laid out unlike its siblings:"
    assert ".value" not in str(caught.value)
    summary = [line for line in lines if "laid out the same way" in line]
    assert len(summary) == 1 and "may follow from it" in summary[0]
    assert len(lines) < 20 and len(lines[0]) < 300 and max(map(len, lines[1:3])) < 200


@pytest.mark.parametrize("wrapper", ["nnx.jit", "eqx.filter_jit"])
def test_the_likely_cause_is_named_by_the_users_path_under_a_jit_wrapper(wrapper):
    """nnx.jit and eqx.filter_jit pass jax.jit their own flattening of the
    arguments: the weight is still named as the user passed it."""
    import equinox as eqx
    from decoders import _eqx_model, NnxDecoder, tokens
    from flax import nnx

    mesh = pod()
    if wrapper == "nnx.jit":

        @nnx.jit
        def create():
            model = NnxDecoder(nnx.Rngs(0), wrong_layer=1)
            state = nnx.state(model)
            specs = nnx.get_partition_spec(state)
            nnx.update(model, jax.lax.with_sharding_constraint(state, specs))
            return model

        with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
            model = create()
        jit = nnx.jit
    else:
        model, jit = _eqx_model(jax.random.key(0), mesh, wrong_layer=1), eqx.filter_jit

    @jit
    def forward(model, batch):
        return model(batch)

    with jax.set_mesh(mesh), jaxshard.axis_rules(RULES):
        with pytest.raises(jaxshard.ShardingError) as caught:
            forward(model, tokens(mesh))
    first = str(caught.value).splitlines()[0]
    assert first.endswith(
        ": the likely cause is model.blocks[1].mlp.up, laid out P('tensor', 'fsdp') "
        "where 3 of its siblings (the same weight in the other layers) are "
        "P('fsdp', 'tensor')."
    )


def test_the_first_wrong_value_points_at_where_it_was_made():
    """Without a weight to blame (the embedding's output left unconstrained), the
    first value laid out wrong says which function made it."""
    mesh = pod()
    decoder = make_nnx(mesh, constrain=False)
    with jax.set_mesh(mesh), jaxshard.axis_rules(RULES):
        with pytest.raises(jaxshard.ShardingError) as caught:
            decoder.step(decoder.state, decoder.batch)
    lines = str(caught.value).splitlines()
    assert re.search(
        r"compiled it: the likely cause is the first value laid out wrong in program "
        r"order, NnxBlock.__call__ #1 of 4, parameter 'x', P\(.*\) where the "
        r"annotation expects P\(\('data', 'fsdp'\), None, None\)\.$",
        lines[0],
    )
    assert lines[1].startswith(
        "It was made by NnxDecoder.__call__, whose own parameters conform"
    )
    assert "NnxBlock.__call__ #1 of 4" in lines[2] and "parameter 'x'" in lines[2]
    # (How far XLA carries the layout differs a little from jax to jax.)
    assert re.match(r"\d+ more values are laid out the same way", lines[3])
    assert lines[4] == "- NnxMlp.__call__ #1–#4: parameter 'x', the return value"
    assert re.fullmatch(r"- NnxBlock.__call__ #\d–#\d: the return value", lines[5])


STEPS = {"linen": "linen_train_step", "nnx": "train_step", "equinox": "train_step"}
WEIGHTS = {
    "linen": "state.params['LinenBlock_1']['LinenMlp_0']['Dense_0']['kernel']",
    "nnx": "state[0]['blocks'][1]['mlp']['up']",
    "equinox": "state[0].blocks[1].mlp.up",
}


@pytest.mark.parametrize("name", list(MAKERS))
def test_a_weight_placed_against_in_shardings_is_named(name):
    """jit's own refusal of an argument laid out otherwise than its in_shardings
    becomes a ShardingError naming the argument by its path, through `checked`."""
    mesh = pod()
    decoder = MAKERS[name](mesh)
    leaves, tree = jax.tree_util.tree_flatten_with_path(decoder.state)
    wrong = WEIGHTS[name].removeprefix("state")
    values = [
        jax.device_put(x, NamedSharding(mesh, P("tensor", "fsdp")))
        if jax.tree_util.keystr(path).removesuffix(".value") == wrong
        else x
        for path, x in leaves
    ]
    state = jax.tree_util.tree_unflatten(tree, values)
    with jax.set_mesh(mesh), jaxshard.axis_rules(RULES):
        with pytest.raises(jaxshard.ShardingError) as caught:
            jaxshard.checked(decoder.step)(state, decoder.batch)
    lines = str(caught.value).splitlines()
    assert lines[0] == (
        f"jaxshard.checked({STEPS[name]}): {WEIGHTS[name]} is P('tensor', 'fsdp'), "
        "where jax.jit's in_shardings say P('fsdp', 'tensor'); jit refuses a "
        "committed array laid out otherwise than its in_shardings (1 argument)."
    )
    assert caught.value.__cause__ is None


def test_no_mesh_in_context_is_said():
    """Outside `jax.set_mesh`, flax's logical constraints do nothing, and the
    residual stream is laid out as lm1b's was: the message says what was off."""
    mesh = pod()
    decoder = make_linen(mesh)
    with nn.logical_axis_rules(RULES):
        with pytest.raises(jaxshard.ShardingError) as caught:
            jax.jit(decoder.loss)(decoder.state, decoder.batch)
        with jax.set_mesh(mesh):
            assert jnp.isfinite(jax.jit(decoder.loss)(decoder.state, decoder.batch))
    lines = str(caught.value).splitlines()
    assert "made by LinenDecoder.__call__" in lines[1]
    assert lines[-1].startswith("No mesh was in context (`jax.set_mesh`)")
    assert "nn.with_logical_constraint" in lines[-1]


def _lm1b_style(wrong_layer=None, checks=False):
    """The linen decoder's abstract train state and its train step, as lm1b writes
    them (`checks`: with value checks on the loss and the gradients)."""
    init = linen_init(LinenDecoder(wrong_layer=wrong_layer), optax.adamw(1e-3))
    dummy = jnp.ones((BATCH, LENGTH), jnp.int32)
    with nn.logical_axis_rules(RULES):
        abstract = jax.eval_shape(init, jax.random.key(0), dummy)
    batch = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32)

    def train_step(state, batch):
        return linen_train_step(state, batch, checks)

    return train_step, {"state": abstract, "batch": batch}


def test_verify_compiles_the_real_train_step_for_a_pod():
    """A train step with value checks, verified for a TPU topology's Auto axes: it
    compiles as written, its checks compiled out and the report saying so; its
    contracts, memory and collectives are those of the step."""
    mesh = jaxshard.tpu_mesh("v5e:2x4", {"data": 2, "fsdp": 2, "tensor": 2})
    step, values = _lm1b_style(checks=True)
    with nn.logical_axis_rules(RULES):
        checked = jaxshard.checked(jax.jit(step, donate_argnums=0))
        report = jaxshard.verify(checked, mesh=mesh, values=values)
        plain, _ = _lm1b_style(checks=False)
        without = jaxshard.verify(plain, mesh=mesh, values=values)
    assert report.ok and any("compiled out" in note for note in report.notes)
    assert len(report.rows) == len(without.rows) > 0
    assert report.memory == without.memory
    assert len(report.collectives) == len(without.collectives)


def test_verify_names_the_wrong_weight_too():
    """`jaxshard.verify` of the linen train step, for a TPU topology, from abstract
    inputs: its error points at the same weight, and summarises the rest."""
    mesh = jaxshard.tpu_mesh("v5e:2x4", {"data": 2, "fsdp": 2, "tensor": 2})
    train_step, values = _lm1b_style(wrong_layer=1)
    with nn.logical_axis_rules(RULES):
        with pytest.raises(jaxshard.ShardingError) as caught:
            jaxshard.verify(train_step, mesh=mesh, values=values)
    lines = str(caught.value).splitlines()
    assert lines[0].endswith(
        ": the likely cause is state.params['LinenBlock_1']['LinenMlp_0']['Dense_0']"
        "['kernel'], laid out P('tensor', 'fsdp') where 3 of its siblings (the same "
        "weight in the other layers) are P('fsdp', 'tensor')."
    )
    assert len(lines) < 20
    report = caught.value.report
    located = [c for c in report.collectives if c.filename is not None]
    assert len(located) >= len(report.collectives) - 2  # flax's ops: the user's lines
    assert all("decoders.py" in c.where for c in located if c.kind == "all-gather")
