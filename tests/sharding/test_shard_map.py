"""In `shard_map` a value is one block; the annotation describes the global array."""

import beartype
import jax
import jax.numpy as jnp
import jaxtyping
import pytest
from helpers import put
from jax import Array
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard import Float


@pytest.fixture(params=["jaxshard", "jaxtyping"])
def decorate(request, typechecker):
    deco = {"jaxshard": jaxshard.jaxtyped, "jaxtyping": jaxtyping.jaxtyped}[
        request.param
    ]
    return deco(typechecker=typechecker)


def test_block_shape_is_global_shape_split(decorate, mesh):
    seen = {}

    @decorate
    def body(x: Float[Array, "batch d", P("dp")]) -> Float[Array, "batch d", P("dp")]:
        seen["local"] = x.shape
        return x * 2

    x = put((64, 8), mesh, P("dp"))
    with jax.set_mesh(mesh):
        out = jax.shard_map(body, in_specs=P("dp"), out_specs=P("dp"))(x)
        jax.jit(jax.shard_map(body, in_specs=P("dp"), out_specs=P("dp")))(x)
    assert out.shape == (64, 8)
    assert seen["local"] == (16, 8)


def test_fixed_sizes_describe_the_global_array(decorate, mesh):
    @decorate
    def body(x: Float[Array, "64 d", P("dp")], w: Float[Array, "d 6", P(None, "tp")]):
        return x @ w

    x = put((64, 8), mesh, P("dp"))
    w = put((8, 6), mesh, P(None, "tp"))
    with jax.set_mesh(mesh):
        out = jax.shard_map(
            body, in_specs=(P("dp"), P(None, "tp")), out_specs=P("dp", "tp")
        )(x, w)
    assert out.shape == (64, 6)


def test_dim_bindings_are_global_across_the_boundary(mesh):
    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    def outer(x: Float[Array, "batch d", P("dp")]) -> Float[Array, "batch d", P("dp")]:
        @jaxshard.jaxtyped(typechecker=beartype.beartype)
        def body(
            b: Float[Array, "batch d", P("dp")],
        ) -> Float[Array, "batch d", P("dp")]:
            return b + 1

        return jax.shard_map(body, in_specs=P("dp"), out_specs=P("dp"))(x)

    with jax.set_mesh(mesh):
        assert jax.jit(outer)(put((64, 8), mesh, P("dp"))).shape == (64, 8)


def test_wrong_block_shape_says_global_and_local(mesh):
    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    def body(x: Float[Array, "64 d", P("dp")]):
        return x

    # The global array has 32 rows: each block has 8, i.e. a global 32, not 64.
    x = put((32, 8), mesh, P("dp"))
    with jax.set_mesh(mesh), pytest.raises(jaxtyping.TypeCheckError) as info:
        jax.shard_map(body, in_specs=P("dp"), out_specs=P("dp"))(x)
    msg = str(info.value.__cause__ or info.value)
    full = str(info.value) + msg
    assert "local shape (8, 8)" in full
    assert "global shape of (32, 8)" in full


def test_block_replicated_over_a_named_axis(mesh):
    """Annotated as split over dp but passed in whole: the block is the whole array."""

    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    def body(x: Float[Array, "64 d", P("dp")]):
        return x

    x = put((64, 8), mesh, P())
    with jax.set_mesh(mesh), pytest.raises(jaxtyping.TypeCheckError):
        jax.shard_map(body, in_specs=P(), out_specs=P())(x)


def test_block_varying_over_an_axis_the_spec_does_not_name(mesh):
    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    def body(x: Float[Array, "b d", P("dp")]) -> Float[Array, "b d", P("dp")]:
        return x

    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    def summed(x: Float[Array, "b d", P()]):
        return x

    x = put((64, 8), mesh, P("dp", "tp"))
    with jax.set_mesh(mesh):
        with pytest.raises(
            jaxshard.ShardingError, match="differs across the shard_map mesh axes 'tp'"
        ):
            jax.shard_map(body, in_specs=P("dp", "tp"), out_specs=P("dp", "tp"))(x)
        # after a psum over every axis the value is replicated: P() holds
        jax.shard_map(
            lambda x: summed(jax.lax.psum(x, ("dp", "tp"))),
            in_specs=P("dp", "tp"),
            out_specs=P(),
        )(x)


@pytest.mark.parametrize("shard_map", [jax.shard_map, jaxshard.shard_map])
def test_constrain_and_device_put_check_the_block_as_a_parameter(mesh, shard_map):
    """A block that varies over a manual axis its annotation says is replicated:
    `constrain` and `device_put` give the verdict a jaxtyped parameter gives, in the
    same words, and say what to do."""
    Whole = Float[Array, "b d", P(None)]

    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    def parameter(b: Whole):
        return b

    bodies = {
        "parameter": parameter,
        "constrain": lambda b: jaxshard.constrain(b, Whole),
        "spec": lambda b: jaxshard.constrain(b, P(None)),
        "device_put": lambda b: jaxshard.device_put(b, annotation=Whole),
        "tree": lambda b: jaxshard.device_put({"w": b}, annotation=dict[str, Whole]),
    }
    x = put((64, 8), mesh, P("dp"))
    said = "this block (float32[16,8]{V:dp}) differs across the shard_map mesh axes "
    said += "'dp', but the annotation's spec P(None) says the array is replicated "
    said += "over them (mesh {'dp': 4, 'tp': 2} (Manual axes))."
    for name, body in bodies.items():
        with jax.set_mesh(mesh), pytest.raises(jaxshard.ShardingError) as e:
            shard_map(body, in_specs=P("dp"), out_specs=P("dp"))(x)
        text = str(e.value)
        assert said in text, name
        if name in ("constrain", "spec"):
            assert text.startswith(f"jaxshard.constrain: {said} Inside shard_map ")
        if name == "tree":
            assert text.startswith(
                "jaxshard.device_put(tree): tree['w'] is not a block of its "
                f"annotated layout:\n- tree['w']: {said}\n"
            )
        if name != "parameter":
            assert "name them in the annotation's spec" in text
            assert "`jax.lax.psum` or `jax.lax.all_gather`" in text
    # Blocks of the annotated array pass, and the same after a psum over dp.
    with jax.set_mesh(mesh):
        for body in bodies.values():
            shard_map(
                lambda b: body(jax.lax.psum(b, "dp")), in_specs=P("dp"), out_specs=P()
            )(x)
        shard_map(
            lambda b: jaxshard.constrain(b, P("dp")),
            in_specs=P("dp"),
            out_specs=P("dp"),
        )(x)


def test_partial_manual_axes(explicit_mesh):
    """With `axis_names={"dp"}`, tp stays Explicit inside and is checked from types."""
    mesh = explicit_mesh

    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    def body(
        x: Float[Array, "64 d", P("dp", "tp")],
    ) -> Float[Array, "64 d", P("dp", "tp")]:
        return x

    x = put((64, 8), mesh, P("dp", "tp"))
    with jax.set_mesh(mesh):
        partial = jax.shard_map(
            body, in_specs=P("dp"), out_specs=P("dp"), axis_names={"dp"}
        )
        assert partial(x).shape == (64, 8)
        with pytest.raises(jaxshard.ShardingError, match="sharded as P"):
            partial(put((64, 8), mesh, P("dp", None)))


def test_axis_missing_inside_shard_map(mesh):
    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    def body(x: Float[Array, "b d", P("fsdp")]):
        return x

    x = put((64, 8), mesh, P("dp"))
    with (
        jax.set_mesh(mesh),
        pytest.raises(jaxshard.ShardingError, match="names mesh axis 'fsdp'"),
    ):
        jax.shard_map(body, in_specs=P("dp"), out_specs=P("dp"))(x)


def test_vmap_inside_shard_map(mesh):
    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    def row(r: Float[Array, "d", P()]) -> Float[Array, "d", P()]:
        return r * 2

    x = put((64, 8), mesh, P("dp"))
    with jax.set_mesh(mesh):
        out = jax.shard_map(jax.vmap(row), in_specs=P("dp"), out_specs=P("dp"))(x)
    assert jnp.allclose(out, 2.0)
