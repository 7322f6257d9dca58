"""The arrays of a Module, dataclass or NamedTuple against their annotations: each
array found with the annotation that reaches it (`_collect`), and the verdicts on
them said at once (`_check_all`), for `check_tree` and `check_partitioning`."""

import dataclasses
import re
import typing
from typing import Any, get_args, get_origin

import jax
import jaxtyping
from jax import Array
from jax.sharding import NamedSharding

from .. import _config
from .._annotations.hints import type_hints
from .._annotations.logical import active_rules, using
from .._annotations.spec import format_spec, padded
from .._errors import ShardingError, TypeCheckError
from .._jax_internals import ArrayMeta
from .array_types import _MetaShardedArray, Shaped
from .boxes import is_variable
from .compare import compare
from .describe import describe_array, describe_mesh, describe_sharding, naming
from .layout import is_array_like


_union_types = (typing.Union, type(int | str))


def _check_all(
    what: str,
    found: list,
    several: str,
    source: str = "the annotation",
    function: str | None = None,
) -> None:
    """Checks each `(path, expected, value, rules)` of `found` (`expected` an
    annotation or a `Stated` layout), with one set of dimension bindings, and raises
    listing every failure by path: a `ShardingError` if a sharding is among the
    reasons, else a `TypeCheckError`: one on one line, several under a head,
    `several` (`{}` for how many); `source` is what states the layouts (an entry's
    fifth item, where it has one, says what states its own). `function` names
    the checks made inside `jit` (by default, `what` up to its parenthesis)."""
    function = what.split("(", 1)[0] if function is None else function
    failures, unruled = [], False
    with jaxtyping.jaxtyped("context"):
        for where, expected, value, rules, *own in found:
            with naming(function, where), using(rules):
                reason, sharding = _reason(expected, value)
                said = own[0] if own else source
                # Logical names read as mesh axes: no rules were in force.
                unruled |= bool(reason) and _unruled(reason, said)
            if reason:
                failures.append((where, _worded(reason, said), sharding))
    if failures:
        error = ShardingError if any(s for *_, s in failures) else TypeCheckError
        lines = [
            f"{w}{' ' if r.startswith('is ') else ': '}{r.rstrip('.')}."
            for w, r, _ in failures
        ]
        hint = _RULES_HINT if unruled else ""
        if len(failures) == 1:  # the path and what is wrong, on one line
            raise error(f"{what}: {lines[0]}{' ' + hint if hint else ''}")
        # The first failure's path on the first line, however many there are.
        head = f"{several.format(len(failures))}, the first {failures[0][0]}"
        listed = "\n".join(f"- {x}" for x in lines) + (f"\n{hint}" if hint else "")
        raise error(f"{what}: {head}:\n{listed}")


_RULES_HINT = (
    "No axis rules are in force: if these specs name logical axes, check under the "
    "rules that map them to mesh axes (`with nnx.logical_axis_rules(rules):` or "
    "`with jaxshard.axis_rules(rules):`)."
)


def _unruled(reason: str, source: str) -> bool:
    """Whether `reason` is a spec of metadata or a layout tree (which may name
    logical axes, unlike an annotation's `P(...)`) naming axes the mesh lacks, read
    with no axis rules in force."""
    return (
        source != "the annotation"
        and reason.startswith("the annotation's spec")
        and " names mesh ax" in reason
        and active_rules() is None
    )


_THIS_ARRAY = re.compile(r"^this array \([^()]*\) (?=is )")


def _worded(reason: str, source: str) -> str:
    """`reason`, which speaks of "the annotation", said of `source` (`"the layout
    tree"`, `"its metadata"`) for a user who wrote no annotation: `is sharded as
    P(...) (...), where the layout tree says P(...) (...)`, to follow the path."""
    if source == "the annotation":
        return reason
    reason = _THIS_ARRAY.sub("", reason)
    reason = reason.replace(", but the annotation expects", f", where {source} says")
    reason = reason.replace("The annotation", source[:1].upper() + source[1:])
    return reason.replace("the annotation", source)


@dataclasses.dataclass(frozen=True)
class Stated:
    """A layout stated by a sharding (a `NamedSharding`, or any `jax.sharding.Sharding`)
    and, from a `jax.ShapeDtypeStruct`, a shape and dtype."""

    sharding: Any
    shape: tuple | None = None
    dtype: Any = None


def _stated(expected: Stated, value: Any) -> tuple[str, bool]:
    """`_reason` for a `Stated` layout: the shape and dtype, then the sharding, the
    mesh compared too (a tracer's, inside `jit`, as an annotation's spec)."""
    if not is_array_like(value):
        return f"is {type(value).__name__}, not an array", False
    shape, dtype = tuple(value.shape), value.dtype
    if expected.shape is not None and (shape, dtype) != (
        expected.shape,
        expected.dtype,
    ):
        return (
            f"is {describe_array(dtype, shape)}, but the annotation expects "
            f"{describe_array(expected.dtype, expected.shape)}",
            False,
        )
    sharding = expected.sharding
    if sharding is None or _config.current().sharding == "off":
        return "", False
    if isinstance(value, jax.core.Tracer) or not hasattr(value, "sharding"):
        if not isinstance(sharding, NamedSharding):
            return "", False  # what it is made into is jit's to say
        return _reason(Shaped[Array, "...", sharding.spec], value)
    actual = value.sharding
    if not isinstance(sharding, NamedSharding):
        if sharding.is_equivalent_to(actual, len(shape)):
            return "", False
        return (
            f"is {describe_sharding(actual, len(shape))}, but the annotation expects "
            f"it {describe_sharding(sharding, len(shape))}",
            True,
        )
    reason = compare(sharding.spec, actual, shape, dtype, sharding.mesh)
    if reason and getattr(actual, "mesh", sharding.mesh) != sharding.mesh:
        found, said = (
            format_spec(padded(s.spec, len(shape))) for s in (actual, sharding)
        )
        return (
            f"is sharded as {found} on mesh {_on(actual.mesh)}, but the annotation "
            f"expects {said} on mesh {_on(sharding.mesh)}",
            True,
        )
    return reason, bool(reason)


def _on(mesh: Any) -> str:
    """`{'x': 2, 'y': 4} (Explicit axes) over devices [0,1,...]`."""
    ids = [int(i) for i in mesh.device_ids.flat]
    shown = ",".join(map(str, ids[:16])) + (",..." if len(ids) > 16 else "")
    return f"{describe_mesh(mesh)} over devices [{shown}]"


def _reason(expected: Any, value: Any) -> tuple[str, bool]:
    """Why `value` fails `expected` ("" if it does not), and whether the sharding is
    the reason."""
    if isinstance(expected, Stated):
        return _stated(expected, value)
    options = _arrays(expected)
    reasons = []
    for option in options:
        plain = ArrayMeta.__instancecheck_str__(option, value)
        if plain:
            reasons.append((plain, False))
            continue
        if isinstance(option, _MetaShardedArray):
            sharded = type(option).__instancecheck_str__(option, value)
            if sharded:
                reasons.append((sharded, True))
                continue
        return "", False
    if value is None and type(None) in get_args(expected):
        return "", False
    return reasons[0] if reasons else ("", False)


def _arrays(annotation: Any) -> list:
    if get_origin(annotation) in _union_types:
        return [a for a in get_args(annotation) if _is_array(a)]
    return [annotation]


def _is_array(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(
        annotation, jaxtyping.AbstractArray
    )


def _collect(value: Any, annotation: Any, where: str, out: list) -> None:
    """Appends `(path, array annotation, value)` for every annotated array in
    `value`, walking the value's own structure."""
    if annotation is None or annotation is Any:
        return
    if is_variable(value):  # flax.nnx.Param and the like: check what it holds
        inner = get_args(annotation)[0] if get_args(annotation) else annotation
        annotation = inner if _is_array_like_annotation(inner) else annotation
        value = value.get_value()
    if _is_array_like_annotation(annotation):
        others = [a for a in get_args(annotation) if not _is_array(a)]
        if value is None and type(None) in others:
            return
        if not is_array_like(value) and any(_fits(value, a) for a in others):
            # A union whose array arms do not hold this value (a quantized weight
            # in `Float[...] | QuantArray`): the arm that does, below.
            annotation = typing.Union[tuple(others)]
        else:
            out.append((where, annotation, value))
            return
    if isinstance(annotation, type(jaxtyping.PyTree)):
        leaves = jax.tree_util.tree_flatten_with_path(value)[0]
        for path, leaf in leaves:
            _collect(leaf, annotation.leaftype, where + jax.tree_util.keystr(path), out)
        return
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in _union_types:
        for option in args:
            if option is not type(None) and _fits(value, option):
                _collect(value, option, where, out)
                return
        return
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        hints = type_hints(type(value))
        for field in dataclasses.fields(value):
            if field.metadata.get("static", False):
                continue
            here = f"{where}.{field.name}"
            _collect(getattr(value, field.name, None), hints.get(field.name), here, out)
        return
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):  # NamedTuple
        hints = type_hints(type(value))
        for field in type(value)._fields:
            here = f"{where}.{field}"
            _collect(getattr(value, field), hints.get(field), here, out)
        return
    if origin in (tuple, list) and isinstance(value, (tuple, list)):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            items = list(zip(args, value))
        else:
            items = [(args[0] if args else None, v) for v in value]
        for i, (a, v) in enumerate(items):
            _collect(v, a, f"{where}[{i}]", out)
        return
    if origin is dict and isinstance(value, dict) and len(args) == 2:
        for k, v in value.items():
            _collect(v, args[1], f"{where}[{k!r}]", out)
        return
    if annotation in (tuple, list, dict) and isinstance(value, annotation):
        # A bare container, `check_tree((model, opt_state))`: each item's own type.
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if not is_array_like(v):
                _collect(v, type(v), f"{where}[{k!r}]", out)
        return
    if _fits(value, annotation):
        # Any other class whose attributes are annotated (a flax.nnx.Module, say).
        hints = type_hints(type(value))
        for name, hint in hints.items():
            if not name.startswith("_") and hasattr(value, name):
                _collect(getattr(value, name), hint, f"{where}.{name}", out)


def _is_array_like_annotation(annotation: Any) -> bool:
    return _is_array(annotation) or any(_is_array(a) for a in _arrays(annotation))


def _fits(value: Any, option: Any) -> bool:
    cls = get_origin(option) or option
    try:
        return isinstance(cls, type) and isinstance(value, cls)
    except TypeError:  # a Protocol that is not runtime-checkable (optax's)
        return False
