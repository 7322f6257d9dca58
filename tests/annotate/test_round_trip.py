"""`jaxshard.annotate`'s round trip: a model with its contracts stripped is
annotated, the contracts written into a copy of its source, and the copy imported:
the written contracts hold when the model runs and under `verify`, catch a
misplaced weight and a wrong activation layout, and on the transformer of
examples/transformer.py equal the ones written by hand."""

import os

import jax
import libcst as cst
import numpy as np
import pytest
from helpers import imported
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard._annotations.hints import type_hints


HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "..", "examples", "transformer.py")
SMALL = {"d": 64, "heads": 4, "hd": 16, "hidden": 128}
DIMS = {**SMALL, "batch": 8, "seqlen": 32, "layers": 2}


class _Stripped(cst.CSTTransformer):
    """Every function's parameter and return annotations, and its jaxtyped
    decorator, removed; each class field's contract (`w: Float[Array, ...]`) made
    `w: Array`."""

    def leave_Param(self, original, updated):
        return updated.with_changes(annotation=None)

    def leave_AnnAssign(self, original, updated):
        annotation = updated.annotation.annotation
        if isinstance(annotation, cst.Subscript) and cst.Module([]).code_for_node(
            annotation.value
        ) in ("Float", "Int"):
            array = cst.Annotation(annotation=cst.Name("Array"))
            return updated.with_changes(annotation=array)
        return updated

    def leave_FunctionDef(self, original, updated):
        kept = [
            d
            for d in updated.decorators
            if "jaxtyped" not in cst.Module([]).code_for_node(d)
        ]
        return updated.with_changes(returns=None, decorators=kept)


def stripped_copy(source: str, folder, name: str):
    """A copy of the module at `source`, its functions' contracts stripped."""
    path = folder / f"{name}.py"
    with open(source, encoding="utf-8") as f:
        text = cst.parse_module(f.read()).visit(_Stripped()).code
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def original():
    return imported(EXAMPLE, "transformer_by_hand")


@pytest.fixture(scope="module", params=["auto", "explicit"])
def written(request, tmp_path_factory, original):
    """The transformer stripped, annotated on a mesh of this axis type, written and
    imported again; and the mesh."""
    kind = AxisType.Explicit if request.param == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((2, 2, 2), ("dp", "fsdp", "tp"), axis_types=(kind,) * 3)
    folder = tmp_path_factory.mktemp(request.param)
    name = f"transformer_{request.param}"
    bare = imported(stripped_copy(EXAMPLE, folder, name), f"{name}_bare")
    params, x = jaxshard.abstract_args(original.model, mesh, DIMS)
    values = {"params": bare.Stack(*params), "x": x}  # the copy's own NamedTuple
    found = jaxshard.annotate(bare.model, mesh=mesh, values=values, dims=DIMS)
    assert found.findings == ()
    diff = found.diff()
    assert diff.count("@jaxshard.jaxtyped(typechecker=beartype)") == 9
    assert found.write() == [str(folder / f"{name}.py")]
    module = imported(folder / f"{name}.py", name)
    return module, mesh, (module.Stack(*params), x)


def specs(module, function: str) -> dict:
    hints = type_hints(getattr(module, function))
    return {
        k: jaxshard.partition_spec(v)
        for k, v in hints.items()
        if getattr(v, "dim_str", None) is not None
    }


@pytest.mark.parametrize(
    "function",
    ["project", "attend", "attention", "mlp", "block", "model", "Block", "Stack"],
)
def test_the_written_layouts_are_the_hand_written_ones(written, original, function):
    """Each function's parameters and return value, and the weights' fields (the
    stacked ones of `Stack` and each layer's of `Block`)."""
    module, _, _ = written
    by_hand, found = specs(original, function), specs(module, function)
    stated = {n: s for n, s in by_hand.items() if s is not None}
    assert stated, function
    for name, spec in stated.items():  # every layout written by hand, found
        assert found[name] == spec, (function, name)


def test_the_written_contracts_hold_under_verify(written):
    """The model's own parameters too: `params` is annotated `Stack`, whose fields
    are checked one by one."""
    module, mesh, _ = written
    assert type_hints(module.model)["params"] is module.Stack
    report = jaxshard.verify(module.model, mesh=mesh, dims=DIMS)
    assert report.ok and len(report.rows) > 10
    functions = {r.function.rsplit(".", 1)[-1] for r in report.rows}
    assert {"project", "attend", "norm", "block"} <= functions
    assert any(r.name == "params.wq" for r in report.rows)


def test_they_catch_a_misplaced_weight_when_the_model_runs(written):
    """Run on concrete arrays: the written contracts pass; a weight laid out over
    the wrong axis fails at the function that takes it."""
    module, mesh, args = written

    def concrete(s):
        return jax.device_put(np.ones(s.shape, np.float32) * 0.01, s.sharding)

    params, x = jax.tree.map(concrete, args)
    with jax.set_mesh(mesh):
        out = jax.jit(module.model)(params, x)
        assert out.shape == x.shape
        moved = jax.device_put(
            params.wq, NamedSharding(mesh, P(None, "tp", "fsdp", None))
        )
        with pytest.raises(jaxshard.ShardingError, match="project"):
            jax.jit(module.model)(params._replace(wq=moved), x)


def test_they_catch_a_wrong_activation_layout(written):
    """The batch laid out over the sequence instead: the model's own contract on
    `x` fails, when it runs and under verify."""
    module, mesh, (params, x) = written
    wrong = NamedSharding(mesh, P(None, "dp", None))
    concrete = jax.device_put(np.zeros(x.shape, np.float32), wrong)
    params = jax.tree.map(
        lambda s: jax.device_put(np.zeros(s.shape, np.float32), s.sharding), params
    )
    with jax.set_mesh(mesh):
        with pytest.raises(jaxshard.ShardingError, match="model"):
            jax.jit(module.model)(params, concrete)


# --- tests/decoders.py's flax decoders, linen and nnx --------------------------------

DECODERS = os.path.join(HERE, "..", "decoders.py")


def annotated_decoder(style: str, folder, name: str):
    """tests/decoders.py stripped of its contracts into `folder/name.py`, and its
    `style` decoder's loss annotated under its rule table (its own module's
    functions and classes): the mesh, and what annotate found."""
    bare = imported(stripped_copy(DECODERS, folder, name), name)
    mesh = jax.make_mesh(
        (2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3
    )
    made = getattr(bare, f"make_{style}")(mesh)
    dims = {"batch": bare.BATCH, "length": bare.LENGTH, "embed": bare.EMBED}
    found = jaxshard.annotate(
        made.loss,
        mesh=mesh,
        values={"state": made.state, "batch": made.batch},
        dims=dims,
        rules=bare.RULES,
        modules=[bare],
    )
    return mesh, found


@pytest.mark.parametrize("style", ["linen", "nnx"])
def test_the_flax_decoders_round_trip(style, tmp_path):
    """The decoders stripped of their contracts, annotated under their rule table
    (logical names where the rules map a layout back to one name each), written and
    imported again: the train step runs and verifies, and the written contracts
    catch a layer whose MLP kernel is named wrongly and tokens laid out wrongly."""
    mesh, found = annotated_decoder(style, tmp_path, "decoders_bare")
    seen = {f.qualname: f.annotations for f in found.functions}
    block = f"{style.capitalize()}Block.__call__"
    act = 'Float[Array, "batch length embed", L("batch", None, None)]'
    assert seen[block] == {"x": act, "return": act}
    found.write()
    written = imported(tmp_path / "decoders_bare.py", f"dec_written_{style}")
    good = getattr(written, f"make_{style}")(mesh)
    with jax.set_mesh(mesh), jaxshard.axis_rules(written.RULES):
        good.step(good.state, good.batch)
        values = {"state": good.state, "batch": good.batch}
        report = jaxshard.verify(good.loss, mesh=mesh, values=values)
        assert report.ok and any(r.function.endswith(block) for r in report.rows)
        bad = getattr(written, f"make_{style}")(mesh, wrong_layer=1)
        with pytest.raises(jaxshard.ShardingError, match="Mlp"):
            bad.step(bad.state, bad.batch)
        tokens = jax.device_put(good.batch, NamedSharding(mesh, P(None, "data")))
        with pytest.raises(jaxshard.ShardingError, match="P\\(None, 'data'\\)"):
            good.loss(good.state, tokens)


def test_the_equinox_decoder_round_trips(tmp_path):
    """An equinox Module's fields (`up: Array` stripped of its contract) are
    written from the instances seen as `self` and in other fields (a list of
    blocks, a nested MLP): they are the layouts the hand-written ones resolve to,
    and the written model trains, and catches a layer whose MLP weight is placed
    transposed, naming it by its path."""
    mesh, found = annotated_decoder("equinox", tmp_path, "eqx_bare")
    fields = {f.qualname: f.annotations for f in found.functions if f.kind == "class"}
    assert set(fields) == {"EqxMlp", "EqxBlock", "EqxDecoder"}
    assert fields["EqxMlp"]["up"].startswith('Float[Array, "embed 64", ')
    # `qkv` is a tuple of arrays, which no class of the model describes.
    assert "EqxBlock: 'qkv'" in " ".join(found.notes)
    found.write()
    written = imported(tmp_path / "eqx_bare.py", "eqx_written")
    original = imported(DECODERS, "decoders_by_hand")
    with jaxshard.axis_rules(written.RULES):  # the specs resolved under the rules
        for cls, field in [("EqxMlp", "up"), ("EqxMlp", "down"), ("EqxBlock", "out"),
                           ("EqxDecoder", "embed")]:  # fmt: skip
            hand = type_hints(getattr(original, cls))[field]
            mine = type_hints(getattr(written, cls))[field]
            assert mine.spec == hand.spec, (cls, field)
    good = written.make_equinox(mesh)
    with jax.set_mesh(mesh), jaxshard.axis_rules(written.RULES):
        good.step(good.state, good.batch)
        bad = written.make_equinox(mesh, wrong_layer=1)
        with pytest.raises(jaxshard.ShardingError, match=r"blocks\[1\]\.mlp\.up"):
            bad.step(bad.state, bad.batch)
