"""`jaxshard.verify` on meshes of simulated CPU devices (TPU topologies: see
test_tpu.py)."""

import json

import beartype
import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import pytest
from jax import Array
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import Float


checked = jaxshard.jaxtyped(typechecker=beartype.beartype)


class Params(eqx.Module):
    w1: Float[Array, "d f", P(None, "tp")]
    w2: Float[Array, "f d", P("tp", None)]


@checked
def mlp(
    p: Params, x: Float[Array, "b d", P("dp", None)]
) -> Float[Array, "b d", P("dp", None)]:
    return jax.nn.relu(x @ p.w1) @ p.w2


@checked
def head(x: Float[Array, "b d", P("dp", None)]) -> Float[Array, "b", P("dp")]:
    return x.sum(axis=1)


def model(
    p: Params, x: Float[Array, "b d", P("dp")], *, layers: int = 3
) -> Float[Array, "b", P("dp")]:
    for _ in range(layers):
        x = mlp(p, x)
    return head(x)


DIMS = {"b": 16, "d": 8, "f": 32}


def rows(report):
    return [(r.function, r.name, r.ok) for r in report.rows]


def test_report_lists_every_contract(auto_mesh):
    report = jaxshard.verify(model, mesh=auto_mesh, dims=DIMS)
    assert report.ok and report.violations == ()
    # Parameters (with the Module's fields), then the functions inside in the order
    # they were traced, each contract once however often the layer runs.
    assert rows(report) == [
        ("model", "p.w1", True),
        ("model", "p.w2", True),
        ("model", "x", True),
        ("mlp", "x", True),
        ("mlp", "return", True),
        ("head", "x", True),
        ("head", "return", True),
        ("model", "return", True),
    ]
    row = report.rows[0]
    assert row.expected == P(None, "tp") and row.array == "float32[8,32]"
    assert isinstance(row.actual, NamedSharding) and row.actual.spec == P(None, "tp")
    assert report.memory.arguments == report.memory["arguments"] > 0
    assert report.memory.total >= report.memory.arguments
    assert report.flops is not None and report.flops > 0
    assert report.compiled.input_shardings[0][0]["x"].spec == P("dp")


def wrong_return(
    p: Params, x: Float[Array, "b d", P("dp")]
) -> Float[Array, "b", P("tp")]:
    return head(mlp(p, x))


@checked
def wrong_layer(x: Float[Array, "b d", P(None, "tp")]) -> Float[Array, "b d"]:
    return x


def two_wrong(x: Float[Array, "b d", P("dp")]) -> Float[Array, "b", P()]:
    return head(wrong_layer(x))


def test_collects_every_violation(mesh):
    report = jaxshard.verify(two_wrong, mesh=mesh, dims=DIMS, raise_on_error=False)
    assert not report.ok
    assert [(r.function, r.name) for r in report.violations] == [
        ("wrong_layer", "x"),
        ("two_wrong", "return"),
    ]
    bad = report.violations[0]
    assert bad.expected == P(None, "tp") and tuple(bad.actual.spec)[:1] == ("dp",)
    assert "P(None, 'tp')" in bad.reason
    text = str(report)
    assert "VIOLATED" in text and "2 of 5 sharding contracts violated" in text
    assert json.loads(report.to_json())["rows"][1]["expected"] == "P(None, 'tp')"
    with pytest.raises(jaxshard.ShardingError) as e:
        jaxshard.verify(two_wrong, mesh=mesh, dims=DIMS)
    message = str(e.value)
    assert "2 sharding contracts violated" in message
    assert "wrong_layer, parameter 'x'" in message and "the return value" in message
    assert e.value.report.violations == report.violations


def test_return_checked_after_propagation(auto_mesh):
    report = jaxshard.verify(
        wrong_return, mesh=auto_mesh, dims=DIMS, raise_on_error=False
    )
    (bad,) = report.violations
    assert bad.name == "return" and bad.expected == P("tp")
    assert "after XLA's sharding propagation it is sharded as P('dp')" in bad.reason


def test_leaves_no_state_behind(auto_mesh):
    jaxshard.verify(wrong_return, mesh=auto_mesh, dims=DIMS, raise_on_error=False)
    # Outside verify the same code raises as usual, at compile time.
    args = jaxshard.abstract_args(wrong_return, auto_mesh, DIMS)
    with pytest.raises(jaxshard.ShardingError, match="wrong_return"):
        jax.jit(checked(wrong_return)).lower(*args).compile()
    assert jax.sharding.get_abstract_mesh().empty


def test_checks_even_when_turned_off(auto_mesh):
    with jaxshard.config(sharding="off"):
        report = jaxshard.verify(
            wrong_return, mesh=auto_mesh, dims=DIMS, raise_on_error=False
        )
    assert len(report.violations) == 1


def test_static_values_and_keyword_only(auto_mesh):
    report = jaxshard.verify(model, mesh=auto_mesh, dims=DIMS, values={"layers": 0})
    assert [r[0] for r in rows(report)] == ["model"] * 3 + ["head", "head", "model"]


def test_shape_errors_propagate(auto_mesh):
    @checked
    def f(x: Float[Array, "b d", P("dp")]) -> Float[Array, "d b"]:
        return x

    with pytest.raises(jaxtyping.TypeCheckError):
        jaxshard.verify(f, mesh=auto_mesh, dims={"b": 4, "d": 8})


def test_shard_map_and_vmap_inside(explicit_mesh):
    @checked
    def per_row(r: Float[Array, "d"]) -> Float[Array, ""]:
        return r.sum()

    def local(x: Float[Array, "b d", P("dp")]) -> Float[Array, "b", P("dp")]:
        return jax.vmap(per_row)(x)

    def f(x: Float[Array, "b d", P("dp")]) -> Float[Array, "b", P("dp")]:
        return jaxshard.shard_map(local)(x)

    report = jaxshard.verify(f, mesh=explicit_mesh, dims={"b": 8, "d": 4})
    names = [(r.function.rsplit(".", 1)[-1], r.name) for r in report.rows]
    assert ("local", "x") in names and ("local", "return") in names
    assert report.ok


def test_needs_a_mesh():
    with pytest.raises(TypeError, match="`mesh` takes a concrete jax.sharding.Mesh"):
        jaxshard.verify(model, mesh=None, dims=DIMS)


def test_bf16_model(auto_mesh):
    report = jaxshard.verify(model, mesh=auto_mesh, dims=DIMS, dtypes=jnp.bfloat16)
    assert report.rows[0].array == "bfloat16[8,32]"


def _plain_layer(
    x: Float[Array, "b d", P("dp", None)], scale: int
) -> Float[Array, "b d", P("dp", None)]:
    return x * scale


@pytest.mark.parametrize(
    "wrap",
    [
        lambda f: jax.jit(f, static_argnums=1),
        lambda f: jax.jit(f, static_argnames="scale"),
        lambda f: eqx.filter_jit(f),
        lambda f: checked(jax.jit(f, static_argnums=1)),
    ],
    ids=["jit", "jit-static-names", "filter_jit", "jaxtyped-jit"],
)
def test_jitted_functions(wrap, auto_mesh):
    """A jitted function is verified like the function it wraps, its static
    arguments passed as Python values."""
    report = jaxshard.verify(
        wrap(_plain_layer), mesh=auto_mesh, dims={"b": 8, "d": 4}, values={"scale": 2}
    )
    assert report.ok and [r.name for r in report.rows] == ["x", "return"]


def test_jit_shardings_are_checked_against_the_annotations(auto_mesh):
    """A jit's `out_shardings` that contradict the return annotation is a
    violation; shardings that agree pass."""
    dp, tp = NamedSharding(auto_mesh, P("dp")), NamedSharding(auto_mesh, P(None, "tp"))
    dims = {"b": 8, "d": 4}
    agree = jax.jit(_plain_layer, static_argnums=1, in_shardings=dp, out_shardings=dp)
    assert jaxshard.verify(agree, mesh=auto_mesh, dims=dims, values={"scale": 2}).ok
    clash = jax.jit(_plain_layer, static_argnums=1, out_shardings=tp)
    with pytest.raises(jaxshard.ShardingError, match="return") as e:
        jaxshard.verify(clash, mesh=auto_mesh, dims=dims, values={"scale": 2})
    # As in a call of `clash`: its program at the top level, the out_shardings
    # propagated into its body as XLA propagates them there.
    (row,) = e.value.report.violations
    assert row.name == "return" and "'tp'" in row.actual_spec


def test_a_jits_in_shardings_lay_out_what_its_program_receives(auto_mesh):
    """A jit's program receives its arguments as its `in_shardings` lay them out
    (over the arguments that are not static): one that contradicts a parameter's
    annotation is that parameter's violation, as in a call; agreeing ones pass."""
    dims = {"b": 8, "d": 4}
    rows = NamedSharding(auto_mesh, P(None, "dp"))
    clash = jax.jit(_plain_layer, static_argnums=1, in_shardings=(rows,))
    with pytest.raises(jaxshard.ShardingError, match="parameter 'x'") as e:
        jaxshard.verify(clash, mesh=auto_mesh, dims=dims, values={"scale": 2})
    assert "x" in [row.name for row in e.value.report.violations]
    called = jaxshard.jaxtyped(clash, typechecker=beartype.beartype)
    with pytest.raises(jaxshard.ShardingError, match="parameter 'x'"):
        jax.block_until_ready(called(jnp.ones((8, 4)), 2))
    agree = jax.jit(_plain_layer, static_argnums=1, in_shardings=P("dp"))
    with jax.set_mesh(auto_mesh):
        assert jaxshard.verify(agree, mesh=auto_mesh, dims=dims, values={"scale": 2}).ok


def test_a_jit_is_compiled_at_the_top_level_as_its_call_is(auto_mesh):
    """verify compiles a `jax.jit` function's program as a call of it compiles it,
    not nested in a jit of its own, where XLA propagates its out_shardings into the
    body otherwise: a return value that a call finds laid out wrong is found wrong
    by verify too."""
    dp = NamedSharding(auto_mesh, P("dp", None))
    tp = NamedSharding(auto_mesh, P(None, "tp"))

    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    def layer(
        x: Float[Array, "b d", P("dp", None)], w: Float[Array, "d d", P(None, "tp")]
    ) -> Float[Array, "b d", P("dp", None)]:
        return (x @ w) * 0 + x

    step = jax.jit(layer, in_shardings=(dp, tp), out_shardings=dp)
    x = jax.device_put(jnp.ones((8, 4)), dp)
    w = jax.device_put(jnp.ones((4, 4)), tp)
    with pytest.raises(jaxshard.ShardingError) as called:
        step(x, w)
    with pytest.raises(jaxshard.ShardingError) as verified:
        jaxshard.verify(step, mesh=auto_mesh, dims={"b": 8, "d": 4})
    (row,) = verified.value.report.violations
    assert row.name == "return" and row.actual_spec in str(called.value)


def test_wrong_argument_types_name_the_parameter(auto_mesh):
    with pytest.raises(TypeError, match="jaxshard.verify: `fn` takes a function"):
        jaxshard.verify(3, mesh=auto_mesh)
    with pytest.raises(TypeError, match="`dims` takes a dict"):
        jaxshard.verify(_plain_layer, mesh=auto_mesh, dims=[("b", 8)])


def test_a_sharding_type_error_names_the_line(explicit_mesh, auto_mesh):
    def contracting(
        x: Float[Array, "b d", P("dp", "tp")], w: Float[Array, "d f", P("tp", None)]
    ) -> Float[Array, "b f", P("dp")]:
        return x @ w

    dims = {"b": 8, "d": 4, "f": 4}
    assert jaxshard.verify(contracting, mesh=auto_mesh, dims=dims).ok
    with pytest.raises(jaxshard.ModelError) as e:
        jaxshard.verify(contracting, mesh=explicit_mesh, dims=dims)
    message = str(e.value)
    assert f"{__file__}:" in message and "in contracting: `return x @ w`" in message
    assert "Contracting dimensions are sharded" in message  # JAX's own words
    assert 'axis_types="auto"' in message
    assert type(e.value.__cause__).__name__ == "ShardingTypeError"


def test_the_report_says_what_its_flops_count(auto_mesh):
    """XLA counts a loop's body once: a scanned model's report says so."""

    def scanned(x: Float[Array, "b d", P("dp", None)]) -> Float[Array, "b d"]:
        return jax.lax.scan(lambda c, _: (jnp.sin(c) @ c.T @ c, None), x, None, 4)[0]

    report = jaxshard.verify(scanned, mesh=auto_mesh, dims={"b": 8, "d": 8})
    assert any("each loop's body once" in note for note in report.notes)
    assert "each loop's body once" in str(report)
    flat = jaxshard.verify(lambda x: x, mesh=auto_mesh, values={"x": jnp.ones(8)})
    assert flat.notes == ()


def test_paths_end_before_flax_boxes(tmp_path):
    """A flax linen box (`nn.LogicallyPartitioned`) and an nnx Variable hold their
    array in `.value`, which is no part of the model: the inputs' and outputs'
    paths end before it, in the report, the snapshot, the page and the messages."""
    import flax.linen as nn
    import optax
    from decoders import (
        BATCH,
        LENGTH,
        linen_init,
        linen_train_step,
        LinenDecoder,
        make_nnx,
        RULES,
    )

    auto = (jax.sharding.AxisType.Auto,) * 3
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=auto)
    init = linen_init(LinenDecoder(), optax.adamw(1e-3))
    with nn.logical_axis_rules(RULES):
        dummy = jnp.ones((BATCH, LENGTH), jnp.int32)
        state = jax.eval_shape(init, jax.random.key(0), dummy)
        batch = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32)
        linen = jaxshard.verify(
            linen_train_step,
            mesh=mesh,
            values={"state": state, "batch": batch},
        )
        nnx = make_nnx(mesh)
        nnx = jaxshard.verify(
            nnx.loss,
            mesh=mesh,
            values={"state": nnx.state, "batch": nnx.batch},
            max_collectives={"all-gather": 0},  # its reason names inputs' paths
            raise_on_error=False,
        )
    embedding = "state.params['Embed_0']['embedding']"
    assert embedding in linen.inputs and "return[0]" + embedding[5:] in linen.outputs
    assert "state[0]['blocks'][0]['mlp']['up']" in nnx.inputs
    linen.save(tmp_path / "linen.json")
    nnx.save(tmp_path / "nnx.json")
    for text in (
        str(linen),
        str(nnx),
        linen.html(),
        (tmp_path / "linen.json").read_text(),
        (tmp_path / "nnx.json").read_text(),
    ):
        assert "].value" not in text
    (gathers,) = nnx.violations
    assert ".value" not in gathers.reason
    # One made for an input's layout is named by the input's path, as the report's.
    for c in nnx.collectives:
        assert c.filename or "/" in c.op_name or c.op_name in nnx.inputs, c.op_name
