"""What a snapshot holds beyond what `snapshot.differences` compares, for the page
`report.html()` draws from it (`html`): the verdict and each violation with its
source line, each input's and output's shape, dtype and spec over the mesh's axes
with its bytes (an input's also beyond an even share over the devices), the
distinct collectives with the line of code each came from (and those of jaxshard's
value checks, per kind), the HBM of a device and the program's code size and FLOPs,
and the snapshot compared with.

None of it is compared: a snapshot written before these keys existed still loads,
and is drawn with what it has.
"""

from typing import Any

import numpy as np
from jax.sharding import NamedSharding

from .._annotations.spec import format_spec
from .collectives import distinct
from .frames import _relative


def view(report: Any) -> dict:
    """The keys a snapshot adds for its page."""
    memory = report.memory
    # What each device holds of an input beyond an even share over the devices, as
    # `report.arrays` (`jaxshard.summary`'s rows) says: what splitting it would free.
    beyond = {row.path: row.bytes_replicated for row in getattr(report, "arrays", ())}
    return {
        "ok": report.ok,
        "violations": [_violation(r) for r in report.violations],
        "layouts": {
            "inputs": {
                k: {**array(v), "replicated_bytes": beyond.get(k)}
                for k, v in report.inputs.items()
            },
            "outputs": {k: array(v) for k, v in report.outputs.items()},
        },
        "sites": sites(report.collectives),
        "check_collectives": _per_kind(report.check_collectives),
        "program": {
            "code": None if memory is None else memory["code"],
            "hbm_bytes": None if memory is None else memory["hbm_bytes"],
            "flops": report.flops,
            "fits": report.fits,
        },
        "against": report.against,
        "notes": list(report.notes),
    }


def _per_kind(found: Any) -> dict[str, dict]:
    """`{kind: {"count": n, "bytes": total}}` of the kinds in `found`."""
    out: dict[str, dict] = {}
    for c in found:
        entry = out.setdefault(c.kind, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += c.bytes
    return out


def _violation(row: Any) -> dict:
    if row.budget is None:
        kind = "contract"
    elif (row.name or "").startswith("snapshot: "):
        kind = "snapshot"
    else:
        kind = "budget"
    return {
        "kind": kind,
        "function": row.function or "",
        "call": row.call,
        "value": row.name or "",
        "array": row.array,
        "block": row.block,
        "annotation": row.annotation,
        "expected": row.budget[0] if row.budget else format_spec(row.expected),
        "actual": row.actual_spec,
        "type": row.actual_type,
        "reason": row.reason,
        "source": row.source,
    }


def array(value: Any) -> dict:
    """An array's shape, dtype, spec (per dimension, the mesh axes splitting it)
    and bytes, in all and on one device."""
    shape = [int(d) for d in value.shape]
    itemsize = np.dtype(value.dtype).itemsize
    sharding = value.sharding
    if isinstance(sharding, NamedSharding):
        spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
        dims = [_axes(entry) for entry in spec]
    else:
        dims = None  # not laid out by mesh axes: a GSPMD or single-device sharding
    try:
        block = sharding.shard_shape(tuple(shape))
    except Exception:  # a sharding that cannot say
        block = shape
    return {
        "dtype": str(np.dtype(value.dtype)),
        "shape": shape,
        "spec": dims,
        "bytes": int(np.prod(shape, dtype=np.int64)) * itemsize,
        "device_bytes": int(np.prod(block, dtype=np.int64)) * itemsize,
    }


def _axes(entry: Any) -> list[str]:
    if entry is None:
        return []
    if isinstance(entry, str):
        return [entry]
    return [str(a) for a in entry]


def sites(found: Any) -> list[dict]:
    """The distinct collectives (`collectives.distinct`: a layer's, once for all
    the layers of a loop), each with how many the program has, the bytes of one
    and of all of them, and the line of code it came from; the most bytes first."""
    out = []
    for c, count in distinct(found):
        if c.filename is None:
            line, function = "", c.op_name or "(made by XLA)"
        else:
            line, function = f"{_relative(c.filename)}:{c.lineno}", c.function or ""
        out.append(
            {
                "line": line,
                "function": function,
                "kind": c.kind,
                "axes": None if c.axes is None else list(c.axes),
                "count": count,
                "each": c.bytes,
                "bytes": c.bytes * count,
                "where": c.where,
            }
        )
    return sorted(out, key=lambda g: (-g["bytes"], g["line"], g["kind"]))
