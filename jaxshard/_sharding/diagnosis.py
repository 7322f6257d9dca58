"""From a program's violated contracts to their likely cause.

One wrong layout usually breaks many contracts: XLA propagates it through every layer
that follows (and, on Auto axes, back through those before). `report` picks the
likely cause, says why it is the likely one, and summarises the violations that
follow the same layout instead of repeating each in full.

Where the layouts of the program's inputs are known (the arguments of the `jax.jit`
call that compiles it, `jaxshard.verify`'s inputs, `jaxshard.checked`'s arguments), a
weight laid out unlike the same weight in the other layers comes first (`siblings`).
Then the first value laid out wrong, in program order, and where it was made: a
parameter of a call was made by its caller, whose own parameters (checked before)
conform; a return value was made inside its function, whose parameters conform.
"""

import dataclasses
import inspect
import re
from collections.abc import Iterable
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .._annotations.spec import format_spec, padded
from .boxes import unboxed_paths
from .describe import value_name
from .sites import call_numbers


def _short(function: Any) -> str:
    return str(getattr(function, "qualname", function))


def _layout(violation: Any) -> tuple[str, str]:
    """The layout a violation found and the one expected, as specs."""
    actual = violation.actual
    ndim = len(violation.site.shape)
    if isinstance(actual, NamedSharding):
        return format_spec(padded(actual.spec, ndim)), format_spec(violation.site.spec)
    return repr(actual), format_spec(violation.site.spec)


def _calls(numbers: dict, site: Any) -> tuple[str, int]:
    """`(function, k)`: the innermost jaxtyped call of `site`, and which call of it."""
    if not site.calls:
        return _short(site.function), 1
    function, token = site.calls[-1]
    return _short(function), numbers.get(token, (1, 1))[0]


def _numbers(ks: Iterable[int]) -> str:
    """`#1–#4`, `#1, #3`."""
    ks = sorted(set(ks))
    runs: list[list[int]] = []
    for k in ks:
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return ", ".join(f"#{r[0]}" if len(r) == 1 else f"#{r[0]}–#{r[-1]}" for r in runs)


def _why(first: Any, sites: list, numbers: dict, inputs: list | None = ()) -> str:
    """Where the first value laid out wrong was made. `inputs` are the program's
    input arrays, `(path, array)`, if known."""
    site = first.site
    before = [s for s in sites if s.order < site.order]
    if site.name == "return":
        token = site.calls[-1][1] if site.calls else None
        own = [
            s for s in before if s.calls and s.calls[-1][1] == token and s is not site
        ]
        conform = "conform" if own else "state no layout"
        return (
            f"made inside {first.call.split(' (in ')[0]}, whose parameters {conform}: "
            "the layout changes there, in an operation or a weight it uses"
        )
    if len(site.calls) >= 2:
        function, token = site.calls[-2]
        k, n = numbers.get(token, (1, 1))
        caller = _short(function) + (f" #{k} of {n}" if n > 1 else "")
        own = [s for s in before if s.calls and s.calls[-1][1] == token]
        conform = "conform" if own else "state no layout"
        return (
            f"made by {caller}, whose own parameters {conform}, and passed on: the "
            "layout changes in its code before that call"
        )
    if inputs and not any(_laid_out_as(a, first) for _, a in inputs):
        # A parameter of the outermost annotated call that no input of the program
        # is: a loop's carry, a slice of a stacked weight, a value of unannotated code.
        return (
            "made inside the program, before the call, as no input of the program is "
            "laid out so: look at the operations and weights that make it (for a "
            "loop's carry, at the loop's body too)"
        )
    return "given to the program laid out so: look at what is passed in"


def _laid_out_as(array: Any, violation: Any) -> bool:
    """Whether a program's input has the shape and the layout a violation found."""
    sharding = getattr(array, "sharding", None)
    if tuple(getattr(array, "shape", ())) != tuple(violation.site.shape):
        return False
    if not isinstance(sharding, NamedSharding):
        return True  # not known to differ
    ndim = len(violation.site.shape)
    return format_spec(padded(sharding.spec, ndim)) == _layout(violation)[0]


@dataclasses.dataclass(frozen=True)
class _Item:
    """One violation, as the message shows it."""

    line: str  # in full
    layout: tuple[str, str]  # the spec found, the spec expected
    function: str  # the innermost annotated call's function, short
    k: int  # which call of it
    n: int  # how many calls of it the program makes
    value: str  # "parameter 'x'", "the return value"


def report(violations: list, sites: list, head: str, inputs: list | None = ()) -> str:
    """The message for the violations of one program (in program order, each with
    its call described): `head`, the likely cause in full, then the rest. `inputs`
    are the program's input arrays, `(path, array)`: one laid out unlike its
    siblings comes first."""
    numbers = call_numbers(sites + [v.site for v in violations])
    items = []
    for v in violations:
        function, k = _calls(numbers, v.site)
        n = numbers.get(v.site.calls[-1][1], (1, 1))[1] if v.site.calls else 1
        items.append(_Item(str(v), _layout(v), function, k, n, value_name(v.site.name)))
    why = _why(violations[0], sites, numbers, inputs)
    notes = list(dict.fromkeys(v.site.note for v in violations if v.site.note))
    if inputs is None and len(items) > 1:
        notes.append(_UNREAD)
    return _compose(items, head, inputs or [], why, notes)


_UNREAD = (
    "The layouts of the program's inputs could not be read (it was compiled ahead "
    "of a call, by `.lower(...).compile()`), so no weight laid out unlike the same "
    "weight in the other layers was looked for: compile it by calling it to have "
    "one named."
)


_CALL = re.compile(r"^(?P<function>[^ ]+?)(?: #(?P<k>\d+) of (?P<n>\d+))?(?: \(in |$)")


def report_rows(rows: list, head: str, inputs: list, line: Any) -> str:
    """The same for the violated rows of `jaxshard.verify`'s report (`line(row)`
    gives one in full); the budgets' rows follow the contracts'."""
    items, budgets = [], []
    for row in rows:
        if row.budget is not None:
            budgets.append(f"- {line(row)}")
            continue
        m = _CALL.match(row.call or str(row.function or ""))
        function = m["function"] if m else str(row.function)
        k, n = (int(m["k"]), int(m["n"])) if m and m["k"] else (1, 1)
        layout = (row.actual_spec, format_spec(row.expected))
        items.append(_Item(line(row), layout, function, k, n, value_name(row.name)))
    if not items:
        return "\n".join([head + ":", *budgets])
    return _compose(items, head, inputs, "", budgets)


def _compose(items: list, head: str, inputs: list, why: str, tail: list) -> str:
    """The message: `head`, then the likely cause on the same first line (a weight
    laid out unlike its siblings, else the first value laid out wrong), then each
    violation in full or summarised, then `tail`."""
    first, rest = items[0], items[1:]
    odd = siblings(inputs)
    found, expected = first.layout
    several = f" #{first.k} of {first.n}" if first.n > 1 else ""
    value = f"{first.function}{several}, {first.value}"
    if odd:
        path, spec, common, count, who = odd[0]
        lines = [
            f"{head}: the likely cause is {path}, laid out {spec} where {count} of "
            f"its siblings ({who}) are {common}."
        ]
        if len(odd) > 1:
            lines.append(
                outliers_note(odd[1:], head="Also laid out unlike its siblings:")
            )
        made = f" ({why})" if why else ""
        lines.append(f"The first value laid out wrong in program order{made}:")
    elif rest:
        lines = [
            f"{head}: the likely cause is the first value laid out wrong in program "
            f"order, {value}, {found} where the annotation expects {expected}."
        ]
        lines.append(f"It was {why}:" if why else "In full:")
    else:
        return "\n".join(
            [f"{head}: {value} is {found} where the annotation expects {expected}:"]
            + [f"- {first.line}", *tail]
        )
    lines.append(f"- {first.line}")
    same = [i for i in rest if i.layout == first.layout]
    other = [i for i in rest if i.layout != first.layout]
    if same:
        lines.append(
            f"{len(same)} more {'values are' if len(same) > 1 else 'value is'} laid "
            f"out the same way, {found} where the annotation expects {expected}, and "
            "may follow from it:"
        )
        lines += _grouped(same)
    if other:
        lines.append(
            f"{len(other)} more {'values are' if len(other) > 1 else 'value is'} laid "
            "out otherwise:"
        )
        lines += [f"- {i.line}" for i in other]
    return "\n".join(lines + tail)


def _grouped(items: list) -> list[str]:
    """`- Mlp.__call__ #1–#4: parameter 'x', the return value`, a line per
    function, in the order they first appear."""
    by_function: dict[str, dict[str, list[int]]] = {}
    several: dict[str, bool] = {}
    for i in items:
        names = by_function.setdefault(i.function, {})
        names.setdefault(i.value, []).append(i.k)
        several[i.function] = several.get(i.function, False) or i.n > 1
    out = []
    for function, names in by_function.items():
        parts: dict[str, list[str]] = {}
        for name, ks in names.items():
            parts.setdefault(_numbers(ks), []).append(name)
        for ks, values in parts.items():
            at = f" {ks}" if several[function] else ""
            out.append(f"- {function}{at}: {', '.join(values)}")
    return out


# --- weights laid out unlike their siblings -----------------------------------------

_PART = re.compile(r"\['[^']*'\]|\[\d+\]|\.\w+|[^.\[]+")
_NUMBER = re.compile(r"(?<=_)\d+(?=')|(?<=\[)\d+(?=\])|(?<=_)\d+$")


def _numbered(path: str) -> list[tuple[int, str]]:
    """`(position, the path with that part's number as #)` for each numbered part
    of `path`: `['block_2']`, `[2]`, `.layer_2`."""
    parts = _PART.findall(path)
    out = []
    for i, part in enumerate(parts):
        if _NUMBER.search(part):
            wild = parts[:i] + [_NUMBER.sub("#", part, count=1)] + parts[i + 1 :]
            out.append((i, "".join(wild)))
    return out


def siblings(leaves: Iterable[tuple[str, Any]]) -> list[tuple[str, str, str, int, str]]:
    """`(path, its spec, its siblings' spec, how many agree, who they are)` for each
    array laid out unlike its siblings. `leaves` are `(path, array)`; arrays without a
    `NamedSharding` are left out.

    The siblings are the arrays of its shape whose paths differ from its in one
    number (the same weight in the other layers), where at least two of them agree
    and it agrees with the majority along no other numbered part of its path (the
    output projection, among a layer's numbered projections, is laid out as itself
    in every layer). Where no array is unlike those, the arrays of its shape whose
    paths end as its does (the same weight in the optimizer state: `.mu[...]`,
    `.nu[...]`), at least two of them agreeing."""
    specs: dict[str, tuple[str, tuple]] = {}
    for path, leaf in leaves:
        path = path.removesuffix(".value")  # a flax box's, or an nnx Variable's
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            continue
        shape = tuple(getattr(leaf, "shape", ()))
        specs[path] = (format_spec(padded(sharding.spec, len(shape))), shape)
    groups: dict[tuple, list[str]] = {}
    for path, (_, shape) in specs.items():
        for i, wild in _numbered(path):
            groups.setdefault((i, wild, shape), []).append(path)
    verdicts: dict[str, list[tuple[bool, str, int]]] = {}
    for members in groups.values():
        for path, verdict in _verdicts(members, specs).items():
            verdicts.setdefault(path, []).append(verdict)
    out = []
    for path in specs:  # in the order of the inputs
        found = verdicts.get(path)
        if not found or any(agrees for agrees, _, _ in found):
            continue
        _, common, most = found[0]
        out.append((path, specs[path][0], common, most, _LAYERS))
    return out or _twins(specs)


_LAYERS = "the same weight in the other layers"
_TWINS = "the arrays of its shape whose paths end as its does: its optimizer state"


def _verdicts(members: list[str], specs: dict) -> dict[str, tuple[bool, str, int]]:
    """`path -> (agrees, the common spec, how many have it)` for a group of arrays
    with a clear majority of at least two (else none)."""
    if len(members) < 3:
        return {}
    counts: dict[str, int] = {}
    for path in members:
        counts[specs[path][0]] = counts.get(specs[path][0], 0) + 1
    common, most = max(counts.items(), key=lambda kv: kv[1])
    if most < 2 or most * 2 <= len(members):
        return {}  # no clear majority
    return {path: (specs[path][0] == common, common, most) for path in members}


def _twins(specs: dict) -> list[tuple[str, str, str, int, str]]:
    """`siblings` by the end of the path: each array against the longest ending it
    shares with at least two arrays of its shape."""
    parts = {path: tuple(_PART.findall(path)) for path in specs}
    endings: dict[tuple, list[str]] = {}
    for path, (_, shape) in specs.items():
        for n in range(1, len(parts[path])):
            endings.setdefault((shape, parts[path][-n:]), []).append(path)
    out = []
    for path, (spec, shape) in specs.items():
        for n in range(len(parts[path]) - 1, 0, -1):
            members = endings[(shape, parts[path][-n:])]
            if len(members) >= 3:
                agrees, common, most = _verdicts(members, specs).get(
                    path, (True, "", 0)
                )
                if not agrees:
                    out.append((path, spec, common, most, _TWINS))
                break
    return out


def paths(tree: Any, root: str) -> list[tuple[str, Any]]:
    """`(path, leaf)` for each array of `tree`, named from `root`."""
    # A flax box or nnx Variable holds its array in `.value`: the path ends before.
    return [(root + jax.tree_util.keystr(p), leaf) for p, leaf in unboxed_paths(tree)]


def inputs_of(call: tuple | None) -> list[tuple[str, Any]]:
    """`(path, array)` for each array argument of a call `(function, args,
    kwargs)`, named by the function's parameters (`state.params['w']`)."""
    if call is None:
        return []
    function, args, kwargs = call
    try:
        bound = inspect.signature(function).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {f"args[{i}]": a for i, a in enumerate(args)} | dict(kwargs)
    out = []
    for name, value in bound.items():
        try:
            out += paths(value, name)
        except Exception:  # noqa: BLE001: a value jax cannot flatten names nothing
            continue
    return out


def outliers_note(
    found: list[tuple[str, str, str, int, str]], shown: int = 3, head: str = ""
) -> str:
    """The likely cause among the program's inputs, in words; "" if there is
    none."""
    if not found:
        return ""
    who = found[0][4]
    lines = [
        head or f"The likely cause, among the program's inputs: laid out unlike {who}:"
    ]
    for path, spec, common, count, _ in found[:shown]:
        lines.append(f"- {path} is {spec}, where {count} of its siblings are {common}.")
    if len(found) > shown:
        lines.append(
            f"- and {len(found) - shown} more alike (its optimizer state, say)."
        )
    return "\n".join(lines)


# --- jit's in_shardings against the arguments ---------------------------------------

_JIT_MISMATCH = "Sharding passed to jit does not match the sharding"


def is_jit_mismatch(error: BaseException) -> bool:
    """Whether `error` is JAX's refusal of an argument whose sharding is not the
    one jit's `in_shardings` gives it."""
    return isinstance(error, ValueError) and _JIT_MISMATCH in str(error)


def jit_mismatch(
    what: str, function: Any, shardings: Any, args: tuple, kwargs, static=()
) -> str:
    """What jit's refusal means: each argument laid out unlike its `in_shardings`
    (`shardings`, a tuple with one tree prefix per positional parameter that is not
    static, as jit takes them), by its path with both layouts on the first line,
    and a weight unlike its siblings if one is. `static`: the static positions."""
    wrong = []
    for path, expected, given in _given(function, shardings, args, static):
        committed = getattr(given, "committed", True)
        actual = getattr(given, "sharding", None)
        expected = getattr(expected, "sharding", expected)  # a Format's
        if isinstance(expected, PartitionSpec) and isinstance(actual, NamedSharding):
            expected = NamedSharding(actual.mesh, expected)
        if not (committed and isinstance(expected, jax.sharding.Sharding)):
            continue
        if actual is not None and not actual.is_equivalent_to(expected, given.ndim):
            wrong.append((path, _spec(expected, given.ndim), _spec(actual, given.ndim)))
    shown = [
        f"{path} is {found}, where jax.jit's in_shardings say {spec}"
        for path, spec, found in wrong[:8]
    ]
    n = len(wrong)
    first = shown[0] if shown else "an argument is laid out otherwise"
    lines = [
        f"{what}: {first}; jit refuses a committed array laid out otherwise than "
        f"its in_shardings ({n or 'an'} argument{'s' if n > 1 else ''})"
        + (":" if n > 1 else ".")
    ]
    lines += [f"- {line}." for line in shown[1:]]
    if n > 8:
        lines.append(f"- and {n - 8} more.")
    named = {path for path, _, _ in wrong}
    odd = [
        o for o in siblings(inputs_of((function, args, kwargs))) if o[0] not in named
    ]
    if odd:
        lines.append(outliers_note(odd))
    lines.append(
        "Place each as the in_shardings say (`jax.device_put(x, sharding)`) before "
        "the call, or give the in_shardings the layout the arrays have."
    )
    return "\n".join(lines)


def _spec(sharding: Any, ndim: int) -> str:
    if isinstance(sharding, NamedSharding):
        return format_spec(padded(sharding.spec, ndim))
    return repr(sharding)


def _given(
    function: Any, shardings: Any, args: tuple, static: Any
) -> list[tuple[str, Any, Any]]:
    """`(path, sharding or None, array)` for each leaf of the positional `args` that
    are not `static`, named by `function`'s parameters, with its sharding from
    `shardings` (one tree prefix per such argument, or one for all)."""
    try:
        names = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        names = []
    dynamic = []
    for i, arg in enumerate(args):
        if i not in static:
            name = names[i] if i < len(names) else f"args[{i}]"
            dynamic.append((name, arg))
    if not isinstance(shardings, (tuple, list)):
        shardings = (shardings,) * len(dynamic)  # one for every argument
    out: list[tuple[str, Any, Any]] = []

    for (name, arg), prefix in zip(dynamic, shardings):

        def each(path: Any, sharding: Any, subtree: Any) -> None:
            for sub, leaf in jax.tree_util.tree_flatten_with_path(subtree)[0]:
                where = name + jax.tree_util.keystr((*path, *sub))
                # A box's own `.value`, which the in_shardings' tree may reach too.
                out.append((where.removesuffix(".value"), sharding, leaf))

        try:
            jax.tree_util.tree_map_with_path(each, prefix, arg, is_leaf=_is_layout)
        except (ValueError, TypeError):
            continue  # a prefix jit itself would refuse
    return out


def _is_layout(x: Any) -> bool:
    """A leaf of jit's in_shardings: a sharding, a spec, a Format, or `None`."""
    return (
        x is None
        or isinstance(x, (jax.sharding.Sharding, PartitionSpec))
        or hasattr(x, "sharding")
    )
