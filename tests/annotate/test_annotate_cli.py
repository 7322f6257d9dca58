"""`python -m jaxshard annotate`, run as a user would, in a subprocess."""

import subprocess
import textwrap

import pytest
from helpers import jaxshard_command


MODEL = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P


    def mlp(x, w1, w2):
        h = jnp.tanh(x @ w1)
        return h @ w2


    def forward(x, w1, w2):
        return mlp(x, w1, w2).sum()


    def example(mesh):
        def sds(shape, spec):
            layout = NamedSharding(mesh, spec)
            return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=layout)

        return {
            "x": sds((16, 8), P("dp", None)),
            "w1": sds((8, 32), P(None, "tp")),
            "w2": sds((32, 8), P("tp", None)),
        }


    def broken(mesh):
        raise KeyError("no weights")
    """
)


@pytest.fixture
def run(tmp_path):
    (tmp_path / "model.py").write_text(MODEL)

    def run(*args):
        return jaxshard_command(tmp_path, "annotate", *args)

    return run


ARGS = ["model:forward", "--inputs", "model:example", "--mesh", "dp=4,tp=2"]


def test_the_diff_on_stdout_applies(run, tmp_path):
    code, out, err = run(*ARGS, "--dim", "batch=16", "--dim", "hidden=32")
    assert code == 0, err
    assert out.startswith("--- a/model.py\n+++ b/model.py\n")
    assert '+    x: Float[Array, "batch 8", P("dp", None)],' in out
    assert '+    w1: Float[Array, "8 hidden", P(None, "tp")],' in out
    assert "+@jaxshard.jaxtyped(typechecker=beartype)" in out
    (tmp_path / "contracts.diff").write_text(out)
    applied = subprocess.run(
        ["patch", "-p1", "-i", "contracts.diff"], cwd=tmp_path, capture_output=True
    )
    assert applied.returncode == 0, applied.stderr
    compile((tmp_path / "model.py").read_text(), "model.py", "exec")


def test_write(run, tmp_path):
    code, out, err = run(*ARGS, "--write")
    assert code == 0, err
    assert out == "" and "Contracts written into 1 files." in err
    text = (tmp_path / "model.py").read_text()
    assert 'x: Float[Array, "16 8", P("dp", None)]' in text
    code, out, err = run(*ARGS)  # written once: nothing more to write
    assert code == 0 and out == "", err


@pytest.mark.parametrize(
    "args, status, said",
    [
        (["model:forward", "--inputs", "model:broken", "--mesh", "dp=4,tp=2"], 3,
         "calling model:broken(mesh) raised KeyError"),
        (["model:nothing", "--inputs", "model:example", "--mesh", "dp=4,tp=2"], 2,
         "nothing"),
        (["model:forward", "--inputs", "model:example", "--mesh", "dp=4,tp=x"], 2,
         "bad --mesh"),
        (["model:forward", "--mesh", "dp=4,tp=2"], 2, "--inputs"),
    ],
)  # fmt: skip
def test_errors(run, args, status, said):
    code, out, err = run(*args)
    assert code == status, err
    assert said in err and "Traceback" not in err and out == ""
