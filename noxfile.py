"""The one place that knows how to run things: `nox -s tests`, `demo`, `examples`,
`torchax`, `bench`, `docs`, `lint`."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import nox


nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests"]

EIGHT_CPU_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}

# The tested (Python, jax) pairs: jax 0.10.2 is the newest for Python 3.11, and 0.11 and
# later need Python 3.12 or newer. pyproject.toml states the same range.
MATRIX = [("3.11", "0.10.2"), ("3.12", "0.11.2"), ("3.13", "0.12.0.1")]
NEWEST = MATRIX[-1]
# torchax 0.0.14 needs torch 2.13, whose CPU build installs on Python 3.11 here.
TORCHAX = MATRIX[0]


def _pyenv_pythons() -> None:
    """Makes pyenv's interpreters of the matrix reachable as `python3.X`.

    pyenv installs each Python under its own root, on PATH only as a shim that answers
    for the versions `PYENV_VERSION` names (its shims set it to the current version).
    To those, add the newest install of each of the matrix's Pythons not yet named.
    """
    if shutil.which("pyenv") is None:
        return
    run = subprocess.run(
        ["pyenv", "versions", "--bare"], capture_output=True, text=True
    )
    named = [v for v in os.environ.get("PYENV_VERSION", "").split(":") if v]
    for python, _ in MATRIX:
        pattern = rf"{re.escape(python)}\.\d+"
        if not any(re.fullmatch(pattern, v) for v in named):
            found = [v for v in run.stdout.split() if re.fullmatch(pattern, v)]
            if found:
                named.append(max(found, key=lambda v: int(v.rsplit(".", 1)[1])))
    if named:
        os.environ["PYENV_VERSION"] = ":".join(named)


_pyenv_pythons()


def _workers() -> str:
    """pytest-xdist's worker count: one per core, at most 4 (each worker is a JAX with
    8 simulated devices and its own compiles, about 1.5 GB)."""
    return str(max(1, min(4, os.cpu_count() or 1)))


def _install(session, jax: str, extras: str) -> None:
    """jaxshard with `extras`, and this jax; the `tpu` extra asks for `jax[tpu]`, so
    pip takes the libtpu that this jax pins."""
    session.install("-e", f".[{extras}]", f"jax=={jax}", f"jaxlib=={jax}")


@nox.session
@nox.parametrize("python,jax", MATRIX, ids=[f"{p}-jax{j}" for p, j in MATRIX])
def tests(session, jax):
    """The test suite on each tested (Python, jax) pair, on 8 simulated CPU devices,
    with the libtpu of that jax to compile for TPUs.

    A pair whose Python is missing is skipped, and nox's summary names it; in CI
    (`CI` set) it is an error.
    """
    env = {"JAX_PLATFORMS": "cpu"}
    if session.python == TORCHAX[0]:
        _install(session, jax, "test,tpu,torchax")
        env["JAXSHARD_REQUIRE_TORCHAX"] = "1"  # tests/test_torchax.py may not skip
    else:
        _install(session, jax, "test,tpu")
    # The docs' own code runs in `nox -s docs`, once.
    session.run("pytest", "-n", _workers(), "-m", "not docs", *session.posargs, env=env)


# The demo and the examples run on whichever Python runs nox, with the newest tested jax
# that Python can have (CI runs them on the newest: `--force-python 3.13`).


@nox.session
def demo(session):
    """A data- and tensor-parallel model whose contracts hold, then a mis-sharded
    call."""
    session.install("-e", ".")
    session.run("python", "examples/demo.py", env=EIGHT_CPU_DEVICES)


@nox.session
def examples(session):
    """A transformer verified for TPU v5e and v5p pods without a TPU, on Auto and
    on Explicit axes, each against its committed snapshot; a decoder annotated with
    logical axis names, verified under several rule tables; a mixture-of-experts
    train step at its small size (full size in `bench`)."""
    session.install("-e", ".[tpu]", "equinox", "flax")
    env = {"JAX_PLATFORMS": "cpu"}
    session.run("python", "examples/transformer.py", env=env)
    session.run("python", "examples/transformer.py", "--explicit", env=env)
    session.run("python", "examples/logical.py", env=env)
    session.run("python", "examples/moe.py", env=env)  # small, on 8 CPU devices


@nox.session(python=TORCHAX[0])
def torchax(session):
    """A PyTorch MLP under torchax on 8 simulated devices: its sharding contracts
    checked eagerly, compiled and by `verify`, and a mis-sharded weight caught."""
    _install(session, TORCHAX[1], "torchax")
    session.run("python", "examples/torchax_mlp.py", env={"JAX_PLATFORMS": "cpu"})


@nox.session
@nox.parametrize(
    "python,jax",
    [MATRIX[0], NEWEST],
    ids=[f"{p}-jax{j}" for p, j in (MATRIX[0], NEWEST)],
)
def bench(session, jax):
    """Benchmarks: ratios measured side by side in one run, on the oldest and the
    newest tested jax."""
    scripts = ["bench_core", "bench_host", "bench_verify", "bench_checks"]
    scripts += [
        "bench_annotate",
        "bench_moe",
        "bench_cache",
        "bench_pod",
        "bench_recompiles_memory",
    ]
    if session.python == TORCHAX[0]:
        _install(session, jax, "test,tpu,torchax")
        scripts.append("bench_torchax")
    else:
        _install(session, jax, "test,tpu")
    env = {"JAX_PLATFORMS": "cpu"}  # libtpu only compiles (bench_verify, bench_moe)
    for script in scripts:
        session.run("python", f"benchmarks/{script}.py", *session.posargs, env=env)


@nox.session(python=NEWEST[0])
def soak(session):
    """The differential soak with many examples (10,000 by default, or `nox -s soak
    -- N`): jaxshard's verdicts against jaxtyping's (random shape strings) and JAX's
    `is_equivalent_to` (random meshes, placements and specs) on every path: eager,
    `isinstance`, Explicit traces, Auto compiles, `jax.shard_map` and
    `jaxshard.shard_map`, under scan, checkpoint, vmap and grad; and value checks
    called from several threads at once, in deferred blocks and in calls ending in
    an exception, against what each call made."""
    _install(session, NEWEST[1], "test")
    examples = session.posargs[0] if session.posargs else "10000"
    env = {"JAX_PLATFORMS": "cpu", "JAXSHARD_PROPERTY_EXAMPLES": examples}
    tests = ["tests/sharding/test_properties.py", "tests/values/test_concurrency.py"]
    session.run("pytest", "-n", _workers(), *tests, "-q", env=env)


@nox.session
def docs(session):
    """Builds the documentation site with `--strict`, then runs each page's code
    (`tests/test_docs.py`) on the newest jax that this Python can have."""
    session.install("-e", ".[docs,test,tpu]")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site")
    session.run("pytest", "-m", "docs", *session.posargs, env={"JAX_PLATFORMS": "cpu"})


@nox.session
def lint(session):
    """ruff, then mypy and pyright on the examples and on what static type checkers
    must see of jaxshard's annotations (`tests/static_types.py`)."""
    session.install("ruff")
    paths = ["jaxshard", "_jaxshard_pytestplugin.py", "tests", "examples", "benchmarks"]
    paths.append("noxfile.py")
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)
    session.install("-e", ".", "mypy", "pyright", "equinox", "flax")
    # Not the torchax example: torch is a large install, for the Python 3.11 leg only.
    typed = [str(p) for p in sorted(Path("examples").glob("*.py"))]
    typed = [p for p in typed if "torchax" not in p] + ["tests/static_types.py"]
    session.run("mypy", "--ignore-missing-imports", *typed)
    session.run("pyright", *typed)
