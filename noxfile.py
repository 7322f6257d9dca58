"""The one place that knows how to run things: `nox -s tests`, `demo`, `bench`, `docs`, `lint`."""

import nox


nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests"]

EIGHT_CPU_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


@nox.session
def tests(session):
    """The test suite, on 8 simulated CPU devices."""
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)


@nox.session
def demo(session):
    """A data- and tensor-parallel model whose contracts hold, then a mis-sharded call."""
    session.install("-e", ".", "beartype")
    session.run("python", "examples/demo.py", env=EIGHT_CPU_DEVICES)


@nox.session
def bench(session):
    """Benchmarks: ratios measured side by side in one run."""
    session.install("-e", ".[test]")
    session.run("python", "benchmarks/bench_core.py", *session.posargs)


@nox.session
def docs(session):
    """Builds the documentation site with `--strict`."""
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site")


@nox.session
def lint(session):
    session.install("ruff")
    session.run("ruff", "check", "jaxshard", "tests", "examples", "benchmarks")
    session.run(
        "ruff", "format", "--check", "jaxshard", "tests", "examples", "benchmarks"
    )
