"""What verify says of values that are part of something larger: a block inside a
`shard_map` body is reported as the global array its annotation describes, beside
the block a device holds; a value check's failure there says which counts are the
blocks' together and which element is one block's; a path into a parameter is a
field, not a parameter."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import Float
from jaxshard._verify import snapshot


DIMS = {"b": 64, "d": 32}


def blocks(mesh):
    """A model whose body runs in `jaxshard.shard_map`, one block per device."""

    @jaxshard.shard_map(mesh=mesh)
    def body(x: Float[Array, "b d", P("dp", None)]) -> Float[Array, "b d", P("dp")]:
        jaxshard.check_finite(x, "x")
        return x * 2

    @jaxshard.jaxtyped
    def model(x: Float[Array, "b d", P("dp", None)]) -> Float[Array, "b d", P("dp")]:
        return body(x)

    return model


def test_a_block_is_shown_as_its_global_array(mesh):
    """An ok row never reads as a mismatch: the global layout beside the expected
    one, and the block each device holds said as such."""
    report = jaxshard.verify(blocks(mesh), mesh=mesh, dims=DIMS)
    inside = next(r for r in report.rows if r.function == "blocks.<locals>.body")
    assert inside.ok and inside.name == "x" and inside.expected == P("dp", None)
    assert inside.actual_spec == "P('dp', None)"  # not the block's P(None, None)
    assert inside.types == ("float32[64@dp,32]", "float32[64@dp,32]")
    assert inside.array == "float32[64,32]" and inside.block == "float32[16,32]"
    line = next(
        x for x in str(report).splitlines() if x.startswith("blocks.<locals>.b")
    )
    assert "P('dp', None)  P('dp', None)" in line
    assert "float32[64@dp,32], block float32[16,32]" in line and line.endswith("ok")
    contract = next(
        c
        for c in snapshot.snapshot(report)["contracts"]
        if c["function"].endswith("body")
    )
    assert contract["type"] == "float32[64@dp,32]"
    assert contract["block"] == "float32[16,32]"
    assert "float32[64@dp,32], block float32[16,32]" in report.html()


def test_a_block_that_differs_where_its_annotation_says_not(auto_mesh):
    """A block that differs over a manual axis its annotation does not name is no
    array the annotation describes: the actual column says where it differs."""

    @jaxshard.jaxtyped
    def inner(x: Float[Array, "b d", P("dp", None)]) -> Float[Array, "b d", P("dp")]:
        return x * jax.lax.axis_index("tp")

    def body(x: Float[Array, "b d", P("dp", None)]) -> Float[Array, "b d", P("dp")]:
        return inner(x)

    def model(x: Float[Array, "b d", P("dp", None)]) -> Float[Array, "b e"]:
        specs = dict(in_specs=P("dp", None), out_specs=P("dp", "tp"))
        return jax.shard_map(body, mesh=auto_mesh, **specs)(x)

    report = jaxshard.verify(
        model, mesh=auto_mesh, dims={**DIMS, "e": 64}, raise_on_error=False
    )
    (row,) = report.violations
    assert row.name == "return" and row.block == "float32[16,32]"
    assert row.actual_spec == "P('dp', None), differing over tp"
    assert "differs across the shard_map mesh axes 'tp'" in row.reason
    assert "inside shard_map a block float32[16,32] per device" in str(report)


def test_a_failed_check_in_a_block_says_what_is_the_blocks(explicit_mesh):
    """Inside a shard_map body the count is every block's together (the copies of a
    block on the tp devices counted once), the element one block's, on the device
    named."""
    model = jaxshard.checked(jax.jit(blocks(explicit_mesh)))
    x = np.zeros((16, 4), np.float32)
    x[5, 1], x[6, 2], x[13, 3] = np.nan, np.inf, np.nan  # blocks dp=1 and dp=3
    x = jax.device_put(x, NamedSharding(explicit_mesh, P("dp", None)))
    try:
        model(x)
    except jaxshard.CheckError as e:
        (found,) = e.failures
    assert (found.count, found.element, found.device) == (3, (1, 1), {"dp": 1, "tp": 0})
    assert str(found).endswith(
        "[3 elements failed across the blocks; first at element [1, 1] of the block "
        "on device dp=1, tp=0]"
    )


class Weights(NamedTuple):
    a: Float[Array, "d f", P(None, "tp")]
    b: Float[Array, "f d", P("tp", None)]


def two(w: Weights, x: Float[Array, "b d", P("dp", None)]) -> Float[Array, "b d"]:
    return (x @ w.a) @ w.b


def test_a_path_into_a_parameter_is_a_field(auto_mesh):
    """`w.b` is a field of the parameter `w` (this one laid out otherwise)."""
    b = jax.ShapeDtypeStruct(
        (16, 32), jnp.float32, sharding=NamedSharding(auto_mesh, P(None, "tp"))
    )
    a = jax.ShapeDtypeStruct(
        (32, 16), jnp.float32, sharding=NamedSharding(auto_mesh, P(None, "tp"))
    )
    report = jaxshard.verify(
        two,
        mesh=auto_mesh,
        dims={**DIMS, "f": 16},
        values={"w": Weights(a, b)},
        raise_on_error=False,
    )
    text = str(report)
    assert "- two, field 'w.b' (float32[16,32], annotated " in text
    assert "parameter 'w.b'" not in text
