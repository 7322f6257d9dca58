"""examples/moe.py at its small size on the 8 simulated CPU devices: its train step
verifies, each all-to-all is found at its line with the bytes the shapes imply, an
expert weight split over the wrong axis is a violation, and too small a capacity is
reported with the device whose tokens it dropped."""

import math
import os

import jax
import jax.numpy as jnp
import pytest
from helpers import imported
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxshard


EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "moe.py")


@pytest.fixture(scope="module")
def moe():
    return imported(EXAMPLE, "moe_example")


@pytest.fixture(scope="module")
def mesh(moe):
    assert jax.device_count() == 8
    return moe.cpu_mesh(moe.SMALL["mesh"])


@pytest.fixture(scope="module")
def report(moe, mesh):
    return moe.verify(mesh, moe.SMALL)


def lines_of(path: str, text: str) -> set[int]:
    with open(path, encoding="utf-8") as f:
        return {i for i, line in enumerate(f, 1) if text in line}


def test_the_train_step_verifies(report):
    assert report.ok and not report.violations
    inside = {(r.function.rsplit(".")[-1], r.name) for r in report.rows}
    assert {("route", "return[0]"), ("dispatch", "return[0]")} <= inside
    assert {("experts_ffn", "h"), ("experts_ffn", "w_gate")} <= inside
    assert ("combine", "return") in inside


def test_each_all_to_all_is_at_its_line_with_the_bytes_the_shapes_imply(moe, report):
    a2a = [c for c in report.collectives if c.kind == "all-to-all"]
    assert a2a
    dims, cfg = moe.SMALL["dims"], moe.SMALL["cfg"]
    tokens = dims["batch"] * dims["seqlen"] // 8  # per device
    capacity = math.ceil(tokens * cfg.top_k / dims["experts"] * cfg.capacity_factor)
    # The whole slot buffer, every expert's slots for this device's tokens, in
    # float32: XLA's CPU compiler moves the bfloat16 slots as float32.
    per_device = dims["experts"] * capacity * dims["d"] * 4
    assert moe.slot_bytes(moe.SMALL, 8, width=4) == per_device
    expected_lines = lines_of(moe.__file__, "jax.lax.all_to_all(")
    assert len(expected_lines) == 2
    for c in a2a:
        assert os.path.samefile(c.filename, moe.__file__)
        assert c.lineno in expected_lines
        assert tuple(c.axes) == ("ep",)
        assert c.bytes == per_device
    assert {c.lineno for c in a2a} == expected_lines


def test_an_expert_weight_split_over_the_wrong_axis_is_a_violation(moe, mesh):
    setup = moe.SMALL
    cfg = setup["cfg"]
    state, *_ = jaxshard.abstract_args(
        moe.train_step, mesh, setup["dims"], jnp.bfloat16, values={"cfg": cfg}
    )
    w = state.params.moe.w_gate  # experts over "fsdp", d over "ep": swapped
    swapped = NamedSharding(mesh, P(None, "fsdp", "ep", None))
    params = state.params._replace(
        moe=state.params.moe._replace(
            w_gate=jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=swapped)
        )
    )
    report = jaxshard.verify(
        moe.train_step,
        mesh=mesh,
        dims=setup["dims"],
        dtypes=jnp.bfloat16,
        values={"state": state._replace(params=params), "cfg": cfg},
        raise_on_error=False,
    )
    assert not report.ok
    found = {(r.function.rsplit(".")[-1], r.name) for r in report.violations}
    assert ("train_step", "state.params.moe.w_gate") in found, found


def test_the_example_reports_the_misplaced_expert_weight(moe, mesh):
    report = moe.misplaced_expert(mesh, moe.SMALL)
    found = [(r.function.rsplit(".")[-1], r.name) for r in report.violations]
    assert found == [("moe", "p.w_gate")]


def test_tokens_dropped_for_capacity_are_reported_with_the_device(moe, mesh):
    cfg = moe.SMALL["cfg"]._replace(capacity_factor=1.0)  # room for a fair share
    block, even, crowded = moe.routed_unevenly(mesh, moe.SMALL["dims"])
    layer = jaxshard.checked(jax.jit(lambda p, x: moe.moe(p, x, cfg)))
    with jax.set_mesh(mesh):
        jax.block_until_ready(layer(block, even))  # nothing dropped
        with pytest.raises(jaxshard.CheckError) as caught:
            layer(block, crowded)
    (failure,) = caught.value.failures
    # The crowded device's 32 tokens choose experts 0 and 1: 64 choices, 8 slots each.
    assert failure.message == "48 tokens dropped"
    assert failure.device == {"dp": 1, "fsdp": 0, "ep": 1}
    assert os.path.samefile(failure.filename, moe.__file__)


def test_the_small_runs_report_matches_its_golden_snapshot(report, jaxshard_snapshot):
    """The layouts of every contract, the collectives (each all-to-all among them)
    and the memory per device, against `__snapshots__/test_moe_example/`: a change
    to the example that moves a layout or adds a collective fails here. One snapshot
    per jax: each XLA's CPU compiler plans its own temporaries (jax 0.10.2's need
    twice 0.12's)."""
    jaxshard_snapshot(report, f"jax-{jax.__version__}")


def test_the_step_fits_a_v5p_chips_hbm_on_a_small_slice(moe, tpu_topology):
    """Compiled for TPU v5p by libtpu: the memory per chip is stated against the
    chip's HBM (95 GiB), and the all-to-alls move the bfloat16 slots the shapes
    imply."""
    setup = moe.SMALL
    report = moe.verify(tpu_topology("v5p:2x2x2", setup["mesh"]), setup)
    assert report.ok and report.fits
    assert report.memory.hbm_bytes == 95 * 2**30
    a2a = [c for c in report.collectives if c.kind == "all-to-all"]
    assert a2a and {c.bytes for c in a2a} == {moe.slot_bytes(setup, 8)}
