"""Golden snapshots of `jaxshard.verify`'s report: what `report.save(path)` writes and
what `verify(..., against=path)` compares.

A snapshot is sorted JSON with nothing that changes from run to run (no times, no
addresses): every input's and output's layout in JAX's notation
(`bfloat16[4096@fsdp,32@tp]`), every contract's verdict, the collectives per kind
(count, bytes, and the functions and mesh axes they came from) and the memory per
device. Counts, layouts and verdicts must match exactly; bytes may grow by the
tolerance. What the page of `report.html()` draws besides (the violations, each
array's spec and bytes, the collectives by line of code: `view`) is kept too, and
not compared: lines of code move with every edit.
"""

import json
import os
from collections import Counter
from typing import Any

from jax.sharding import NamedSharding

from .._annotations.spec import format_spec, sharded_type
from .._sharding.describe import describe_bytes, describe_devices, describe_sharding
from . import schema
from .files import write_text
from .view import view


FORMAT = 1
MEMORY = ("arguments", "outputs", "temporaries", "aliased", "total")  # not "code"


def snapshot(report: Any) -> dict:
    """The report as plain, stable data."""
    collectives: dict[str, dict] = {}
    for c in report.collectives:
        entry = collectives.setdefault(
            c.kind, {"count": 0, "bytes": 0, "axes": {}, "functions": {}}
        )
        entry["count"] += 1
        entry["bytes"] += c.bytes
        for key, value in (("axes", _axes(c)), ("functions", _function(c))):
            entry[key][value] = entry[key].get(value, 0) + 1
    contracts = [
        {
            "function": row.function or "",
            "value": row.name or "",
            "expected": format_spec(row.expected),
            "actual": row.actual_spec,
            "type": row.actual_type or row.array,
            "ok": row.ok,
            # Inside a shard_map body: the block a device holds (not compared).
            **({"block": row.block} if row.block else {}),
        }
        for row in report.rows
        if row.budget is None
    ]
    contracts = {json.dumps(c, sort_keys=True): c for c in contracts}.values()
    order = ("function", "value", "expected", "type", "actual", "ok")
    memory = report.memory
    return {
        "jaxshard_snapshot": FORMAT,
        "function": report.function,
        # A string keeps the axes in order (the keys of a JSON object are sorted).
        "mesh": ",".join(f"{k}={v}" for k, v in report.mesh.shape.items()),
        "axis_types": [t.name for t in report.mesh.axis_types],
        "devices": describe_devices(report.mesh),
        "inputs": {k: layout(v) for k, v in report.inputs.items()},
        "outputs": {k: layout(v) for k, v in report.outputs.items()},
        "contracts": sorted(contracts, key=lambda c: [str(c[k]) for k in order]),
        "collectives": collectives,
        "memory": None if memory is None else {k: memory[k] for k in MEMORY},
        **view(report),
    }


def dumps(data: dict) -> str:
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def save(report: Any, path: str | os.PathLike) -> None:
    """Writes the report's snapshot to `path`, whole or not at all (`files`)."""
    write_text(path, dumps(snapshot(report)))


def load(path: str | os.PathLike, what: str = "jaxshard.verify") -> dict:
    """A snapshot written by `report.save`; a clear error for anything else."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{what}: there is no snapshot at {path}. Write one first, from a "
            "report you trust: `report.save(path)` (or `--snapshot PATH` on the "
            "command line)."
        )
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    # ValueError: a number of more than 4300 digits; RecursionError: [[[[...]]]]
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"{what}: cannot read the snapshot {path}: {e}") from None
    if not isinstance(data, dict) or "jaxshard_snapshot" not in data:
        raise ValueError(
            f"{what}: {path} is not a jaxshard snapshot (one written by "
            "`report.save(path)` or `--snapshot PATH`)."
        )
    found = data["jaxshard_snapshot"]
    if type(found) is not int or found != FORMAT:  # `true` is no format
        raise ValueError(
            f"{what}: the snapshot {path} has format {json.dumps(found)[:20]}; this "
            f"jaxshard reads format {FORMAT}. Write it again with `report.save(path)`."
        )
    if wrong := schema.problem(data):
        raise ValueError(
            f"{what}: the snapshot {path} is malformed: {wrong}. Write it again from "
            "a report: `report.save(path)` (or `--snapshot PATH` on the command line)."
        )
    return data


def differences(
    report: Any, old: dict, tolerance: float = 0.05
) -> list[tuple[str, str, str, str]]:
    """How `report` differs from the snapshot `old`: one `(what, was, now, sentence)`
    per difference, in the snapshot's order. Memory and bytes moved may grow by
    `tolerance` (a fraction) and may shrink freely; everything else must match."""
    new = snapshot(report)
    found = []
    for key in ("mesh", "axis_types", "devices"):
        if old.get(key) != new[key]:
            found.append(
                (
                    key.replace("_", " "),
                    str(old.get(key)),
                    str(new[key]),
                    f"the snapshot was taken on {_mesh(old)}, this program is "
                    f"compiled for {_mesh(new)}: the rest cannot be compared. Compare "
                    "with a snapshot of the same mesh, or save a new one.",
                )
            )
            return found
    for side in ("inputs", "outputs"):
        found += _layouts(side, old.get(side, {}), new[side])
    found += _contracts(old.get("contracts", []), new["contracts"])
    found += _collectives(old.get("collectives", {}), new["collectives"], report)
    for kind, now in sorted(new["collectives"].items()):
        was = old.get("collectives", {}).get(kind, {}).get("bytes", 0)
        if was and (grew := _grew(was, now["bytes"], tolerance)):
            found.append(
                (
                    f"collectives: {kind} bytes",
                    describe_bytes(was),
                    describe_bytes(now["bytes"]),
                    f"{kind}s move {describe_bytes(now['bytes'])} per device, "
                    f"{describe_bytes(was)} in the snapshot: {grew}.",
                )
            )
    was, now = old.get("memory"), new["memory"]
    if was and now and (grew := _grew(was["total"], now["total"], tolerance)):
        parts = ", ".join(
            f"{k} {describe_bytes(was[k])} -> {describe_bytes(now[k])}"
            for k in ("arguments", "outputs", "temporaries")
        )
        found.append(
            (
                "memory per device",
                describe_bytes(was["total"]),
                describe_bytes(now["total"]),
                f"the program needs {describe_bytes(now['total'])} per device, "
                f"{describe_bytes(was['total'])} in the snapshot: {grew} ({parts}).",
            )
        )
    return found


# --- the parts ----------------------------------------------------------------------


def _changed(old: dict, new: dict) -> list[tuple[Any, Any, Any]]:
    """`(key, was, now)` for each key whose value differs (`None` where absent)."""
    keys = sorted(old.keys() | new.keys())
    return [(k, old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)]


def _layouts(side: str, old: dict, new: dict) -> list:
    value = side[:-1]  # "input", "output"
    found = []
    for name, was, now in _changed(old, new):
        if was is None:
            sentence = f"a new {value}, {now}."
        elif now is None:
            sentence = f"the {value} ({was}) is gone."
        else:
            sentence = f"was {was}, now {now}{_replicated(was, now)}."
        found.append((f"{value} {name}", str(was), str(now), sentence))
    return found


def _replicated(was: str, now: str) -> str:
    if "@" in was and "@" not in now:
        return ": every device now holds all of it (replicated)"
    if "@" in now and "@" not in was:
        return ": it is now split over devices"
    return ""


def _contracts(old: list, new: list) -> list:
    """Contracts are matched by function and value; one may have several
    annotations or verdicts (a function called with different shapes)."""

    def verdicts(contracts: list) -> dict[tuple, str]:
        out: dict[tuple, list] = {}
        for c in contracts:
            state = "holds" if c["ok"] else "VIOLATED"
            verdict = f"expects {c['expected']}: {c['type']} ({state})"
            out.setdefault((c["function"], c["value"]), []).append(verdict)
        return {k: "; ".join(sorted(v)) for k, v in out.items()}

    found = []
    for (function, value), a, b in _changed(verdicts(old), verdicts(new)):
        if a is None:
            sentence = f"a new contract, which {b}."
        elif b is None:
            sentence = f"no longer checked; it {a}."
        else:
            sentence = f"was: {a}; now: {b}."
        what = f"contract {function + ', ' if function else ''}{value}"
        found.append((what, a or "absent", b or "absent", sentence))
    return found


def _collectives(old: dict, new: dict, report: Any) -> list:
    """Counts per kind and mesh axes must match. Which function a collective is
    attributed to only describes a new one: JAX versions attribute differently."""
    found = []
    for kind in sorted(old.keys() | new.keys()):
        a = old.get(kind, {"count": 0, "axes": {}})
        b = new.get(kind, {"count": 0, "axes": {}})
        if a["count"] == b["count"] and a["axes"] == b["axes"]:
            continue
        added = Counter(b["axes"]) - Counter(a["axes"])
        removed = Counter(a["axes"]) - Counter(b["axes"])
        # The places that are new: those of the functions with more of this kind
        # than the snapshot's (all of this kind's, if none has more).
        grown = Counter(b.get("functions", {})) - Counter(a.get("functions", {}))
        parts = []
        for axes, n in sorted(added.items()):
            these = [
                c for c in report.collectives if c.kind == kind and _axes(c) == axes
            ]
            new_ones = [c for c in these if _function(c) in grown] or these
            # A place with many alike (a layer of a loop) is one, with its count.
            places = sorted(Counter(c.where for c in new_ones).items())
            lines = [f"{where} ×{k}" if k > 1 else where for where, k in places]
            at = f", at {', '.join(lines[:3])}" if lines else ""
            more = f" and {len(lines) - 3} more places" if len(lines) > 3 else ""
            parts.append(f"{n} more over {axes}{at}{more}")
        parts += [f"{n} fewer over {axes}" for axes, n in sorted(removed.items())]
        found.append(
            (
                f"collectives: {kind}",
                str(a["count"]),
                str(b["count"]),
                f"{a['count']} in the snapshot, {b['count']} now: "
                + "; ".join(parts)
                + ".",
            )
        )
    return found


def _grew(was: int, now: int, tolerance: float) -> str:
    """How much `now` grew over `was`, as words, if by more than `tolerance`."""
    if now <= was * (1 + tolerance):
        return ""
    by = "from nothing" if not was else f"by {now / was - 1:.1%}"
    return f"grown {by}, more than the tolerance ({tolerance:.0%})"


def _axes(c: Any) -> str:
    return "(unknown axes)" if c.axes is None else ",".join(c.axes) or "(no axes)"


def _function(c: Any) -> str:
    return c.function or "(unknown)"


def layout(value: Any) -> str:
    """A `jax.ShapeDtypeStruct`'s layout in JAX's notation, `float32[8@dp,4]`."""
    sharding = value.sharding
    if isinstance(sharding, NamedSharding):
        return sharded_type(value.dtype, value.shape, sharding.spec)
    return (
        sharded_type(value.dtype, value.shape, ())
        + f" ({describe_sharding(sharding, len(value.shape))})"
    )


def _mesh(data: dict) -> str:
    types = "/".join(sorted(set(data.get("axis_types") or ())))
    return f"mesh {data.get('mesh')} ({types} axes) of {data.get('devices')}"
