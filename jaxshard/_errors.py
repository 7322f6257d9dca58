"""jaxshard's exceptions: every contract failure is a `jaxtyping.TypeCheckError`."""

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


class UntestedVersionWarning(UserWarning):
    """The installed jax is outside the range this jaxshard release is tested with."""


UntestedVersionWarning.__module__ = "jaxshard"
