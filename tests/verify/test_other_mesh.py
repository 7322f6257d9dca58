"""`jaxshard.verify` of a step jitted, or of values placed, on the CPU devices at
hand, for a TPU topology's mesh: each NamedSharding's spec is moved onto verify's
mesh and the report says so; what cannot be moved is a clear error."""

import jax
import jax.numpy as jnp
import optax
import pytest
from decoders import nnx_loss_step, NnxTwoLayers
from flax import nnx
from jax import Array
from jax.sharding import (
    AxisType,
    NamedSharding,
    PartitionSpec as P,
    SingleDeviceSharding,
)

import jaxshard
from jaxshard import Float


pytestmark = pytest.mark.tpu_topology

DIMS = {"b": 16, "d": 8, "f": 4}


def step(
    x: Float[Array, "b d", P("dp", None)],
    w: Float[Array, "d f", P(None, "tp")],
    scale: int = 2,
) -> Float[Array, "b f", P("dp", "tp")]:
    return (x @ w) * scale


@pytest.fixture(scope="module")
def cpu():
    assert jax.device_count() == 8
    return jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)


@pytest.fixture
def tpu(tpu_topology):
    return tpu_topology("v5e:2x4", {"dp": 4, "tp": 2})


def on(mesh, *specs):
    return tuple(NamedSharding(mesh, spec) for spec in specs)


def moved_note(report) -> str:
    [note] = [n for n in report.notes if "another mesh than verify's" in n]
    return note


def test_a_jit_with_shardings_on_the_cpus_is_jitted_anew_on_verifys_mesh(cpu, tpu):
    jitted = jax.jit(
        step,
        in_shardings=on(cpu, P("dp", None), P(None, "tp")),
        out_shardings=on(cpu, P("dp", "tp"))[0],
        static_argnames=("scale",),
        donate_argnums=(0,),
    )
    report = jaxshard.verify(jitted, mesh=tpu, dims=DIMS, values={"scale": 3})
    assert report.ok and [r.name for r in report.rows] == ["x", "w", "return"]
    assert {k: v.sharding.spec for k, v in report.inputs.items()} == {
        "x": P("dp", None),
        "w": P(None, "tp"),
    }
    assert report.outputs["return"].sharding.spec == P("dp", "tp")
    assert {d.device_kind for d in report.inputs["x"].sharding.device_set} == {
        "TPU v5 lite"
    }
    note = moved_note(report)
    assert note.startswith("step was jitted with shardings on another mesh")
    assert "in_shardings[0]" in note and "8 × cpu" in note
    assert "8 × TPU v5 lite" in note and "static and donated" in note
    assert note in str(report)


def test_a_jit_whose_shardings_are_on_verifys_mesh_is_left_as_it_is(tpu):
    jitted = jax.jit(step, in_shardings=on(tpu, P("dp", None), P(None, "tp")))
    report = jaxshard.verify(jitted, mesh=tpu, dims=DIMS)
    assert report.ok and report.notes == ()


@pytest.mark.parametrize(
    "sharding, why",
    [
        (
            lambda: SingleDeviceSharding(jax.devices()[0]),
            "it is a SingleDeviceSharding, which has no spec to move",
        ),
        (
            lambda: NamedSharding(jax.make_mesh((8,), ("x",)), P("x")),
            "its spec P('x') names 'x', which verify's mesh lacks",
        ),
    ],
)
def test_a_sharding_that_cannot_be_moved_is_a_clear_error(tpu, sharding, why):
    jitted = jax.jit(step, in_shardings=(sharding(), None), static_argnums=(2,))
    with pytest.raises(ValueError) as caught:
        jaxshard.verify(jitted, mesh=tpu, dims=DIMS)
    message = str(caught.value)
    assert message.startswith("jaxshard.verify(step): jax.jit's in_shardings[0] is")
    assert "not on verify's mesh {'dp': 4, 'tp': 2}" in message
    assert why in message
    assert "NamedSharding(mesh, spec)" in message and "__wrapped__" in message
    assert "Received incompatible devices" not in message


def test_values_placed_on_the_cpus_are_moved_onto_verifys_mesh(cpu, tpu):
    with jax.set_mesh(cpu):
        model = NnxTwoLayers(nnx.Rngs(0), use_bias=True)
        opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    values = {"model": model, "opt": opt}
    report = jaxshard.verify(nnx_loss_step, mesh=tpu, dims=DIMS, values=values)
    assert report.ok
    assert report.inputs["model.up.kernel"].sharding.spec == P(None, "tp")
    assert report.inputs["model.down.kernel"].sharding.spec == P("tp", None)
    note = moved_note(report)
    assert note.startswith("14 of the values given are laid out on another mesh")
    assert "model.down.bias and 13 more" in note
    # The model itself is left as it was.
    assert isinstance(model.up.kernel[...], jax.Array)
    assert model.up.kernel[...].sharding.mesh == cpu


def test_an_uncommitted_value_is_not_moved(tpu):
    values = {"x": jnp.ones((16, 8))}  # laid out as XLA chooses
    report = jaxshard.verify(
        step, mesh=tpu, dims=DIMS, values=values, raise_on_error=False
    )
    assert report.inputs["w"].sharding.spec == P(None, "tp")
    assert not any("another mesh" in n for n in report.notes)


def test_a_sharding_made_inside_the_function_on_other_devices_is_a_clear_error(
    cpu, tpu
):
    @jax.jit
    def inner(y):
        return jax.lax.with_sharding_constraint(y, NamedSharding(cpu, P("dp")))

    def outer(x: Float[Array, "b d", P("dp", None)]):
        return inner(x)

    with pytest.raises(ValueError) as caught:
        jaxshard.verify(outer, mesh=tpu, dims=DIMS)
    message = str(caught.value)
    assert message.startswith("jaxshard.verify(outer): JAX refused to compile outer")
    assert "because something in it names other devices" in message
    assert "jax.sharding.get_abstract_mesh()" in message
