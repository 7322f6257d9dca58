"""The type hints of a function or class, as far as they can be resolved: one that
names something out of scope (flax's `TrainState` has `opt_state: optax.OptState`,
whose `ArrayTree` is a forward reference that only optax's module resolves) leaves
that one hint out, not every hint of the class."""

import sys
import typing
from typing import Any


def type_hints(obj: Any) -> dict[str, Any]:
    """`typing.get_type_hints(obj, include_extras=True)`; where that fails, each
    annotation that resolves on its own (a class's from its own module, along its
    MRO), and none of those that do not."""
    try:
        return typing.get_type_hints(obj, include_extras=True)
    except Exception:  # noqa: BLE001: a name out of scope, or no annotations at all
        pass
    out: dict[str, Any] = {}
    owners = reversed(obj.__mro__) if isinstance(obj, type) else [obj]
    for owner in owners:
        module = sys.modules.get(getattr(owner, "__module__", ""), None)
        scope = dict(vars(module)) if module is not None else {}
        if isinstance(owner, type):
            scope.update(vars(owner))
        for name, hint in (
            getattr(owner, "__dict__", {})
            .get("__annotations__", getattr(owner, "__annotations__", {}))
            .items()
        ):
            resolved = _resolved(hint, scope)
            if resolved is not None:
                out[name] = resolved
    return out


def _resolved(hint: Any, scope: dict) -> Any:
    if isinstance(hint, str):
        hint = typing.ForwardRef(hint)
    if not isinstance(hint, typing.ForwardRef):
        return hint
    try:
        return typing.get_type_hints(_Holder(hint, scope), scope, include_extras=True)[
            "x"
        ]
    except Exception:  # noqa: BLE001: left out
        return None


class _Holder:
    """Something `get_type_hints` resolves one forward reference of."""

    def __init__(self, hint: Any, scope: dict):
        self.__annotations__ = {"x": hint}
        self.__globals__ = scope
