"""jaxshard's pytest plugin, in pytest sessions of their own (each starts JAX anew)."""

import pytest


@pytest.fixture
def run(pytester, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("XLA_FLAGS", raising=False)

    def run(*args, **files):
        pytester.makepyfile(**files)
        return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs", *args)

    return run


COUNT = """
import jax

def test_count():
    assert len(jax.devices()) == {n}
"""


def test_devices_option(run):
    result = run("--jaxshard-devices", "4", test_count=COUNT.format(n=4))
    result.assert_outcomes(passed=1)


def test_devices_ini_option(run, pytester):
    pytester.makeini("[pytest]\njaxshard_devices = 3\n")
    run(test_count=COUNT.format(n=3)).assert_outcomes(passed=1)
    # The command line wins over the ini file.
    run("--jaxshard-devices", "2", test_count=COUNT.format(n=2)).assert_outcomes(
        passed=1
    )


def test_too_late(run):
    result = run(
        "--jaxshard-devices",
        "4",
        conftest="import jax.numpy as jnp\nstarted = jnp.ones(1)\n",
        test_count=COUNT.format(n=4),
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--jaxshard-devices asks for 4 CPU devices, but JAX had already started*"]
    )


def test_mesh_factory(run):
    result = run(
        "--jaxshard-devices",
        "8",
        test_mesh="""
        from jax.sharding import AxisType

        def test_mesh(mesh):
            m = mesh({"dp": 4, "tp": 2}, axis_types="auto")
            assert m.shape == {"dp": 4, "tp": 2}
            assert m.axis_types == (AxisType.Auto,) * 2

        def test_too_big(mesh):
            mesh({"dp": 16})
        """,
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*needs 16 devices, but JAX has 8 CPU devices*"])


TPU_TESTS = """
import pytest

def test_fixture(tpu_topology):
    mesh = tpu_topology("v5e:2x2", {"dp": 2, "tp": 2})
    assert mesh.devices.size == 4
    assert mesh.devices.flat[0].device_kind == "TPU v5 lite"

@pytest.mark.tpu_topology
def test_marker():
    import jaxshard
    assert jaxshard.tpu_mesh("v5p:2x2x2", {"x": 8}).devices.size == 8
"""


def test_tpu_topology(run):
    run(test_tpu=TPU_TESTS).assert_outcomes(passed=2)


NO_LIBTPU = "import _jaxshard_pytestplugin as p\np._libtpu_missing = lambda: True\n"


def test_tpu_topology_skips_without_libtpu(run):
    result = run(
        conftest=NO_LIBTPU,
        test_tpu=TPU_TESTS,
    )
    result.assert_outcomes(skipped=2)
    hint = "needs libtpu, XLA's TPU compiler (it runs on any x86-64 Linux machine): "
    skipped = [line for line in result.outlines if line.startswith("SKIPPED")]
    assert [line.split(": ", 1)[1] for line in skipped] == [
        f"{hint}pip install 'jaxshard[tpu]'"
    ] * 2
    assert all(line.startswith("SKIPPED [1] test_tpu.py:") for line in skipped)


QUIET = """
import jax
import jaxshard

def test_tpu_and_cpu():
    assert jax.devices()[0].platform == "cpu"
    assert jaxshard.tpu_mesh("v5e:2x2", {"dp": 4}).devices.size == 4
"""


def test_no_libtpu_noise_on_a_machine_without_tpus(run, monkeypatch):
    for name in ("JAX_PLATFORMS", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE"):
        monkeypatch.delenv(name, raising=False)
    result = run("-s", test_quiet=QUIET)
    result.assert_outcomes(passed=1)
    err = result.stderr.str()
    assert "TPU_WORKER_HOSTNAMES" not in err and "E0000" not in err


GIVEN = """
import jax.numpy as jnp
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

@settings(max_examples=5, deadline=None)
@given(rows=st.sampled_from([4, 8, 12]))
def test_with_given(mesh, rows):
    m = mesh({"dp": 4})
    x = jnp.ones((rows, 2), device=NamedSharding(m, P("dp")))
    assert x.sharding.spec == P("dp")
"""


def test_mesh_fixture_with_hypothesis_given(run):
    """The fixture factories are session-scoped: hypothesis's health check, which
    refuses function-scoped fixtures in `@given` tests, lets them through."""
    run("--jaxshard-devices", "4", test_given=GIVEN).assert_outcomes(passed=1)
