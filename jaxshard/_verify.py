"""`jaxshard.verify`: compile a function for a mesh (a TPU pod's, on a CPU-only machine)
from its annotations, and report every sharding contract with what XLA chose."""

import dataclasses
import functools as ft
import inspect
import json
import os
import re
import sysconfig
import threading
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import _config
from ._abstract import _bound_inputs
from ._array_types import partition_spec
from ._collectives import Collective, collectives, KINDS, summary
from ._decorator import checked_by_jaxshard
from ._errors import (
    AnnotationError,
    expect,
    expect_callable,
    ModelError,
    ShardingError,
    TypeCheckError,
)
from ._jax_internals import function_name, is_sharding_type_error
from ._sharding import (
    call_numbers,
    describe_call,
    describe_mesh,
    describe_sharding,
    naming,
    Site,
)
from ._signature import _name, _tree, signature
from ._spec import format_spec


# --- the report ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    """One sharding contract, and what XLA made of it.

    **Attributes:**

    - `function`: the checked function's qualified name, e.g. `"mlp"` or
        `"Block.__call__"` (`None` for an `isinstance` check outside any).
    - `name`: the parameter, a path into it (`"params.w1"`), or `"return"`.
    - `expected`: the annotation's `PartitionSpec`.
    - `actual`: the sharding the value has in the compiled program (after sharding
        propagation on Auto meshes; from the type on Explicit meshes).
    - `ok`: whether the two agree.
    - `reason`: what is wrong, as a sentence; `""` when `ok`.
    - `annotation`, `array`: the annotation and the value's dtype and shape, as text.
    - `call`: for a violation, which call of the function it happened in and the
        annotated calls around it, e.g. `"Block.__call__ #5 of 8 (in
        Decoder.__call__)"`; `""` for a contract that holds (its row stands for
        every call).
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
    budget: tuple[str, str] | None = None  # (limit, found) of a collective budget

    @property
    def actual_spec(self) -> str:
        if self.budget is not None:
            return self.budget[1]
        return _describe(self.actual, self.expected)


def _describe(sharding: Any, expected: PartitionSpec) -> str:
    if isinstance(sharding, NamedSharding):
        spec = list(sharding.spec)
        spec += [None] * max(0, len(expected) - len(spec))
        while len(spec) > len(expected) and spec[-1] is None:
            spec.pop()
        return format_spec(PartitionSpec(*spec))
    return describe_sharding(sharding, len(expected))


class Memory(dict):
    """Bytes per device of the compiled program (from `memory_analysis()`), as a dict
    with keys `arguments`, `outputs`, `temporaries`, `aliased`, `code` and `total`
    (arguments + outputs + temporaries - aliased), also readable as attributes."""

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
    - `memory`: a `Memory`, the compiled program's bytes per device.
    - `flops`: the compiled program's floating-point operations per device, from
        `cost_analysis()` (`None` where XLA gives none).
    - `compiled`: the `jax.stages.Compiled` program.
    - `collectives`: every collective of the compiled program, in program order, as
        `jaxshard.Collective`s (kind, bytes per device, mesh axes, and the line of
        your code it came from); `collective_bytes`: their bytes per kind.

    `str(report)` is a table; `report.to_dict()` is plain data, for JSON.
    """

    function: str
    mesh: Any
    rows: tuple[Row, ...]
    memory: Memory | None
    flops: float | None
    compiled: Any = dataclasses.field(repr=False, compare=False)

    @ft.cached_property
    def collectives(self) -> tuple[Collective, ...]:
        return collectives(self.compiled.as_text(), self.mesh)

    @property
    def collective_bytes(self) -> dict[str, int]:
        return summary(self.collectives)

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
            "devices": _device_kind(self.mesh),
            "ok": self.ok,
            "rows": [
                {
                    "function": r.function,
                    "name": r.name,
                    "array": r.array,
                    "expected": r.budget[0] if r.budget else format_spec(r.expected),
                    "actual": r.actual_spec,
                    "ok": r.ok,
                    "reason": r.reason,
                }
                for r in self.rows
            ],
            "memory": None if self.memory is None else dict(self.memory),
            "flops": self.flops,
            "collectives": [
                {
                    "kind": c.kind,
                    "bytes": c.bytes,
                    "axes": None if c.axes is None else list(c.axes),
                    "where": c.where,
                }
                for c in self.collectives
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False)

    def __str__(self) -> str:
        head = (
            f"jaxshard.verify: {self.function} on mesh {describe_mesh(self.mesh)}, "
            f"{_device_kind(self.mesh)}"
        )
        table = [("function", "value", "array", "expected", "actual", "")]
        for r in self.rows:
            table.append(
                (
                    r.call or r.function or ("" if r.budget else "(isinstance)"),
                    r.name or "",
                    r.array,
                    r.budget[0] if r.budget else format_spec(r.expected),
                    r.actual_spec,
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
        count = len(self.violations)
        if count:
            lines.append(f"{count} of {len(self.rows)} contracts violated:")
            lines += [f"- {_violation(r)}" for r in self.violations]
        else:
            lines.append(f"All {len(self.rows)} contracts hold.")
        if self.memory is not None:
            m = self.memory
            lines.append(
                f"Memory per device: arguments {_bytes(m.arguments)}, outputs "
                f"{_bytes(m.outputs)}, temporaries {_bytes(m.temporaries)}, total "
                f"{_bytes(m.total)}."
            )
        if self.flops is not None:
            lines.append(f"FLOPs per device: {self.flops:.3g}.")
        lines += _describe_collectives(self.collectives)
        return "\n".join(lines)


def _describe_collectives(found: tuple[Collective, ...]) -> list[str]:
    if not found:
        return ["Collectives: none."]
    counts = {k: sum(c.kind == k for c in found) for k in KINDS}
    totals = summary(found)
    parts = [f"{k} {counts[k]} ({_bytes(totals[k])})" for k in KINDS if counts[k]]
    lines = ["Collectives per device: " + ", ".join(parts) + "; the largest:"]
    for c in sorted(found, key=lambda c: -c.bytes)[:5]:
        axes = "" if c.axes is None else f" over {', '.join(c.axes) or '(none)'}"
        lines.append(f"  {c.kind} {_bytes(c.bytes)}{axes} at {c.where}")
    return lines


def _violation(row: Row) -> str:
    if row.budget is not None:
        return f"{row.name}: {row.reason}"
    function = row.call or row.function
    if row.function is None:
        what = "a value checked with isinstance outside any jaxtyped function"
    elif row.name == "return":
        what = f"{function}, the return value"
    else:
        what = f"{function}, parameter {row.name!r}"
    return f"{what} ({row.array}, annotated {row.annotation}): {row.reason}"


def _device_kind(mesh: Any) -> str:
    devices = mesh.devices.flat
    kind = getattr(devices[0], "device_kind", "?")
    return f"{mesh.devices.size} × {kind}"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


# --- recording ----------------------------------------------------------------------


_SHARDING_IN_TYPE = re.compile(r"@(\([^)]*\)|\w+)")


class Recorder:
    """Collects every sharding check made while `verify` traces and compiles. Checks
    made at compile time report from XLA's threads, hence the lock."""

    def __init__(self, function: Any = None):
        self._lock = threading.Lock()
        self._checks: list[tuple[Site, Any, str]] = []
        self.function = function  # the verified function, left out of call chains

    def next_order(self) -> int:  # the sites' own order is global
        return 0

    def add(self, site: Site, actual: Any, reason: str) -> None:
        with self._lock:
            self._checks.append((site, actual, reason))

    def rows(self) -> tuple[Row, ...]:
        """One row per distinct contract and outcome, in program order; a violation
        also per call it happened in."""
        numbers = call_numbers([site for site, _, _ in self._checks])
        found: dict[tuple, Row] = {}
        for site, actual, reason in sorted(self._checks, key=lambda c: c[0].order):
            row = Row(
                function=_qualname(site.function),
                name=site.name,
                expected=site.spec,
                actual=actual,
                ok=not reason,
                reason=reason,
                annotation=site.annotation,
                array=_SHARDING_IN_TYPE.sub("", site.array),  # the table shows it apart
                call=(
                    describe_call(site, numbers, short=True, within=self.function)
                    if reason
                    else ""
                ),
            )
            key = (row.function, row.name, row.annotation, row.array, row.reason)
            found.setdefault((*key, row.call), row)
        return tuple(found.values())


def _qualname(function: Any) -> str | None:
    return getattr(function, "qualname", function)


def _is_input(value: Any) -> bool:
    return any(
        isinstance(leaf, (jax.ShapeDtypeStruct, jax.Array, np.ndarray))
        for leaf in jax.tree.leaves(value)
    )


def verify(
    fn: Callable,
    *,
    mesh: Any,
    dims: Mapping[str, Any] | None = None,
    dtypes: Any = None,
    values: Mapping[str, Any] | None = None,
    raise_on_error: bool = True,
    max_collectives: Mapping[str, int] | None = None,
    max_collective_bytes: int | None = None,
) -> Report:
    """Compiles `fn` for `mesh` from its annotations and checks every sharding
    contract on the way.

    The inputs are abstract (`jaxshard.abstract_args`): nothing is allocated, so a
    model for a 256-chip pod compiles on a laptop. Every sharding contract met while
    tracing and compiling is checked: `fn`'s own parameters and return value (whether
    or not `fn` is decorated), and those of every `jaxtyped` function it calls. On an
    Explicit mesh the verdict comes from the types at trace time; on an Auto mesh,
    from XLA's sharding propagation. All violations are collected, not only the first.

    **Arguments:**

    - `fn`: the function, e.g. a training step or a model's forward pass (jitted or
        not).
    - `mesh`: the mesh: `jaxshard.tpu_mesh("v5e:16x16", {"dp": 16, "tp": 16})` for a
        TPU pod, or a mesh of simulated CPU devices.
    - `dims`, `dtypes`, `values`: as for `jaxshard.abstract_args`. Values that hold
        no arrays are passed to `fn` as Python values (static).
    - `max_collectives`: a budget of collectives per kind, e.g. `{"all-gather": 0}`
        (kinds: all-gather, all-reduce, reduce-scatter, all-to-all,
        collective-permute). More is a violation, naming the lines they came from.
    - `max_collective_bytes`: a budget of bytes moved per device by all collectives.
    - `raise_on_error`: raise `jaxshard.ShardingError` listing every violation
        (`True`, the default), or return the report either way.

    **Returns:**

    A `Report`: `report.rows`, `report.violations`, `report.ok`, `report.memory`,
    `report.flops`; `print(report)` shows a table.

    !!! Example

        ```python
        mesh = jaxshard.tpu_mesh("v5e:16x16", {"dp": 16, "tp": 16})
        dims = {"batch": 1024, "seqlen": 2048}
        report = jaxshard.verify(forward, mesh=mesh, dims=dims)
        print(report)
        ```
    """
    expect_callable("verify", fn)
    expect(
        isinstance(mesh, Mesh),
        "verify",
        "mesh",
        "a concrete jax.sharding.Mesh (from jaxshard.tpu_mesh or jax.make_mesh)",
        mesh,
    )
    expect(dims is None or isinstance(dims, Mapping), "verify", "dims", "a dict", dims)
    _check_budget(max_collectives, max_collective_bytes)
    given = values is None or isinstance(values, Mapping)
    expect(given, "verify", "values", "a dict", values)
    name = _name(fn)
    what = f"jaxshard.verify({name})"
    bound = _bound_inputs(fn, mesh, dims, dtypes, values, what)
    sig = inspect.signature(inspect.unwrap(fn))
    traced = {k: v for k, v in bound.items() if _is_input(v)}
    static = {k: v for k, v in bound.items() if k not in traced}
    checked = checked_by_jaxshard(fn)
    _, hints = signature(fn)
    target = inspect.unwrap(fn)
    qualname = function_name(target)

    def program(inputs):
        given = {**static, **inputs}
        args, kwargs = [], {}
        order = list(sig.parameters)
        for p in sig.parameters.values():
            if p.name not in given:
                continue
            # Positionally while none is skipped: a jit with in_shardings takes no
            # keyword arguments.
            if (
                p.kind in _POSITIONAL
                and not kwargs
                and len(args) == order.index(p.name)
            ):
                args.append(given[p.name])
            else:
                kwargs[p.name] = given[p.name]
        for p, value in given.items():
            _check_leaves(qualname, p, hints.get(p), value)
        out = checked(*args, **kwargs)
        _check_leaves(qualname, "return", hints.get("return"), out)
        return out

    program.__name__ = program.__qualname__ = name.rsplit(".", 1)[-1]
    recorder = Recorder(qualname)
    with (
        jax.set_mesh(mesh),
        _config.overriding(sharding="check", recorder=recorder),
    ):
        try:
            compiled = jax.jit(program).lower(traced).compile()
        except Exception as e:
            if not is_sharding_type_error(e):
                raise
            raise ModelError(_sharding_type_error(name, mesh, e)) from e
    found = collectives(compiled.as_text(), mesh)
    budget = _budget_rows(found, max_collectives, max_collective_bytes)
    report = Report(
        function=name,
        mesh=mesh,
        rows=recorder.rows() + budget,
        memory=_memory(compiled),
        flops=_flops(compiled),
        compiled=compiled,
    )
    report.__dict__["collectives"] = found  # what the cached property would compute
    if raise_on_error and not report.ok:
        count = len(report.violations)
        error = ShardingError(
            f"{count} sharding contract{'s' if count > 1 else ''} violated when "
            f"{name} was compiled for mesh {describe_mesh(mesh)} "
            f"({_device_kind(mesh)}):\n"
            + "\n".join(f"- {_violation(r)}" for r in report.violations)
        )
        error.report = report  # pyright: ignore[reportAttributeAccessIssue]
        raise error
    return report


def _sharding_type_error(name: str, mesh: Mesh, error: Exception) -> str:
    """What a sharding type error from JAX says, with where in the user's code it
    arose and what to do."""
    where = ""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if _is_user_code(frame.filename):
            line = (frame.line or "").strip()
            where = f" at {frame.filename}:{frame.lineno}, in {frame.name}: `{line}`"
            break
    return (
        f"jaxshard.verify({name}): JAX refused an operation{where}, on mesh "
        f"{describe_mesh(mesh)}: "
        f"{str(error).splitlines()[0]} This is the model's error, not a contract's: "
        "on Explicit axes JAX asks for the sharding of a result it cannot infer. Give "
        "it where JAX asks (e.g. `out_sharding=` or `jax.sharding.reshard`), or verify "
        'on Auto axes (`jaxshard.tpu_mesh(..., axis_types="auto")`, the default; '
        "`--axis-types auto`), where XLA chooses."
    )


def _is_user_code(filename: str) -> bool:
    if filename.startswith("<"):  # generated (beartype's wrappers)
        return False
    path = os.path.abspath(filename)
    return not any(path.startswith(root) for root in _LIBRARY_ROOTS)


# Installed packages (JAX, jaxtyping, beartype, ...), the standard library and jaxshard.
_LIBRARY_ROOTS = tuple(
    os.path.abspath(p) + os.sep
    for p in {*(sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib"))}
) + (os.path.dirname(os.path.abspath(__file__)) + os.sep,)


_POSITIONAL = (
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
)


def _check_budget(max_collectives: Any, max_bytes: Any) -> None:
    accepts = f"a dict of collective kinds ({', '.join(KINDS)}) to counts"
    given = max_collectives is None or isinstance(max_collectives, Mapping)
    expect(given, "verify", "max_collectives", accepts, max_collectives)
    for kind, count in (max_collectives or {}).items():
        if kind not in KINDS:
            raise ValueError(
                f"jaxshard.verify: max_collectives names {kind!r}, which is not a "
                f"collective; the kinds are {', '.join(KINDS)}."
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
    found: tuple[Collective, ...], max_collectives: Any, max_bytes: int | None
) -> tuple[Row, ...]:
    """A violated row for each budget the program's collectives exceed."""
    rows = []
    for kind, limit in (max_collectives or {}).items():
        these = [c for c in found if c.kind == kind]
        if len(these) > limit:
            rows.append(_budget_row(kind, f"<= {limit}", str(len(these)), these))
    total = sum(c.bytes for c in found)
    if max_bytes is not None and total > max_bytes:
        rows.append(
            _budget_row("bytes", f"<= {_bytes(max_bytes)}", _bytes(total), list(found))
        )
    return tuple(rows)


def _budget_row(what: str, expected: str, actual: str, culprits: list) -> Row:
    culprits = sorted(culprits, key=lambda c: -c.bytes)
    listed = "; ".join(
        f"{c.kind} of {_bytes(c.bytes)}"
        + ("" if c.axes is None else f" over {', '.join(c.axes) or '(none)'}")
        + f" at {c.where}"
        for c in culprits[:5]
    )
    more = f" (and {len(culprits) - 5} more)" if len(culprits) > 5 else ""
    noun = "bytes moved per device" if what == "bytes" else f"{what}s"
    return Row(
        function=None,
        name=f"collectives: {what}",
        expected=PartitionSpec(),
        actual=None,
        ok=False,
        reason=f"{actual} {noun}, over the budget of {expected}: {listed}{more}.",
        annotation=f"max {noun} {expected}",
        array="",
        budget=(expected, actual),
    )


class _Leaf:
    def __init__(self, annotation: Any):
        self.annotation = annotation


def _leaf(annotation: Any, where: str, default: Any = None) -> Any:
    del where, default
    if annotation is None or partition_spec(annotation) is None:
        return None
    return _Leaf(annotation)


_leaf.prefixable = True  # pyright: ignore[reportFunctionMemberAccess]


def _check_leaves(function: str, name: str, annotation: Any, value: Any) -> None:
    """Checks the arrays inside a parameter or return value whose annotation fixes a
    tree structure (an equinox Module's fields, say), which typecheckers don't look
    into."""
    if annotation is None:
        return
    try:
        tree = _tree(annotation, _leaf, name)
    except AnnotationError:
        return
    if tree is None or isinstance(tree, _Leaf):
        return  # an array, or no sharded array: the typechecker sees to it

    def check(outer: Any, leaf: Any, subtree: Any) -> None:
        if leaf is None:
            return
        for inner, x in jax.tree_util.tree_flatten_with_path(subtree)[0]:
            here = name + jax.tree_util.keystr((*outer, *inner))
            with naming(function, here):
                if not isinstance(x, leaf.annotation):
                    raise TypeCheckError(
                        f"{function}, {here}: this value ({x!r}) does not match its "
                        f"annotation {leaf.annotation!r}."
                    )

    try:
        jax.tree_util.tree_map_with_path(
            check, tree, value, is_leaf=lambda x: x is None
        )
    except ValueError:
        pass  # the value's structure differs: the typechecker reports it


def _memory(compiled: Any) -> Memory | None:
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
