"""`python -m jaxshard verify`, run as a user would, in a subprocess."""

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import jax
import pytest
from helpers import jaxshard_command

import jaxshard


MODEL = textwrap.dedent(
    """
    from typing import NamedTuple

    import beartype
    import jax
    import jax.numpy as jnp
    from jax import Array
    from jax.sharding import PartitionSpec as P

    import jaxshard
    from jaxshard import Float


    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    def layer(
        x: Float[Array, "b d", P("dp")], w: Float[Array, "d f", P(None, "tp")]
    ) -> Float[Array, "b f", P("dp", "tp")]:
        return jnp.tanh(x @ w)


    def mis_annotated(
        x: Float[Array, "b d", P("dp")], w: Float[Array, "d f", P(None, "tp")]
    ) -> Float[Array, "b f", P("tp")]:
        return layer(x, w)


    def wrong_shape(x: Float[Array, "b d", P("dp")]) -> Float[Array, "d"]:
        return x


    jitted = jax.jit(layer)


    def contracting(
        x: Float[Array, "b d", P("dp", "tp")], w: Float[Array, "d f", P("tp", None)]
    ) -> Float[Array, "b f", P("dp")]:
        return x @ w  # contracts over tp: Explicit axes need an out_sharding


    def broken(x: Float[Array, "b d", P("dp")]) -> Float[Array, "b d", P("dp")]:
        return x.reshape(3, -1)


    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    def dense(
        x: Float[Array, "b d", P("dp")], w: Float[Array, "d f"]
    ) -> Float[Array, "b f", P("dp")]:
        return x @ w


    def forward(params, x: Float[Array, "b d", P("dp")]) -> Float[Array, "b f"]:
        return dense(x, params["w"])


    def abstract_params():
        return {"w": jax.ShapeDtypeStruct((8, 16), jnp.float32)}


    concrete_params = {"w": jnp.ones((8, 16))}
    all_values = {"params": concrete_params}


    class Model:
        def __init__(self, w):
            self.w = w

        def __call__(self, x: Float[Array, "b d", P("dp")]) -> Float[Array, "b f"]:
            return dense(x, self.w)


    model = Model(jnp.ones((8, 16)))


    class Weights(NamedTuple):
        w: Float[Array, "d f", P(None, "tp")]


    def named(p: Weights, x: Float[Array, "b d", P("dp")]) -> Float[Array, "b f"]:
        return x @ p.w
    """
)

DIMS = ["--dim", "b=16", "--dim", "d=8", "--dim", "f=16"]
BD = DIMS[:4]  # for functions with no dimension f


@pytest.fixture
def run(tmp_path):
    (tmp_path / "model.py").write_text(MODEL)

    def run(*args):
        return jaxshard_command(tmp_path, *args)

    return run


def test_contracts_hold(run):
    code, out, _ = run("verify", "model:layer", "--mesh", "dp=4,tp=2", *DIMS)
    assert code == 0, out
    assert re.search(
        r"^layer +x +P\('dp'\) +P\('dp'\) +float32\[16@dp,8\] +ok$", out, re.M
    )
    assert "All 3 contracts hold." in out
    assert "8 × cpu" in out


def test_violations_exit_1(run):
    code, out, _ = run("verify", "model.py:mis_annotated", "--mesh", "dp=4,tp=2", *DIMS)
    assert code == 1
    assert "VIOLATED" in out and "1 of 6 sharding contracts violated" in out


def test_json(run):
    code, out, _ = run(
        "verify",
        "model:mis_annotated",
        "--mesh=dp=4,tp=2",
        "--axis-types=auto",
        "--json",
        *DIMS,
    )
    assert code == 1
    report = json.loads(out)
    assert report["ok"] is False and report["mesh"] == {"dp": 4, "tp": 2}
    (bad,) = [r for r in report["rows"] if not r["ok"]]
    assert bad["name"] == "return" and bad["expected"] == "P('tp')"
    assert bad["actual"] == "P('dp', 'tp')"
    assert report["memory"]["arguments"] > 0


def test_tpu_topology(run):
    code, out, _ = run(
        "verify", "model:layer", "--topology", "v5e:2x2", "--mesh", "dp=2,tp=2", *DIMS
    )
    assert code == 0, out
    assert "4 × TPU v5 lite" in out


def test_dimensions_of_namedtuple_fields(run):
    """Dimensions used only inside a NamedTuple parameter's fields are not stray."""
    code, out, err = run("verify", "model:named", "--mesh", "dp=4,tp=2", *DIMS)
    assert code == 0, err
    assert re.search(r"^named +p\.w +P\(None, 'tp'\)", out, re.M), out


def test_dtype(run):
    code, out, _ = run(
        "verify", "model:layer", "--mesh", "dp=4,tp=2", "--dtype", "bfloat16", *DIMS
    )
    assert code == 0 and "bfloat16[16@dp,8]" in out


def test_a_jitted_function(run):
    code, out, _ = run("verify", "model:jitted", "--mesh", "dp=4,tp=2", *DIMS)
    assert code == 0 and "layer" in out


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_the_models_own_errors_exit_3(run, axis_types):
    """Exit 1 is for contracts; a function that fails to trace or compile exits 3,
    with one line naming where. Contracting over a sharded dimension is fine on Auto
    axes (the default) and JAX's sharding type error on Explicit ones."""
    mesh = ["--mesh", "dp=4,tp=2", "--axis-types", axis_types, *DIMS]
    code, _, err = run("verify", "model:contracting", *mesh)
    if axis_types == "auto":
        assert code == 0, err
    else:
        assert code == 3, err
        assert "model.py:" in err and "in contracting: `return x @ w" in err
        assert "Auto axes" in err and "out_sharding" in err
    code, _, err = run("verify", "model:broken", "--mesh", "dp=4", *BD)
    assert code == 3 and "failed to trace or compile" in err, err
    assert len(err.strip().splitlines()) == 1


BROKEN = {
    # A model's module that raises as it is imported, or imports what is missing.
    "pkg/__init__.py": "",
    "pkg/raising.py": "import os\n\nraise RuntimeError('no TPU driver here')\n",
    "pkg/missing.py": "import no_such_dependency_of_the_model\n",
    "pkg/exiting.py": "import sys\n\nsys.exit('usage: train.py --steps N')\n",
    "values.py": "def params():\n    return {'w': undefined_name}\n\n\nRULES = 3\n"
    "\n\ndef rules():\n    raise KeyError('mlp')\n",
}


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["pkg.raising:f"],
            "pkg.raising:f: importing pkg.raising raised RuntimeError: no TPU driver "
            "here (pkg/raising.py:3)",
        ),
        (
            ["pkg/raising.py:f"],
            "pkg/raising.py:f: importing pkg/raising.py raised RuntimeError: no TPU "
            "driver here (pkg/raising.py:3)",
        ),
        (
            ["pkg.missing:f"],
            "pkg.missing:f: importing pkg.missing raised ModuleNotFoundError: No "
            "module named 'no_such_dependency_of_the_model' (pkg/missing.py:1)",
        ),
        (
            ["pkg.exiting:f"],
            "pkg.exiting:f: importing pkg.exiting raised SystemExit: usage: train.py "
            "--steps N (pkg/exiting.py:3)",
        ),
        (
            ["model:forward", "--values", "params=values:params"],
            "--values params=values:params: calling values:params() raised NameError: "
            "name 'undefined_name' is not defined (values.py:2)",
        ),
        (
            ["model:layer", "--rules", "values:rules"],
            "--rules values:rules: calling values:rules() raised KeyError: 'mlp' "
            "(values.py:9)",
        ),
    ],
)
def test_the_models_code_failing_as_it_is_loaded_exits_3(run, tmp_path, args, line):
    """The model's module (or a --values or --rules function) raising is the model's
    failure, as one that fails to trace is: exit 3, one line naming the target, the
    exception and where it was raised; no traceback."""
    for name, text in BROKEN.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    code, out, err = run("verify", *args, "--mesh", "dp=4", *DIMS)
    assert code == 3 and out == "", err
    assert err.strip() == line.replace("/", os.sep)


def test_a_mesh_larger_than_the_run_can_make_is_refused_at_once(run):
    """JAX would spend minutes making 200,000 CPU devices, and XLA then refuse to
    compile for more than 2048 in one process."""
    start = time.monotonic()
    code, out, err = run("verify", "model:layer", "--mesh", "dp=100000,tp=2", *DIMS)
    assert code == 2 and out == "" and time.monotonic() - start < 60
    last = err.strip().splitlines()[-1]
    assert (
        "the mesh dp=100000,tp=2 needs 200000 devices; a run simulates at most " in last
    )
    assert "2048 CPU devices" in last and "--topology v5e:16x16" in last
    code, _, err = run("verify", "model:layer", "--mesh", "dp=2049", *DIMS)
    assert code == 2 and "needs 2049 devices" in err


CPU_DEVICES = """
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

n = int(sys.argv[1])
jax.config.update("jax_num_cpu_devices", n)
mesh = jax.make_mesh((n,), ("dp",), devices=jax.devices())
double = jax.jit(lambda x: x * 2, in_shardings=NamedSharding(mesh, P("dp")))
try:
    double.lower(jax.ShapeDtypeStruct((2 * n,), jnp.float32)).compile()
    print("compiled")
except jax.errors.JaxRuntimeError as e:
    print(str(e).splitlines()[0])
"""


def test_the_cpu_device_limit_is_xlas(tmp_path):
    """`cli.MAX_CPU_DEVICES`: XLA's CPU compiler compiles for 2048 devices in one
    process, and not for one more. When a JAX release lifts the limit, this says
    so."""
    from jaxshard._verify.cli import MAX_CPU_DEVICES

    (tmp_path / "cpu_devices.py").write_text(CPU_DEVICES)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    found = []
    for n in (MAX_CPU_DEVICES, MAX_CPU_DEVICES + 1):
        out = subprocess.run(
            [sys.executable, str(tmp_path / "cpu_devices.py"), str(n)],
            env={**env, "JAX_PLATFORMS": "cpu"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        found.append(out.stdout.strip())
    assert found == [
        "compiled",
        "INVALID_ARGUMENT: Multiprocess computations aren't implemented on the CPU "
        "backend.",
    ]


@pytest.mark.parametrize(
    "values",
    [
        ["--values", "params=model:abstract_params"],
        ["--values", "params=model:concrete_params"],
        ["--values", "model:all_values"],
    ],
)
def test_values_for_parameters_with_no_array_annotation(run, values):
    """A flax-style forward(params, x): params from a module, abstract or concrete,
    or returned by a function."""
    args = ["model:forward", "--mesh", "dp=4,tp=2", *DIMS, *values]
    code, out, err = run("verify", *args)
    assert code == 0, err
    assert "forward" in out and "dense" in out


def test_a_method_with_its_instance(run):
    args = ["model:Model.__call__", "--mesh", "dp=4,tp=2", *DIMS]
    code, _, err = run("verify", *args, "--values", "self=model:model")
    assert code == 0, err
    code, _, err = run("verify", *args)
    assert code == 2 and "--values PARAM=MODULE:OBJECT" in err


def test_collective_budgets(run):
    """`layer` contracts over nothing: no collectives; `contracting` all-reduces."""
    args = ["--mesh", "dp=4,tp=2", *DIMS, "--max-collectives", "all-reduce=0"]
    code, out, _ = run("verify", "model:layer", *args)
    assert code == 0 and "Collectives" in out
    code, out, _ = run("verify", "model:contracting", *args)
    assert code == 1 and "collectives: all-reduce" in out
    assert "model.py:" in out
    code, _, err = run("verify", "model:layer", *args[:-1], "all-gathers=0")
    assert code == 2 and "--max-collectives names 'all-gathers'" in err


def test_sharding_budgets(run):
    """`layer`'s w is split over tp and x over dp: all of the inputs' bytes are."""
    args = ["verify", "model:layer", "--mesh", "dp=4,tp=2", *DIMS]
    code, _, err = run(*args, "--min-sharded-fraction", "0.9")
    assert code == 0, err
    code, out, _ = run(*args, "--max-replicated-bytes", "0")
    assert code == 0
    code, out, _ = run(
        "verify",
        "model:dense",
        "--mesh",
        "dp=4",
        *DIMS[:4],
        "--dim",
        "f=16",
        "--max-replicated-bytes",
        "0",
    )
    assert code == 1 and "parameters: replicated bytes" in out


def test_other_contract_failures_exit_1(run):
    code, _, err = run("verify", "model:wrong_shape", "--mesh", "dp=4", *BD)
    assert code == 1 and "TypeCheckError" in err


@pytest.mark.parametrize(
    "args, reason",
    [
        (["nowhere:f", "--mesh", "dp=4"], "cannot import module 'nowhere'"),
        (["model:nothing", "--mesh", "dp=4"], "has no attribute 'nothing'"),
        (["model", "--mesh", "dp=4"], "write MODULE:NAME"),
        (["model:layer", "--mesh", "dp4"], "bad --mesh 'dp4'"),
        (["model:layer", "--mesh", "dp=4,tp=2", "--dim", "b=8"], "'d' (in x, w)"),
        (
            ["model:layer", "--mesh", "dp=4,tp=2", "--dim", "b=8"],
            "with --dim NAME=SIZE",
        ),
        (["model:layer", "--mesh", "dp=4,tp=2", "--dim", "b"], "bad --dim 'b'"),
        (
            ["model:layer", "--mesh", "dp=2", "--topology", "v9:2x2", *DIMS],
            "does not know the TPU topology 'v9:2x2'",
        ),
        (["model:layer", "--mesh", "dp=16", *DIMS, "--devices", "8"], "needs 16"),
        (
            ["model:layer", "--mesh", "dp=4", *DIMS, "--dim", "foo=3"],
            "--dim names 'foo', which no annotation of layer uses",
        ),
        (
            ["model:layer", "--mesh", "dp=4", "--dim", "b=16", "--dim", "dd=8"],
            "its dimensions are 'b', 'd', 'f'. Did you mean 'd'?",
        ),
        (
            ["model:layer", "--mesh", "dp=4", *DIMS, "--dtype", "int32"],
            "--dtype asks for int32, which no array annotation of layer allows",
        ),
        (
            ["model:layer", "--mesh", "dp=4", *DIMS, "--dtype", "zz=bfloat16"],
            "--dtype names 'zz', but no input of layer matches",
        ),
        (
            ["model:layer", "--mesh", "dp=2,tp=4", "--topology", "v5e:2x2", *DIMS],
            "has 4 devices, but the axes {'dp': 2, 'tp': 4} multiply to 8",
        ),
        (
            ["model:forward", "--mesh", "dp=4", *DIMS],
            "Give it with --values PARAM=MODULE:OBJECT",
        ),
        (
            ["model:forward", "--mesh", "dp=4", *DIMS, "--values", "model:nope"],
            "has no attribute 'nope'",
        ),
        (
            ["model:forward", "--mesh", "dp=4", *DIMS, "--values", "model:model"],
            "without PARAM= it must be a dict",
        ),
        (
            ["model:layer", "--mesh", "dp=4", *DIMS, "--min-sharded-fraction", "2"],
            "--min-sharded-fraction takes a fraction from 0 to 1; got 2.0",
        ),
        (
            ["model:layer", "--mesh", "dp=4", *DIMS, "--hbm-budget", "0"],
            "--hbm-budget takes a number of bytes; got 0",
        ),
        (
            ["model:layer", "--mesh", "dp=4", *DIMS, "--devices", "0"],
            "--devices takes a number of CPU devices to simulate, from 1 to 2048; "
            "got 0.",
        ),
        (
            ["model:layer", "--mesh", "dp=4", *DIMS, "--devices", "-3"],
            "from 1 to 2048; got -3.",
        ),
        (
            ["model:layer", "--mesh", "dp=4", *DIMS, "--devices", "4096"],
            "--devices 4096: a run simulates at most 2048 CPU devices",
        ),
        (
            ["model:layer", "--mesh", "dp=4", *DIMS, "--devices", "2"],
            "the mesh dp=4 needs 4 devices; --devices 2 simulates 2. Give --devices 4",
        ),
        (
            [
                "model:layer",
                "--mesh",
                "dp=4",
                *DIMS,
                "--devices",
                "0",
                "--topology",
                "v5e:2x2",
            ],
            "--devices is for CPU meshes; it conflicts with --topology",
        ),  # fmt: skip
        (
            ["model:forward", "--mesh", "dp=4", *DIMS, "--values", "params=nowhere:p"],
            "cannot import module 'nowhere'",
        ),
    ],
)
def test_usage_errors_exit_2(run, args, reason):
    code, out, err = run("verify", *args)
    assert code == 2 and out == ""
    last = err.strip().splitlines()[-1]
    assert reason in last, err


def test_help_documents_every_option(run):
    code, out, _ = run("verify", "--help")
    assert code == 0
    for option in [
        "--topology",
        "--mesh",
        "--dim",
        "--dtype",
        "--devices",
        "--axis-types",
        "--json",
        "--values",
        "--max-collectives",
        "--max-collective-bytes",
        "--min-sharded-fraction",
        "--max-replicated-bytes",
        "Exit status: 0 when every contract holds, 1 when one is violated, 2 on a "
        "usage error, 3 when the function itself fails to trace or compile",
    ]:
        assert option in " ".join(out.split())


def test_no_libtpu_noise_on_a_machine_without_tpus(tmp_path):
    """libtpu, loaded by JAX when nothing says CPU, complains on stderr about the TPU
    it cannot find; the command sets what it looks for first, on a machine with no
    TPU, without overriding the user's settings."""
    (tmp_path / "model.py").write_text(MODEL)
    quiet = (
        "JAX_PLATFORMS",
        "TPU_WORKER_HOSTNAMES",
        "TPU_ACCELERATOR_TYPE",
        "XLA_FLAGS",
    )
    env = {k: v for k, v in os.environ.items() if k not in quiet}
    args = ["verify", "model:layer", "--topology", "v5e:2x2", "--mesh", "dp=2,tp=2"]
    out = subprocess.run(
        [sys.executable, "-m", "jaxshard", *args, *DIMS],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "TPU_WORKER_HOSTNAMES" not in out.stderr and "E0000" not in out.stderr
    assert "TPU accelerator type" not in out.stderr


def test_version(capsys):
    from jaxshard._verify.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"jaxshard {jaxshard.__version__} (jax {jax.__version__}")


@pytest.mark.parametrize(
    "args, suggestion",
    [
        (
            ["verify", "m:f", "--mesh", "dp=2", "--dimm", "b=2"],
            "unrecognized arguments: --dimm b=2. Did you mean '--dim'?",
        ),
        (
            ["verify", "m:f", "--mesh", "dp=2", "--max-colectives=all-gather=0"],
            "Did you mean '--max-collectives'?",
        ),
        (["verfy", "m:f"], "Did you mean 'verify'?"),
        (
            ["verify", "m:f", "--mesh", "dp=2", "--axis-types", "explict"],
            "Did you mean 'explicit'?",
        ),
    ],
)
def test_a_misspelled_option_or_command(capsys, args, suggestion):
    """argparse's usage error and exit status 2, with the option meant: checked in
    this process, as parsing comes before anything else the command does."""
    from jaxshard._verify.cli import main

    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    assert suggestion in capsys.readouterr().err.strip().splitlines()[-1]
