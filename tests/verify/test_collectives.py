"""`report.collectives`: the collectives of the compiled program, each with its kind,
bytes, mesh axes and the line of user code it came from."""

import inspect
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import Array
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard import Float
from jaxshard._verify import (
    collectives as _collectives,
    frames as _frames,
    snapshot as _snapshot,
)
from jaxshard._verify.collectives import KINDS as _KINDS


def contract(
    x: Float[Array, "b d", P("dp", "tp")], w: Float[Array, "d f", P("tp", None)]
) -> Float[Array, "b f", P("dp", None)]:
    y = x @ w  # sums over tp
    return y + jnp.sum(y, axis=0, keepdims=True)  # sums over dp


def gather(x: Float[Array, "b d", P("dp", None)]) -> Float[Array, "b d", P()]:
    return jax.lax.with_sharding_constraint(x * 2, P())


def line_of(fn, text: str) -> int:
    source, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(source) if text in line)


def test_kinds_bytes_axes_and_lines(auto_mesh):
    report = jaxshard.verify(contract, mesh=auto_mesh, dims={"b": 64, "d": 32, "f": 16})
    found = report.collectives
    assert [(c.kind, c.axes) for c in found] == [
        ("all-reduce", ("tp",)),
        ("all-reduce", ("dp",)),
    ]
    # A block of y is 64/4 x 16 float32; the column sums are 16 float32.
    assert [c.bytes for c in found] == [16 * 16 * 4, 16 * 4]
    assert [(c.filename, c.lineno, c.function) for c in found] == [
        (__file__, line_of(contract, "y = x @ w"), "contract"),
        (__file__, line_of(contract, "jnp.sum"), "contract"),
    ]
    assert report.collective_bytes["all-reduce"] == 16 * 16 * 4 + 16 * 4
    assert report.collective_bytes["all-gather"] == 0
    text = str(report)
    assert "Collectives per device: all-reduce 2 (1.1 KiB)" in text
    here = os.path.relpath(__file__)  # where is relative to the working directory
    assert f"over tp at {here}:{line_of(contract, 'y = x @ w')} (contract)" in text
    assert report.to_dict()["collectives"][0]["axes"] == ["tp"]


def test_an_all_gather(auto_mesh):
    report = jaxshard.verify(gather, mesh=auto_mesh, dims={"b": 64, "d": 32})
    (found,) = report.collectives
    assert found.kind == "all-gather" and found.axes == ("dp",)
    assert found.bytes == 64 * 32 * 4  # the whole array, on each device
    # jax 0.10.2 attributes the gather to the constraint's line; 0.12 gathers the
    # input where it enters, and names it so.
    if found.lineno is None:
        assert "x" in found.op_name
        assert found.where == f"{found.op_name} (in no line of your code)"
    else:
        assert found.lineno == line_of(gather, "with_sharding_constraint")


def test_no_collectives(auto_mesh):
    def local(x: Float[Array, "b d", P("dp", None)]) -> Float[Array, "b d", P("dp")]:
        return x * 2

    report = jaxshard.verify(local, mesh=auto_mesh, dims={"b": 64, "d": 32})
    assert report.collectives == ()
    assert "Collectives: none." in str(report)


@pytest.mark.tpu_topology
def test_async_pairs_count_once_on_a_tpu(tpu_topology):
    mesh = tpu_topology("v5e:2x2", {"dp": 4})
    report = jaxshard.verify(gather, mesh=mesh, dims={"b": 64, "d": 256})
    text = report.compiled.as_text()
    assert "all-gather" in text
    kinds = [c.kind for c in report.collectives]
    assert kinds.count("all-gather") == 1, kinds
    assert report.collectives[0].axes == ("dp",)
    # The start op's result holds its input beside its output: the output counts.
    assert report.collectives[0].bytes == 64 * 256 * 4


def exchange(x: Float[Array, "e c d", P(None, "ep", None)]):
    return jax.shard_map(
        lambda b: jax.lax.all_to_all(b, "ep", 0, 1, tiled=True),
        in_specs=P(None, "ep", None),
        out_specs=P("ep", None, None),
    )(x)


def test_an_op_with_an_operand_per_peer_moves_them_all():
    """XLA's CPU compiler gives an all-to-all over 8 devices 8 operands, one per
    peer (its combiners merge collectives the same way): the bytes are all of
    them, each device's whole buffer, not one peer's share."""
    mesh = jax.make_mesh((8,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    report = jaxshard.verify(exchange, mesh=mesh, dims={"e": 16, "c": 128, "d": 64})
    assert re.search(r"all-to-all\(%[\w.\-]+, %", report.compiled.as_text())
    (a2a,) = [c for c in report.collectives if c.kind == "all-to-all"]
    assert a2a.bytes == 16 * (128 // 8) * 64 * 4  # this device's block, float32


@pytest.mark.parametrize(
    "attributes, groups",
    [
        ("replica_groups={{0,1},{2,3}}, x", [[0, 1], [2, 3]]),
        ("replica_groups=[2,2]<=[4], x", [[0, 1], [2, 3]]),
        ("replica_groups=[2,2]<=[2,2]T(1,0), x", [[0, 2], [1, 3]]),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_0'}, x", [[0, 2], [1, 3]]),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_1'}, x", [[0, 1], [2, 3]]),
        (
            "replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], "
            "device_ids=([4,2]T(1,0)) {'axis_1'}, use_global_device_ids=true",
            [[0, 1], [2, 3], [4, 5], [6, 7]],
        ),
    ],
)
def test_replica_group_notations(attributes, groups):
    assert _collectives._groups(attributes) == groups


def test_axes_from_groups():
    class Mesh:
        devices = np.empty((4, 2))
        axis_names = ("dp", "tp")

    assert _collectives._axes([[0, 1], [2, 3], [4, 5], [6, 7]], Mesh) == ("tp",)
    assert _collectives._axes([[0, 2, 4, 6], [1, 3, 5, 7]], Mesh) == ("dp",)
    assert _collectives._axes([list(range(8))], Mesh) == ("dp", "tp")
    assert _collectives._axes(None, Mesh) is None


def test_budgets_fail_like_contracts(auto_mesh):
    dims = {"b": 64, "d": 32, "f": 16}
    ok = jaxshard.verify(
        contract, mesh=auto_mesh, dims=dims, max_collectives={"all-gather": 0}
    )
    assert ok.ok and ok.collective_bytes["all-gather"] == 0
    report = jaxshard.verify(
        contract,
        mesh=auto_mesh,
        dims=dims,
        max_collectives={"all-reduce": 1},
        max_collective_bytes=512,
        raise_on_error=False,
    )
    count, size = report.violations
    assert count.name == "collectives: all-reduce" and not count.ok
    assert count.reason.startswith("2 all-reduces, over the budget of <= 1")
    assert (
        f"{os.path.relpath(__file__)}:{line_of(contract, 'y = x @ w')}" in count.reason
    )
    assert size.name == "collectives: bytes"
    assert size.reason.startswith(
        "1.1 KiB moved per device, over the budget of <= 512 B"
    )
    with pytest.raises(jaxshard.ShardingError, match="collectives: all-reduce"):
        jaxshard.verify(
            contract, mesh=auto_mesh, dims=dims, max_collectives={"all-reduce": 0}
        )
    text = str(report)
    assert "VIOLATED" in text and "<= 1" in text
    assert report.to_dict()["rows"][-1]["expected"] == "<= 512 B"


def test_bad_budgets(auto_mesh):
    dims = {"b": 64, "d": 32, "f": 16}
    with pytest.raises(ValueError, match="'all-gathers', which is not a collective"):
        jaxshard.verify(
            contract, mesh=auto_mesh, dims=dims, max_collectives={"all-gathers": 0}
        )
    with pytest.raises(TypeError, match="max_collectives\\['all-gather'\\]"):
        jaxshard.verify(
            contract, mesh=auto_mesh, dims=dims, max_collectives={"all-gather": -1}
        )


def project(a, b):
    """A small helper around an einsum, as model code has."""
    return jnp.einsum("bd,de->be", a, b)


def attention(x, w):
    return project(jnp.sin(x), w)  # a sum over "tp": an all-reduce


def block(x, w):
    return attention(x, w) + 1


def layered(
    x: Float[Array, "b d", P(None, "tp")], w: Float[Array, "d e", P("tp", None)]
) -> Float[Array, "b e"]:
    return block(x, w)


def test_a_collective_shows_the_calls_that_led_to_it(auto_mesh):
    """The innermost line of the user's code is a helper's: the chain of calls to
    it shows which line of the model made the collective, up to the verified
    function."""
    dims = {"b": 64, "d": 32, "e": 16}
    report = jaxshard.verify(layered, mesh=auto_mesh, dims=dims)
    (found,) = [c for c in report.collectives if c.kind == "all-reduce"]
    functions = [function for _, _, function in found.chain]
    assert functions == ["project", "attention", "block", "layered"], found.chain
    assert found.chain[1][1] == line_of(attention, "project(")
    assert found.where.startswith("tests/verify/test_collectives.py:")
    assert " ← :" in found.where and "(attention)" in found.where


# --- alike collectives, one line each -----------------------------------------------


def sine_layer(x, w):
    return jnp.sin(x @ w)  # a sum over "tp": an all-reduce


def loop_of(layers: int):
    """A model of `layers` alike blocks in a Python loop: one all-reduce each."""

    def looped(
        x: Float[Array, "b d", P(None, "tp")], ws: Float[Array, "l d d", P(None, "tp")]
    ) -> Float[Array, "b d"]:
        for i in range(layers):
            x = jax.lax.with_sharding_constraint(sine_layer(x, ws[i]), P(None, "tp"))
        return x

    return looped


def scanned(
    x: Float[Array, "b d", P("dp", None)],
    ws: Float[Array, "l k d d", P(None, None, "tp")],
) -> Float[Array, "b d"]:
    def layer(x, w):
        for i in range(w.shape[0]):  # k alike projections in each scanned layer
            x = jax.lax.with_sharding_constraint(sine_layer(x, w[i]), P("dp", None))
        return x, None

    return jax.lax.scan(layer, x, ws)[0]


def test_alike_collectives_are_one_line_with_a_count(auto_mesh, tmp_path):
    """Four blocks in a Python loop make four alike all-reduces (kind, bytes, axes
    and calls): one line, `×4`, in the text, the budget's reason, the page and the
    snapshot's differences; every count stays exact."""
    dims = {"b": 64, "d": 32, "l": 4}
    golden = tmp_path / "two.json"
    jaxshard.verify(loop_of(2), mesh=auto_mesh, dims=dims).save(golden)
    report = jaxshard.verify(
        loop_of(4),
        mesh=auto_mesh,
        dims=dims,
        max_collectives={"all-reduce": 3},
        against=golden,
        raise_on_error=False,
    )
    reduces = [c for c in report.collectives if c.kind == "all-reduce"]
    assert len(reduces) == 4 and len(set(reduces)) == 1
    at = f"{os.path.relpath(__file__)}:{line_of(sine_layer, 'x @ w')} (sine_layer)"
    text = str(report)
    (line,) = [x for x in text.splitlines() if x.startswith("  all-reduce")]
    assert line.startswith(f"  all-reduce 4.0 KiB ×4 over tp at {at} ← :")
    assert "Collectives per device: all-reduce 4 (16.0 KiB)" in text
    budget, difference = (
        r for r in report.violations if r.name.endswith("collectives: all-reduce")
    )
    assert budget.reason.startswith("4 all-reduces, over the budget of <= 3: ")
    assert budget.reason.count(at) == 1 and "×4" in budget.reason
    assert difference.reason.startswith("2 in the snapshot, 4 now: 2 more over tp,")
    assert difference.reason.count(at) == 1 and difference.reason.endswith("×4.")
    sites = _snapshot.snapshot(report)["sites"]
    (site,) = [s for s in sites if s["kind"] == "all-reduce"]
    assert (site["count"], site["each"], site["bytes"]) == (4, 4096, 4 * 4096)
    assert "×4" in report.html()


def test_a_scanned_layers_alike_collectives_are_one_line(auto_mesh):
    report = jaxshard.verify(
        scanned, mesh=auto_mesh, dims={"b": 64, "d": 32, "l": 3, "k": 4}
    )
    reduces = [c for c in report.collectives if c.kind == "all-reduce"]
    assert len(reduces) == 4  # the scan's body, compiled once
    lines = [x for x in str(report).splitlines() if x.startswith("  all-reduce")]
    assert len(lines) == 1 and " ×4 over tp at " in lines[0]
    assert f"{line_of(sine_layer, 'x @ w')} (sine_layer)" in lines[0]


# --- the value checks' own collectives ----------------------------------------------


def summed(checks: bool):
    """A model with an all-reduce of its own, and with `checks` two value checks,
    whose findings are combined across devices."""

    def model(x: Float[Array, "b d", P("dp", "tp")]) -> Float[Array, "d", P("tp")]:
        if checks:
            jaxshard.check_finite(x, "x")
        y = jnp.sin(x)
        if checks:
            jaxshard.check_finite(y, "y")
        return jnp.sum(y, axis=0)  # a sum over "dp": an all-reduce

    return model


def test_the_value_checks_collectives_are_apart(mesh, tmp_path):
    """Two `check_finite`s add their own collectives: listed apart, and left out
    of `report.collectives`, the budgets and the snapshot's differences."""
    dims = {"b": 64, "d": 32}
    golden = tmp_path / "without.json"
    without = jaxshard.verify(summed(False), mesh=mesh, dims=dims)
    without.save(golden)
    budget = {k: sum(c.kind == k for c in without.collectives) for k in _KINDS}
    report = jaxshard.verify(
        summed(True),
        mesh=mesh,
        dims=dims,
        max_collectives=budget,
        max_collective_bytes=sum(c.bytes for c in without.collectives),
        against=golden,
        tolerance=10.0,  # the checks' state takes memory: not what is tested
    )
    assert report.collectives == without.collectives
    assert [c.kind for c in report.collectives] == ["all-reduce"]
    assert report.check_collectives and not without.check_collectives
    assert all(c.from_checks for c in report.check_collectives)
    assert not any(c.from_checks for c in report.collectives)
    text = str(report)
    assert "Collectives from jaxshard's value checks (left out of the budgets" in text
    data = report.to_dict()
    assert len(data["check_collectives"]) == len(report.check_collectives)
    assert (
        _snapshot.snapshot(report)["collectives"]
        == (_snapshot.snapshot(without)["collectives"])
    )
    assert 'id="check-collectives"' in report.html()


def test_which_files_are_the_checks():
    from jaxshard._values import shard_map, stats

    assert _frames._is_check_code(stats.__file__)
    assert not _frames._is_check_code(shard_map.__file__)  # the model's blocks
    assert not _frames._is_check_code(__file__)


# --- through library code: flax NNX modules ------------------------------------------


def test_the_frames_of_a_compiled_program_reach_the_users_calls(auto_mesh):
    """The compiled program's own stack frame table (whose printed parent ids XLA
    shifts by one) gives the whole chain of calls in the user's code."""
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    w = jax.ShapeDtypeStruct((32, 16), jnp.float32)
    text = jax.jit(layered).lower(x, w).compile().as_text()
    frames = _frames._Frames(text)
    ids = re.findall(r'op_name="[^"]*dot_general".*?stack_frame_id=(\d+)', text)
    chains = {frames.user_chain(int(i)) for i in ids}
    assert chains and all(
        [f for _, _, f in chain][:4] == ["project", "attention", "block", "layered"]
        for chain in chains
    ), chains


@pytest.mark.parametrize("through", ["nnx.jit", "function"])
def test_an_nnx_models_collectives_are_at_its_lines(auto_mesh, through):
    """nnx.Linear's matmul is flax's code: the collective is at the line of the
    module's `__call__` that called it, through flax's frames, whether the step is
    an `nnx.jit` or a plain function."""
    import optax
    from decoders import nnx_loss_step, NnxTwoLayers
    from flax import nnx

    with jax.set_mesh(auto_mesh):
        model = NnxTwoLayers(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    x = jax.ShapeDtypeStruct(
        (16, 8), jnp.float32, sharding=jax.NamedSharding(auto_mesh, P("dp", None))
    )

    def forward(model, x):
        return (model(x) ** 2).mean()

    step = nnx_loss_step if through == "nnx.jit" else forward
    values = {"model": model, "x": x} | ({"opt": opt} if through == "nnx.jit" else {})
    report = jaxshard.verify(step, mesh=auto_mesh, values=values)
    model_lines = [c for c in report.collectives if c.axes == ("tp",)]
    assert model_lines, report.collectives
    call = line_of(NnxTwoLayers.__call__, "self.down(")
    for found in model_lines:
        assert (found.function, found.lineno) == ("NnxTwoLayers.__call__", call)
        assert os.path.basename(found.filename) == "decoders.py"
        assert found.chain[-1][2].endswith(step.__name__), found.chain
