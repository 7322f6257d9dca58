"""`jaxshard.check_tree`: check the arrays of a Module, dataclass or NamedTuple against
their annotations at any point, not only when it is made."""

import dataclasses
import typing
from typing import Any, get_args, get_origin

import jax
import jaxtyping

from ._array_types import _MetaShardedArray
from ._errors import ShardingError, TypeCheckError
from ._jax_internals import ArrayMeta
from ._sharding import naming


_union_types = (typing.Union, type(int | str))


def check_tree(tree: Any, annotation: Any = None, *, name: str | None = None) -> None:
    """Checks every array in `tree` against its annotation: shape, dtype and sharding.

    An equinox Module's fields are checked by jaxtyping when it is made (`__init__`),
    and not after `eqx.tree_at`, an optimizer update or any other change.
    `check_tree(model)` checks them whenever it is called: every field of the Module,
    dataclass or NamedTuple, at any depth (`tuple[...]`, `list[...]`, `dict[...]`,
    `PyTree[...]` and `Optional` fields included), with one set of dimension bindings
    for the whole tree. Any other class with annotated attributes is walked the same
    way, such as a `flax.nnx.Module` whose attributes are annotated
    `nnx.Param[Float[Array, "d f", P(None, "tp")]]` (the array a Param holds is
    checked). Eagerly it raises at once; inside `jax.jit` it checks as
    annotations do there (at trace time on Explicit meshes, when XLA compiles on Auto
    meshes).

    **Arguments:**

    - `tree`: the value, e.g. an equinox Module.
    - `annotation`: its type; by default `type(tree)`.
    - `name`: what to call it in messages (default: its class's name).

    **Raises:**

    `jaxshard.ShardingError` if an array is sharded other than as annotated, else
    `jaxtyping.TypeCheckError` if one has the wrong shape or dtype; the message lists
    every failing array by its path.

    !!! Example

        ```python
        model = eqx.tree_at(lambda m: m.w, model, new_w)
        jaxshard.check_tree(model)  # is model.w still sharded as annotated?
        ```
    """
    annotation = type(tree) if annotation is None else annotation
    name = getattr(annotation, "__name__", "tree") if name is None else name
    found: list[tuple[str, Any, Any]] = []
    _collect(tree, annotation, name, found)
    failures = []
    with jaxtyping.jaxtyped("context"):  # one set of dimension bindings
        for where, expected, value in found:
            with naming("check_tree", where):
                reason, sharding = _reason(expected, value)
            if reason:
                failures.append((where, reason, sharding))
    if failures:
        error = ShardingError if any(s for *_, s in failures) else TypeCheckError
        head = (
            "1 array does not match its annotation"
            if len(failures) == 1
            else f"{len(failures)} arrays do not match their annotations"
        )
        raise error(
            f"check_tree({name}): {head}:\n"
            + "\n".join(f"- {w}: {r}" for w, r, _ in failures)
        )


def _reason(expected: Any, value: Any) -> tuple[str, bool]:
    """Why `value` fails `expected` ("" if it does not), and whether the sharding is
    the reason."""
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
    if _is_variable(value):  # flax.nnx.Param and the like: check what it holds
        inner = get_args(annotation)[0] if get_args(annotation) else annotation
        annotation = inner if _is_array_like_annotation(inner) else annotation
        value = value.get_value()
    if _is_array_like_annotation(annotation):
        if not (value is None and type(None) in get_args(annotation)):
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
        hints = typing.get_type_hints(type(value), include_extras=True)
        for field in dataclasses.fields(value):
            if field.metadata.get("static", False):
                continue
            here = f"{where}.{field.name}"
            _collect(getattr(value, field.name, None), hints.get(field.name), here, out)
        return
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):  # NamedTuple
        hints = typing.get_type_hints(type(value), include_extras=True)
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
    if isinstance(annotation, type) and isinstance(value, annotation):
        # Any other class whose attributes are annotated (a flax.nnx.Module, say).
        try:
            hints = typing.get_type_hints(type(value), include_extras=True)
        except Exception:  # an annotation naming something out of scope
            return
        for name, hint in hints.items():
            if not name.startswith("_") and hasattr(value, name):
                _collect(getattr(value, name), hint, f"{where}.{name}", out)


def _is_array_like_annotation(annotation: Any) -> bool:
    return _is_array(annotation) or any(_is_array(a) for a in _arrays(annotation))


def _is_variable(value: Any) -> bool:
    """A `flax.nnx.Variable` (`nnx.Param`, ...), without importing flax."""
    return type(value).__module__.startswith("flax.nnx") and hasattr(value, "get_value")


def _fits(value: Any, option: Any) -> bool:
    cls = get_origin(option) or option
    return isinstance(cls, type) and isinstance(value, cls)
