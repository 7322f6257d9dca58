"""jaxshard's exceptions: every contract failure is a `jaxtyping.TypeCheckError`."""

from typing import Any

from jaxtyping import (
    AnnotationError as AnnotationError,
    TypeCheckError as TypeCheckError,
)


class ShardingError(TypeCheckError):
    """An array is not sharded the way its annotation says.

    A subclass of `jaxtyping.TypeCheckError`, so code that catches jaxtyping's errors
    catches this one too. The message names the function, the parameter (or the return
    value), the expected and actual partition specs, the mesh, and the array's dtype
    and shape.
    """


ShardingError.__module__ = "jaxshard"


class ModelError(Exception):
    """`jaxshard.verify` could not trace or compile the function, for a reason of its
    own rather than a contract: JAX refused one of its operations (a sharding type
    error on Explicit axes, say). The message names the function, the source line and
    the operation, and `__cause__` is JAX's error."""


ModelError.__module__ = "jaxshard"


class UntestedVersionWarning(UserWarning):
    """The installed jax is outside the range this jaxshard release is tested with."""


UntestedVersionWarning.__module__ = "jaxshard"


def expect(ok: bool, function: str, parameter: str, accepts: str, value: Any) -> None:
    """A public entry point's argument check: unless `ok`, a `TypeError` that names
    the function, the parameter, what it accepts and what it got."""
    if not ok:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise TypeError(
            f"jaxshard.{function}: `{parameter}` takes {accepts}; got {shown} (type "
            f"{type(value).__name__})."
        )


def expect_callable(function: str, fn: Any, parameter: str = "fn") -> None:
    expect(callable(fn), function, parameter, "a function (any callable)", fn)
