"""`jaxshard.summary`: each array's bytes per device, concrete and abstract; and the
same rows of `verify`'s inputs in its report."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import Float, L
from jaxshard._annotations.spec import format_spec


@dataclasses.dataclass
class Params:
    w: Float[Array, "d f", P("dp", "tp")]  # split over all 8 devices
    v: Float[Array, "f d", L("mlp", None)]  # over "tp" only: replicated over "dp"
    b: Float[Array, "f"]  # replicated


jax.tree_util.register_dataclass(Params, data_fields=["w", "v", "b"], meta_fields=[])
RULES = [("mlp", "tp")]
KiB = 1024


def make() -> Params:
    return Params(jnp.ones((64, 32)), jnp.ones((32, 64)), jnp.ones(32))


def check_rows(summary):
    by_path = {r.path: r for r in summary.rows}
    w, v, b = by_path["Params.w"], by_path["Params.v"], by_path["Params.b"]
    assert (w.shape, w.dtype, w.spec) == ((64, 32), "float32", "P('dp', 'tp')")
    assert (w.bytes_total, w.bytes_per_device, w.bytes_replicated) == (8 * KiB, KiB, 0)
    assert v.spec == "P('tp')"
    assert (v.bytes_per_device, v.bytes_replicated) == (4 * KiB, 3 * KiB)
    assert b.bytes_per_device == b.bytes_total == 128
    # The largest per device first.
    assert [r.path for r in summary.rows] == ["Params.v", "Params.w", "Params.b"]
    assert summary.bytes_total == 16 * KiB + 128
    assert summary.bytes_per_device == 5 * KiB + 128


def test_concrete_tree(auto_mesh):
    with jax.set_mesh(auto_mesh), jaxshard.axis_rules(RULES):
        params = jaxshard.device_put(make())
        params = dataclasses.replace(
            params, b=jax.device_put(params.b, NamedSharding(auto_mesh, P()))
        )
    summary = jaxshard.summary(params)
    check_rows(summary)
    text = str(summary)
    lines = text.splitlines()
    assert (
        lines[0]
        == "jaxshard.summary: Params, 3 arrays on mesh {'dp': 4, 'tp': 2} (Auto axes)"
    )
    assert lines[2].split() == [
        "path", "shape", "dtype", "spec", "per", "device", "total", "replicated"
    ]  # fmt: skip
    assert lines[4].split() == [
        "Params.v", "(32,", "64)", "float32", "P('tp')", "4.0", "KiB", "8.0", "KiB",
        "3.0", "KiB",
    ]  # fmt: skip
    assert lines[-1] == (
        "Total 16.1 KiB; per device 5.1 KiB, of which 3.1 KiB beyond an even share "
        "(replicated)."
    )


def test_abstract_tree_placed_as_annotated(auto_mesh):
    abstract = jax.eval_shape(make)
    with jaxshard.axis_rules(RULES):
        check_rows_abstract = jaxshard.summary(abstract, auto_mesh)
    rows = {r.path: r for r in check_rows_abstract.rows}
    assert rows["Params.w"].spec == "P('dp', 'tp')"
    assert rows["Params.v"].bytes_per_device == 4 * KiB
    assert rows["Params.b"].spec == "unplaced"  # its annotation states no spec
    # Without a mesh, nothing places the abstract arrays.
    unplaced = jaxshard.summary(abstract)
    assert {r.spec for r in unplaced.rows} == {"unplaced"}
    assert unplaced.bytes_per_device == unplaced.bytes_total


def test_inside_jit_a_layout_not_known_is_not_replicated(auto_mesh, explicit_mesh):
    """On Auto axes a traced value's type says nothing of its layout: it is shown
    as its annotation places it, else as unknown (not P(), replicated); on Explicit
    axes its type is its layout."""
    seen = {}

    def summarise(params):
        seen[jax.typeof(params.w).sharding.mesh.axis_types[0]] = jaxshard.summary(
            params
        )
        return params

    for mesh in (auto_mesh, explicit_mesh):
        with jax.set_mesh(mesh), jaxshard.axis_rules(RULES):
            jax.jit(summarise)(jaxshard.device_put(make()))
    auto = seen[AxisType.Auto]
    rows = {r.path: r for r in auto.rows}
    assert rows["Params.w"].spec == "P('dp', 'tp')"  # as annotated
    assert rows["Params.v"].spec == "P('tp')"
    assert rows["Params.b"].spec == "unknown"  # its annotation states no spec
    assert rows["Params.b"].bytes_per_device == rows["Params.b"].bytes_total
    assert rows["Params.b"].bytes_replicated == 0
    text = str(auto)
    assert "Params.b  (32,)     float32  unknown" in text
    assert text.splitlines()[-1] == (
        "unknown: layout not known while tracing (inside jit on Auto axes, XLA "
        "chooses it when it compiles), counted whole; annotate the array, or "
        "summarise outside jit."
    )
    rows = {r.path: r for r in seen[AxisType.Explicit].rows}
    assert rows["Params.b"].spec == "P()"  # its type says replicated
    assert rows["Params.w"].spec == "P('dp', 'tp')"
    assert "unknown" not in str(seen[AxisType.Explicit])


def test_eval_shape_on_explicit_axes_is_shown_as_annotated(explicit_mesh):
    """`jax.eval_shape` on Explicit axes gives each array the layout it is made
    with (replicated): the annotation's layout is what it will have once placed,
    as `shardings_of` says."""
    with jax.set_mesh(explicit_mesh), jaxshard.axis_rules(RULES):
        abstract = jax.eval_shape(make)
        assert abstract.w.sharding.spec == P(None, None)  # as made
        shown = jaxshard.summary(abstract)
        shardings = jaxshard.shardings_of(abstract)
    rows = {r.path: r for r in shown.rows}
    assert rows["Params.w"].spec == "P('dp', 'tp')" == format_spec(shardings.w.spec)
    assert rows["Params.w"].bytes_per_device == KiB
    assert rows["Params.v"].spec == "P('tp')"
    assert rows["Params.b"].spec == "P()"  # nothing annotates it: as made
    # Without a mesh in context, on the abstract mesh the arrays were traced on.
    with jaxshard.axis_rules(RULES):
        assert {r.path: r.spec for r in jaxshard.summary(abstract).rows} == {
            r.path: r.spec for r in shown.rows
        }
    placed = jaxshard.device_put(abstract, explicit_mesh, rules=RULES)
    assert {r.path: r.spec for r in jaxshard.summary(placed, rules=RULES).rows} == {
        r.path: r.spec for r in shown.rows
    }


def test_any_pytree_and_one_device():
    summary = jaxshard.summary({"a": np.ones((4, 4), np.float32), "k": jnp.ones(3)})
    assert [r.path for r in summary.rows] == ["tree['a']", "tree['k']"]
    assert summary.rows[1].spec == "one device"
    assert summary.rows[0].spec == "unplaced"  # a numpy array has no sharding


def test_verify_report_lists_its_inputs(auto_mesh):
    @jaxshard.jaxtyped
    def f(p: Params, x: Float[Array, "n d", P("dp", None)]) -> Float[Array, "n f"]:
        return x @ p.w + p.b

    with jaxshard.axis_rules(RULES):
        report = jaxshard.verify(f, mesh=auto_mesh, dims={"n": 16, "d": 64, "f": 32})
    arrays = {r.path: r for r in report.arrays}
    assert arrays["p.v"].bytes_per_device == 4 * KiB
    assert arrays["x"].spec == "P('dp')" and arrays["x"].bytes_per_device == KiB
    assert report.arrays[0].path == "p.v"  # the largest per device
    data = report.to_dict()["arrays"]
    assert data[0] == {
        "path": "p.v",
        "shape": [32, 64],
        "dtype": "float32",
        "spec": "P('tp')",
        "bytes_per_device": 4 * KiB,
        "bytes_total": 8 * KiB,
    }
    text = str(report)
    assert "The inputs per device:" in text
    assert any(line.split()[:1] == ["p.v"] for line in text.splitlines())
