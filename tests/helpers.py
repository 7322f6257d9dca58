import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding


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
