"""The budgets `jaxshard.verify` checks a compiled program against: collectives per
kind and bytes moved, memory per device against the budget and the HBM of the mesh's
chips, and how much of the inputs is sharded; and the inputs' and outputs' layouts
these are read from, and the program's memory per device and FLOPs, with the HBM of
a TPU chip."""

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from .._errors import did_you_mean, expect
from .._sharding.boxes import unboxed_paths
from .._sharding.describe import (
    describe_bytes as _bytes,
)
from .collectives import Collective, describe, KINDS, most_bytes
from .report import _over_budget, Memory, Row


def layouts(values: Any, shardings: Any, root: str = "") -> dict[str, Any]:
    """Path -> `jax.ShapeDtypeStruct` with its sharding, for each array in `values`
    (a dict of parameters, with `root=""`: `params.wq`, `x`; or an output, with
    `root="return"`: `return['loss']`) that the compiled program has.

    `shardings` has the structure of `values`, as `Compiled.input_shardings` and
    `output_shardings` give it: an input the program never reads, which jit leaves
    out (`keep_unused=False`), has `None` there (JAX 0.10 to 0.12; pinned by
    tests/verify/test_unused_inputs.py) and no entry here. The two are paired by
    their place in that structure: `tree_leaves` would drop the `None`s and pair
    each later sharding with the input before its own."""
    # `flatten_up_to` keeps a `None` leaf in its place; an empty node of `values`
    # (a `None` parameter) is one of `shardings` too.
    flat = jax.tree_util.tree_structure(values).flatten_up_to(shardings)
    leaves = unboxed_paths(values)  # a flax box's `.value` is no part of a path
    out = {}
    for (path, leaf), sharding in zip(leaves, flat, strict=True):
        if sharding is None:
            continue
        out[path_name(path, root)] = jax.ShapeDtypeStruct(
            np.shape(leaf), _dtype(leaf), sharding=sharding
        )
    return out


def _dtype(leaf: Any) -> Any:
    """The dtype of an input: a Python number's as JAX takes it (weakly typed)."""
    dtype = getattr(leaf, "dtype", None)
    return dtype if dtype is not None else jax.numpy.asarray(leaf).dtype


def unused_note(paths: Any, kept: Mapping[str, Any]) -> tuple[str, ...]:
    """What the report says of the inputs jit left out of the program: those it
    never reads (`keep_unused=False`), which have no layout and take no memory."""
    unused = [p for p in paths if p not in kept]
    if not unused:
        return ()
    n = len(unused)
    listed = ", ".join(unused[:8]) + (f" and {n - 8} more" if n > 8 else "")
    them, have = ("them", "they have") if n > 1 else ("it", "it has")
    return (
        f"The program never reads {n} input{'s' if n > 1 else ''} ({listed}): jit "
        f"left {them} out of the compiled program (`keep_unused=False`), so {have} "
        "no layout in report.inputs and no bytes on any device.",
    )


def input_names(values: Any, argument: str) -> dict[str, str]:
    """JAX's name for each array of `values`, the dict of parameters passed to the
    compiled program as its `argument` (`inputs['params']['w1'].value`, which names
    a collective XLA makes for the input's layout) -> its path in the report
    (`params['w1']`)."""
    jax_paths = jax.tree_util.tree_flatten_with_path(values)[0]
    return {
        argument + jax.tree_util.keystr(raw): path_name(path, "")
        for (raw, _), (path, _) in zip(jax_paths, unboxed_paths(values))
    }


def path_name(path: tuple, root: str = "") -> str:
    """`params['w1']`: the parameter's name (the first key), then the path into
    it; or, with a `root`, the path from there (`return['loss']`)."""
    if root:
        return root + jax.tree_util.keystr(path)
    first = getattr(path[0], "key", None) if path else None
    return f"{first}{jax.tree_util.keystr(path[1:])}" if first else str(path)


def sharding_budget_rows(
    inputs: Mapping[str, Any],
    min_sharded_fraction: float | None,
    max_replicated_bytes: int | None,
) -> tuple[Row, ...]:
    """Rows for the sharding budgets the parameters (`layouts`) break: the fraction
    of their bytes that is split over devices (not fully replicated), and the bytes
    of fully replicated parameters that every device holds. Each lists the largest
    replicated parameters first."""
    if min_sharded_fraction is None and max_replicated_bytes is None:
        return ()
    sizes = []
    for name, leaf in inputs.items():
        size = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        replicated = bool(getattr(leaf.sharding, "is_fully_replicated", True))
        sizes.append((name, size, replicated))
    total = sum(size for _, size, _ in sizes) or 1
    replicated = sorted((s for s in sizes if s[2]), key=lambda s: -s[1])
    worst = "; ".join(f"{p} {_bytes(n)}" for p, n, _ in replicated[:5])
    worst = f" The largest replicated: {worst}." if worst else ""
    rows = []
    fraction = 1 - sum(n for _, n, _ in replicated) / total
    if min_sharded_fraction is not None and fraction < min_sharded_fraction:
        rows.append(
            _sharding_row(
                "sharded fraction",
                f">= {min_sharded_fraction:.0%}",
                f"{fraction:.1%}",
                f"{fraction:.1%} of the parameters' bytes are split over devices, "
                f"less than min_sharded_fraction ({min_sharded_fraction:.0%}).{worst}",
            )
        )
    kept = sum(n for _, n, _ in replicated)
    if max_replicated_bytes is not None and kept > max_replicated_bytes:
        rows.append(
            _sharding_row(
                "replicated bytes",
                f"<= {_bytes(max_replicated_bytes)}",
                _bytes(kept),
                f"every device holds {_bytes(kept)} of fully replicated parameters, "
                f"more than max_replicated_bytes ({_bytes(max_replicated_bytes)})."
                + worst,
            )
        )
    return tuple(rows)


def _sharding_row(what: str, expected: str, actual: str, reason: str) -> Row:
    return _over_budget(
        f"parameters: {what}", expected, actual, reason, f"{what} {expected}"
    )


def _does_not_fit(xla_says: str) -> Row:
    """The row of a program XLA refused to compile for want of memory."""
    return _over_budget(
        "memory per device",
        "<= HBM",
        "more",
        f"the program does not fit on a device; XLA refused it: {xla_says}",
        annotation="memory <= the device's HBM",
    )


def _check_budget(
    max_collectives: Any = None,
    max_bytes: Any = None,
    hbm_budget: Any = None,
    min_sharded_fraction: Any = None,
    max_replicated_bytes: Any = None,
) -> None:
    """`verify`'s budgets, checked before anything is compiled."""
    fine = hbm_budget is None or (isinstance(hbm_budget, int) and hbm_budget > 0)
    expect(fine, "verify", "hbm_budget", "a number of bytes", hbm_budget)
    fraction = min_sharded_fraction
    fine = fraction is None or (
        isinstance(fraction, (int, float)) and 0 <= fraction <= 1
    )
    expect(fine, "verify", "min_sharded_fraction", "a fraction from 0 to 1", fraction)
    most = max_replicated_bytes
    fine = most is None or (isinstance(most, int) and most >= 0)
    expect(fine, "verify", "max_replicated_bytes", "a number of bytes", most)
    accepts = f"a dict of collective kinds ({', '.join(KINDS)}) to counts"
    given = max_collectives is None or isinstance(max_collectives, Mapping)
    expect(given, "verify", "max_collectives", accepts, max_collectives)
    for kind, count in (max_collectives or {}).items():
        if kind not in KINDS:
            raise ValueError(
                f"jaxshard.verify: max_collectives names {kind!r}, which is not a "
                f"collective; the kinds are {', '.join(KINDS)}."
                + did_you_mean(str(kind), KINDS)
            )
        expect(
            isinstance(count, int) and count >= 0,
            "verify",
            f"max_collectives[{kind!r}]",
            "a count (an int, 0 or more)",
            count,
        )
    fine = max_bytes is None or (isinstance(max_bytes, int) and max_bytes >= 0)
    expect(fine, "verify", "max_collective_bytes", "a number of bytes", max_bytes)


def _budget_rows(
    found: tuple[Collective, ...],
    max_collectives: Any,
    max_bytes: int | None,
    memory: Memory | None = None,
    hbm_budget: int | None = None,
) -> tuple[Row, ...]:
    """A violated row for each budget the program exceeds: its collectives', and
    its memory per device (the device's HBM, and `hbm_budget`)."""
    rows = []
    if memory is not None:
        limits = [b for b in (memory.hbm_bytes, hbm_budget) if b is not None]
        if limits and memory.total > min(limits):
            limit = min(limits)
            what = "the device's HBM" if limit == memory.hbm_bytes else "hbm_budget"
            rows.append(
                _over_budget(
                    "memory per device",
                    f"<= {_bytes(limit)}",
                    _bytes(memory.total),
                    f"the program needs {_bytes(memory.total)} per device "
                    f"(arguments {_bytes(memory.arguments)}, outputs "
                    f"{_bytes(memory.outputs)}, temporaries "
                    f"{_bytes(memory.temporaries)}), more than {what} "
                    f"({_bytes(limit)}).",
                    annotation=f"memory <= {_bytes(limit)}",
                )
            )
    for kind, limit in (max_collectives or {}).items():
        these = [c for c in found if c.kind == kind]
        if len(these) > limit:
            rows.append(_budget_row(kind, f"<= {limit}", str(len(these)), these))
    total = sum(c.bytes for c in found)
    if max_bytes is not None and total > max_bytes:
        rows.append(
            _budget_row(
                "bytes",
                f"<= {_bytes(max_bytes)}",
                _bytes(total),
                list(found),
            )
        )
    return tuple(rows)


def _budget_row(what: str, expected: str, actual: str, culprits: list) -> Row:
    groups = most_bytes(tuple(culprits))
    listed = "; ".join(describe(c, n) for c, n in groups[:5])
    rest = sum(n for _, n in groups[5:])
    more = f" (and {rest} more)" if rest else ""
    # `actual` is "400.0 MiB" for bytes, "3" for a kind of collective
    noun = "bytes moved per device" if what == "bytes" else f"{what}s"
    said = "moved per device" if what == "bytes" else noun
    return _over_budget(
        f"collectives: {what}",
        expected,
        actual,
        f"{actual} {said}, over the budget of {expected}: {listed}{more}.",
        annotation=f"max {noun} {expected}",
    )


# --- the program's measures ---------------------------------------------------------

GiB = 1 << 30

# HBM per TPU chip, by the device kind JAX reports, from Google Cloud's TPU
# documentation ("TPU versions"): v4 32 GiB, v5e 16 GiB, v5p 95 GiB, v6e (Trillium)
# 32 GiB. A topology whose chips list two devices each (v4) halves it per device.
HBM_PER_CHIP = {
    "TPU v4": 32 * GiB,
    "TPU v5 lite": 16 * GiB,
    "TPU v5": 95 * GiB,
    "TPU v6 lite": 32 * GiB,
}


def hbm_per_device(mesh: Any) -> int | None:
    """The HBM of one device of `mesh`, or `None` off TPUs (or for an unknown
    generation)."""
    devices = list(mesh.devices.flat)
    per_chip = HBM_PER_CHIP.get(getattr(devices[0], "device_kind", ""))
    if per_chip is None:
        return None
    chips = {tuple(getattr(d, "coords", (i,))) for i, d in enumerate(devices)}
    return per_chip * len(chips) // len(devices)


def _memory(compiled: Any, mesh: Any = None) -> Memory | None:
    try:
        stats = compiled.memory_analysis()
    except Exception:  # not every backend implements it
        return None
    if stats is None:
        return None
    out = Memory(
        arguments=stats.argument_size_in_bytes,
        outputs=stats.output_size_in_bytes,
        temporaries=stats.temp_size_in_bytes,
        aliased=stats.alias_size_in_bytes,
        code=stats.generated_code_size_in_bytes,
    )
    out["total"] = out.arguments + out.outputs + out.temporaries - out.aliased
    out["hbm_bytes"] = None if mesh is None else hbm_per_device(mesh)
    out["headroom"] = None if out.hbm_bytes is None else out.hbm_bytes - out.total
    return out


def _flops(compiled: Any) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:
        return None
    if isinstance(cost, list):  # older jax: one dict per program
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    return float(cost["flops"])
