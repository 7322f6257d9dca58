"""Parameter trees checked against the partitioning their leaves carry: flax linen's
boxes, nnx Variables, or a tree of specs (`jaxshard.check_partitioning`,
`jaxshard.Partitioned`)."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax import Array
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import BY_NAME, Float, L


RULES = [("batch", "fsdp"), ("embed", "fsdp"), ("mlp", "tp"), ("vocab", "tp")]


def auto_mesh():
    return jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)


class Mlp(nn.Module):
    """A linen layer whose weights the library makes: no annotation reaches them."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(
            32, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp"))
        )(x)
        h = nn.with_logical_constraint(h, ("batch", "mlp"))
        y = nn.Dense(
            16, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed"))
        )(h)
        return nn.with_logical_constraint(y, ("batch", "embed"))


def initialised(mesh):
    x = jnp.ones((8, 16))
    abstract = jax.eval_shape(Mlp().init, jax.random.key(0), x)
    specs = nn.get_partition_spec(abstract)
    shardings = nn.logical_to_mesh_sharding(specs, mesh, RULES)
    return jax.jit(Mlp().init, out_shardings=shardings)(jax.random.key(0), x), abstract


def replicate(tree, mesh):
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), tree)


def test_linen_boxes_eagerly():
    mesh = auto_mesh()
    with jax.set_mesh(mesh), jaxshard.axis_rules(RULES):
        params, _ = initialised(mesh)
        jaxshard.check_partitioning(params)
        bad = replicate(params, mesh)
        with pytest.raises(jaxshard.ShardingError) as caught:
            jaxshard.check_partitioning(bad)
    message = str(caught.value)
    assert message.startswith(
        "check_partitioning(params): 2 arrays are not partitioned as their metadata "
        "says, the first params['params']['Dense_0']['kernel']:"
    )
    assert (
        "- params['params']['Dense_0']['kernel'] is sharded as P(None, None) "
        "(float32[16,32]), where its metadata says P('fsdp', 'tp')" in message
    )
    assert "its metadata's L('embed', 'mlp') is P('fsdp', 'tp')" in message
    assert "annotation" not in message  # the user wrote none
    assert "bias" not in message  # no metadata: not checked


def test_flax_rules_and_the_boxes_own():
    mesh = auto_mesh()
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        params, _ = initialised(mesh)
        jaxshard.check_partitioning(params)  # flax's rules in force
    # Without rules, logical names cannot be resolved: a clear error, per leaf.
    with pytest.raises(jaxshard.ShardingError, match="no axis rules are in force"):
        jaxshard.check_partitioning(params)
    jaxshard.check_partitioning(params, rules=RULES)


def test_a_tree_of_specs():
    mesh = auto_mesh()
    with jax.set_mesh(mesh), jaxshard.axis_rules(RULES):
        params, abstract = initialised(mesh)
        unboxed = nn.unbox(params)
        specs = nn.get_partition_spec(abstract)
        jaxshard.check_partitioning(unboxed, jax.tree.map(lambda s: L(*s), specs,
                                    is_leaf=lambda s: isinstance(s, P)))  # fmt: skip
        mesh_specs = nn.logical_to_mesh(specs, RULES)
        jaxshard.check_partitioning(unboxed, mesh_specs)
        with pytest.raises(jaxshard.ShardingError, match=r"\['Dense_1'\]\['kernel'\]"):
            jaxshard.check_partitioning(replicate(unboxed, mesh), mesh_specs)
        with pytest.raises(ValueError, match="one spec"):
            jaxshard.check_partitioning(unboxed, [P()])


def test_specs_from_flax_metadata_are_logical():
    """`nn.get_partition_spec` of the abstract variables, the documented form for
    unboxed params, names flax's logical axes: read under the rules in force (here
    flax's own), and every path without the box's `.value`."""
    mesh = auto_mesh()
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        params, abstract = initialised(mesh)
        unboxed, specs = nn.unbox(params), nn.get_partition_spec(abstract)
        jaxshard.check_partitioning(unboxed, specs)
        bad = dict(unboxed["params"])
        bad["Dense_1"] = replicate(bad["Dense_1"], mesh)
        with pytest.raises(jaxshard.ShardingError) as caught:
            jaxshard.check_partitioning({"params": bad}, specs)
    lines = str(caught.value).splitlines()
    assert lines[0].startswith(
        "check_partitioning(params): params['params']['Dense_1']['kernel'] is sharded"
    )
    assert "L('mlp', 'embed')" in lines[0] and ".value" not in str(caught.value)
    with pytest.raises(jaxshard.ShardingError) as caught:
        jaxshard.check_partitioning(unboxed, specs)  # no rules in force
    message = str(caught.value)
    assert "names mesh axes 'embed', 'mlp'" in message
    assert message.splitlines()[-1].startswith("No axis rules are in force")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    w_up: Array
    w_down: Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    """Weights as Explicit-axes code keeps them: a registered dataclass, whose layouts
    the code base states as a tree of `NamedSharding`s of the same structure."""

    embed: Array
    layers: list[Layer]

    @staticmethod
    def shardings(mesh) -> "Weights":
        def at(*spec):
            return NamedSharding(mesh, P(*spec))

        layer = Layer(at(None, ("y", "z")), at(("y", "z"), None))
        return Weights(at("x", None), [layer, layer, layer])


def weights(mesh, down=P(("y", "z"), None)) -> Weights:
    layouts = Weights.shardings(mesh)
    shapes = Weights((32, 8), [Layer((8, 16), (16, 8))] * 3)
    placed = jax.tree.map(
        lambda shape, s: jax.device_put(jnp.ones(shape), s),
        shapes, layouts, is_leaf=lambda x: isinstance(x, tuple),
    )  # fmt: skip
    bad = jax.device_put(placed.layers[1].w_down, NamedSharding(mesh, down))
    placed.layers[1] = Layer(placed.layers[1].w_up, bad)
    return placed


def xyz_mesh(devices=None):
    devices = jax.devices() if devices is None else devices
    return jax.make_mesh(
        (2, 2, 2), ("x", "y", "z"), axis_types=(AxisType.Explicit,) * 3,
        devices=devices,
    )  # fmt: skip


@pytest.mark.parametrize("form", ["NamedSharding", "ShapeDtypeStruct", "spec"])
def test_a_layout_tree_of_shardings(form):
    """The layouts a code base states (`Weights.shardings(mesh)`, what
    `jax.jit(out_shardings=...)` takes, what `x.sharding` gives), as shardings,
    `ShapeDtypeStruct`s or specs: a misplaced leaf named by its path with both
    layouts, in words for a user who wrote no annotation."""
    mesh = xyz_mesh()
    layouts = {
        "NamedSharding": Weights.shardings(mesh),
        "ShapeDtypeStruct": jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            weights(mesh),
        ),
        "spec": jax.tree.map(lambda s: s.spec, Weights.shardings(mesh)),
    }[form]
    jaxshard.check_partitioning(weights(mesh), layouts, name="weights")
    with pytest.raises(jaxshard.ShardingError) as caught:
        jaxshard.check_partitioning(
            weights(mesh, P(None, ("y", "z"))), layouts, name="weights"
        )
    lines = str(caught.value).splitlines()
    assert lines == [
        "check_partitioning(weights): weights.layers[1].w_down is sharded as "
        "P(None, ('y', 'z')) "
        "(float32[16,8@(y,z)]), where the layout tree says P(('y', 'z'), None) "
        "(float32[16@(y,z),8]), on mesh {'x': 2, 'y': 2, 'z': 2} (Explicit axes).",
    ]
    assert "annotation" not in str(caught.value) and "third item" not in lines[0]


def test_a_layout_tree_compares_the_mesh_shape_and_dtype():
    mesh = xyz_mesh()
    other = xyz_mesh(jax.devices()[::-1])
    moved = jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(other, x.sharding.spec)),
        weights(mesh),
    )
    with pytest.raises(jaxshard.ShardingError) as caught:
        jaxshard.check_partitioning(moved, Weights.shardings(mesh))
    message = str(caught.value)
    assert message.startswith(
        "check_partitioning(Weights): 7 arrays are not laid out as the layout tree "
        "says, the first Weights.embed:"
    )
    assert (
        "- Weights.embed is sharded as P('x', None) on mesh {'x': 2, 'y': 2, 'z': 2} "
        "(Explicit axes) over devices [7,6,5,4,3,2,1,0], where the layout tree says "
        "P('x', None) on mesh {'x': 2, 'y': 2, 'z': 2} (Explicit axes) over devices "
        "[0,1,2,3,4,5,6,7]." in message
    )
    structs = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        weights(mesh),
    )
    structs.embed = jax.ShapeDtypeStruct((32, 4), jnp.bfloat16, sharding=None)
    with pytest.raises(jaxshard.TypeCheckError) as caught:
        jaxshard.check_partitioning(weights(mesh), structs)
    assert not isinstance(caught.value, jaxshard.ShardingError)
    assert str(caught.value) == (
        "check_partitioning(Weights): Weights.embed is float32[32,8], where the layout "
        "tree says bfloat16[32,4]."
    )


def test_a_tree_is_named_by_its_class_and_a_class_is_no_tree():
    mesh = xyz_mesh()
    with pytest.raises(jaxshard.ShardingError) as caught:
        jaxshard.check_partitioning(
            weights(mesh, P(None, ("y", "z"))), Weights.shardings(mesh)
        )
    assert str(caught.value).startswith(
        "check_partitioning(Weights): Weights.layers[1]"
    )
    with pytest.raises(TypeError, match="takes a value, not the class Weights"):
        jaxshard.shardings_of(Weights, mesh)


def test_a_layout_tree_leaf_that_states_no_layout():
    mesh = xyz_mesh()
    with pytest.raises(TypeError) as caught:
        jaxshard.check_partitioning(
            weights(mesh), jax.tree.map(lambda x: "y", weights(mesh))
        )
    message = str(caught.value)
    assert message.startswith(
        "check_partitioning: the layout tree's leaf for Weights.embed is 'y' (type "
        "str), which states no layout."
    )
    assert "third item" not in message


def test_a_layout_tree_inside_jit():
    """Inside `jit` on Explicit axes, at trace time, the shardings' specs."""
    mesh = xyz_mesh()

    @jax.jit
    def step(w):
        jaxshard.check_partitioning(w, Weights.shardings(mesh), name="w")
        return jax.tree.map(lambda x: x * 2, w)

    with jax.set_mesh(mesh):
        step(weights(mesh))
        with pytest.raises(jaxshard.ShardingError, match=r"w\.layers\[1\]\.w_down"):
            step(weights(mesh, P(None, ("y", "z"))))


@pytest.mark.parametrize("axis_types", ["auto"])
def test_inside_jit_as_an_annotation(axis_types):
    del axis_types
    mesh = auto_mesh()

    @jaxshard.jaxtyped
    def forward(
        params: jaxshard.Partitioned, x: Float[Array, "batch embed", BY_NAME]
    ) -> Float[Array, "batch embed", BY_NAME]:
        return Mlp().apply(params, x)

    with jax.set_mesh(mesh), jaxshard.axis_rules(RULES):
        params, _ = initialised(mesh)
        x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("fsdp")))
        step = jax.jit(forward)
        step(params, x)
        with pytest.raises(jaxshard.ShardingError) as caught:
            step(replicate(params, mesh), x)
    assert "['Dense_0']['kernel']" in str(caught.value)


def test_verify_places_abstract_boxes_and_checks_them():
    mesh = auto_mesh()

    def forward(
        params: jaxshard.Partitioned, x: Float[Array, "batch embed", BY_NAME]
    ) -> Float[Array, "batch embed", BY_NAME]:
        return Mlp().apply(params, x)

    _, abstract = initialised(mesh)
    report = jaxshard.verify(
        forward, mesh=mesh, dims={"batch": 8, "embed": 16},
        values={"params": abstract}, rules=RULES,
    )  # fmt: skip
    names = {row.name for row in report.rows}
    assert "params['params']['Dense_1']['kernel']" in names
    kernel = report.inputs["params['params']['Dense_0']['kernel']"]  # no box's .value
    assert kernel.sharding.spec == P("fsdp", "tp")
    wrong = [("batch", "fsdp"), ("embed", "tp"), ("mlp", "fsdp")]
    report = jaxshard.verify(
        forward, mesh=mesh, dims={"batch": 8, "embed": 16},
        values={"params": abstract}, rules=wrong, raise_on_error=False,
    )  # fmt: skip
    assert report.ok  # the inputs are placed by the same (wrong) rules: consistent


def test_nnx_variables():
    mesh = auto_mesh()
    init = nnx.with_partitioning(nnx.initializers.ones, ("embed", "mlp"))
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        layer = nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0))
        state = nnx.state(layer)
        jaxshard.check_partitioning(state)
        with pytest.raises(jaxshard.ShardingError, match=r"params\['kernel'\]"):
            jaxshard.check_partitioning(replicate(state, mesh))


def test_nnx_variables_named_by_mesh_axes():
    # nnx's own docs name mesh axes in `with_partitioning`, with no rules: they are
    # read as mesh axes, with or without jaxshard's rules in force.
    mesh = auto_mesh()
    init = nnx.with_partitioning(nnx.initializers.ones, ("fsdp", "tp"))
    with jax.set_mesh(mesh):
        layer = nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0))
        state = nnx.state(layer)
        assert state["kernel"].get_value().sharding.spec == P("fsdp", "tp")
        jaxshard.check_partitioning(state)
        with jaxshard.axis_rules(RULES):
            jaxshard.check_partitioning(state)
        with pytest.raises(jaxshard.ShardingError, match=r"params\['kernel'\]"):
            jaxshard.check_partitioning(replicate(state, mesh))


def test_nnx_attributes_annotated_logically():
    mesh = auto_mesh()

    class Layer(nnx.Module):
        w: nnx.Param[Float[Array, "embed mlp", BY_NAME]]

        def __init__(self, w):
            self.w = nnx.Param(w)

    with jax.set_mesh(mesh), jaxshard.axis_rules(RULES):
        good = Layer(
            jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("fsdp", "tp")))
        )
        jaxshard.check_tree(good)
        bad = Layer(jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P())))
        with pytest.raises(jaxshard.ShardingError, match=r"Layer\.w.*mlp -> 'tp'"):
            jaxshard.check_tree(bad)


MODEL = """
import jax
import jax.numpy as jnp
import flax.linen as nn
from jax import Array
import jaxshard
from jaxshard import BY_NAME, Float

RULES = [("batch", "fsdp"), ("embed", "fsdp"), ("mlp", "tp")]


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.ones, ("embed", "mlp"))
        return nn.Dense(32, kernel_init=init)(x)


def forward(params: jaxshard.Partitioned, x: Float[Array, "batch embed", BY_NAME]):
    return Mlp().apply(params, x)


def abstract_params():
    return jax.eval_shape(Mlp().init, jax.random.key(0), jnp.ones((8, 16)))
"""


def test_cli_checks_a_boxed_tree(tmp_path):
    import os
    import subprocess
    import sys

    (tmp_path / "model.py").write_text(MODEL)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-m", "jaxshard", "verify", "model:forward", "--mesh",
         "fsdp=4,tp=2", "--dim", "batch=8", "--dim", "embed=16", "--rules",
         "model:RULES", "--values", "params=model:abstract_params"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "params['params']['Dense_0']['kernel']" in out.stdout
    assert "float32[16@fsdp,32@tp]" in out.stdout
