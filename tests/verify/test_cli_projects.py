"""`python -m jaxshard verify` and the pytest plugin used as a project of its own
uses them: a src layout and a flat layout, each target form, each failure's exit
status."""

import json
import textwrap

import pytest
from helpers import jaxshard_command


LAYERS = """
from jax import Array
from jax.sharding import PartitionSpec as P
from jaxshard import Float

X = Float[Array, "batch d", P("dp", None)]
W = Float[Array, "d h", P(None, "tp")]
Y = Float[Array, "batch h", P("dp", "tp")]
"""

MODEL = """
import jax
from {imports} import X, W, Y


def forward(x: X, w: W) -> Y:
    return x @ w


jitted = jax.jit(forward)
NOT_CALLABLE = 3


class Model:
    @staticmethod
    def apply(x: X, w: W) -> Y:
        return x @ w
"""

SIZES = ("--mesh", "dp=2,tp=2", "--dim", "batch=8", "--dim", "d=4", "--dim", "h=4")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A project with a src layout (`src/mypkg/model.py`, importing its package's
    `.layers`) and a flat one (`flat/model.py`, importing `helper` beside it)."""
    root = tmp_path_factory.mktemp("project")
    package = root / "src" / "mypkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "layers.py").write_text(LAYERS)
    (package / "model.py").write_text(MODEL.format(imports=".layers"))
    (root / "flat").mkdir()
    (root / "flat" / "helper.py").write_text(LAYERS)
    (root / "flat" / "model.py").write_text(MODEL.format(imports="helper"))
    (root / "flat" / "broken.py").write_text("raise RuntimeError('boom at import')\n")
    return root


def verify(folder, target, *args, env=None):
    return jaxshard_command(folder, "verify", target, *SIZES, *args, env=env)


@pytest.mark.parametrize(
    "folder, target, env",
    [
        ("src", "mypkg.model:forward", None),
        ("src", "mypkg.model:jitted", None),
        ("src", "mypkg.model:Model.apply", None),
        (".", "mypkg.model:forward", {"PYTHONPATH": "src"}),
        ("flat", "model:forward", None),
        ("flat", "model.py:forward", None),
    ],
)
def test_each_target_form_verifies(project, folder, target, env):
    status, out, err = verify(project / folder, target, env=env)
    assert status == 0, err
    assert "All 3 contracts hold." in out


@pytest.mark.parametrize(
    "target", ["src/mypkg/model.py:forward", "src/mypkg/model.py:jitted"]
)
def test_a_path_to_a_packages_module_imports_it_in_its_package(project, target):
    """`src/mypkg/model.py` imports `.layers`: a relative import, which works only
    when the file is imported as `mypkg.model` (it was loaded as a module named
    `model` with no package, and exited 3 with "attempted relative import")."""
    status, out, err = verify(project, target)
    assert status == 0, err
    assert "All 3 contracts hold." in out


def test_a_path_to_a_flat_script_imports_the_modules_beside_it(project):
    """`flat/model.py` imports `helper`, beside it, as `python flat/model.py` may
    (it exited 3 with "No module named 'helper'")."""
    status, out, err = verify(project, "flat/model.py:forward")
    assert status == 0, err
    assert "All 3 contracts hold." in out


@pytest.mark.parametrize(
    "folder, target, status, message",
    [
        ("src", "mypkg.modle:forward", 2, "cannot import module 'mypkg.modle'"),
        ("src", "mypkg.model:forwrd", 2, "'forwrd'. Did you mean 'forward'?"),
        ("src", "mypkg.model:Model.nope", 2, "'mypkg.model:Model' has no attribute"),
        ("src", "mypkg.model:NOT_CALLABLE", 2, "is not callable"),
        (".", "src/mypkg/model.py:nope", 2, "has no attribute 'nope'"),
        (".", "flat/missing.py:forward", 2, "no such file"),
        (".", "flat/broken.py:forward", 3, "raised RuntimeError: boom at import"),
        ("flat", "broken:forward", 3, "raised RuntimeError: boom at import"),
    ],
)
def test_a_bad_target_is_one_line_and_its_exit_status(
    project, folder, target, status, message
):
    got, out, err = verify(project / folder, target)
    assert got == status, err
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (("--mesh", "dp=2,tp"), "bad --mesh 'dp=2,tp'"),
        (("--mesh", "dp=2,tp=2", "--devices", "3"), "needs 4 devices"),
        (("--dtype", "bfloat17"), "unknown dtype 'bfloat17'"),
        (("--max-collectives", "all-gathr=0"), "Did you mean 'all-gather'?"),
    ],
)
def test_a_bad_option_is_a_usage_error(project, args, message):
    status, out, err = jaxshard_command(
        project / "src",
        "verify",
        "mypkg.model:forward",
        *SIZES[2:],
        *(() if "--mesh" in args else SIZES[:2]),
        *args,
    )
    assert status == 2, err
    assert message in err


def test_a_dimension_without_a_size_is_a_usage_error(project):
    status, out, err = jaxshard_command(
        project / "src",
        "verify",
        "mypkg.model:forward",
        *SIZES[:6],
    )
    assert status == 2, err
    assert "these dimensions have no size: 'h' (in w)" in err


def test_json_dtype_html_and_snapshots_round_trip(project, tmp_path):
    folder = project / "src"
    page = tmp_path / "not" / "yet" / "page.html"
    snapshot = tmp_path / "snapshots" / "forward.json"
    status, out, err = verify(
        folder,
        "mypkg.model:forward",
        "--dtype",
        "bfloat16",
        "--json",
        "--html",
        str(page),
        "--snapshot",
        str(snapshot),
    )
    assert status == 0, err
    report = json.loads(out)
    assert report["ok"] and len(report["rows"]) == 3
    assert {row["expected_type"] for row in report["rows"]} == {
        "bfloat16[8@dp,4]",
        "bfloat16[4,4@tp]",
        "bfloat16[8@dp,4@tp]",
    }
    assert page.read_text().startswith("<!DOCTYPE html>")
    status, out, err = verify(
        folder, "mypkg.model:forward", "--dtype", "bfloat16", "--against", str(snapshot)
    )
    assert status == 0, err
    # The same snapshot for a program laid out otherwise: each difference fails.
    status, out, err = verify(
        folder, "mypkg.model:Model.apply", "--against", str(snapshot)
    )
    assert status == 1, err
    assert "snapshot: " in out and "VIOLATED" in out


def test_a_collective_budget_and_the_cache(project, tmp_path):
    folder, cache = project / "src", str(tmp_path / "cache")
    runs = [
        verify(folder, "mypkg.model:forward", "--cache-dir", cache) for _ in range(2)
    ]
    assert runs[0] == runs[1] and runs[0][0] == 0
    assert list((tmp_path / "cache").iterdir())
    (tmp_path / "gathers.py").write_text(
        textwrap.dedent(
            """
            import jax
            from jax.sharding import PartitionSpec as P
            from mypkg.layers import X, W

            def forward(x: X, w: W):
                return jax.lax.with_sharding_constraint(x @ w, P(None, None))
            """
        )
    )
    status, out, err = verify(
        tmp_path,
        "gathers:forward",
        "--max-collectives",
        "all-gather=0",
        env={"PYTHONPATH": str(folder)},
    )
    assert status == 1, err
    assert "all-gather" in out and "VIOLATED" in out


PLUGIN_TEST = """
import jax
import jaxshard
from jax.sharding import PartitionSpec as P
from jax import Array
from jaxshard import Float


def forward(
    x: Float[Array, "batch d", P("dp", None)], w: Float[Array, "d h", P(None, "tp")]
) -> Float[Array, "batch h", P("dp", "tp")]:
    return x @ w


def test_devices(mesh):
    assert len(jax.devices()) == 8
    assert dict(mesh({"dp": 4, "tp": 2}).shape) == {"dp": 4, "tp": 2}


def test_snapshot(mesh, jaxshard_snapshot):
    report = jaxshard.verify(
        forward,
        mesh=mesh({"dp": 4, "tp": 2}),
        dims={"batch": 8, "d": 4, "h": 4},
        raise_on_error=False,
    )
    jaxshard_snapshot(report)
"""


@pytest.mark.parametrize("xdist", [(), ("-n", "2")])
def test_the_plugin_in_a_project(pytester, monkeypatch, xdist):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    pytester.makepyfile(test_model=PLUGIN_TEST)
    args = ("-p", "no:cacheprovider", "--jaxshard-devices", "8", *xdist)
    first = pytester.runpytest_subprocess(*args)
    first.assert_outcomes(passed=2, warnings=1)
    snapshot = pytester.path / "__snapshots__" / "test_model" / "test_snapshot.json"
    assert json.loads(snapshot.read_text())["mesh"] == "dp=4,tp=2"
    pytester.runpytest_subprocess(*args).assert_outcomes(passed=2)
    # A changed program fails against the snapshot it wrote.
    pytester.makepyfile(
        test_model=PLUGIN_TEST.replace('P("dp", "tp")]:', 'P("dp", None)]:')
    )
    failed = pytester.runpytest_subprocess(*args)
    failed.assert_outcomes(passed=1, failed=1)
    failed.stdout.fnmatch_lines(["*difference*from the snapshot*"])


def test_the_caches_warnings_name_the_users_call(tmp_path):
    """A report the cache cannot store, and an entry it cannot read, are warned
    about at the user's `jaxshard.verify` call (they named jaxshard's own
    `_errors.py` and `verify.py`)."""
    import jax
    from helpers import layer

    import jaxshard

    mesh = jax.make_mesh((1, 1), ("dp", "tp"), devices=jax.devices()[:1])
    dims = {"batch": 8, "d": 4, "h": 4}
    (tmp_path / "a file").write_text("")
    with jaxshard.config(cache_dir=str(tmp_path / "a file")):
        with pytest.warns(UserWarning, match="not stored in the cache") as caught:
            jaxshard.verify(layer(), mesh=mesh, dims=dims)
    assert [w.filename for w in caught] == [__file__]
    cache = tmp_path / "cache"
    with jaxshard.config(cache_dir=str(cache)):
        jaxshard.verify(layer(), mesh=mesh, dims=dims)
        entries = [p for p in cache.rglob("*") if p.is_file()]
        assert entries
        for entry in entries:
            entry.write_bytes(b"not a pickle")
        with pytest.warns(UserWarning, match="cannot be read") as caught:
            jaxshard.verify(layer(), mesh=mesh, dims=dims)
    assert {w.filename for w in caught} == {__file__}
