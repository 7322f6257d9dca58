"""`jaxshard.annotate`'s observation and inference: what each function of a model
takes and returns, seen while the model is traced and compiled on a mesh, as
contracts."""

import dataclasses
import os
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import Array, Float


EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
sys.path.insert(0, os.path.abspath(EXAMPLES))
import transformer  # noqa: E402


SMALL = {"d": 64, "heads": 4, "hd": 16, "hidden": 128}
DIMS = {**SMALL, "batch": 8, "seqlen": 32, "layers": 2}


def mesh_of(kind: str):
    types = (AxisType.Explicit if kind == "explicit" else AxisType.Auto,) * 3
    return jax.make_mesh((2, 2, 2), ("dp", "fsdp", "tp"), axis_types=types)


def by_name(found) -> dict:
    return {f.qualname: f.annotations for f in found.functions}


def test_bfloat16_is_float():
    found = jaxshard.annotate(
        transformer.model, mesh=mesh_of("auto"), dims=DIMS, dtypes=jnp.bfloat16
    )
    assert by_name(found)["norm"]["scale"] == 'Float[Array, "d", P(None)]'


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_the_transformers_layouts_are_its_hand_written_ones(kind):
    found = jaxshard.annotate(transformer.model, mesh=mesh_of(kind), dims=DIMS)
    seen = by_name(found)
    x = 'Float[Array, "batch seqlen d", P(("dp", "fsdp"), None, None)]'
    heads = 'Float[Array, "batch seqlen heads hd", P(("dp", "fsdp"), None, "tp", None)]'
    assert seen["block"] == {"p": "Block", "x": x, "return": x}
    assert seen["model"]["params"] == "Stack"
    assert seen["project"] == {
        "x": x,
        "w": 'Float[Array, "d heads hd", P("fsdp", "tp", None)]',
        "return": heads,
    }
    assert seen["attend"] == {"q": heads, "k": heads, "v": heads, "return": heads}
    assert found.findings == ()
    assert found.report.ok
    # The weights come in as NamedTuples of the model's own: their fields are
    # annotated, the stacked ones and each layer's, as written by hand.
    classes = {f.qualname: f for f in found.functions if f.kind == "class"}
    assert set(classes) == {"Block", "Stack"}
    assert classes["Block"].annotations["wo"] == (
        'Float[Array, "heads hd d", P("tp", None, "fsdp")]'
    )
    assert classes["Stack"].annotations["w1"] == (
        'Float[Array, "layers d hidden", P(None, "fsdp", "tp")]'
    )
    # Only the scan body's `(x, None)` is a pytree no class of the model describes.
    (note,) = found.notes
    assert "(model.<locals>.layer: 'return')" in note


def mlp(x, w):
    return jnp.tanh(x @ w)


def model(x, w1, w2):
    """Calls `mlp` twice: once on a batch split over dp, once on one split over
    tp (the finding)."""
    h = mlp(x, w1)
    h = jax.lax.with_sharding_constraint(h, P(None, "tp"))
    return mlp(h, w2)


def test_a_parameter_laid_out_two_ways_is_a_finding(auto_mesh):
    def sds(shape, spec):
        return jax.ShapeDtypeStruct(
            shape, jnp.float32, sharding=NamedSharding(auto_mesh, spec)
        )

    values = {
        "x": sds((16, 8), P("dp", None)),
        "w1": sds((8, 8), P()),
        "w2": sds((8, 8), P()),
    }
    with pytest.warns(UserWarning, match="laid out differently"):
        found = jaxshard.annotate(
            model, mesh=auto_mesh, values=values, modules=[sys.modules[__name__]]
        )
    ((finding),) = [f for f in found.findings if f.name == "x"]
    assert finding.function.qualname == "mlp"
    assert {spec for spec, _ in finding.layouts} == {P("dp", None), P(None, "tp")}
    assert str(finding).startswith("mlp: parameter 'x' P(")
    assert "in 1 call" in str(finding) and "test_observe.py:" in str(finding)
    # No layout for it; its shape and dtype still.
    assert by_name(found)["mlp"]["x"] == 'Float[Array, "16 8"]'


def test_a_size_two_names_share_is_written_as_a_number(auto_mesh):
    dims = {**DIMS, "hd": 16, "seqlen": 16}  # two names of size 16
    found = jaxshard.annotate(transformer.model, mesh=auto_mesh_3(), dims=dims)
    assert by_name(found)["project"]["w"] == (
        'Float[Array, "d heads 16", P("fsdp", "tp", None)]'
    )


def auto_mesh_3():
    return mesh_of("auto")


def test_logical_names_where_the_rules_map_back(auto_mesh):
    """A layout is written in logical names where the rules give each split
    dimension's axes one name; in mesh axes where they give several."""
    rules = [("batch", ("dp", "fsdp")), ("heads", "tp"), ("embed", "fsdp")]
    found = jaxshard.annotate(
        transformer.model, mesh=auto_mesh_3(), dims=DIMS, rules=rules
    )
    seen = by_name(found)
    assert seen["block"]["x"] == (
        'Float[Array, "batch seqlen d", L("batch", None, None)]'
    )
    assert seen["project"]["w"] == (
        'Float[Array, "d heads hd", L("embed", "heads", None)]'
    )
    rules.append(("mlp", "tp"))  # "tp" is "heads" or "mlp": no one name
    found = jaxshard.annotate(
        transformer.model, mesh=auto_mesh_3(), dims=DIMS, rules=rules
    )
    assert by_name(found)["project"]["w"] == (
        'Float[Array, "d heads hd", P("fsdp", "tp", None)]'
    )


def test_vmap_bodies_are_seen_per_example(auto_mesh):
    def per_row(row):
        return row * 2

    def step(x):
        return jax.vmap(per_row)(x)

    x = jax.ShapeDtypeStruct(
        (8, 4), jnp.float32, sharding=NamedSharding(auto_mesh, P("dp", None))
    )
    found = jaxshard.annotate(
        step, mesh=auto_mesh, values={"x": x}, modules=[sys.modules[__name__]]
    )
    seen = by_name(found)
    assert seen["test_vmap_bodies_are_seen_per_example.<locals>.per_row"] == {
        "row": 'Float[Array, "4", P(None)]',
        "return": 'Float[Array, "4", P(None)]',
    }


def inner(h, w):
    return jnp.tanh(h @ w)


def outer(x: Float[Array, "batch d"], w: Float[Array, "d e"]):
    return inner(x, w)


def test_names_the_existing_annotations_give_carry_over(auto_mesh):
    """With no dims, a size takes the name the annotations already written give it:
    the batch of every activation is `batch`."""
    values = {
        "x": jax.ShapeDtypeStruct(
            (16, 8), jnp.float32, sharding=NamedSharding(auto_mesh, P("dp", None))
        ),
        "w": jax.ShapeDtypeStruct((8, 4), jnp.float32),
    }
    found = jaxshard.annotate(
        outer, mesh=auto_mesh, values=values, modules=[sys.modules[__name__]]
    )
    assert by_name(found)["inner"] == {
        "h": 'Float[Array, "batch d", P("dp", None)]',
        "w": 'Float[Array, "d e", P(None, None)]',
        "return": 'Float[Array, "batch e", P("dp", None)]',
    }


@pytest.mark.parametrize(
    "kwargs, said",
    [
        ({"mesh": "dp=4"}, "jaxshard.annotate: `mesh` takes a concrete"),
        ({"dims": [("b", 4)]}, "jaxshard.annotate: `dims` takes a dict"),
        ({"modules": ["no_such_module"]}, "'no_such_module', which cannot be"),
    ],
)
def test_bad_arguments(auto_mesh, kwargs, said):
    with pytest.raises((TypeError, ValueError)) as e:
        jaxshard.annotate(outer, **{"mesh": auto_mesh, **kwargs})
    assert str(e.value).startswith(said) or said in str(e.value)


def body(block):
    return block * 2


def test_a_shard_map_bodys_blocks_are_left_and_said(auto_mesh):
    """An annotation in a shard_map body describes the whole array, which a block's
    shape does not tell: the body's arrays get none, and a note says so."""

    def step(x):
        mapped = jax.shard_map(
            body, mesh=auto_mesh, in_specs=P("dp"), out_specs=P("dp")
        )
        return mapped(x) + 1

    x = jax.ShapeDtypeStruct(
        (8, 4), jnp.float32, sharding=NamedSharding(auto_mesh, P("dp"))
    )
    found = jaxshard.annotate(
        step, mesh=auto_mesh, values={"x": x}, modules=[sys.modules[__name__]]
    )
    assert "body" not in by_name(found)
    assert any("shard_map body (body)" in note for note in found.notes)


# --- the fields of the model's own dataclasses and NamedTuples ----------------------


class Mlp(NamedTuple):
    up: jax.Array
    down: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    scale: jax.Array
    mlp: Mlp
    extras: list  # arrays no class of the model describes


def _hidden_class():
    class Hidden(NamedTuple):  # no module binds its name
        w: jax.Array

    return Hidden


HIDDEN = _hidden_class()


def layer_body(x, layer):
    """A module-level scan body: its `layer` is one layer's slice of the stack."""
    return apply_layer(layer, x), None


def apply_layer(layer, x):
    h = jnp.tanh((x * layer.scale) @ layer.mlp.up) @ layer.mlp.down
    return h + sum(e.sum() for e in layer.extras)


def stacked(layers, hidden, x):
    return jax.lax.scan(layer_body, x * hidden.w, layers)[0]


def test_the_fields_of_the_models_own_classes(auto_mesh):
    """The fields of a registered dataclass and of the NamedTuple in it are written
    as the whole stack's (a scan body's one-layer slices of the same classes are
    not a second layout); the parameter holding the stack is annotated with its
    class, those holding one layer's slice are not. A class no module names and a
    list of arrays are said in the notes."""

    def sds(shape, spec):
        return jax.ShapeDtypeStruct(
            shape, jnp.float32, sharding=NamedSharding(auto_mesh, spec)
        )

    layers = Layer(
        scale=sds((3, 8), P()),
        mlp=Mlp(sds((3, 8, 16), P(None, None, "tp")), sds((3, 16, 8), P(None, "tp"))),
        extras=[sds((3, 2), P())],
    )
    values = {"layers": layers, "hidden": HIDDEN(sds((8,), P())), "x": sds((4, 8), P())}
    dims = {"layers": 3, "d": 8, "h": 16, "batch": 4}
    found = jaxshard.annotate(
        stacked, mesh=auto_mesh, values=values, dims=dims,
        modules=[sys.modules[__name__]],
    )  # fmt: skip
    classes = {f.qualname: f.annotations for f in found.functions if f.kind == "class"}
    assert classes["Mlp"] == {
        "up": 'Float[Array, "layers d h", P(None, None, "tp")]',
        "down": 'Float[Array, "layers h d", P(None, "tp", None)]',
    }
    assert classes["Layer"] == {"scale": 'Float[Array, "layers d", P(None, None)]'}
    seen = by_name(found)
    assert seen["stacked"]["layers"] == "Layer"
    assert "layer" not in seen["apply_layer"] and "layer" not in seen["layer_body"]
    assert "hidden" not in seen["stacked"]
    notes = " ".join(found.notes)
    assert "(stacked: 'hidden')" in notes and "do not name the class" in notes
    assert "Layer: 'extras'" in notes
    assert found.findings == ()
