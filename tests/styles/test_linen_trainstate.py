"""flax linen as flax's examples/lm1b writes it (tests/styles.py, `make_lm1b`): a
TrainState made by a jitted init with `out_shardings`, and a train step jitted with
`in_shardings=(state_shardings, data_sharding, None)`, `static_argnums=(2, 3, 4)` and
`donate_argnums=0`, under the contracts an adopter adds (issue 49)."""

import os
import traceback

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from styles import LM1B_MESH_AXES, LM1B_RULES, make_lm1b, misplaced, TransformerLM

import jaxshard


# Block 1's first MLP kernel, as jax.tree_util.keystr writes its path in the state.
KERNEL = (
    ".params['decoder']['encoderdecoderblock_1']['MlpBlock_0']['Dense_0']['kernel']"
)
MOMENTS = [f".opt_state[0].{m}{KERNEL.removeprefix('.params')}" for m in ("mu", "nu")]


@pytest.fixture(scope="module")
def lm():
    assert jax.device_count() == 8
    mesh = jax.make_mesh((2, 2, 2), LM1B_MESH_AXES, axis_types=(AxisType.Auto,) * 3)
    return make_lm1b(mesh)


def fresh(state):
    """A copy of the state, laid out as it is: the step donates what it is given."""
    return jax.tree.map(jnp.copy, state)


def transposed(lm, paths=(KERNEL,)):
    """The state with the leaves at `paths` placed P('tensor', 'fsdp'), where the
    rules place them P('fsdp', 'tensor')."""
    state = fresh(lm.state)
    for path in paths:
        state = misplaced(state, path, NamedSharding(lm.mesh, P("tensor", "fsdp")))
    return state


def in_force(lm):
    """The mesh and the adopter's rules (flax's too) in force."""
    return jax.set_mesh(lm.mesh), jaxshard.axis_rules(LM1B_RULES)


def named_with_both_layouts(lines: list[str], path: str) -> bool:
    """Whether a line names `path` with the layout it has and the one expected."""
    return any(
        path in line and "P('tensor', 'fsdp')" in line and "P('fsdp', 'tensor')" in line
        for line in lines
    )


def _ends_in_this_file(error: BaseException) -> bool:
    last = traceback.extract_tb(error.__traceback__)[-1]
    return os.path.samefile(last.filename, __file__)


# --- (1) the contracts hold on the code as written ----------------------------------


@pytest.mark.parametrize("with_shardings", [True, False])
def test_the_step_as_lm1b_jits_it_holds_its_contracts(lm, with_shardings):
    mesh, rules = in_force(lm)
    with mesh, rules:
        step = jaxshard.checked(lm.jitted(with_shardings))
        state, first = step(*lm.args(fresh(lm.state)))
        state, second = step(*lm.args(state))
    assert jnp.isfinite(first["loss"]) and jnp.isfinite(second["loss"])
    assert int(state.step) == 2


def test_the_forward_pass_eagerly_holds_its_contracts(lm):
    mesh, rules = in_force(lm)
    with mesh, rules:
        logits = TransformerLM(lm.config.replace(deterministic=True)).apply(
            {"params": lm.state.params}, lm.batch["inputs"]
        )
    assert logits.shape == (8, lm.config.max_len, lm.config.vocab_size)


def test_the_state_is_checked_against_its_own_logical_specs(lm):
    """`nn.get_partition_spec` of the abstract state (logical names in P's), as lm1b
    computes it; lm1b's table leaves "kv" out, which flax reads as unsharded. The
    misplaced kernel is named on the message's first line, with both layouts."""
    with jaxshard.axis_rules(LM1B_RULES, unknown="replicated"):
        jaxshard.check_partitioning(lm.state, lm.state_specs)
        with pytest.raises(jaxshard.ShardingError) as caught:
            jaxshard.check_partitioning(transposed(lm), lm.state_specs)
    lines = str(caught.value).splitlines()
    assert KERNEL in lines[0]
    assert named_with_both_layouts(lines, KERNEL)
    assert not any("MlpBlock_0']['Dense_1']" in line for line in lines)


def test_the_boxes_lm1b_makes_are_checked_under_flaxs_own_rules(lm):
    model = TransformerLM(lm.config.replace(deterministic=True))
    dummy = jnp.ones((2, lm.config.max_len), jnp.int32)
    with jax.set_mesh(lm.mesh), nn.logical_axis_rules(LM1B_RULES):
        abstract = jax.eval_shape(model.init, jax.random.key(0), dummy)
        shardings = nn.logical_to_mesh_sharding(
            nn.get_partition_spec(abstract), lm.mesh, LM1B_RULES
        )
        boxed = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), dummy)
        jaxshard.check_partitioning(boxed)


# --- (2) a misplaced kernel against jit's in_shardings --------------------------------


@pytest.mark.parametrize(
    "paths", [[KERNEL], [KERNEL, *MOMENTS]], ids=["kernel", "and-moments"]
)
def test_a_kernel_placed_against_in_shardings_is_named_with_both_layouts(lm, paths):
    """jit refuses the committed kernel (and, restored as wrongly, its moments):
    each is named by its path with the layout it has and the one in_shardings
    give it, the first on the message's first line, with train_step."""
    mesh, rules = in_force(lm)
    with mesh, rules:
        with pytest.raises(jaxshard.ShardingError) as caught:
            jaxshard.checked(lm.jitted())(*lm.args(transposed(lm, paths)))
    lines = str(caught.value).splitlines()
    assert "train_step" in lines[0] and f"state{KERNEL}" in lines[0]
    assert "in_shardings" in lines[0]
    for path in paths:
        assert named_with_both_layouts(lines, f"state{path}")
    count = "1 argument" if len(paths) == 1 else f"{len(paths)} arguments"
    assert count in str(caught.value)
    assert "Dense_1" not in str(caught.value)  # no other weight is blamed


# --- (2) the same kernel, the step jitted without in_shardings -----------------------


@pytest.fixture(scope="module")
def unsharded_step_error(lm):
    """The error of `checked(jax.jit(train_step, static_argnums=(2, 3, 4)))` on the
    state with block 1's kernel transposed (one compile, read by several tests)."""
    mesh, rules = in_force(lm)
    with mesh, rules:
        step = jaxshard.checked(lm.jitted(with_shardings=False))
        try:
            step(*lm.args(transposed(lm)))
        except jaxshard.ShardingError as error:
            return error
    pytest.fail("no ShardingError")


def test_without_in_shardings_the_kernel_is_the_likely_cause(unsharded_step_error):
    """Not the first activation laid out wrong: the kernel laid out unlike the same
    kernel in the other blocks, on the first line, as the user passed it, in the
    step named as the user's (not checked's own program)."""
    first = str(unsharded_step_error).splitlines()[0]
    assert "likely cause" in first and f"state{KERNEL}" in first
    assert "P('tensor', 'fsdp')" in first and "P('fsdp', 'tensor')" in first
    assert "siblings" in first
    assert "jit(train_step)" in first and "program" not in first
    assert "args[0]" not in str(unsharded_step_error)


def test_the_traceback_ends_at_the_users_call(unsharded_step_error):
    assert _ends_in_this_file(unsharded_step_error)


# --- check_partitioning against the shardings lm1b computes ----------------------


def test_the_state_is_checked_against_its_shardings(lm):
    jaxshard.check_partitioning(lm.state, lm.state_shardings)
    with pytest.raises(jaxshard.ShardingError) as caught:
        jaxshard.check_partitioning(transposed(lm), lm.state_shardings)
    lines = str(caught.value).splitlines()
    assert KERNEL in lines[0]
    assert named_with_both_layouts(lines, KERNEL)
    assert "layout tree says P('fsdp', 'tensor')" in str(caught.value)


def test_check_tree_takes_a_train_state(lm):
    jaxshard.check_tree(lm.state)  # no annotated field: nothing to check, no error


def abstract_inputs(lm, mesh) -> tuple:
    """The train state and a batch as verify takes them for `mesh`: abstract,
    placed as lm1b places them (the state by its logical specs under lm1b's rules,
    the batch over the data and fsdp axes)."""
    shardings = nn.logical_to_mesh_sharding(lm.state_specs, mesh, LM1B_RULES)
    state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        lm.state,
        shardings,
    )
    data = NamedSharding(mesh, P(("data", "fsdp")))
    batch = {"inputs": jax.ShapeDtypeStruct((8, 16), jnp.int32, sharding=data)}
    return state, batch


@pytest.mark.tpu_topology
def test_the_step_verifies_for_a_v5e_slice(lm, tpu_topology):
    mesh = tpu_topology("v5e:2x4", {"data": 2, "fsdp": 2, "tensor": 2})
    state, batch = abstract_inputs(lm, mesh)
    values = {
        "state": state,
        "batch": batch,
        "config": lm.config,
        "learning_rate_fn": lm.args()[3],
        "label_smoothing": 0.0,
        "dropout_rng": lm.dropout_rng,
    }
    from styles import train_step

    report = jaxshard.verify(
        train_step, mesh=mesh, values=values, dims={"batch": 8}, rules=LM1B_RULES
    )
    assert report.ok and len(report.rows) == 3


def test_the_traceback_of_the_in_shardings_error_ends_at_the_users_call(lm):
    mesh, rules = in_force(lm)
    with mesh, rules:
        with pytest.raises(jaxshard.ShardingError) as caught:
            jaxshard.checked(lm.jitted())(*lm.args(transposed(lm)))
    assert _ends_in_this_file(caught.value)


@pytest.mark.tpu_topology
def test_the_step_verifies_with_an_unused_input(lm, tpu_topology):
    """The step wrapped as a verify target, its state left unannotated (point 8
    aside): lm1b's dropout rng reaches no operation when dropout is off."""
    from styles import InputTokens, lm1b_schedule, train_step

    mesh = tpu_topology("v5e:2x4", {"data": 2, "fsdp": 2, "tensor": 2})
    state, batch = abstract_inputs(lm, mesh)

    def step(state, batch: dict[str, InputTokens], dropout_rng):
        return train_step(state, batch, lm.config, lm1b_schedule, 0.0, dropout_rng)

    values = {"state": state, "batch": batch, "dropout_rng": lm.dropout_rng}
    report = jaxshard.verify(step, mesh=mesh, values=values, rules=LM1B_RULES)
    assert report.ok
    kernel = {row.path: row.spec for row in report.arrays}[f"state{KERNEL}"]
    assert kernel == "P('fsdp', 'tensor')"
