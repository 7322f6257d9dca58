"""`jaxshard.check_tree`: a Module's fields checked at any point."""

import dataclasses
from typing import NamedTuple

import beartype
import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import jaxtyping
import pytest
from helpers import put
from jax import Array
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import Float


@jaxshard.jaxtyped(typechecker=beartype.beartype)
class Layer(eqx.Module):
    w: Float[Array, "d f", P(None, "tp")]
    b: Float[Array, "f", P("tp")] | None
    blocks: tuple[Float[Array, "d d"], ...]
    scale: float = eqx.field(static=True, default=1.0)


class Pair(NamedTuple):
    x: Float[Array, "b d", P("dp", None)]
    extra: dict[str, Float[Array, "d"]]


def layer(mesh, w_spec=P(None, "tp")):
    return Layer(put((8, 4), mesh, w_spec), None, (put((8, 8), mesh, P()),))


def test_a_module_after_tree_at(mesh):
    model = layer(mesh)
    jaxshard.check_tree(model)
    with pytest.raises(jaxshard.ShardingError, match="sharded"):
        Layer(put((8, 4), mesh, P("dp")), None, ())  # __init__ checks, as always
    moved = eqx.tree_at(lambda m: m.w, model, put((8, 4), mesh, P("dp")))
    with pytest.raises(jaxshard.ShardingError) as e:
        jaxshard.check_tree(moved)
    assert str(e.value).startswith(  # one failure, one line
        "check_tree(Layer): Layer.w: this array (float32[8,4]) is sharded as "
        "P('dp', None)"
    )


def test_every_failure_listed_with_its_path(mesh):
    model = layer(mesh)
    bad = eqx.tree_at(
        lambda m: (m.w, m.b, m.blocks),
        model,
        (put((8, 4), mesh, P()), put((4,), mesh, P()), (put((8, 3), mesh, P()),)),
        is_leaf=lambda x: x is None,
    )
    with pytest.raises(jaxshard.ShardingError) as e:
        jaxshard.check_tree(bad, name="model")
    message = str(e.value)
    assert message.startswith(
        "check_tree(model): 3 arrays do not match their annotations, the first model.w:"
    )
    for path in ("model.w", "model.b", "model.blocks[0]"):
        assert f"- {path}: " in message


def test_shape_and_dtype_alone_are_type_errors(mesh):
    model = eqx.tree_at(lambda m: m.blocks, layer(mesh), (put((8, 4), mesh, P()),))
    with pytest.raises(jaxtyping.TypeCheckError) as e:
        jaxshard.check_tree(model)
    assert not isinstance(e.value, jaxshard.ShardingError)
    assert "Layer.blocks[0]" in str(e.value)


def test_named_tuples_dicts_and_an_explicit_annotation(mesh):
    pair = Pair(put((8, 4), mesh, P("dp")), {"a": put((4,), mesh, P())})
    jaxshard.check_tree(pair)
    jaxshard.check_tree((pair,), tuple[Pair], name="args")
    wrong = pair._replace(extra={"a": put((5,), mesh, P())})
    with pytest.raises(jaxtyping.TypeCheckError, match=r"args\[0\].extra\['a'\]"):
        jaxshard.check_tree((wrong,), tuple[Pair], name="args")


def test_a_bare_spec_is_one_arrays_annotation(mesh):
    """As `constrain` takes them: a `P` or `L(...)` checks one array's layout (and
    only its rank of the rest)."""
    x = put((8, 4), mesh, P("dp"))
    jaxshard.check_tree(x, P("dp"))
    with jaxshard.axis_rules([("batch", "dp")]):
        jaxshard.check_tree(x, jaxshard.L("batch"))
    with pytest.raises(jaxshard.ShardingError) as e:
        jaxshard.check_tree(x, P("tp"))
    text = str(e.value)
    assert text.startswith("check_tree(P('tp')): ")
    assert "is sharded as P('dp', None)" in text
    assert "but the annotation expects P('tp')" in text
    with pytest.raises(jaxshard.ShardingError, match="has 3 entries but the array"):
        jaxshard.check_tree(x, P("dp", None, None))


def test_inside_jit(mesh):
    @jax.jit
    def f(model):
        jaxshard.check_tree(model)
        return model.w * 2

    with jax.set_mesh(mesh):
        f(layer(mesh))
        with pytest.raises(jaxshard.ShardingError, match="Layer.w"):
            f(eqx.tree_at(lambda m: m.w, layer(mesh), put((8, 4), mesh, P("dp"))))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantArray:
    """An int8 weight and its scale, as quantized checkpoints keep them."""

    quant: jaxshard.Int8[Array, "d f", P(None, "tp")]
    scale: Float[Array, "1 f", P(None, "tp")]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Quantizable:
    w: Float[Array, "d f", P(None, "tp")] | QuantArray


def test_a_union_passes_when_any_arm_holds(mesh):
    """A field typed `array | QuantArray` holding a QuantArray is checked as one
    (its own fields), and the array arm still when an array is what it holds."""
    quant = QuantArray(
        put((8, 4), mesh, P(None, "tp"), jnp.int8),
        put((1, 4), mesh, P(None, "tp")),
    )
    jaxshard.check_tree(Quantizable(quant))
    jaxshard.check_tree(Quantizable(put((8, 4), mesh, P(None, "tp"))))
    with pytest.raises(jaxshard.ShardingError) as e:
        jaxshard.check_tree(Quantizable(put((8, 4), mesh, P("dp", None))))
    assert "): Quantizable.w: this array (float32[8,4]) is sharded as P('dp'" in str(
        e.value
    )
    misplaced = dataclasses.replace(quant, scale=put((1, 4), mesh, P()))
    with pytest.raises(jaxshard.ShardingError) as e:
        jaxshard.check_tree(Quantizable(misplaced))
    assert "): Quantizable.w.scale: this array (float32[1,4]) is sharded as P(None" in (
        str(e.value)
    )
    with pytest.raises(jaxtyping.TypeCheckError, match="Quantizable.w"):
        jaxshard.check_tree(Quantizable("not a weight"))  # type: ignore[arg-type]


@jaxshard.jaxtyped(typechecker=beartype.beartype)
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Mlp:
    w: Float[Array, "d f", P(None, "tp")]


def test_a_checked_registered_dataclass_is_checked_when_made_not_rebuilt(mesh):
    """JAX rebuilds a registered dataclass through its `__init__`, with shardings,
    `ShapeDtypeStruct`s or tracers as its leaves: checked when the user makes it,
    not then."""
    with pytest.raises(jaxshard.ShardingError, match="Mlp"):
        Mlp(put((8, 4), mesh, P("dp", None)))
    mlp = Mlp(put((8, 4), mesh, P(None, "tp")))
    shardings = jax.tree.map(lambda x: x.sharding, mlp)
    assert isinstance(shardings.w, NamedSharding)
    assert jax.eval_shape(lambda m: m, mlp).w.shape == (8, 4)
    with jax.set_mesh(mesh):
        out = jax.jit(lambda m: m, out_shardings=shardings)(mlp)
    assert out.w.sharding == shardings.w


def test_linen_boxes_are_checked_against_their_names(mesh):
    """A flax linen box carries its partitioning, as an nnx Variable does:
    `check_tree` checks what it holds against it, by the box's path."""
    boxed = nn.Partitioned(put((8, 4), mesh, P("tp", None)), names=(None, "tp"))
    params = {"dense": {"kernel": boxed, "bias": put((4,), mesh, P())}}
    with pytest.raises(jaxshard.ShardingError) as e:
        jaxshard.check_tree(params, name="params")
    message = str(e.value)
    assert message.startswith("check_tree(params): params['dense']['kernel'] is ")
    assert "where its metadata says P(None, 'tp')" in message
    params["dense"]["kernel"] = boxed.replace_boxed(put((8, 4), mesh, P(None, "tp")))
    jaxshard.check_tree(params)
