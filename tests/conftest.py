import jax


# Every test runs on 8 simulated CPU devices: jaxshard's pytest plugin sets them up
# from `jaxshard_devices = "8"` in pyproject.toml. libtpu, when installed, only
# compiles for TPU topologies: keep the runtime on the CPU.
jax.config.update("jax_platforms", "cpu")

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
def mesh(request, mesh):
    """A 4x2 mesh of each axis type, from the plugin's `mesh` factory."""
    return mesh({"dp": 4, "tp": 2}, axis_types=request.param)
