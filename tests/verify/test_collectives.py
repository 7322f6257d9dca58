"""`report.collectives`: the collectives of the compiled program, each with its kind,
bytes, mesh axes and the line of user code it came from."""

import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import Array
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard import Float
from jaxshard._verify import collectives as _collectives


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


@pytest.mark.parametrize(
    "attributes, groups",
    [
        ("replica_groups={{0,1},{2,3}}, x", [[0, 1], [2, 3]]),
        ("replica_groups=[2,2]<=[4], x", [[0, 1], [2, 3]]),
        ("replica_groups=[2,2]<=[2,2]T(1,0), x", [[0, 2], [1, 3]]),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_0'}, x", [[0, 2], [1, 3]]),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_1'}, x", [[0, 1], [2, 3]]),
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
