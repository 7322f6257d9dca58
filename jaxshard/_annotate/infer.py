"""From what `annotate` saw to contracts: for each function, the annotation of each
array parameter and of the return value, as source text (and for each class, of each
array field), and the findings, the parameters laid out differently in different
calls.

A dimension takes the name `dims` gives its size (when one name has that size), else
its number; one whose size differs between calls is `_`, and a parameter whose rank
differs is `"..."`. A layout is written when every call had the same one (`P(...)`,
or `L(...)` where the rule table maps each dimension's axes back to one logical
name); a parameter laid out differently in different calls gets none, and a finding.
A parameter that held an instance of one of the user's classes is annotated with the
class, whose fields carry the contracts.
"""

import collections
import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from .._annotations.logical import resolve
from .._annotations.spec import format_spec, padded
from .._config import AxisRules
from .._verify.frames import _relative
from .observe import Held, Seen


# jaxtyping's dtype classes, by the kind of dtype each takes (bfloat16 and the
# float8s are floating point to JAX, though not to NumPy).
_KINDS = (
    (jnp.bool_, "Bool"),
    (jnp.unsignedinteger, "UInt"),
    (jnp.signedinteger, "Int"),
    (jnp.floating, "Float"),
    (jnp.complexfloating, "Complex"),
)


def _kind(dtype: Any) -> str:
    return next((name for k, name in _KINDS if jnp.issubdtype(dtype, k)), "Shaped")


@dataclasses.dataclass(frozen=True)
class Function:
    """A function seen while tracing: where it is, and its contracts as source
    text, by parameter (`"return"` for the return value), in signature order; or
    (`kind` "class") a dataclass or NamedTuple, by field."""

    filename: str
    qualname: str
    lineno: int
    annotations: dict[str, str]
    names: frozenset[str]  # what the annotations need: "Float", "P", "L", ...
    kind: str = "function"


@dataclasses.dataclass(frozen=True)
class Finding:
    """A parameter (or return value) laid out differently in different calls."""

    function: Function
    name: str
    layouts: tuple[tuple[PartitionSpec, int], ...]  # each layout, in how many calls

    def __str__(self) -> str:
        what, calls = f"parameter {self.name!r}", "call"
        if self.name == "return":
            what = "the return value"
        if self.function.kind == "class":
            what, calls = f"field {self.name!r}", "instance"
        counts = ", ".join(
            f"{format_spec(spec)} in {n} {calls}{'s' if n > 1 else ''}"
            for spec, n in self.layouts
        )
        where = f"{_relative(self.function.filename)}:{self.function.lineno}"
        return f"{self.function.qualname}: {what} {counts}, at {where}"


def functions(
    seen: list[Seen],
    dims: Mapping[str, int] | None,
    rules: Any = None,
    held: Sequence[Held] = (),
) -> tuple[list[Function], list[Finding]]:
    """The contracts of each function (and class) in `seen` and `held`, and the
    findings."""
    names = _names(dims or {}, seen)
    slices = _slices(seen)
    seen = [s for s in seen if s.kind != "field" or s.call not in slices]
    held = [h for h in held if h.instance not in slices]
    by_function: dict[tuple, dict[str, list]] = {}
    for s in [*seen, *held]:
        key = (s.filename, s.qualname, s.lineno, s.kind)
        by_function.setdefault(key, {}).setdefault(s.name, []).append(s)
    found, findings = [], []
    for (filename, qualname, lineno, kind), params in by_function.items():
        ordered = sorted(params.items(), key=lambda item: _place(item[1][0]))
        annotations, needs, unlike = {}, set(), []
        for name, calls in ordered:
            held_by = {c.type for c in calls if isinstance(c, Held)}
            if held_by:  # an instance of a class: its name, if it is the same
                one = len(held_by) == 1 and all(isinstance(c, Held) for c in calls)
                if one and None not in held_by:
                    annotations[name] = held_by.pop()
                continue
            text, spec_names, layouts = _annotation(calls, names, rules)
            annotations[name] = text
            needs |= spec_names
            if layouts is not None:
                unlike.append((name, layouts))
        if not annotations:
            continue
        function = Function(
            filename,
            qualname,
            lineno,
            annotations,
            frozenset(needs),
            "class" if kind == "field" else "function",
        )
        found.append(function)
        findings += [Finding(function, name, layouts) for name, layouts in unlike]
    return found, findings


def _slices(seen: list[Seen]) -> set[int]:
    """The instances that are a slice of another along leading dimensions (`scan`
    over a NamedTuple of stacked weights gives its body one layer's, of the same
    class): every array field the other's with the same leading ones dropped. The
    class's fields are annotated as the whole instances' are."""
    shapes: dict[int, dict[tuple, tuple[int, ...]]] = collections.defaultdict(dict)
    for s in seen:
        if s.kind == "field":
            shapes[s.call][(s.qualname, s.filename, s.name)] = s.shape
    # Each instance's fields, and their shapes in that order.
    signature = {
        number: (tuple(sorted(fields)), tuple(fields[k] for k in sorted(fields)))
        for number, fields in shapes.items()
    }
    kinds: dict[tuple, set[tuple]] = collections.defaultdict(set)  # fields -> shapes
    for fields, sizes in signature.values():
        kinds[fields].add(sizes)
    sliced = set()
    for fields, signatures in kinds.items():
        for small, large in itertools.permutations(signatures, 2):
            drop = {len(b) - len(a) for a, b in zip(small, large)}
            if len(drop) == 1 and (k := drop.pop()) > 0:
                if all(b[k:] == a for a, b in zip(small, large)):
                    sliced.add((fields, small))
    return {number for number, key in signature.items() if key in sliced}


def _place(s: Seen | Held) -> int:
    return s.position if s.position >= 0 else 1 << 30  # the return value last


def _names(dims: Mapping[str, int], seen: list[Seen]) -> dict[int, str]:
    """Size -> its name: the one `dims` gives it, else the one that the existing
    annotations give every dimension of that size they name (a name they give two
    sizes is none; a size two names share has none)."""
    by_size = collections.defaultdict(set)
    for name, size in dims.items():
        if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
            by_size[int(size)].add(name)
    named = {size: next(iter(n)) for size, n in by_size.items() if len(n) == 1}
    sizes = collections.defaultdict(set)  # name -> the sizes annotations give it
    for s in seen:
        for name, size in zip(s.named or (), s.shape):
            if name is not None:
                sizes[name].add(size)
    found = collections.defaultdict(set)
    for name, given in sizes.items():
        if len(given) == 1 and name not in dims:
            found[next(iter(given))].add(name)
    for size, names in found.items():
        if len(names) == 1 and size not in by_size:
            named[size] = next(iter(names))
    return named


def _annotation(
    calls: list[Seen], names: dict[int, str], rules: Any
) -> tuple[str, set[str], tuple | None]:
    """The annotation of a parameter seen in `calls`, what it needs imported, and
    its layouts with their counts if they differ between calls."""
    kinds = {_kind(c.dtype) for c in calls}
    kind = kinds.pop() if len(kinds) == 1 else "Shaped"
    shape = _shape([c.shape for c in calls], names)
    needs = {kind, "Array"}
    text = f'{kind}[Array, "{shape}"'
    if shape == "...":  # no one layout fits arrays of several ranks
        return text + "]", needs, None
    layouts = collections.Counter(
        padded(c.spec, len(c.shape)) for c in calls if c.spec is not None
    )
    if len(layouts) > 1:
        return text + "]", needs, tuple(layouts.most_common())
    if len(layouts) == 1 and all(c.spec is not None for c in calls):
        written, name = _spec_text(next(iter(layouts)), rules)
        return f"{text}, {written}]", needs | {name}, None
    return text + "]", needs, None  # a layout XLA never said


def _shape(shapes: list[tuple[int, ...]], names: dict[int, str]) -> str:
    """The shape string of arrays of `shapes` (one per call)."""
    if len({len(s) for s in shapes}) > 1:
        return "..."
    dims = []
    for sizes in zip(*shapes):
        if len(set(sizes)) > 1:
            dims.append("_")
        else:
            dims.append(names.get(sizes[0], str(sizes[0])))
    return " ".join(dims)


def _spec_text(spec: PartitionSpec, rules: AxisRules | None) -> tuple[str, str]:
    """`spec` as source (`P("dp", None)`), or as logical names (`L("batch",
    None)`) where `rules` maps each entry back to one name; and which it is."""
    logical = None if rules is None else _logical(spec, rules)
    if logical is not None:
        return "L(" + ", ".join(_quoted(e) for e in logical) + ")", "L"
    return "P(" + ", ".join(_quoted(e) for e in spec) + ")", "P"


def _logical(spec: PartitionSpec, rules: AxisRules) -> tuple | None:
    """The logical spec that `rules` resolve to `spec`, with one logical name per
    split dimension (a rule mapping it to exactly that dimension's axes; `None`
    for an unsplit one), or `None` if no such spec, or more than one, gives it."""
    options = []
    for entry in spec:
        if entry is None:
            options.append([None])
            continue
        named = [n for n, axes in rules.rules if _axes(axes) == _axes(entry)]
        options.append(list(dict.fromkeys(named)))
    if not all(options) or math.prod(map(len, options)) > _TRIED:
        return None
    fits = [
        logical
        for logical in itertools.product(*options)
        if len({n for n in logical if n}) == len([n for n in logical if n])
        and resolve(logical, rules)[0] == spec
    ]
    return fits[0] if len(fits) == 1 else None


_TRIED = 64  # the most logical specs tried for one layout


def _axes(axes: Any) -> tuple:
    if axes is None:
        return ()
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def _quoted(entry: Any) -> str:
    """An entry of a spec as Python source, with double quotes (as ruff writes)."""
    if entry is None:
        return "None"
    if isinstance(entry, (tuple, list)):
        inner = ", ".join(f'"{a}"' for a in entry)
        return f"({inner},)" if len(entry) == 1 else f"({inner})"
    return f'"{entry}"'
