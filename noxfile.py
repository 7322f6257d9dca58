"""The one place that knows how to run things: `nox -s tests`, `demo`, `examples`,
`bench`, `docs`, `lint`."""

import nox


nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests"]

EIGHT_CPU_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


# The jax the test session pins: the `tpu` extra's libtpu is the one `jax[tpu]` asks
# for with it (tests/test_tpu.py checks).
JAX = ["jax==0.10.2", "jaxlib==0.10.2"]


@nox.session
def tests(session):
    """The test suite, on 8 simulated CPU devices, with libtpu to compile for TPUs."""
    session.install("-e", ".[test,tpu]", *JAX)
    session.run("pytest", *session.posargs, env={"JAX_PLATFORMS": "cpu"})


@nox.session
def demo(session):
    """A data- and tensor-parallel model whose contracts hold, then a mis-sharded
    call."""
    session.install("-e", ".")
    session.run("python", "examples/demo.py", env=EIGHT_CPU_DEVICES)


@nox.session
def examples(session):
    """A transformer block verified for TPU v5e and v5p pods, without a TPU."""
    session.install("-e", ".[tpu]", "equinox", *JAX)
    session.run("python", "examples/transformer.py", env={"JAX_PLATFORMS": "cpu"})


@nox.session
def bench(session):
    """Benchmarks: ratios measured side by side in one run."""
    session.install("-e", ".[test,tpu]", *JAX)
    session.run("python", "benchmarks/bench_core.py", *session.posargs)
    session.run("python", "benchmarks/bench_verify.py", *session.posargs)
    session.run("python", "benchmarks/bench_checks.py", *session.posargs)


@nox.session
def docs(session):
    """Builds the documentation site with `--strict`."""
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site")


@nox.session
def lint(session):
    session.install("ruff")
    paths = ["jaxshard", "_jaxshard_pytestplugin.py", "tests", "examples", "benchmarks"]
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)
