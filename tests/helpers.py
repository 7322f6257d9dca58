import importlib.util
import os
import re
import subprocess
import sys

import beartype
import jax
import jax.numpy as jnp
from jax import Array
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import Float


def put(shape, mesh, spec, dtype=jnp.float32):
    """An array of `shape` placed on `mesh` with `spec`."""
    return jax.device_put(jnp.ones(shape, dtype), NamedSharding(mesh, spec))


def hlo_ops(compiled_text: str) -> list[str]:
    """The instructions of a compiled HLO module, without names or metadata."""
    ops = []
    for line in compiled_text.splitlines():
        m = re.match(r"\s*(ROOT )?%[\w.\-]+ = (.*?) (\w[\w\-]*)\(", line)
        if m:
            ops.append(f"{m.group(2)} {m.group(3)}")
    return ops


def layer(jaxtyped=jaxshard.jaxtyped, typechecker=beartype.beartype):
    """`x @ w` with x over dp, w over tp and the output over both."""

    @jaxtyped(typechecker=typechecker)
    def f(
        x: Float[Array, "batch d", P("dp", None)], w: Float[Array, "d h", P(None, "tp")]
    ) -> Float[Array, "batch h", P("dp", "tp")]:
        return x @ w

    return f


def imported(path, name: str):
    """The module in the file `path`, imported as `name` (an example, or a copy of
    a model's source that a test wrote)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def jaxshard_command(folder, *args, env=None) -> tuple[int, str, str]:
    """`python -m jaxshard ARGS` run in `folder` as a user runs it (no simulated
    devices from this process's XLA_FLAGS; `env` added): its exit status, stdout
    and stderr."""
    given = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-m", "jaxshard", *args],
        cwd=folder,
        env={**given, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return out.returncode, out.stdout, out.stderr
