"""flax nnx Modules checked whole: each Variable (and flax linen box) whose layout no
annotation states, against the partitioning it carries (`nnx.with_partitioning`), as
`check_partitioning` reads it. For `check_tree`, and for a `jaxtyped` function's
parameter annotated with an nnx Module class. flax is not imported: a Module is
known by its classes' modules, as `boxes` knows a Variable."""

import inspect
import typing
from collections.abc import Callable
from typing import Any, get_args, get_origin

import jax

from .._annotations.hints import type_hints
from . import decorator
from .partitioning import METADATA, metadata_checks
from .tree import _check_all


_union_types = (typing.Union, type(int | str))


def is_module_class(annotation: Any) -> bool:
    """A subclass of `flax.nnx.Module`."""
    return isinstance(annotation, type) and any(
        c.__name__ == "Module" and c.__module__.startswith("flax.nnx")
        for c in annotation.__mro__
    )


def _modules_in(annotation: Any) -> bool:
    """Whether `annotation` is an nnx Module class, or a union with one."""
    if get_origin(annotation) in _union_types:
        return any(is_module_class(a) for a in get_args(annotation))
    return is_module_class(annotation)


class ModuleParameters:
    """The parameters of a `jaxtyped` function annotated with an nnx Module class
    (`model: Decoder`), each checked at an eager call against its Variables'
    metadata.

    A Module's weights are made by its layers (`nnx.Linear`, `nnx.LayerNorm`), not
    passed to any annotated function: their partitioning is in their metadata.
    Checking a Module argument by its type alone would pass a kernel laid out
    otherwise. Only concrete weights are checked: inside `jit` a Variable holds a
    tracer, laid out as the jitted function's inputs were, and a check there would
    add a probe per weight to the program (`jaxshard.check_tree(model)` in the step
    makes one on purpose). The parameters are found at the first call,
    once the function's annotations can be resolved; a function without such a
    parameter costs one attribute read per call from then on."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.names: tuple[str, ...] | None = None  # not yet known
        self.signature: inspect.Signature | None = None

    def check(self, args: tuple, kwargs: dict) -> None:
        """Raises a `ShardingError` naming each Variable of a Module argument that is
        not laid out as its metadata says."""
        if self.names is None:
            self.names = self._find()
        if not self.names:
            return
        assert self.signature is not None
        try:
            bound = self.signature.bind(*args, **kwargs).arguments
        except TypeError:
            return  # the call itself says what is wrong with its arguments
        function = _name(self.fn)
        for name in self.names:
            value = bound.get(name)
            if not is_module_class(type(value)):
                continue  # `None` for an `Optional[Decoder]`, say
            found = [
                entry
                for entry in metadata_checks(value, name, set())
                if not isinstance(entry[2], jax.core.Tracer)
            ]
            _check_all(
                f"{function}, parameter {name!r}",
                found,
                "{} arrays are not partitioned as their metadata says",
                METADATA,
                function=function,
            )

    def _find(self) -> tuple[str, ...]:
        target = inspect.unwrap(self.fn)
        try:
            self.signature = inspect.signature(target)
        except (TypeError, ValueError):
            return ()
        hints = type_hints(target)
        return tuple(
            name for name in self.signature.parameters if _modules_in(hints.get(name))
        )


def _name(fn: Callable) -> str:
    """`module.qualname`, as jaxtyping names a function in its messages."""
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)}"


decorator.module_parameters.append(ModuleParameters)
