"""What `jaxshard.verify` returns: the report of every contract, the compiled
program's memory, FLOPs and collectives (the budgets are in `budgets`)."""

import dataclasses
import functools as ft
import json
import os
from collections.abc import Mapping
from typing import Any

from jax.sharding import NamedSharding, PartitionSpec

from .._annotations.spec import format_spec
from .._errors import expect
from .._sharding.describe import (
    describe_bytes as _bytes,
    describe_devices,
    describe_mesh,
    describe_sharding,
    subject,
)
from .._sharding.summary import array_row, ArrayRow, largest_first, table
from . import snapshot as _snapshot
from .collectives import (
    Collective,
    collectives,
    describe,
    KINDS,
    most_bytes,
    summary,
)


@dataclasses.dataclass(frozen=True)
class Row:
    """One sharding contract, and what XLA made of it.

    **Attributes:**

    - `function`: the checked function's qualified name, e.g. `"mlp"` or
        `"Block.__call__"` (`None` for an `isinstance` check outside any).
    - `name`: the parameter, a path into it (`"params.w1"`), or `"return"`.
    - `expected`: the annotation's `PartitionSpec`.
    - `actual`: the sharding the value has in the compiled program (after sharding
        propagation on Auto meshes; from the type on Explicit meshes); inside a
        `shard_map` body, the global array's `PartitionSpec` (see `block`), or
        for a block that differs over a mesh axis its annotation does not name,
        a text saying so (`"P('dp', None), differing over tp"`).
    - `ok`: whether the two agree.
    - `reason`: what is wrong, as a sentence; `""` when `ok`.
    - `annotation`, `array`: the annotation and the value's dtype and shape, as text.
    - `expected_type`, `actual_type`: the expected and the actual layout in JAX's
        notation for sharded types, e.g. `"float32[8@dp,4]"` (`""` for a budget).
    - `call`: for a violation, which call of the function it happened in and the
        annotated calls around it, e.g. `"Block.__call__ #5 of 8 (in
        Decoder.__call__)"`; `""` for a contract that holds (its row stands for
        every call).
    - `source`: where the annotated function is defined, `"model.py:42"` (`""` for
        a budget).
    - `block`: inside a `shard_map` body, the block one device holds,
        `"float32[16,32]"`; `array`, `actual` and the types are then the global
        array's, which the annotation describes (`""` elsewhere).
    """

    function: str | None
    name: str | None
    expected: PartitionSpec
    actual: Any
    ok: bool
    reason: str
    annotation: str
    array: str
    call: str = ""
    types: tuple[str, str] = ("", "")  # expected_type, actual_type
    budget: tuple[str, str] | None = None  # (limit, found) of a collective budget
    source: str = ""
    block: str = ""

    @property
    def expected_type(self) -> str:
        return self.types[0]

    @property
    def actual_type(self) -> str:
        return self.types[1]

    @property
    def actual_spec(self) -> str:
        if self.budget is not None:
            return self.budget[1]
        return _describe(self.actual, self.expected)


def _describe(sharding: Any, expected: PartitionSpec) -> str:
    if isinstance(sharding, str):  # a shard_map block that is no global array
        return sharding
    if isinstance(sharding, (NamedSharding, PartitionSpec)):
        spec = list(getattr(sharding, "spec", sharding))
        spec += [None] * max(0, len(expected) - len(spec))
        while len(spec) > len(expected) and spec[-1] is None:
            spec.pop()
        return format_spec(PartitionSpec(*spec))
    return describe_sharding(sharding, len(expected))


class Memory(dict):
    """Bytes per device of the compiled program (from `memory_analysis()`), as a dict
    with keys `arguments`, `outputs`, `temporaries`, `aliased`, `code` and `total`
    (arguments + outputs + temporaries - aliased), also readable as attributes;
    `hbm_bytes`, the memory of one device of the mesh's TPU generation (`None` on
    other devices), and `headroom`, what is left of it (`None` likewise)."""

    def __getattr__(self, name: str) -> int:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclasses.dataclass(frozen=True)
class Report:
    """What `jaxshard.verify` found.

    **Attributes:**

    - `function`: the verified function's name.
    - `mesh`: the mesh it was compiled for.
    - `rows`: one `Row` per contract, in the order the checks were traced; a contract
        checked several times with the same outcome (a layer called in a loop) is one
        row.
    - `violations`: the rows that failed; `ok`: whether there are none.
    - `memory`: a `Memory`, the compiled program's bytes per device, with the HBM of
        a device of the mesh's TPU generation and the headroom; `fits`: whether the
        program fits in it (`None` off TPUs).
    - `flops`: the compiled program's floating-point operations per device, from
        `cost_analysis()` (`None` where XLA gives none).
    - `compiled`: the `jax.stages.Compiled` program; `None` for a report from
        verify's cache (`jaxshard.config(cache_dir=...)`), or for a program XLA
        refused for not fitting in HBM.
    - `collectives`: every collective of the compiled program, in program order, as
        `jaxshard.Collective`s (kind, bytes per device, mesh axes, and the line of
        your code it came from); `collective_bytes`: their bytes per kind.
        `check_collectives`: those jaxshard's value checks add to combine their
        findings across devices, left out of `collectives`, the budgets and the
        snapshot (adding a check changes none of them).
    - `inputs`, `outputs`: every input and output array of the compiled program, by
        its path (`"params.wq"`, `"return['loss']"`), as a `jax.ShapeDtypeStruct`
        with the sharding XLA gave it.
    - `arrays`: the inputs as `jaxshard.ArrayRow`s (path, shape, dtype, spec, bytes
        per device), largest per device first: which arrays dominate each device's
        memory.
    - `against`: the snapshot it was compared with (`verify(..., against=path)`),
        or `None`.

    `str(report)` is a table; `report.to_dict()` is plain data, for JSON;
    `report.save(path)` writes a golden snapshot, which `report.compare(path)` (or
    `verify(..., against=path)`) checks a later report against. `report.html()` is
    a page to look at, and a report is drawn as one in a notebook.
    """

    function: str
    mesh: Any
    rows: tuple[Row, ...]
    memory: Memory | None
    flops: float | None
    compiled: Any = dataclasses.field(repr=False, compare=False)
    inputs: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    outputs: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    notes: tuple[str, ...] = ()  # what was left out of the program, and why
    against: str | None = None

    def html(self) -> str:
        """The report as one self-contained HTML page (no network, no external
        scripts or fonts): the verdict and every violation with its source line, how
        each input is laid out over the mesh's axes, memory per device against the
        HBM, the collectives by line of code, what changed since the snapshot, and
        every table, searchable and sortable. A view of the data `save` writes:
        `python -m jaxshard show SNAPSHOT --html PAGE` draws a saved one."""
        from . import html

        return html.page(_snapshot.snapshot(self))

    def save_html(self, path: str | os.PathLike) -> None:
        """Writes `html()` to `path`, e.g. as a CI job's artifact."""
        from . import html

        html.write(html.page(_snapshot.snapshot(self)), path)

    def _repr_html_(self) -> str:
        """A notebook (Jupyter, Colab) draws the report as `html()` does."""
        from . import html

        return html.fragment(_snapshot.snapshot(self))

    def save(self, path: str | os.PathLike) -> None:
        """Writes the report's golden snapshot to `path` (JSON): every input's and
        output's layout, every contract's verdict, the collectives per kind and the
        memory per device, sorted, with nothing that changes between runs (no
        times or addresses); and what `html()` draws (the violations, the
        collectives by line of code), which is not compared. Commit it, and check
        later reports against it with `verify(..., against=path)`."""
        _snapshot.save(self, path)

    def compare(
        self, snapshot: str | os.PathLike, *, tolerance: float = 0.05
    ) -> tuple[Row, ...]:
        """How this report differs from the snapshot at `snapshot` (written by
        `save`), as violated rows, each naming what changed: an input or output's
        layout, a contract's verdict, a collective's count or where it comes from,
        more bytes moved or more memory per device than the snapshot's plus
        `tolerance` (a fraction: 0.05 allows 5% growth). Empty when nothing did."""
        _check_tolerance(tolerance)
        old = _snapshot.load(snapshot, "jaxshard: report.compare")
        return self._differences(old, snapshot, tolerance)

    def _differences(
        self, old: dict, path: str | os.PathLike, tolerance: float
    ) -> tuple[Row, ...]:
        """`compare` against the snapshot `old`, already read from `path`."""
        return tuple(
            _over_budget(
                f"snapshot: {what}",
                was,
                now,
                sentence,
                annotation=f"as in the snapshot {os.fspath(path)}",
            )
            for what, was, now, sentence in _snapshot.differences(self, old, tolerance)
        )

    @property
    def fits(self) -> bool | None:
        """Whether the program fits in one device's HBM (`None` when unknown)."""
        if self.compiled is None and self.memory is None:  # XLA refused it
            return False
        if self.memory is None or self.memory.hbm_bytes is None:
            return None
        return self.memory.total <= self.memory.hbm_bytes

    @ft.cached_property
    def _every_collective(self) -> tuple[Collective, ...]:
        if self.compiled is None:  # XLA refused to compile it
            return ()
        return collectives(self.compiled.as_text(), self.mesh)

    @property
    def collectives(self) -> tuple[Collective, ...]:
        return tuple(c for c in self._every_collective if not c.from_checks)

    @property
    def check_collectives(self) -> tuple[Collective, ...]:
        return tuple(c for c in self._every_collective if c.from_checks)

    @property
    def collective_bytes(self) -> dict[str, int]:
        return summary(self.collectives)

    @ft.cached_property
    def arrays(self) -> tuple[ArrayRow, ...]:
        return largest_first(
            array_row(path, v.shape, v.dtype, v.sharding)
            for path, v in self.inputs.items()
        )

    @property
    def violations(self) -> tuple[Row, ...]:
        return tuple(row for row in self.rows if not row.ok)

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_dict(self) -> dict:
        return {
            "function": self.function,
            "mesh": dict(self.mesh.shape),
            "devices": describe_devices(self.mesh),
            "ok": self.ok,
            "rows": [
                {
                    "function": r.function,
                    "name": r.name,
                    "array": r.array,
                    **({"block": r.block} if r.block else {}),
                    "expected": r.budget[0] if r.budget else format_spec(r.expected),
                    "actual": r.actual_spec,
                    "expected_type": r.expected_type,
                    "actual_type": r.actual_type,
                    "ok": r.ok,
                    "reason": r.reason,
                }
                for r in self.rows
            ],
            "inputs": {k: _snapshot.layout(v) for k, v in self.inputs.items()},
            "arrays": [r.to_dict() for r in self.arrays],
            "outputs": {k: _snapshot.layout(v) for k, v in self.outputs.items()},
            "memory": None if self.memory is None else dict(self.memory),
            "flops": self.flops,
            "collectives": [_collective(c) for c in self.collectives],
            "check_collectives": [_collective(c) for c in self.check_collectives],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False)

    def __str__(self) -> str:
        head = (
            f"jaxshard.verify: {self.function} on mesh {describe_mesh(self.mesh)}, "
            f"{describe_devices(self.mesh)}"
        )
        table = [("function", "value", "expected", "actual", "as a JAX type", "")]
        for r in self.rows:
            table.append(
                (
                    r.call or r.function or ("" if r.budget else "(isinstance)"),
                    r.name or "",
                    r.budget[0] if r.budget else format_spec(r.expected),
                    r.actual_spec,
                    _jax_type(r),
                    "ok" if r.ok else "VIOLATED",
                )
            )
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines = [head, ""]
        for i, row in enumerate(table):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths).rstrip())
        if not self.rows:
            lines.append("(no sharding contracts were checked)")
        lines.append("")
        if self.violations:
            lines.append(tally(self.violations, self.rows) + ":")
            lines += [f"- {_violation(r)}" for r in self.violations]
        else:
            lines.append(f"All {len(self.rows)} contracts hold.")
        if self.memory is not None:
            m = self.memory
            lines.append(
                f"Memory per device: arguments {_bytes(m.arguments)}, outputs "
                f"{_bytes(m.outputs)}, temporaries {_bytes(m.temporaries)}, total "
                f"{_bytes(m.total)}"
                + (
                    "."
                    if m.hbm_bytes is None
                    else f", of {_bytes(m.hbm_bytes)} of HBM ("
                    + (
                        f"{_bytes(m.headroom)} to spare)."
                        if m.headroom >= 0
                        else f"{_bytes(-m.headroom)} too much: it does not fit)."
                    )
                )
            )
        if self.flops is not None:
            lines.append(f"FLOPs per device: {self.flops:.3g}.")
        lines += _describe_arrays(self.arrays)
        lines += _describe_collectives(self.collectives)
        if self.check_collectives:
            lines.append(
                "Collectives from jaxshard's value checks (left out of the budgets "
                f"and the snapshot): {_per_kind(self.check_collectives)}."
            )
        lines += self.notes
        return "\n".join(lines)


def _collective(c: Collective) -> dict:
    axes = None if c.axes is None else list(c.axes)
    return {"kind": c.kind, "bytes": c.bytes, "axes": axes, "where": c.where}


def _per_kind(found: tuple[Collective, ...]) -> str:
    """`all-gather 18 (144.0 MiB), all-reduce 2 (256.0 MiB)`."""
    counts = {k: sum(c.kind == k for c in found) for k in KINDS}
    totals = summary(found)
    return ", ".join(
        f"{k} {counts[k]} ({_bytes(totals[k])})" for k in KINDS if counts[k]
    )


def _describe_collectives(found: tuple[Collective, ...]) -> list[str]:
    if not found:
        return ["Collectives: none."]
    lines = [f"Collectives per device: {_per_kind(found)}; the largest:"]
    lines += [f"  {describe(c, n)}" for c, n in most_bytes(found)[:5]]
    return lines


def _describe_arrays(rows: tuple[ArrayRow, ...], shown: int = 5) -> list[str]:
    """The inputs that take the most memory per device, as a table."""
    if not rows:
        return []
    head = (
        f"The largest of the {len(rows)} inputs per device"
        if len(rows) > shown
        else "The inputs per device"
    )
    return [f"{head}:"] + ["  " + line for line in table(rows[:shown])]


def tally(violations: tuple[Row, ...], rows: tuple[Row, ...] = ()) -> str:
    """`2 sharding contracts violated, 1 budget exceeded, 3 differences from the
    snapshot`; given all the rows, `2 of 5 sharding contracts violated, ...`."""
    snapshot = sum(r.name.startswith("snapshot: ") for r in violations if r.budget)
    budgets = sum(r.budget is not None for r in violations) - snapshot
    contracts = len(violations) - budgets - snapshot
    of = sum(r.budget is None for r in rows)
    parts = [
        (contracts, of, "sharding contract", "violated"),
        (budgets, 0, "budget", "exceeded"),
        (snapshot, 0, "difference", "from the snapshot"),
    ]
    return ", ".join(
        f"{n} {f'of {of} ' if of else ''}{noun}{'s' if max(n, of) > 1 else ''} {verb}"
        for n, of, noun, verb in parts
        if n
    )


def _violation(row: Row) -> str:
    if row.budget is not None:
        return f"{row.name}: {row.reason}"
    what = subject(row.function and (row.call or row.function), row.name)
    block = f", inside shard_map a block {row.block} per device" if row.block else ""
    return f"{what} ({row.array}{block}, annotated {row.annotation}): {row.reason}"


def _jax_type(row: Row) -> str:
    """The table's type: inside a shard_map body, the global array's, and the
    block each device holds."""
    shown = row.actual_type or row.array
    return f"{shown}, block {row.block}" if row.block else shown


def _check_tolerance(tolerance: Any) -> None:
    fine = isinstance(tolerance, (int, float)) and not isinstance(tolerance, bool)
    fine = fine and tolerance >= 0
    expect(fine, "verify", "tolerance", "a fraction, 0 or more (0.05 is 5%)", tolerance)


def _over_budget(
    name: str, limit: str, found: str, reason: str, annotation: str
) -> Row:
    """The violated row of a budget (collectives, memory, sharding): `limit` and
    `found` fill the table's expected and actual columns."""
    return Row(
        function=None,
        name=name,
        expected=PartitionSpec(),
        actual=None,
        ok=False,
        reason=reason,
        annotation=annotation,
        array="",
        budget=(limit, found),
    )
