"""`jaxshard.device_put` and `jaxshard.shardings_of`: trees placed as their field
annotations (or nnx metadata) say, concrete, abstract and inside `jit`."""

import dataclasses
from typing import NamedTuple

import decoders
import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import Array
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import Float, L, PyTree


RULES = [("mlp", "tp"), ("embed", "dp")]
MISSING = [("mlp", "fsdp"), ("embed", "dp")]  # "fsdp" is no axis of the mesh


class Block(eqx.Module):
    up: Float[Array, "d h", P(None, "tp")]
    down: Float[Array, "h d", L("mlp", "embed")]
    scale: Float[Array, " d"]  # no sharding: replicated over the mesh
    act: object = jax.nn.relu  # not an array


class Model(eqx.Module):
    embed: Float[Array, "v d", P("dp", None)]
    blocks: list[Block]


def init(key, d: int = 8) -> Model:
    k = iter(jax.random.split(key, 8))
    blocks = [
        Block(
            jax.random.normal(next(k), (d, 4)),
            jax.random.normal(next(k), (4, d)),
            jnp.ones(d),
        )
        for _ in range(2)
    ]
    return Model(jax.random.normal(next(k), (16, d)), blocks)


def spec(x) -> P:
    entries = list(x.sharding.spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


@pytest.fixture(scope="module", params=["auto", "explicit"])
def mesh(request):
    kind = AxisType.Auto if request.param == "auto" else AxisType.Explicit
    return jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(kind, kind))


def test_equinox_module_placed_as_annotated(mesh):
    model = init(jax.random.key(0))
    with jax.set_mesh(mesh), jaxshard.axis_rules(RULES):
        placed = jaxshard.device_put(model)
    assert spec(placed.embed) == P("dp")
    for block in placed.blocks:
        assert spec(block.up) == P(None, "tp")
        assert spec(block.down) == P("tp", "dp")  # L("mlp", "embed") under RULES
        assert block.scale is not None and block.act is jax.nn.relu
    # Annotated without a spec: replicated over the mesh; the input tree is
    # unchanged.
    assert placed.blocks[0].scale.sharding == NamedSharding(mesh, P())
    assert len(model.blocks[0].scale.sharding.device_set) == 1
    assert model.embed.sharding != placed.embed.sharding
    np.testing.assert_array_equal(placed.embed, model.embed)


def test_mesh_argument_and_rules_argument(mesh):
    placed = jaxshard.device_put(init(jax.random.key(0)), mesh, rules=RULES)
    assert placed.blocks[1].down.sharding.mesh == mesh
    assert spec(placed.blocks[1].down) == P("tp", "dp")


def test_dataclass_namedtuple_and_annotated_pytree(mesh):
    @dataclasses.dataclass
    class Pair:
        a: Float[Array, "n m", P("dp", None)]
        b: Float[Array, "m", P("tp")]

    class Batch(NamedTuple):
        x: Float[Array, "n m", P(None, "tp")]
        y: Pair

    batch = Batch(jnp.ones((8, 4)), Pair(np.ones((8, 4), np.float32), jnp.ones(4)))
    jax.tree_util.register_dataclass(Pair, data_fields=["a", "b"], meta_fields=[])
    placed = jaxshard.device_put(batch, mesh)
    assert isinstance(placed, Batch) and isinstance(placed.y, Pair)
    assert (spec(placed.x), spec(placed.y.a), spec(placed.y.b)) == (
        P(None, "tp"),
        P("dp"),
        P("tp"),
    )
    # Any pytree, with its annotation given.
    params = {"w": jnp.ones((8, 2)), "v": jnp.ones((4, 2))}
    annotation = PyTree[Float[Array, "_ k", P("dp", None)]]
    out = jaxshard.device_put(params, mesh, annotation=annotation)
    assert spec(out["w"]) == spec(out["v"]) == P("dp")


def test_abstract_tree_gets_shardings_and_creates_placed(mesh):
    with jax.set_mesh(mesh), jaxshard.axis_rules(RULES):
        abstract = eqx.filter_eval_shape(init, jax.random.key(0))
        placed = jaxshard.device_put(abstract)
        assert isinstance(placed.blocks[0].down, jax.ShapeDtypeStruct)
        assert placed.blocks[0].down.sharding.spec == P("tp", "dp")
        assert placed.blocks[0].scale is abstract.blocks[0].scale  # nothing says
        # Created already placed: a jitted init whose output is laid out as annotated.
        model = eqx.filter_jit(lambda key: jaxshard.device_put(init(key)))(
            jax.random.key(0)
        )
    assert spec(model.blocks[1].down) == P("tp", "dp")
    assert spec(model.embed) == P("dp")


def test_shardings_of_for_jit_out_shardings(mesh):
    @dataclasses.dataclass
    class Params:
        w: Float[Array, "d h", P("dp", "tp")]
        b: Float[Array, "h"]

    jax.tree_util.register_dataclass(Params, data_fields=["w", "b"], meta_fields=[])

    def make(key):
        return Params(jax.random.normal(key, (8, 4)), jnp.zeros(4))

    with jax.set_mesh(mesh):
        shardings = jaxshard.shardings_of(jax.eval_shape(make, jax.random.key(0)))
        assert shardings.w == NamedSharding(mesh, P("dp", "tp"))
        assert shardings.b is None
        params = jax.jit(make, out_shardings=shardings)(jax.random.key(0))
    assert spec(params.w) == P("dp", "tp")


def test_wrong_shape_names_every_path():
    model = init(jax.random.key(0))
    wrong = eqx.tree_at(lambda m: m.blocks[1].up, model, jnp.ones((8, 4, 1)))
    with pytest.raises(jaxshard.TypeCheckError) as e:
        jaxshard.device_put(wrong, jax.make_mesh((4, 2), ("dp", "tp")), rules=RULES)
    text = str(e.value)
    assert "jaxshard.device_put(Model): Model.blocks[1].up does not match" in text
    assert "- Model.blocks[1].up: float32[8,4,1]:" in text
    assert "Fix the array" in text


def test_uneven_or_missing_axes_are_jaxshard_errors(mesh):
    model = init(jax.random.key(0), d=6)
    with pytest.raises(jaxshard.ShardingError) as e:
        jaxshard.device_put(model, mesh, rules=RULES)
    assert (
        "- Model.blocks[0].down (float32[4,6]): P('tp', 'dp') splits dimension 1"
        in (str(e.value))
    )
    with pytest.raises(jaxshard.ShardingError, match="names mesh axis 'fsdp'"):
        jaxshard.device_put(init(jax.random.key(0)), mesh, rules=MISSING)


def test_inside_shard_map_each_array_is_a_block_of_the_annotated_one(mesh):
    """In a shard_map body, as for `constrain`: each annotation describes the global
    array (shape and divisibility checked on it), the manual axes stay shard_map's
    and the others are laid out."""
    Tree = dict[str, Float[Array, "b d", P("dp", "tp")]]
    Fixed = dict[str, Float[Array, "8 4", P("dp", "tp")]]
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("dp", None)))

    def run(annotation, b=lambda b: b):
        def body(block):
            return jaxshard.device_put({"w": b(block) * 2}, annotation=annotation)["w"]

        mapped = jax.shard_map(
            body, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"), axis_names={"dp"}
        )
        with jax.set_mesh(mesh):
            return jax.jit(mapped)(x)

    for annotation in (Tree, Fixed):  # dp is 4 devices: each block is [2, 4]
        out = run(annotation)
        assert (out == 2).all() and spec(out) == P("dp", "tp")  # tp laid out inside
    with pytest.raises(jaxshard.TypeCheckError) as e:
        run(dict[str, Float[Array, "8 5", P("dp", "tp")]])
    assert "tree['w']: float32[2,4], one block of the global float32[8,4]" in str(
        e.value
    )
    with pytest.raises(jaxshard.ShardingError, match="does not divide it evenly"):
        run(Tree, lambda b: b[:, :3])


def test_a_bare_spec_is_one_arrays_annotation(mesh):
    """As `constrain` takes them: a `P` or `L(...)` lays out one array of any shape
    and dtype (only its rank is checked), for each function that takes an
    annotation."""
    x = jnp.ones((8, 4))
    for annotation in (P("dp", "tp"), L("embed", "mlp")):
        placed = jaxshard.device_put(x, mesh, annotation=annotation, rules=RULES)
        assert spec(placed) == P("dp", "tp")
        assert placed.sharding.mesh == mesh
        sharding = jaxshard.shardings_of(x, mesh, annotation=annotation, rules=RULES)
        assert sharding == NamedSharding(mesh, P("dp", "tp"))
        abstract = jaxshard.device_put(
            jax.ShapeDtypeStruct((8, 4), jnp.float32),
            mesh,
            annotation=annotation,
            rules=RULES,
        )
        assert abstract.sharding == NamedSharding(mesh, P("dp", "tp"))
    with jax.set_mesh(mesh):
        placed = jax.jit(lambda x: jaxshard.device_put(x, annotation=P("dp")))(x)
    assert spec(placed) == P("dp")


def test_a_bare_spec_is_checked_as_an_annotation(mesh):
    x = jnp.ones((8, 4))
    with pytest.raises(jaxshard.ShardingError) as e:
        jaxshard.device_put(x, mesh, annotation=P("dp", "tp", None))
    assert str(e.value).startswith("jaxshard.device_put(P('dp', 'tp', None)): ")
    assert "has 3 entries but the array has 2 dimensions" in str(e.value)
    with pytest.raises(jaxshard.ShardingError) as e:
        jaxshard.shardings_of(jnp.ones((6, 4)), mesh, annotation=P("dp"))
    assert "P('dp') splits dimension 0 (of size 6)" in str(e.value)
    with pytest.raises(jaxshard.AnnotationError, match="jaxshard.device_put: BY_NAME"):
        jaxshard.device_put(x, mesh, annotation=jaxshard.BY_NAME)


def test_one_arrays_annotation_for_a_tree_says_so(mesh):
    for annotation in (P("dp"), Float[Array, "b d", P("dp")]):
        with pytest.raises(jaxshard.TypeCheckError) as e:
            jaxshard.device_put({"w": jnp.ones((8, 4))}, mesh, annotation=annotation)
        text = str(e.value)
        assert (
            "`annotation` describes one array, but the value is a dict of 1 leaf,"
            in text
        )
        assert "Give the tree's annotation" in text


class LinenBlock(nn.Module):
    """A linen layer whose kernel carries its partitioning and whose LayerNorm's
    scale and bias carry none."""

    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.ones, ("embed", "mlp"))
        return nn.Dense(4, kernel_init=init, use_bias=False)(nn.LayerNorm()(x))


def test_what_nothing_lays_out_is_replicated_over_the_mesh(mesh):
    """Arrays made on one device whose layout nothing states (no annotation, no
    metadata): replicated over the mesh, not left on device 0; one laid out on the
    mesh already stays as it is."""
    variables = LinenBlock().init(jax.random.key(0), jnp.ones((2, 8)))  # one device
    assert len(variables["params"]["LayerNorm_0"]["scale"].sharding.device_set) == 1
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        placed = jaxshard.device_put(variables)
    params = placed["params"]
    assert spec(params["Dense_0"]["kernel"].value) == P("dp", "tp")
    for name in ("scale", "bias"):
        assert params["LayerNorm_0"][name].sharding == NamedSharding(mesh, P())
    kept = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("dp")))
    tree = {"w": jnp.ones((8, 4)), "kept": kept, "host": np.ones(3), "n": 3}
    out = jaxshard.device_put(tree, mesh)
    assert out["w"].sharding == NamedSharding(mesh, P())
    assert out["kept"] is kept and out["n"] == 3
    assert isinstance(out["host"], np.ndarray)  # a numpy array stays one


def test_what_nothing_lays_out_moves_to_a_mesh_of_the_same_devices(mesh):
    """An array laid out on a mesh of the same axes and devices (another axis type)
    keeps its layout on the new one."""
    other = AxisType.Explicit if mesh.axis_types[0] == AxisType.Auto else AxisType.Auto
    twin = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(other, other))
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(twin, P(None, "tp")))
    assert jaxshard.device_put({"x": x}, mesh)["x"].sharding == NamedSharding(
        mesh, P(None, "tp")
    )


def test_no_mesh_says_how_to_give_one():
    with pytest.raises(ValueError, match="needs a mesh"):
        jaxshard.device_put(init(jax.random.key(0)), rules=RULES)
    with pytest.raises(TypeError, match="`mesh` takes a jax.sharding.Mesh"):
        jaxshard.device_put(init(jax.random.key(0)), "mesh")
    with pytest.raises(ValueError, match="needs a mesh"):  # arrays to replicate
        jaxshard.device_put({"w": jnp.ones(4)})


# --- the test decoders, on an 8-device mesh ------------------------------------------


@pytest.fixture(scope="module")
def lm_mesh():
    return jax.make_mesh(
        (2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 3
    )


def _eqx_decoder(key) -> decoders.EqxDecoder:
    """The equinox decoder, its weights made where they are made (unplaced)."""
    keys = iter(jax.random.split(key, 64))
    e, m, v = decoders.EMBED, decoders.MLP, decoders.VOCAB

    def w(*shape):
        return jax.random.normal(next(keys), shape) / jnp.sqrt(shape[0])

    blocks = [
        decoders.EqxBlock(
            tuple(w(e, e) for _ in range(3)), w(e, e), decoders.EqxMlp(w(e, m), w(m, e))
        )
        for _ in range(decoders.LAYERS)
    ]
    return decoders.EqxDecoder(w(v, e), blocks)


def test_equinox_decoder_created_placed(lm_mesh):
    with jax.set_mesh(lm_mesh), jaxshard.axis_rules(decoders.RULES):
        model = eqx.filter_jit(lambda key: jaxshard.device_put(_eqx_decoder(key)))(
            jax.random.key(0)
        )
        jaxshard.check_tree(model)  # every field as annotated
    assert spec(model.blocks[2].mlp.up) == P("fsdp", "tensor")
    assert spec(model.embed) == P("tensor", "fsdp")
    assert model.embed.sharding.mesh == lm_mesh


def test_nnx_decoder_placed_by_its_metadata(lm_mesh):
    one = jax.make_mesh((1, 1, 1), lm_mesh.axis_names, devices=jax.devices()[:1])
    with jax.set_mesh(one), nn.logical_axis_rules(decoders.RULES):
        model = decoders.NnxDecoder(nnx.Rngs(0))  # on one device
    assert len(model.embed[...].sharding.device_set) == 1
    with jax.set_mesh(lm_mesh), nn.logical_axis_rules(decoders.RULES):
        placed = jaxshard.device_put(model)
        jaxshard.check_partitioning(nnx.state(placed))
        made = nnx.jit(lambda: jaxshard.device_put(decoders.NnxDecoder(nnx.Rngs(0))))()
        abstract = jax.eval_shape(lambda: decoders.NnxDecoder(nnx.Rngs(0)))
        shardings = jaxshard.shardings_of(abstract)
    assert placed is not model and len(model.embed[...].sharding.device_set) == 1
    assert spec(placed.blocks[3].mlp.up[...]) == P("fsdp", "tensor")
    assert spec(placed.embed[...]) == P("tensor", "fsdp")
    assert spec(made.blocks[0].qkv[1][...]) == P("fsdp", "tensor")
    assert shardings.blocks[0].out.get_value() == NamedSharding(
        lm_mesh, P("tensor", "fsdp")
    )
