"""examples/moe.py at its small size on the 8 simulated CPU devices: its train step
verifies, each all-to-all is found at its line with the bytes the shapes imply, an
expert weight split over the wrong axis is a violation, and too small a capacity is
reported with the device whose tokens it dropped."""

import importlib.util
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxshard


EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "moe.py")


def imported(path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


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
    # The whole slot buffer, every expert's slots for this device's tokens, in bf16.
    per_device = dims["experts"] * capacity * dims["d"] * 2
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
    w = state.params.w_gate  # experts over "fsdp", d over "ep": swapped
    swapped = NamedSharding(mesh, P(None, "fsdp", "ep", None))
    params = state.params._replace(
        w_gate=jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=swapped)
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
    assert ("train_step", "state.params.w_gate") in found, found


def concrete_block(moe, mesh, dims):
    """A layer's weights, the router picking expert `i % 8` for model dimension i."""
    block = {}
    key = jax.random.key(0)
    for name, annotation in moe.Block.__annotations__.items():
        shape = tuple(dims[d] for d in annotation.dim_str.split())
        key, sub = jax.random.split(key)
        block[name] = jax.random.normal(sub, shape) * 0.02
    block["ln2"] = jnp.ones(dims["d"])
    block["router"] = jnp.eye(dims["d"], dims["experts"]) * 4
    return moe.Block(
        **{
            name: jax.device_put(
                value,
                NamedSharding(
                    mesh, jaxshard.partition_spec(moe.Block.__annotations__[name])
                ),
            )
            for name, value in block.items()
        }
    )


def test_tokens_dropped_for_capacity_are_reported_with_the_device(moe, mesh):
    dims = moe.SMALL["dims"]
    cfg = moe.Config(top_k=2, capacity_factor=1.0)  # room for a fair share only
    block = concrete_block(moe, mesh, dims)
    b, s, d, e = dims["batch"], dims["seqlen"], dims["d"], dims["experts"]
    # Token t leans on experts t % 8 and (t + 1) % 8: each device's 32 tokens make
    # 8 choices of each expert, its capacity exactly.
    t = np.arange(b * s).reshape(b, s)
    x = np.zeros((b, s, d), np.float32)
    np.put_along_axis(x, (t % e)[..., None], 1.0, axis=-1)
    np.put_along_axis(x, ((t + 1) % e)[..., None], 1.0, axis=-1)
    # The sixth device's rows (dp 1, fsdp 0, ep 1) all lean on experts 0 and 1.
    x[10:12] = 0.0
    x[10:12, :, :2] = 1.0
    x = jax.device_put(x, NamedSharding(mesh, P(moe.BATCH, None, None)))
    step = jaxshard.checked(jax.jit(lambda p, x: moe.moe(p, x, cfg)))
    with jax.set_mesh(mesh):
        fair = jnp.asarray(x).at[10:12].set(x[0:2])
        jax.block_until_ready(step(block, fair))  # nothing dropped
        with pytest.raises(jaxshard.CheckError) as caught:
            step(block, x)
    (failure,) = caught.value.failures
    assert failure.message == "48 tokens dropped"  # 64 choices, 8 slots each for two
    assert failure.device == {"dp": 1, "fsdp": 0, "ep": 1}
    assert os.path.samefile(failure.filename, moe.__file__)
