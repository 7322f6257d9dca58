"""What static type checkers see of jaxshard's dtype classes (read only under
`typing.TYPE_CHECKING`, as jaxtyping does): `Annotated`, so that
`Float[Array, "b d", P("dp", None)]` reads as `Array` to mypy and pyright, the shape
and the spec being metadata."""

from typing import (
    Annotated as BFloat16,  # noqa: F401
    Annotated as Bool,  # noqa: F401
    Annotated as Complex,  # noqa: F401
    Annotated as Complex64,  # noqa: F401
    Annotated as Complex128,  # noqa: F401
    Annotated as Float,  # noqa: F401
    Annotated as Float8e4m3b11fnuz,  # noqa: F401
    Annotated as Float8e4m3fn,  # noqa: F401
    Annotated as Float8e4m3fnuz,  # noqa: F401
    Annotated as Float8e5m2,  # noqa: F401
    Annotated as Float8e5m2fnuz,  # noqa: F401
    Annotated as Float16,  # noqa: F401
    Annotated as Float32,  # noqa: F401
    Annotated as Float64,  # noqa: F401
    Annotated as Inexact,  # noqa: F401
    Annotated as Int,  # noqa: F401
    Annotated as Int2,  # noqa: F401
    Annotated as Int4,  # noqa: F401
    Annotated as Int8,  # noqa: F401
    Annotated as Int16,  # noqa: F401
    Annotated as Int32,  # noqa: F401
    Annotated as Int64,  # noqa: F401
    Annotated as Integer,  # noqa: F401
    Annotated as Key,  # noqa: F401
    Annotated as Num,  # noqa: F401
    Annotated as Real,  # noqa: F401
    Annotated as Shaped,  # noqa: F401
    Annotated as UInt,  # noqa: F401
    Annotated as UInt2,  # noqa: F401
    Annotated as UInt4,  # noqa: F401
    Annotated as UInt8,  # noqa: F401
    Annotated as UInt16,  # noqa: F401
    Annotated as UInt32,  # noqa: F401
    Annotated as UInt64,  # noqa: F401
    TYPE_CHECKING,
)


if not TYPE_CHECKING:
    raise ImportError(
        "jaxshard._annotations.indirection is for static type checkers only"
    )
