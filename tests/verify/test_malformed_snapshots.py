"""A snapshot that is valid JSON but not what `report.save` writes (edited by hand,
merged badly) is refused as it is read, before anything is compiled: one line naming
the field and what was expected, a `ValueError` from the API (the error of a bad
snapshot file) and exit status 2 from the command line, `verify --against` and
`show` alike."""

import copy
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import jax
import pytest
from hypothesis import given, settings, strategies as st
from jax import Array
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard import Float
from jaxshard._verify import cli, html, snapshot


DIMS = {"b": 16, "d": 8, "f": 16}


def layer(
    x: Float[Array, "b d", P("dp")], w: Float[Array, "d f", P(None, "tp")]
) -> Float[Array, "b f", P("dp")]:  # XLA keeps it split over tp: a violation
    return jax.lax.with_sharding_constraint(x, P()) @ w  # and an all-gather


@pytest.fixture(scope="module")
def report(auto_mesh):
    return jaxshard.verify(layer, mesh=auto_mesh, dims=DIMS, raise_on_error=False)


@pytest.fixture(scope="module")
def good(report):
    """The report's snapshot, with every part the page draws (those a TPU's or a
    comparison's would have, too)."""
    data = snapshot.snapshot(report)
    assert data["violations"] and data["sites"] and data["layouts"]["inputs"]
    assert data["collectives"] and data["memory"]
    data["program"]["hbm_bytes"] = 16 << 30
    data["check_collectives"] = {"all-reduce": {"count": 1, "bytes": 4}}
    data["against"], data["notes"] = "old.json", ["a note"]
    return json.loads(snapshot.dumps(data))


def broken(good: dict, path: tuple, value) -> dict:
    """`good` with the field at `path` set to `value` (deleted for `DELETE`)."""
    data = copy.deepcopy(good)
    *parents, last = path
    where = data
    for key in parents:
        where = where[key]
    if value is DELETE:
        del where[last]
    else:
        where[last] = value
    return data


DELETE = object()
# Each: the field changed, its new value, and the field the message names.
MALFORMED = {
    "a list of collectives": (("collectives",), [1], "collectives is [1]"),
    "an object of contracts": (("contracts",), {}, "contracts is {}"),
    "no memory total": (("memory", "total"), DELETE, "memory.total is missing"),
    "a 401-digit total": (
        ("memory", "total"),
        10**400,
        "memory.total is a 401-digit number, where a whole number from 0 to 2**63",
    ),
    "a number for axis types": (("axis_types",), 5, "axis_types is 5"),
    "an infinite number of bytes": (
        ("collectives", "all-gather", "bytes"),
        float("inf"),
        'collectives["all-gather"].bytes is Infinity',
    ),
    "a violation's kind of the wrong type": (
        ("violations", 0, "kind"),
        ["contract"],
        'violations[0].kind is ["contract"], where a string is expected',
    ),
}


def written(data: dict, folder) -> str:
    path = os.path.join(folder, "golden.json")
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(data))  # `Infinity` for an infinite float, as Python may
    return path


@pytest.mark.parametrize("case", MALFORMED)
def test_verify_refuses_it_before_compiling(
    report, good, auto_mesh, tmp_path, monkeypatch, case
):
    field, value, named = MALFORMED[case]
    path = written(broken(good, field, value), tmp_path)

    def compiled(*args):
        raise AssertionError("compiled before the snapshot was read")

    monkeypatch.setattr("jaxshard._verify.verify._compiled", compiled)
    with pytest.raises(ValueError) as e:
        jaxshard.verify(layer, mesh=auto_mesh, dims=DIMS, against=path)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"jaxshard.verify: the snapshot {path} is malformed: ")
    assert f"its field {named}" in message
    assert message.endswith("Write it again from a report: `report.save(path)` (or "
                            "`--snapshot PATH` on the command line).")  # fmt: skip
    with pytest.raises(ValueError, match="jaxshard: report.compare: the snapshot"):
        report.compare(path)


@pytest.mark.parametrize("case", MALFORMED)
def test_show_exits_2(good, tmp_path, capsys, case):
    field, value, named = MALFORMED[case]
    path = written(broken(good, field, value), tmp_path)
    for args in ([], ["--html", str(tmp_path / "page.html")]):
        assert cli.main(["show", path, *args]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1
        assert err.startswith(f"python -m jaxshard show: the snapshot {path} is ")
        assert f"its field {named}" in err and "`verify --snapshot PATH`" in err
    assert not (tmp_path / "page.html").exists()


def test_show_sends_no_escape_sequence_to_the_terminal(good, tmp_path, capsys):
    """A snapshot's strings may hold anything: `show` prints their control
    characters as escapes, so a hostile one cannot drive the terminal."""
    data = copy.deepcopy(good)
    data["function"] = "layer\x1b]0;pwned\x07\x1b[2J"
    assert cli.main(["show", written(data, tmp_path)]) == 0
    out, _ = capsys.readouterr()
    assert "\x1b" not in out and "\x07" not in out
    assert "layer\\x1b]0;pwned\\x07\\x1b[2J on mesh" in out


def test_a_format_of_true_is_no_format(good, auto_mesh, tmp_path, capsys):
    """`true == 1` in Python: a snapshot whose format is `true` is refused."""
    path = written(broken(good, ("jaxshard_snapshot",), True), tmp_path)
    with pytest.raises(
        ValueError, match="has format true; this jaxshard reads format 1"
    ):
        jaxshard.verify(layer, mesh=auto_mesh, dims=DIMS, against=path)
    assert cli.main(["show", path]) == 2
    assert "has format true" in capsys.readouterr().err


def test_numbers_too_long_or_too_deep_to_read(tmp_path):
    """What Python's json refuses past its limits is a file it cannot read."""
    path = tmp_path / "golden.json"
    for x in ["9" * 5000, "[" * 100_000 + "]" * 100_000]:
        path.write_text('{"jaxshard_snapshot": 1, "x": ' + x + "}")
        with pytest.raises(ValueError, match="cannot read the snapshot"):
            snapshot.load(path)


def test_the_snapshots_jaxshard_writes_are_well_formed(good):
    assert snapshot.load(written(good, tempfile.mkdtemp())) == good
    examples = os.path.join(os.path.dirname(jaxshard.__file__), "..", "examples")
    for name in os.listdir(examples):
        if name.endswith(".json"):
            snapshot.load(os.path.join(examples, name))


# --- any field, any value ---------------------------------------------------------


def fields(data, path=()):
    """The path of every field of `data`, nested ones too."""
    items = data.items() if isinstance(data, dict) else enumerate(data)
    for key, value in items:
        yield (*path, key)
        if isinstance(value, (dict, list)):
            yield from fields(value, (*path, key))


JSON = st.one_of(
    st.just(DELETE),
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.just(10**400),
    st.floats(),  # NaN and infinities too
    st.text(max_size=4),
    st.lists(st.integers(-3, 3) | st.text(max_size=2), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(-3, 3), max_size=2),
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("malformed")


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_field_changed_is_refused_or_drawn_and_compared(report, good, folder, data):
    """Whatever one field becomes, the snapshot is refused with a `ValueError`, or
    everything that reads it (the comparison, the page, `show`'s verdict) works."""
    path = data.draw(st.sampled_from(sorted(fields(good), key=repr)), label="field")
    value = data.draw(JSON, label="value")
    if value is DELETE and isinstance(path[-1], int):
        value = None  # a list's item cannot be deleted in place
    file = written(broken(good, path, value), folder)
    try:
        loaded = snapshot.load(file)
    except ValueError as e:
        assert "\n" not in str(e) and str(e).startswith("jaxshard.verify: ")
        return
    snapshot.differences(report, loaded)
    html.page(loaded)
    html.summary(loaded)


# --- the command line ---------------------------------------------------------------

MODEL = textwrap.dedent(
    """
    import jax
    from jax import Array
    from jax.sharding import PartitionSpec as P

    from jaxshard import Float


    def layer(x: Float[Array, "b d", P("dp")]) -> Float[Array, "b d", P("dp")]:
        open("traced", "w").close()  # what the test looks for
        return x * 2
    """
)


@pytest.mark.parametrize("case", ["a list of collectives", "no memory total"])
def test_verify_against_exits_2_before_tracing(good, tmp_path, case):
    (tmp_path / "model.py").write_text(MODEL)
    field, value, named = MALFORMED[case]
    path = written(broken(good, field, value), tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    args = ["model:layer", "--mesh", "dp=4", "--dim", "b=8", "--dim", "d=4"]
    out = subprocess.run(
        [sys.executable, "-m", "jaxshard", "verify", *args, "--against", path],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and out.stdout == "", out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"python -m jaxshard: error: --against: the snapshot {path} is "
        f"malformed: its field {named}"
    )
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "traced").exists()
