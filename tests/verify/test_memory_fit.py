"""`report.memory.hbm_bytes`, `report.fits` and `hbm_budget`."""

import jax.numpy as jnp
import pytest
from jax import Array
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard import Float
from jaxshard._verify import budgets


GiB = 1 << 30


def scale(x: Float[Array, "b d", P("dp", None)]) -> Float[Array, "b d", P("dp", None)]:
    return x * 2


def test_no_hbm_on_cpu_meshes(auto_mesh):
    report = jaxshard.verify(scale, mesh=auto_mesh, dims={"b": 64, "d": 32})
    assert report.memory.hbm_bytes is None and report.memory.headroom is None
    assert report.fits is None and report.ok
    budget = report.memory.total - 1
    with pytest.raises(jaxshard.ShardingError, match="more than hbm_budget"):
        jaxshard.verify(
            scale, mesh=auto_mesh, dims={"b": 64, "d": 32}, hbm_budget=budget
        )
    with pytest.raises(TypeError, match="`hbm_budget` takes a number of bytes"):
        jaxshard.verify(scale, mesh=auto_mesh, dims={"b": 64, "d": 32}, hbm_budget=-1)


@pytest.mark.tpu_topology
@pytest.mark.parametrize(
    "topology, axes, per_device",
    [
        ("v5e:2x2", {"dp": 4}, 16 * GiB),
        ("v5p:2x2x2", {"dp": 8}, 95 * GiB),
        ("v6e:2x2", {"dp": 4}, 32 * GiB),
        ("v4:2x2x2", {"dp": 16}, 16 * GiB),  # two devices per 32 GiB chip
    ],
)
def test_hbm_per_device_by_generation(tpu_topology, topology, axes, per_device):
    mesh = tpu_topology(topology, axes)
    assert budgets.hbm_per_device(mesh) == per_device
    report = jaxshard.verify(scale, mesh=mesh, dims={"b": 64, "d": 128})
    assert report.memory.hbm_bytes == per_device
    assert report.memory.headroom == per_device - report.memory.total
    assert report.fits is True and "of HBM (" in str(report)


@pytest.mark.tpu_topology
def test_a_program_that_does_not_fit(tpu_topology):
    """4 x 16 GiB of float32 on a v5e chip (16 GiB): a violation, which the budget
    names; with a smaller budget, the budget."""
    mesh = tpu_topology("v5e:2x2", {"dp": 4})
    dims = {"b": 4 * 1024, "d": 1024 * 1024}  # 16 GiB in all, 4 GiB per device
    report = jaxshard.verify(
        scale, mesh=mesh, dims=dims, dtypes=jnp.float32, raise_on_error=False
    )
    assert report.fits is True  # 4 GiB in, 4 GiB out
    big = {"b": 4 * 4096, "d": 1024 * 1024}  # 16 GiB per device, in and out
    report = jaxshard.verify(scale, mesh=mesh, dims=big, raise_on_error=False)
    assert report.fits is False
    (row,) = report.violations
    # XLA's TPU compiler refuses such a program: its words are the reason.
    assert row.name == "memory per device" and "exceeds available HBM" in row.reason
    with pytest.raises(jaxshard.ShardingError, match="does not fit on a device"):
        jaxshard.verify(scale, mesh=mesh, dims=big)
    small = jaxshard.verify(
        scale, mesh=mesh, dims=dims, hbm_budget=GiB, raise_on_error=False
    )
    (row,) = small.violations
    assert "more than hbm_budget (1.0 GiB)" in row.reason


def sharded_and_not(
    w: Float[Array, "d f", P("dp", None)],
    b: Float[Array, "f", P()],
    big: Float[Array, "d d", P()],
) -> Float[Array, "f", P()]:
    return (w.sum(0) + b) * big.sum()


def test_sharding_budgets(auto_mesh):
    """w (d x f) is split over dp; b and big are whole on every device. The budgets
    list the largest replicated parameter first."""
    dims = {"d": 64, "f": 32}  # w: 8 KiB, b: 128 B, big: 16 KiB
    report = jaxshard.verify(
        sharded_and_not,
        mesh=auto_mesh,
        dims=dims,
        min_sharded_fraction=0.5,
        max_replicated_bytes=1024,
        raise_on_error=False,
    )
    fraction, replicated = report.violations
    share = 8192 / (8192 + 128 + 16384)
    assert fraction.name == "parameters: sharded fraction"
    assert fraction.reason.startswith(f"{share:.1%} of the parameters' bytes are split")
    assert "The largest replicated: big 16.0 KiB; b 128 B." in fraction.reason
    assert replicated.name == "parameters: replicated bytes"
    assert "every device holds 16.1 KiB of fully replicated parameters" in (
        replicated.reason
    )
    assert jaxshard.verify(
        sharded_and_not, mesh=auto_mesh, dims=dims, min_sharded_fraction=0.3
    ).ok
    with pytest.raises(TypeError, match="`min_sharded_fraction` takes a fraction"):
        jaxshard.verify(
            sharded_and_not, mesh=auto_mesh, dims=dims, min_sharded_fraction=2
        )
