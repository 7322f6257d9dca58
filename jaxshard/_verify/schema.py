"""What a snapshot's JSON must hold, checked as it is read (`snapshot.load`), before
anything is compiled or drawn: a file edited by hand, merged badly or written by
something else fails there, in one sentence naming the field, rather than as a
`TypeError` deep in the comparison after a long compile.

The schema is a table: each field of the snapshot, and what it must be. Every key
`snapshot.snapshot` writes is in it (those of the page, `view.view`, optional: a
snapshot written before them still loads); keys it does not know are let be.
Numbers must be finite, and whole numbers below 2**63, as XLA's are.
"""

import json
import math
import re
from collections.abc import Callable
from typing import Any


_MISSING = object()
_LIMIT = 2**63


class _Leaf:
    """A value of one kind: `test` says whether `value` is one."""

    def __init__(self, what: str, test: Callable[[Any], bool]):
        self.what, self.test = what, test

    def problem(self, value: Any, field: str) -> tuple | None:
        return None if self.test(value) else (field, value, self.what)


class _Maybe:
    """`node`, or null."""

    def __init__(self, node: Any):
        self.node, self.what = node, f"{node.what}, or null"

    def problem(self, value: Any, field: str) -> tuple | None:
        found = None if value is None else self.node.problem(value, field)
        if found and found[0] == field:  # this very value: say null would do too
            return (field, value, self.what)
        return found


class _List:
    def __init__(self, item: Any, what: str = ""):
        self.item, self.what = item, what or f"a list, each {item.what}"

    def problem(self, value: Any, field: str) -> tuple | None:
        if type(value) is not list:
            return (field, value, self.what)
        for i, x in enumerate(value):
            if found := self.item.problem(x, f"{field}[{i}]"):
                return found
        return None


class _Map:
    """An object whose keys are names (of arrays, kinds, axes) and whose values are
    each an `item`."""

    def __init__(self, item: Any, what: str = ""):
        self.item, self.what = (
            item,
            what or f"an object, each of whose values is {item.what}",
        )

    def problem(self, value: Any, field: str) -> tuple | None:
        if type(value) is not dict:
            return (field, value, self.what)
        for key, x in value.items():
            if found := self.item.problem(x, _at(field, key)):
                return found
        return None


class _Record:
    """An object with these fields; `check` says what is wrong between them ("" if
    nothing)."""

    def __init__(
        self,
        name: str,
        required: dict[str, Any],
        optional: dict[str, Any] | None = None,
        check: Callable[[dict], str] | None = None,
    ):
        keys = ", ".join(json.dumps(k) for k in required) or "nothing required"
        self.what = f"{name} (an object with {keys})"
        self.required, self.optional = required, optional or {}
        self.check = check

    def problem(self, value: Any, field: str) -> tuple | None:
        if type(value) is not dict:
            return (field, value, self.what)
        for key, node in self.required.items():
            if key not in value:
                return (_at(field, key), _MISSING, node.what)
            if found := node.problem(value[key], _at(field, key)):
                return found
        for key, node in self.optional.items():
            if key in value and (found := node.problem(value[key], _at(field, key))):
                return found
        if self.check and (reason := self.check(value)):
            return (field, value, reason)
        return None


def _at(field: str, key: str) -> str:
    """`memory.total`, `collectives["all-gather"]`: the field `key` of `field`."""
    if key.isidentifier():
        return f"{field}.{key}" if field else key
    return f"{field}[{json.dumps(key, ensure_ascii=False)}]"


# --- the kinds of value -------------------------------------------------------------

STRING = _Leaf("a string", lambda v: type(v) is str)
BOOL = _Leaf("true or false", lambda v: type(v) is bool)
COUNT = _Leaf(
    "a whole number from 0 to 2**63", lambda v: type(v) is int and 0 <= v < _LIMIT
)
NUMBER = _Leaf(
    "a finite number",
    lambda v: (
        (type(v) is int and abs(v) < _LIMIT) or (type(v) is float and math.isfinite(v))
    ),
)
# `dp=4,tp=2`, as `snapshot.snapshot` writes a mesh; "" for a mesh of no axes.
_AXIS = r"[^=,]+=[1-9][0-9]{0,17}"
MESH = _Leaf(
    'mesh axes in order, "dp=4,tp=2"',
    lambda v: type(v) is str and re.fullmatch(f"(?:{_AXIS}(?:,{_AXIS})*)?", v),
)
NAMES = _List(STRING, "a list of strings")


def _spec_fits_shape(array: dict) -> str:
    spec, shape = array.get("spec"), array["shape"]
    if spec is None or len(spec) == len(shape):
        return ""
    return 'an array whose "spec" has one entry per dimension of its "shape"'


# --- the snapshot -------------------------------------------------------------------

CONTRACT = _Record(
    "a contract",
    {"function": STRING, "value": STRING, "expected": STRING, "actual": STRING,
     "type": STRING, "ok": BOOL},
    {"block": STRING},
)  # fmt: skip
COLLECTIVES_BY_KIND = (
    'an object of totals by kind of collective, {"all-gather": {"count": 3, "bytes": '
    '1024, "axes": {"tp": 3}}}'
)
COLLECTIVES = _Record(
    "a kind of collective's totals",
    {"count": COUNT, "bytes": COUNT, "axes": _Map(COUNT, "counts by mesh axes")},
    {"functions": _Map(COUNT, "counts by function")},
)
MEMORY = _Record(
    "the memory per device",
    {"arguments": COUNT, "outputs": COUNT, "temporaries": COUNT, "total": COUNT},
    {"aliased": COUNT},
)
VIOLATION = _Record(
    "a violation",
    {"kind": STRING, "value": STRING, "expected": STRING, "actual": STRING},
    {
        k: _Maybe(STRING)
        for k in ("function", "call", "array", "block", "annotation", "type",
                  "reason", "source")
    },
)  # fmt: skip
ARRAY = _Record(
    "an array's layout",
    {"dtype": STRING, "shape": _List(COUNT, "a list of dimension sizes"),
     "spec": _Maybe(_List(NAMES, "a list of mesh axes per dimension")),
     "bytes": COUNT, "device_bytes": COUNT},
    {"replicated_bytes": _Maybe(COUNT)},
    check=_spec_fits_shape,
)  # fmt: skip
ARRAYS = _Maybe(_Map(ARRAY))
SITE = _Record(
    "a line of code's collectives",
    {"line": STRING, "function": STRING, "kind": STRING, "axes": _Maybe(NAMES),
     "count": COUNT, "bytes": _Maybe(COUNT)},
    {"each": _Maybe(COUNT), "where": _Maybe(STRING)},
)  # fmt: skip
PROGRAM = _Record(
    "the program's size",
    {},
    {"code": _Maybe(COUNT), "hbm_bytes": _Maybe(COUNT), "flops": _Maybe(NUMBER),
     "fits": _Maybe(BOOL)},
)  # fmt: skip
SNAPSHOT = _Record(
    "a snapshot",
    {
        "function": STRING,
        "mesh": MESH,
        "axis_types": NAMES,
        "devices": STRING,
        "inputs": _Map(STRING, "layouts by path"),
        "outputs": _Map(STRING, "layouts by path"),
        "contracts": _List(CONTRACT),
        "collectives": _Map(COLLECTIVES, COLLECTIVES_BY_KIND),
        "memory": _Maybe(MEMORY),
    },
    {  # what the page draws (`view.view`)
        "ok": BOOL,
        "violations": _Maybe(_List(VIOLATION)),
        "layouts": _Maybe(
            _Record("the layouts", {}, {"inputs": ARRAYS, "outputs": ARRAYS})
        ),
        "sites": _Maybe(_List(SITE)),
        "check_collectives": _Maybe(
            _Map(_Record("totals", {"count": COUNT, "bytes": COUNT}))
        ),
        "program": _Maybe(PROGRAM),
        "against": _Maybe(STRING),
        "notes": _Maybe(NAMES),
    },
)


def problem(data: dict) -> str:
    """What is wrong with the snapshot `data`, as the end of a sentence ("its field
    memory.total is missing, where a whole number ... is expected"); "" if
    nothing."""
    found = SNAPSHOT.problem(data, "")
    if found is None:
        return ""
    field, value, what = found
    if value is _MISSING:
        return f"its field {field} is missing, where {what} is expected"
    return f"its field {field} is {_shown(value)}, where {what} is expected"


def _shown(value: Any) -> str:
    """`value` as JSON, cut short: `[1]`, `"x"`, `a 401-digit number`."""
    if type(value) is int and abs(value) >= 10**18:
        return f"a {len(str(abs(value)))}-digit number"
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."
