import jax


# Before anything initialises JAX's backends: every test runs on 8 simulated devices.
jax.config.update("jax_num_cpu_devices", 8)

import beartype  # noqa: E402
import jaxtyping  # noqa: E402
import pytest  # noqa: E402
import typeguard  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import jaxshard  # noqa: E402


@pytest.fixture(params=["beartype", "typeguard"])
def typechecker(request):
    return {"beartype": beartype.beartype, "typeguard": typeguard.typechecked}[
        request.param
    ]


@pytest.fixture(params=["jaxshard", "jaxtyping"])
def jaxtyped(request):
    """Both decorators: jaxshard's, and jaxtyping's own."""
    return {"jaxshard": jaxshard.jaxtyped, "jaxtyping": jaxtyping.jaxtyped}[
        request.param
    ]


@pytest.fixture(scope="session")
def explicit_mesh():
    assert jax.device_count() == 8
    return jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)


@pytest.fixture(scope="session")
def auto_mesh():
    assert jax.device_count() == 8
    return jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)


@pytest.fixture(params=["explicit", "auto"])
def mesh(request, explicit_mesh, auto_mesh):
    return {"explicit": explicit_mesh, "auto": auto_mesh}[request.param]
