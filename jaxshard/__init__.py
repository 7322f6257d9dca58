"""jaxshard: sharding contracts in jaxtyping annotations, checked wherever JAX runs."""

from ._array_types import BFloat16 as BFloat16
from ._array_types import Bool as Bool
from ._array_types import Complex as Complex
from ._array_types import Complex64 as Complex64
from ._array_types import Complex128 as Complex128
from ._array_types import Float as Float
from ._array_types import Float8e4m3b11fnuz as Float8e4m3b11fnuz
from ._array_types import Float8e4m3fn as Float8e4m3fn
from ._array_types import Float8e4m3fnuz as Float8e4m3fnuz
from ._array_types import Float8e5m2 as Float8e5m2
from ._array_types import Float8e5m2fnuz as Float8e5m2fnuz
from ._array_types import Float16 as Float16
from ._array_types import Float32 as Float32
from ._array_types import Float64 as Float64
from ._array_types import Inexact as Inexact
from ._array_types import Int as Int
from ._array_types import Int2 as Int2
from ._array_types import Int4 as Int4
from ._array_types import Int8 as Int8
from ._array_types import Int16 as Int16
from ._array_types import Int32 as Int32
from ._array_types import Int64 as Int64
from ._array_types import Integer as Integer
from ._array_types import Key as Key
from ._array_types import Num as Num
from ._array_types import partition_spec as partition_spec
from ._array_types import Real as Real
from ._array_types import Shaped as Shaped
from ._array_types import sharded as sharded
from ._array_types import UInt as UInt
from ._array_types import UInt2 as UInt2
from ._array_types import UInt4 as UInt4
from ._array_types import UInt8 as UInt8
from ._array_types import UInt16 as UInt16
from ._array_types import UInt32 as UInt32
from ._array_types import UInt64 as UInt64
from ._config import config as config
from ._decorator import jaxtyped as jaxtyped
from ._errors import ShardingError as ShardingError


__version__ = "0.1.0"

__all__ = [
    "BFloat16",
    "Bool",
    "Complex",
    "Complex64",
    "Complex128",
    "config",
    "Float",
    "Float8e4m3b11fnuz",
    "Float8e4m3fn",
    "Float8e4m3fnuz",
    "Float8e5m2",
    "Float8e5m2fnuz",
    "Float16",
    "Float32",
    "Float64",
    "Inexact",
    "Int",
    "Int2",
    "Int4",
    "Int8",
    "Int16",
    "Int32",
    "Int64",
    "Integer",
    "jaxtyped",
    "Key",
    "Num",
    "partition_spec",
    "Real",
    "Shaped",
    "sharded",
    "ShardingError",
    "UInt",
    "UInt2",
    "UInt4",
    "UInt8",
    "UInt16",
    "UInt32",
    "UInt64",
]
