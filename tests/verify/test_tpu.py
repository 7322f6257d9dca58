"""Compiling for real TPU topologies with libtpu, on a machine without TPUs."""

import importlib.metadata
import math
import re

import beartype
import jax
import jax.numpy as jnp
import pytest
from jax import Array
from jax.sharding import AxisType, PartitionSpec as P

import jaxshard
from jaxshard import Float


pytestmark = pytest.mark.tpu_topology

checked = jaxshard.jaxtyped(typechecker=beartype.beartype)


@checked
def layer(
    x: Float[Array, "b d", P("dp", None)],
    w: Float[Array, "d f", P(None, "tp")],
) -> Float[Array, "b f", P("dp", "tp")]:
    return jnp.tanh(x @ w)


@checked
def mis_annotated(
    x: Float[Array, "b d", P("dp", None)],
    w: Float[Array, "d f", P(None, "tp")],
) -> Float[Array, "b f", P("tp", "dp")]:
    return layer(x, w)


@pytest.mark.parametrize(
    "topology, axes, kind",
    [
        ("v5e:2x2", {"dp": 2, "tp": 2}, "TPU v5 lite"),
        ("v5e:16x16", {"dp": 16, "tp": 16}, "TPU v5 lite"),
        ("v5p:2x2x2", {"dp": 4, "tp": 2}, "TPU v5"),
        ("v4:2x2x2", {"dp": 8, "tp": 2}, "TPU v4"),
    ],
)
@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_verify_on_topology(tpu_topology, topology, axes, kind, axis_types):
    mesh = tpu_topology(topology, axes, axis_types=axis_types)
    assert mesh.devices.size == math.prod(axes.values())
    assert {d.device_kind for d in mesh.devices.flat} == {kind}
    dims = {"b": 64 * axes["dp"], "d": 256, "f": 128 * axes["tp"]}
    report = jaxshard.verify(layer, mesh=mesh, dims=dims)
    assert report.ok and [r.name for r in report.rows] == ["x", "w", "return"]
    # Each device holds its shard of each argument: the compiled program says so.
    per_device = 4 * (64 * 256 + 256 * 128)
    assert report.memory.arguments == per_device
    assert report.memory.outputs == 4 * 64 * 128
    assert report.flops >= 2 * 64 * 256 * 128

    bad = jaxshard.verify(mis_annotated, mesh=mesh, dims=dims, raise_on_error=False)
    (violation,) = bad.violations
    assert violation.name == "return" and violation.expected == P("tp", "dp")
    assert violation.actual.spec[:2] == ("dp", "tp")


def test_a_pod_sized_mlp(tpu_topology):
    """256 chips, data parallel over 16 and tensor parallel over 16: the weights of
    a 4096-wide MLP are a sixteenth per chip."""
    mesh = tpu_topology("v5e:16x16", {"dp": 16, "tp": 16}, axis_types="auto")

    @checked
    def mlp(
        x: Float[Array, "b s d", P("dp", None, None)],
        w1: Float[Array, "d f", P(None, "tp")],
        w2: Float[Array, "f d", P("tp", None)],
    ) -> Float[Array, "b s d", P("dp", None, None)]:
        h = jax.nn.gelu(x @ w1)
        h = jax.lax.with_sharding_constraint(h, P("dp", None, "tp"))
        return h @ w2

    dims = {"b": 256, "s": 2048, "d": 4096, "f": 16384}
    report = jaxshard.verify(mlp, mesh=mesh, dims=dims, dtypes=jnp.bfloat16)
    assert report.ok
    weights = 2 * 2 * 4096 * 16384 // 16
    activations = 2 * 16 * 2048 * 4096
    assert report.memory.arguments == weights + activations


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_check_finite_survives_the_tpu_compiler(tpu_topology, dtype):
    """`check_finite` finds the first non-finite element of each device's block of
    a leaf with one reduction of `~isfinite(x)` (`_locate`) and one all-reduce:
    XLA's TPU compiler keeps the test in it."""
    mesh = tpu_topology("v5e:2x2", {"dp": 2, "tp": 2}, axis_types="explicit")
    x = jax.ShapeDtypeStruct(
        (512, 512), dtype, sharding=jax.sharding.NamedSharding(mesh, P("dp"))
    )

    def f(x):
        jaxshard.check_finite(x, name="x")
        return x * 2

    with jax.set_mesh(mesh):
        text = jaxshard.checked(jax.jit(f)).lower(x).compile().as_text()
    assert "is-finite" in text and "all-reduce" in text, text


def test_value_checks_on_auto_axes_of_a_topology_are_compiled_out(tpu_topology):
    """XLA's TPU compiler, loaded for a topology without TPUs, does not call back
    JAX's custom partitioning, which value checks use on Auto axes: `verify`
    compiles a step with checks as it is, without them, and says so; contracts,
    memory and collectives are those of the step without checks."""

    @checked
    def f(x: Float[Array, "b d", P("dp")]) -> Float[Array, "b d", P("dp")]:
        jaxshard.check_finite(x, name="x")
        return x * 2

    dims = {"b": 512, "d": 512}
    mesh = tpu_topology("v5e:2x2", {"dp": 2, "tp": 2})
    report = jaxshard.verify(f, mesh=mesh, dims=dims)
    assert report.ok and len(report.rows) == 2
    (note,) = report.notes
    assert "value checks" in note and "compiled out" in note
    assert note in str(report)
    with jaxshard.config(checks="off"):
        quiet = jaxshard.verify(f, mesh=mesh, dims=dims)
    assert quiet.notes == () and quiet.memory == report.memory
    assert quiet.collectives == report.collectives
    explicit = tpu_topology("v5e:2x2", {"dp": 2, "tp": 2}, axis_types="explicit")
    report = jaxshard.verify(f, mesh=explicit, dims=dims)
    assert report.ok and report.collectives == ()
    (found,) = report.check_collectives  # the checks' all-reduce, on a TPU too
    assert found.kind == "all-reduce" and found.from_checks


def test_unknown_topology_names_the_known_chips():
    with pytest.raises(ValueError) as e:
        jaxshard.tpu_mesh("v9x:2x2", {"dp": 4})
    message = str(e.value)
    assert "'v9x:2x2'" in message and "v5e" in message and "v5p" in message


def test_axes_must_cover_the_topology():
    with pytest.raises(ValueError, match="has 4 devices, but the axes"):
        jaxshard.tpu_mesh("v5e:2x2", {"dp": 2})
    with pytest.raises(ValueError, match="positive sizes"):
        jaxshard.tpu_mesh("v5e:2x2", {"dp": 0})


@pytest.mark.parametrize(
    "topology, axes",
    [
        ("v5e:2x2", {"dp": 4}),
        ("v5e:2x2", {"dp": 2, "tp": 2}),
        ("v5p:2x2x2", {"dp": 2, "fsdp": 2, "tp": 2}),
        ("v5p:2x2x2", {"dp": 2, "fsdp": 4}),
        ("v5p:4x4x4", {"dp": 2, "fsdp": 8, "tp": 4}),
        ("v5p:4x4x4", {"dp": 4, "fsdp": 4, "tp": 4}),
        ("v4:2x2x2", {"dp": 4, "tp": 4}),
    ],
)
def test_axis_types_default_to_auto_on_every_topology(topology, axes):
    """The same default whatever layout `jax.make_mesh` finds (or, where it finds
    none, libtpu's device order): Auto, as `jax.experimental.topologies.make_mesh`
    and a bare `jax.sharding.Mesh` have it. Explicit is asked for."""
    n = len(axes)
    assert jaxshard.tpu_mesh(topology, axes).axis_types == (AxisType.Auto,) * n
    explicit = jaxshard.tpu_mesh(topology, axes, axis_types="explicit")
    assert explicit.axis_types == (AxisType.Explicit,) * n


def test_axis_types():
    mesh = jaxshard.tpu_mesh("v5e:2x2", {"dp": 2, "tp": 2}, axis_types="auto")
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    mesh = jaxshard.tpu_mesh(
        "v5e:2x2", {"dp": 2, "tp": 2}, axis_types=("explicit", AxisType.Auto)
    )
    assert mesh.axis_types == (AxisType.Explicit, AxisType.Auto)
    with pytest.raises(ValueError, match="'auto' or 'explicit'"):
        jaxshard.tpu_mesh("v5e:2x2", {"dp": 4}, axis_types="manual")


def test_missing_libtpu_says_how_to_install(monkeypatch):
    from jaxshard._verify import tpu as _mesh

    monkeypatch.setattr(_mesh, "_libtpu_missing", lambda: True)
    with pytest.raises(ImportError, match=re.escape("pip install 'jaxshard[tpu]'")):
        jaxshard.tpu_mesh("v5e:2x2", {"dp": 4})


def test_tpu_extra_matches_jax():
    """The `tpu` extra asks for `jax[tpu]` in the tested range, so pip installs the
    libtpu that this jax's own `tpu` extra pins."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    def tpu_extra(package, name):
        found = [Requirement(r) for r in importlib.metadata.requires(package)]
        return [r for r in found if r.name == name and "tpu" in str(r.marker)]

    (ours,) = tpu_extra("jaxshard", "jax")
    assert ours.extras == {"tpu"}
    assert ours.specifier == SpecifierSet(jaxshard.TESTED_JAX)
    (pin,) = tpu_extra("jax", "libtpu")
    assert importlib.metadata.version("libtpu") in pin.specifier


def test_dependencies_state_the_tested_range():
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    found = {
        r.name: r.specifier
        for r in map(Requirement, importlib.metadata.requires("jaxshard"))
        if r.marker is None
    }
    assert found["jax"] == found["jaxlib"] == SpecifierSet(jaxshard.TESTED_JAX)
    assert importlib.metadata.version("jax") in found["jax"]
