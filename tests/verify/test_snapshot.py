"""Golden snapshots (`report.save`, `report.compare`, `verify(against=)`, the CLI's
`--snapshot`/`--against` and the plugin's `jaxshard_snapshot`), and layouts printed
in JAX's notation, `float32[8@dp,4]`."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax import Array
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import Float, Int
from jaxshard._annotations.spec import sharded_type


DIMS = {"batch": 8, "vocab": 64, "d": 16}


def embed(
    table: Float[Array, "vocab d", P("dp", None)], ids: Int[Array, "batch", P("dp")]
) -> Float[Array, "batch d", P("dp", None)]:
    return jnp.take(table, ids, axis=0)


def embed_replicated(
    table: Float[Array, "vocab d", P(None, None)], ids: Int[Array, "batch", P("dp")]
) -> Float[Array, "batch d", P("dp", None)]:
    return jnp.take(table, ids, axis=0)


def project(
    x: Float[Array, "batch d", P("dp", None)], w: Float[Array, "d d", P(None, "tp")]
) -> Float[Array, "batch d", P("dp", "tp")]:
    return x @ w


def project_gathered(
    x: Float[Array, "batch d", P("dp", None)], w: Float[Array, "d d", P(None, "tp")]
) -> Float[Array, "batch d", P("dp", "tp")]:
    x = jax.lax.with_sharding_constraint(x * 2, P())  # an all-gather
    return jax.lax.with_sharding_constraint(x @ w, P("dp", "tp"))


# Each pair shares a name, as one function before and after an edit would.
embed_replicated.__name__ = embed_replicated.__qualname__ = "embed"
project_gathered.__name__ = project_gathered.__qualname__ = "project"


@pytest.fixture
def golden(auto_mesh, tmp_path):
    path = tmp_path / "embed.json"
    jaxshard.verify(embed, mesh=auto_mesh, dims=DIMS).save(path)
    return path


def test_the_snapshot_is_stable_sorted_and_complete(auto_mesh, golden):
    text = golden.read_text()
    again = jaxshard.verify(embed, mesh=auto_mesh, dims=DIMS)
    again.save(golden.with_name("again.json"))
    assert golden.with_name("again.json").read_text() == text
    data = json.loads(text)
    assert text == json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    assert data["mesh"] == "dp=4,tp=2" and data["axis_types"] == ["Auto", "Auto"]
    assert data["inputs"] == {"ids": "int32[8@dp]", "table": "float32[64@dp,16]"}
    assert data["outputs"] == {"return": "float32[8@dp,16]"}
    assert again.to_dict()["inputs"] == data["inputs"]
    assert again.inputs["table"].sharding.spec == P("dp", None)
    assert {(c["value"], c["expected"], c["ok"]) for c in data["contracts"]} == {
        ("table", "P('dp', None)", True),
        ("ids", "P('dp')", True),
        ("return", "P('dp', None)", True),
    }
    assert set(data["memory"]) == {
        "arguments", "outputs", "temporaries", "aliased", "total"
    }  # fmt: skip
    assert data["memory"]["total"] == again.memory.total
    # Nothing of this machine or this run: no paths, line numbers or addresses.
    assert __file__ not in text and "0x" not in text and os.sep + "tmp" not in text


def test_an_unchanged_program_matches(auto_mesh, golden):
    report = jaxshard.verify(embed, mesh=auto_mesh, dims=DIMS, against=golden)
    assert report.ok and report.compare(golden) == ()


def test_a_replicated_embedding(auto_mesh, golden):
    report = jaxshard.verify(
        embed_replicated, mesh=auto_mesh, dims=DIMS, against=golden,
        raise_on_error=False,
    )  # fmt: skip
    names = [r.name for r in report.violations]
    assert "snapshot: input table" in names
    (row,) = [r for r in report.violations if r.name == "snapshot: input table"]
    assert row.reason == (
        "was float32[64@dp,16], now float32[64,16]: every device now holds all of it "
        "(replicated)."
    )
    assert "snapshot: contract embed, table" in names  # it expects P(None, None) now
    assert "1 difference" not in str(report) and "differences from the snapshot" in (
        str(report)
    )
    with pytest.raises(jaxshard.ShardingError, match="from the snapshot") as caught:
        jaxshard.verify(embed_replicated, mesh=auto_mesh, dims=DIMS, against=golden)
    assert "- snapshot: input table: was float32[64@dp,16]" in str(caught.value)


def test_a_new_all_gather(auto_mesh, tmp_path):
    path = tmp_path / "project.json"
    jaxshard.verify(project, mesh=auto_mesh, dims=DIMS).save(path)
    assert json.loads(path.read_text())["collectives"] == {}
    report = jaxshard.verify(
        project_gathered, mesh=auto_mesh, dims=DIMS, against=path,
        raise_on_error=False,
    )  # fmt: skip
    gathers = [c for c in report.collectives if c.kind == "all-gather"]
    (row,) = [
        r for r in report.violations if r.name == "snapshot: collectives: all-gather"
    ]
    assert row.reason.startswith(f"0 in the snapshot, {len(gathers)} now: ")
    assert row.budget == ("0", str(len(gathers)))
    # Where it came from: the line (or, where XLA names none, JAX's op name).
    assert gathers[0].where in row.reason


def test_memory_may_grow_by_the_tolerance(auto_mesh, golden):
    data = json.loads(golden.read_text())
    total = data["memory"]["total"]
    data["memory"]["total"] = int(total / 1.2)  # so the program now needs 20% more
    golden.write_text(json.dumps(data))
    report = jaxshard.verify(embed, mesh=auto_mesh, dims=DIMS)
    (row,) = report.compare(golden)
    assert row.name == "snapshot: memory per device"
    assert "grown by 20." in row.reason and "more than the tolerance (5%)" in row.reason
    assert report.compare(golden, tolerance=0.25) == ()
    data["memory"]["total"] = total * 2  # less memory than the snapshot: fine
    golden.write_text(json.dumps(data))
    assert report.compare(golden) == ()


def test_collective_bytes_may_grow_by_the_tolerance(auto_mesh, tmp_path):
    path = tmp_path / "gathered.json"
    report = jaxshard.verify(project_gathered, mesh=auto_mesh, dims=DIMS)
    report.save(path)
    data = json.loads(path.read_text())
    data["collectives"]["all-gather"]["bytes"] //= 2
    path.write_text(json.dumps(data))
    (row,) = report.compare(path)
    assert row.name == "snapshot: collectives: all-gather bytes"
    assert "grown by 100.0%" in row.reason
    assert report.compare(path, tolerance=1.0) == ()


def test_another_mesh_is_one_difference(golden):
    other = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    (row,) = jaxshard.verify(embed, mesh=other, dims=DIMS).compare(golden)
    assert row.name == "snapshot: mesh"
    assert "the rest cannot be compared" in row.reason


def test_bad_snapshots(auto_mesh, tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(FileNotFoundError, match=r"no snapshot at .*report\.save"):
        jaxshard.verify(embed, mesh=auto_mesh, dims=DIMS, against=missing)
    other = tmp_path / "other.json"
    other.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="is not a jaxshard snapshot"):
        jaxshard.verify(embed, mesh=auto_mesh, dims=DIMS, against=other)
    other.write_text("{")
    with pytest.raises(ValueError, match="cannot read the snapshot"):
        jaxshard.verify(embed, mesh=auto_mesh, dims=DIMS, against=other)
    other.write_text('{"jaxshard_snapshot": 99}')
    with pytest.raises(ValueError, match="has format 99"):
        jaxshard.verify(embed, mesh=auto_mesh, dims=DIMS, against=other)
    with pytest.raises(TypeError, match="`against` takes the path of a snapshot"):
        jaxshard.verify(embed, mesh=auto_mesh, dims=DIMS, against=3)
    with pytest.raises(TypeError, match="`tolerance` takes a fraction"):
        jaxshard.verify(embed, mesh=auto_mesh, dims=DIMS, tolerance=-1)


# --- JAX's notation -------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        P(),
        P("dp"),
        P(None, "tp"),
        P(("dp", "tp")),
        P("tp", "dp"),
        P(None, ("tp", "dp")),
    ],
)
def test_notation_is_jaxs(explicit_mesh, spec):
    x = jax.device_put(
        jnp.ones((8, 16), jnp.bfloat16), NamedSharding(explicit_mesh, spec)
    )
    assert sharded_type(x.dtype, x.shape, spec) == str(jax.typeof(x))


def test_messages_and_reports_give_both(auto_mesh):
    def wrong(x: Float[Array, "b d", P("dp", "tp")]) -> Float[Array, "b d", P()]:
        return x

    report = jaxshard.verify(wrong, mesh=auto_mesh, dims={"b": 8, "d": 4},
                             raise_on_error=False)  # fmt: skip
    (row,) = report.violations
    assert (row.expected_type, row.actual_type) == (
        "float32[8,4]",
        "float32[8@dp,4@tp]",
    )
    assert (
        "sharded as P('dp', 'tp') (float32[8@dp,4@tp]), but the annotation expects "
        "P() (float32[8,4])" in row.reason
    )
    assert "float32[8@dp,4@tp]" in str(report)
    assert report.to_dict()["rows"][0]["actual_type"] == "float32[8@dp,4@tp]"
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(auto_mesh, P(None, "tp")))
    with pytest.raises(jaxshard.ShardingError) as caught:
        jaxshard.jaxtyped(wrong)(x)
    assert (
        "is sharded as P(None, 'tp') (float32[8,4@tp]), but the annotation expects "
        "P('dp', 'tp') (float32[8@dp,4@tp])" in str(caught.value)
    )


# --- the command line -----------------------------------------------------------------


MODEL = """
import jax
import jax.numpy as jnp
from jax import Array
from jax.sharding import PartitionSpec as P
from jaxshard import Float

def layer(x: Float[Array, "b d", P("dp", None)]) -> Float[Array, "b d", P("dp", None)]:
    return x * 2
"""
GATHERED = MODEL.replace(
    "return x * 2", "return jax.lax.with_sharding_constraint(x, P()) * 2"
)


def cli(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-m", "jaxshard", "verify", "model:layer",
         "--mesh", "dp=4,tp=2", "--dim", "b=16", "--dim", "d=8", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return out.returncode, out.stdout, out.stderr


def test_cli_snapshot_and_against(tmp_path):
    (tmp_path / "model.py").write_text(MODEL)
    code, _, err = cli(tmp_path, "--snapshot", "snap/layer.json")
    assert code == 0 and "Snapshot written to snap/layer.json" in err
    assert json.loads((tmp_path / "snap/layer.json").read_text())["inputs"] == {
        "x": "float32[16@dp,8]"
    }
    code, out, _ = cli(tmp_path, "--against", "snap/layer.json")
    assert code == 0, out
    (tmp_path / "model.py").write_text(GATHERED)
    code, out, _ = cli(tmp_path, "--against", "snap/layer.json")
    assert code == 1
    assert "difference" in out and "snapshot: collectives: all-gather" in out
    code, out, _ = cli(tmp_path, "--against", "missing.json")
    assert code == 2 and "no snapshot at missing.json" in out + _
    code, out, err = cli(tmp_path, "--against", "snap/layer.json", "--tolerance", "-1")
    assert code == 2 and "--tolerance takes a fraction" in err


# --- the pytest fixture ---------------------------------------------------------------


TEST = """
import jax
from jax import Array
from jax.sharding import PartitionSpec as P
import jaxshard
from jaxshard import Float

def layer(x: Float[Array, "b d", P("dp", None)]) -> Float[Array, "b d", P("dp", None)]:
    return {body}

def test_layer(mesh, jaxshard_snapshot):
    mesh = mesh({{"dp": 4}}, axis_types="auto")
    report = jaxshard.verify(
        layer, mesh=mesh, dims={{"b": 16, "d": 8}}, raise_on_error=False
    )
    jaxshard_snapshot(report)
"""


def test_the_fixture(pytester, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("XLA_FLAGS", raising=False)

    def run(body, *args):
        pytester.makepyfile(test_model=TEST.format(body=body))
        return pytester.runpytest_subprocess(
            "-p", "no:cacheprovider", "--jaxshard-devices", "4", *args
        )

    first = run("x * 2")
    first.assert_outcomes(passed=1, warnings=1)
    first.stdout.fnmatch_lines(["*wrote a new snapshot*test_layer.json: commit it*"])
    path = pytester.path / "__snapshots__" / "test_model" / "test_layer.json"
    assert json.loads(path.read_text())["outputs"] == {"return": "float32[16@dp,8]"}
    run("x * 2").assert_outcomes(passed=1)
    changed = run("jax.lax.with_sharding_constraint(x, P()) * 2")
    changed.assert_outcomes(failed=1)
    changed.stdout.fnmatch_lines([
        "*difference* from the snapshot*test_layer.json:",
        "*- collectives: all-gather: 0 in the snapshot, 1 now*",
        "*pytest --jaxshard-snapshot-update*",
    ])  # fmt: skip
    run("jax.lax.with_sharding_constraint(x, P()) * 2", "--jaxshard-snapshot-update")
    run("jax.lax.with_sharding_constraint(x, P()) * 2").assert_outcomes(passed=1)


def first(x, w):
    return jnp.einsum("bd,de->be", x, w)  # a sum over "tp": an all-reduce


def second(h, w):
    return jnp.einsum("be,ef->bf", h, w)


def two_layers(
    x: Float[Array, "batch d", P("dp", "tp")],
    w1: Float[Array, "d d", P("tp", None)],
    w2: Float[Array, "d d", P(None, None)],
) -> Float[Array, "batch d", P("dp", None)]:
    return second(jax.lax.with_sharding_constraint(first(x, w1), P("dp", "tp")), w2)


def two_layers_changed(
    x: Float[Array, "batch d", P("dp", "tp")],
    w1: Float[Array, "d d", P("tp", None)],
    w2: Float[Array, "d d", P("tp", None)],
) -> Float[Array, "batch d", P("dp", None)]:
    return second(jax.lax.with_sharding_constraint(first(x, w1), P("dp", "tp")), w2)


two_layers_changed.__name__ = two_layers_changed.__qualname__ = "two_layers"


def test_a_difference_lists_the_new_places_only(auto_mesh, tmp_path):
    """One more all-reduce, in `second`: the difference names that place, not the
    places the snapshot already had."""
    path = tmp_path / "two.json"
    before = jaxshard.verify(two_layers, mesh=auto_mesh, dims=DIMS)
    assert [c.function for c in before.collectives if c.kind == "all-reduce"] == [
        "first"
    ]
    before.save(path)
    after = jaxshard.verify(
        two_layers_changed, mesh=auto_mesh, dims=DIMS, raise_on_error=False
    )
    (row,) = [r for r in after.compare(path) if r.name.endswith(": all-reduce")]
    assert "1 more over tp" in row.reason and "(second)" in row.reason
    assert "(first)" not in row.reason
