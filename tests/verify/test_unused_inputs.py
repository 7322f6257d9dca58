"""`jaxshard.verify` of a function whose compiled program never reads some of its
inputs: jit leaves them out (`keep_unused=False`), and every verdict, layout and
memory row stays with the input it is about."""

import jax
import jax.numpy as jnp
import optax
import pytest
from decoders import nnx_loss_step, NnxTwoLayers
from flax import nnx
from jax import Array
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import Float


DIMS = {"b": 16, "d": 8, "f": 4}


def specs(report) -> dict:
    return {path: leaf.sharding.spec for path, leaf in report.inputs.items()}


def per_device(report) -> dict:
    return {row.path: row.spec for row in report.arrays}


def struct(mesh, shape, spec):
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))


def test_compiled_input_shardings_give_none_for_an_input_jit_drops():
    """What `budgets.layouts` reads: JAX's record of the kept inputs, as public API
    (jax 0.10.2, 0.11.2, 0.12.0.1)."""
    mesh = jax.make_mesh((8,), ("dp",))
    x = struct(mesh, (16, 4), P("dp", None))
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    compiled = jax.jit(lambda s, p, x: x * 2).lower(scalar, {"w": x}, x).compile()
    (s, p, kept), kwargs = compiled.input_shardings
    assert s is None and p == {"w": None} and kwargs == {}
    assert kept.spec == P("dp", None)


def scalar_first(
    step: Float[Array, ""],
    x: Float[Array, "b d", P("dp", None)],
    w: Float[Array, "d f", P(None, "tp")],
) -> Float[Array, "b f", P("dp", "tp")]:
    return x @ w


def test_an_unused_scalar_first_leaves_the_others_layouts_in_place(mesh):
    report = jaxshard.verify(scalar_first, mesh=mesh, dims=DIMS)
    assert report.ok
    assert specs(report) == {"x": P("dp", None), "w": P(None, "tp")}
    assert per_device(report) == {"x": "P('dp')", "w": "P(None, 'tp')"}
    # Only what the program holds: x's and w's blocks, no byte of `step`.
    assert report.memory.arguments == (16 * 8 // 4 + 8 * 4 // 2) * 4
    [note] = [n for n in report.notes if "never reads" in n]
    assert "1 input (step)" in note and "keep_unused=False" in note
    assert "report.inputs" in note


def middle(
    x: Float[Array, "b d", P("dp", None)],
    params: dict,
    w: Float[Array, "d f", P(None, "tp")],
) -> Float[Array, "b f", P("dp", "tp")]:
    return x @ w


def unused_params(mesh):
    """Arrays of other ranks and layouts than x's and w's: paired with them by
    position, they would be refused (rank) or shown in their place."""
    return {
        "a": struct(mesh, (16,), P("dp")),
        "b": struct(mesh, (4, 8, 2), P("tp", None, None)),
        "c": None,
    }


def test_an_unused_pytree_in_the_middle_leaves_the_others_layouts_in_place(mesh):
    values = {"params": unused_params(mesh)}
    report = jaxshard.verify(middle, mesh=mesh, dims=DIMS, values=values)
    assert report.ok
    assert specs(report) == {"x": P("dp", None), "w": P(None, "tp")}
    assert [(r.name, r.ok) for r in report.rows] == [
        ("x", True),
        ("w", True),
        ("return", True),
    ]
    [note] = [n for n in report.notes if "never reads" in n]
    assert "2 inputs (params['a'], params['b'])" in note
    assert str(report).count("never reads") == 1
    # The snapshot holds the program's inputs only.
    assert set(report.to_dict()["inputs"]) == {"x", "w"}


def test_a_violation_beside_an_unused_input_names_its_own_input(mesh):
    values = {
        "params": unused_params(mesh),
        "w": struct(mesh, (8, 4), P("tp", None)),  # the annotation says P(None, 'tp')
    }
    with pytest.raises(jaxshard.ShardingError) as caught:
        jaxshard.verify(middle, mesh=mesh, dims=DIMS, values=values)
    report = caught.value.report
    [wrong] = [r for r in report.violations if r.name == "w"]
    assert wrong.actual_spec == "P('tp', None)"
    assert not any(r.name == "x" for r in report.violations)
    assert specs(report)["w"] == P("tp", None)
    assert specs(report)["x"] == P("dp", None)
    assert "w" in str(caught.value).splitlines()[0]


def test_the_sharding_budgets_count_only_the_programs_inputs(mesh):
    # `params` is replicated and larger than x and w together: counted, it would
    # break the budget.
    big = {"a": struct(mesh, (1024, 8), P())}
    report = jaxshard.verify(
        middle,
        mesh=mesh,
        dims=DIMS,
        values={"params": big},
        max_replicated_bytes=0,
        min_sharded_fraction=1.0,
    )
    assert report.ok and set(report.inputs) == {"x", "w"}


def test_an_nnx_loss_step_that_returns_only_the_loss(auto_mesh):
    mesh = auto_mesh  # nnx.Linear's matmuls leave Explicit axes' outputs unsaid
    with jax.set_mesh(mesh):
        model = NnxTwoLayers(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    values = {"model": model, "opt": opt}
    report = jaxshard.verify(nnx_loss_step, mesh=mesh, dims=DIMS, values=values)
    assert report.ok
    assert [(r.name, r.ok) for r in report.rows if r.budget is None] == [
        ("x", True),
        ("return", True),
    ]
    assert specs(report) == {
        "model.up.kernel": P(None, "tp"),
        "model.down.kernel": P("tp", None),
        "x": P("dp", None),
    }
    [note] = [n for n in report.notes if "never reads" in n]
    assert "opt.opt_state[0].mu['up']['kernel']" in note and "opt.step" in note
    assert "model." not in note


def test_a_value_laid_out_unevenly_is_refused_before_compiling(auto_mesh):
    """A value whose sharding splits a dimension the mesh axes do not divide is a
    ValueError naming its path, not JAX's IndivisibleError from the compile."""

    def f(x):
        return x * 2

    x = jax.ShapeDtypeStruct(
        (6, 4), jnp.float32, sharding=NamedSharding(auto_mesh, P("dp", None))
    )
    with pytest.raises(ValueError) as e:
        jaxshard.verify(f, mesh=auto_mesh, values={"x": {"w": x}})
    message = str(e.value)
    assert message.startswith("jaxshard.verify(f): values['x']['w']: dimension 0 ")
    assert "has size 6, which P('dp', None) splits 4 ways over dp" in message
