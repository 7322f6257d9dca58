"""jaxshard's pytest plugin, loaded through the `pytest11` entry point.

- `--jaxshard-devices N` (or the ini option `jaxshard_devices = N`): N simulated CPU
  devices, set before JAX starts its backends.
- fixture `mesh`: a factory, `mesh({"dp": 4, "tp": 2}, axis_types="auto")`.
- fixture `tpu_topology`: a factory for meshes of a TPU topology's devices,
  `tpu_topology("v5e:16x16", {"dp": 16, "tp": 16})`; skips the test with an install
  hint when libtpu is absent. The marker `@pytest.mark.tpu_topology` does the same.
- `--jaxshard-rules MODULE:OBJECT` (or the ini option `jaxshard_axis_rules`): the
  default axis rules for logical annotations in every test.
- fixture `jaxshard_snapshot`: `jaxshard_snapshot(report)` checks a `jaxshard.verify`
  report against the test's golden snapshot in `__snapshots__/` next to the test
  file, writing it when there is none; `--jaxshard-snapshot-update` rewrites them.

It lives outside the `jaxshard` package so that loading it imports nothing: JAX reads
some environment variables (`JAX_PLATFORMS`) when it is imported, and a conftest may
set them first.
"""

import glob
import importlib.util
import math
import os
import pathlib
import re
import sys
import warnings

import pytest


LIBTPU_HINT = (
    "needs libtpu, XLA's TPU compiler (it runs on any x86-64 Linux machine): "
    "pip install 'jaxshard[tpu]'"
)


def pytest_addoption(parser):
    group = parser.getgroup("jaxshard")
    group.addoption(
        "--jaxshard-devices",
        type=int,
        metavar="N",
        help="simulate N CPU devices (set before JAX starts; overrides the "
        "jaxshard_devices ini option)",
    )
    group.addoption(
        "--jaxshard-snapshot-update",
        action="store_true",
        help="write the golden snapshots the jaxshard_snapshot fixture is given, "
        "instead of comparing reports with them",
    )
    group.addoption(
        "--jaxshard-rules",
        metavar="MODULE:OBJECT",
        help="the default axis rules for logical annotations (jaxshard.L, BY_NAME) in "
        "every test: a rule table, e.g. model:FSDP_RULES (overrides the "
        "jaxshard_axis_rules ini option)",
    )
    group.addoption(
        "--jaxshard-cache-dir",
        metavar="DIR",
        help="keep jaxshard.verify's reports in DIR, so that a test verifying an "
        "unchanged program takes its report from there without compiling "
        "(overrides the jaxshard_cache_dir ini option and JAXSHARD_CACHE_DIR)",
    )
    parser.addini("jaxshard_devices", help="simulate this many CPU devices", default="")
    parser.addini(
        "jaxshard_cache_dir",
        help="a folder for jaxshard.verify's reports (see --jaxshard-cache-dir)",
        default="",
    )
    parser.addini(
        "jaxshard_axis_rules",
        help="MODULE:OBJECT, the default axis rules for logical annotations",
        default="",
    )


def pytest_configure(config):
    if not _libtpu_missing():
        _quiet_libtpu()  # before JAX starts and loads libtpu
    config.addinivalue_line(
        "markers",
        "tpu_topology: the test compiles for a TPU topology; skipped with an "
        "install hint when libtpu is absent",
    )
    n = config.getoption("jaxshard_devices")
    source = "--jaxshard-devices"
    if n is None and str(config.getini("jaxshard_devices")).strip():
        source = "the jaxshard_devices ini option"
        try:
            n = int(config.getini("jaxshard_devices"))
        except ValueError:
            raise pytest.UsageError(
                f"{source} must be a number of devices, e.g. 8; got "
                f"{config.getini('jaxshard_devices')!r}"
            ) from None
    if n is not None:
        _simulate_devices(n, source)
    rules = (
        config.getoption("jaxshard_rules")
        or str(config.getini("jaxshard_axis_rules")).strip()
    )
    if rules:
        _default_rules(rules)
    folder = (
        config.getoption("jaxshard_cache_dir")
        or str(config.getini("jaxshard_cache_dir")).strip()
    )
    if folder:
        _cache_in(os.path.join(str(config.rootpath), os.path.expanduser(folder)))


def _cache_in(folder: str) -> None:
    """verify's cache in `folder` for the session: through the environment for a
    jaxshard imported later (and the test's subprocesses), and the setting itself
    for one imported already (by a conftest)."""
    os.environ["JAXSHARD_CACHE_DIR"] = folder
    if "jaxshard" in sys.modules:
        sys.modules["jaxshard"].config.update("cache_dir", folder)


def _default_rules(target: str) -> None:
    import jaxshard
    from jaxshard._verify.options import _call, _load_object

    try:
        table = _load_object(target, "--jaxshard-rules")
        if callable(table):
            table = _call(table, f"calling {target}()")
        jaxshard.config.update("axis_rules", table)
    except (ValueError, TypeError, ImportError) as e:
        raise pytest.UsageError(f"--jaxshard-rules {target}: {e}") from None


def _simulate_devices(n: int, source: str) -> None:
    if n < 1:
        raise pytest.UsageError(f"{source} must be at least 1; got {n}")
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
        return
    except RuntimeError:  # JAX has started its backends: the count is fixed
        pass
    have = len(jax.devices("cpu"))
    if have < n:
        raise pytest.UsageError(
            f"{source} asks for {n} CPU devices, but JAX had already started with "
            f"{have}: something made arrays or asked for devices before pytest was "
            "configured (a conftest or plugin, at import). Make it wait until the "
            f"tests run, or set the count before JAX starts (XLA_FLAGS="
            f"--xla_force_host_platform_device_count={n})."
        )


def pytest_collection_modifyitems(config, items):
    del config
    for item in items:
        if item.get_closest_marker("tpu_topology") and _libtpu_missing():
            item.add_marker(pytest.mark.skip(reason=LIBTPU_HINT))


def _quiet_libtpu() -> None:
    # `jaxshard._verify.tpu.quiet_libtpu`, without importing jaxshard (and so JAX) here.
    if glob.glob("/dev/accel*") or os.path.exists("/dev/vfio"):
        return
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")


def _libtpu_missing() -> bool:
    return importlib.util.find_spec("libtpu") is None


@pytest.fixture(scope="session")
def mesh():
    """A factory for meshes of simulated CPU devices:
    `mesh({"dp": 4, "tp": 2}, axis_types="auto")`. `axis_types` is "auto",
    "explicit", an `AxisType` or one per axis (default: `jax.make_mesh`'s).

    Session-scoped (it holds no state), so tests decorated with hypothesis's `@given`
    can use it: hypothesis refuses function-scoped fixtures there."""
    import jax

    from jaxshard._verify.tpu import _axis_types

    def make(axes, *, axis_types=None):
        axes = dict(axes)
        n = math.prod(axes.values())
        devices = jax.devices("cpu")
        if n > len(devices):
            pytest.fail(
                f"mesh({axes}) needs {n} devices, but JAX has {len(devices)} CPU "
                f"devices: run pytest with --jaxshard-devices {n} (or set "
                f"jaxshard_devices = {n} in the ini file)",
                pytrace=False,
            )
        types = _axis_types(axis_types, len(axes))
        kwargs = {} if types is None else {"axis_types": types}
        return jax.make_mesh(
            tuple(axes.values()), tuple(axes), devices=devices[:n], **kwargs
        )

    return make


@pytest.fixture(scope="session")
def tpu_topology():
    """A factory for meshes of a TPU topology's devices (`jaxshard.tpu_mesh`):
    `tpu_topology("v5e:2x2", {"dp": 2, "tp": 2})`, with Auto axes unless
    `axis_types="explicit"`. Skips the test when libtpu is absent. Session-scoped, so
    `@given` tests can use it."""
    if _libtpu_missing():
        pytest.skip(LIBTPU_HINT)
    from jaxshard import tpu_mesh

    return tpu_mesh


@pytest.fixture
def jaxshard_snapshot(request):
    """Checks `jaxshard.verify` reports against golden snapshots:
    `jaxshard_snapshot(report)`, or `jaxshard_snapshot(report, "v5e")` for several
    in one test (`tolerance=` as for `report.compare`).

    The snapshot lives in `__snapshots__/<test module>/<test name>.json` next to the
    test file. When there is none, it is written (with a warning: commit it). When
    there is one, each difference from it fails the test, listed. After an intended
    change, `pytest --jaxshard-snapshot-update` rewrites the snapshots."""
    return _Snapshots(request)


_SAFE = re.compile(r"[^\w.-]+")  # what a file name may not hold


class _Snapshots:
    def __init__(self, request):
        self.update = request.config.getoption("jaxshard_snapshot_update")
        path = pathlib.Path(request.node.path)
        self.directory = path.parent / "__snapshots__" / path.stem
        self.test = _SAFE.sub("_", request.node.name).strip("_")
        self.unnamed = 0

    def __call__(self, report, name=None, *, tolerance=0.05):
        from jaxshard import Report

        if not isinstance(report, Report):
            raise TypeError(
                "jaxshard_snapshot takes the report of jaxshard.verify (use "
                f"raise_on_error=False to get one with violations); got "
                f"{type(report).__name__}"
            )
        if name is None:
            self.unnamed += 1
            name = "" if self.unnamed == 1 else str(self.unnamed)
        stem = self.test + ("-" + _SAFE.sub("_", name) if name else "")
        path = self.directory / f"{stem}.json"
        if self.update or not path.exists():
            report.save(path)
            if not self.update:
                warnings.warn(
                    f"jaxshard_snapshot wrote a new snapshot, {path}: commit it",
                    pytest.PytestWarning,
                    stacklevel=2,
                )
            return
        differences = report.compare(path, tolerance=tolerance)
        if differences:
            pytest.fail(
                f"{len(differences)} difference{'s' if len(differences) > 1 else ''} "
                f"from the snapshot {path}:\n"
                + "\n".join(
                    f"- {r.name[len('snapshot: ') :]}: {r.reason}" for r in differences
                )
                + "\nIf the change is intended, rewrite the snapshot: pytest "
                "--jaxshard-snapshot-update",
                pytrace=False,
            )
