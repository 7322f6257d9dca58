"""jaxshard: sharding contracts in jaxtyping annotations, checked wherever JAX runs.

Every public name of jaxtyping is here too, so `import jaxshard as jt` can replace
`import jaxtyping as jt`: the dtype classes are subclasses of jaxtyping's (a third item
adds a partition spec), `jaxtyped` and `config` extend jaxtyping's, and the rest are
jaxtyping's own objects.
"""

import sys as _sys
from typing import TYPE_CHECKING

from jaxtyping import (
    AbstractArray as AbstractArray,
    AbstractDtype as AbstractDtype,
    get_array_name_format as get_array_name_format,
    install_import_hook as install_import_hook,
    load_ipython_extension as load_ipython_extension,
    make_numpy_struct_dtype as make_numpy_struct_dtype,
    print_bindings as print_bindings,
    set_array_name_format as set_array_name_format,
)

from ._sharding.array_types import (
    partition_spec as partition_spec,
    sharded as sharded,
)


if TYPE_CHECKING:  # `Float[Array, "b d", P("dp")]` reads as `Array`
    from typing import Any as Partitioned  # a parameter tree of any type

    from jax import Array as Array
    from jax.tree_util import PyTreeDef as PyTreeDef
    from jax.typing import ArrayLike as ArrayLike, DTypeLike as DTypeLike
    from jaxtyping import (
        PRNGKeyArray as PRNGKeyArray,
        PyTree as PyTree,
        Scalar as Scalar,
        ScalarLike as ScalarLike,
    )

    from ._annotate.annotate import (
        annotate as annotate,
        Annotations as Annotations,
    )
    from ._annotations.indirection import (
        BFloat16 as BFloat16,
        Bool as Bool,
        Complex as Complex,
        Complex64 as Complex64,
        Complex128 as Complex128,
        Float as Float,
        Float8e4m3b11fnuz as Float8e4m3b11fnuz,
        Float8e4m3fn as Float8e4m3fn,
        Float8e4m3fnuz as Float8e4m3fnuz,
        Float8e5m2 as Float8e5m2,
        Float8e5m2fnuz as Float8e5m2fnuz,
        Float16 as Float16,
        Float32 as Float32,
        Float64 as Float64,
        Inexact as Inexact,
        Int as Int,
        Int2 as Int2,
        Int4 as Int4,
        Int8 as Int8,
        Int16 as Int16,
        Int32 as Int32,
        Int64 as Int64,
        Integer as Integer,
        Key as Key,
        Num as Num,
        Real as Real,
        Shaped as Shaped,
        UInt as UInt,
        UInt2 as UInt2,
        UInt4 as UInt4,
        UInt8 as UInt8,
        UInt16 as UInt16,
        UInt32 as UInt32,
        UInt64 as UInt64,
    )
    from ._launch.launch import launch as launch, ProcessOutcome as ProcessOutcome
    from ._sharding.place import device_put as device_put, shardings_of as shardings_of
    from ._sharding.summary import (
        ArrayRow as ArrayRow,
        Summary as Summary,
        summary as summary,
    )
    from ._verify.abstract import abstract_args as abstract_args
    from ._verify.collectives import Collective as Collective
    from ._verify.report import Memory as Memory, Report as Report, Row as Row
    from ._verify.tpu import tpu_mesh as tpu_mesh
    from ._verify.verify import verify as verify
else:
    from ._sharding.array_types import (
        BFloat16 as BFloat16,
        Bool as Bool,
        Complex as Complex,
        Complex64 as Complex64,
        Complex128 as Complex128,
        Float as Float,
        Float8e4m3b11fnuz as Float8e4m3b11fnuz,
        Float8e4m3fn as Float8e4m3fn,
        Float8e4m3fnuz as Float8e4m3fnuz,
        Float8e5m2 as Float8e5m2,
        Float8e5m2fnuz as Float8e5m2fnuz,
        Float16 as Float16,
        Float32 as Float32,
        Float64 as Float64,
        Inexact as Inexact,
        Int as Int,
        Int2 as Int2,
        Int4 as Int4,
        Int8 as Int8,
        Int16 as Int16,
        Int32 as Int32,
        Int64 as Int64,
        Integer as Integer,
        Key as Key,
        Num as Num,
        Real as Real,
        Shaped as Shaped,
        UInt as UInt,
        UInt2 as UInt2,
        UInt4 as UInt4,
        UInt8 as UInt8,
        UInt16 as UInt16,
        UInt32 as UInt32,
        UInt64 as UInt64,
    )
    from ._sharding.partitioning import Partitioned as Partitioned
from . import _annotations, _sharding
from ._annotations.logical import axis_rules as axis_rules, BY_NAME as BY_NAME, L as L
from ._config import config as config
from ._errors import (
    AnnotationError as AnnotationError,
    ModelError as ModelError,
    ShardingError as ShardingError,
    TypeCheckError as TypeCheckError,
    UntestedVersionWarning as UntestedVersionWarning,
)
from ._jax_internals import TESTED_JAX as TESTED_JAX
from ._sharding import nnx as _nnx  # noqa: F401 (puts its Module check in jaxtyped)
from ._sharding.constrain import constrain as constrain
from ._sharding.decorator import jaxtyped as jaxtyped
from ._sharding.partitioning import (
    check_partitioning as check_partitioning,
    check_tree as check_tree,
)
from ._sharding.signature import shardings as shardings
from ._values.checked import (
    checked as checked,
    deferred_checks as deferred_checks,
    flush_checks as flush_checks,
)
from ._values.checks import (
    check as check,
    check_finite as check_finite,
    check_range as check_range,
)
from ._values.shard_map import shard_map as shard_map
from ._values.sites import CheckError as CheckError, Failure as Failure
from ._version import __version__ as __version__


# Annotations pickled before the modules moved into subpackages name two of them by
# their old paths.
_sys.modules.setdefault("jaxshard._array_types", _sharding.array_types)
_sys.modules.setdefault("jaxshard._logical", _annotations.logical)

# jaxtyping's names that it makes on first use, and `jaxshard.strategies`, which
# imports hypothesis: made or imported when first asked for, not at `import jaxshard`.
_FROM_JAXTYPING = (
    "Array",
    "ArrayLike",
    "DTypeLike",
    "PRNGKeyArray",
    "PyTree",
    "PyTreeDef",
    "Scalar",
    "ScalarLike",
)


# What only some programs use (verify and its report, the launcher, placing and
# summarising) is imported on first use, so that `import jaxshard` costs little more
# than `import jax`: each name, and the module that defines it.
_ON_FIRST_USE = {
    "abstract_args": "._verify.abstract",
    "annotate": "._annotate.annotate",
    "Annotations": "._annotate.annotate",
    "ArrayRow": "._sharding.summary",
    "Collective": "._verify.collectives",
    "device_put": "._sharding.place",
    "launch": "._launch.launch",
    "Memory": "._verify.report",
    "ProcessOutcome": "._launch.launch",
    "Report": "._verify.report",
    "Row": "._verify.report",
    "shardings_of": "._sharding.place",
    "summary": "._sharding.summary",
    "Summary": "._sharding.summary",
    "tpu_mesh": "._verify.tpu",
    "verify": "._verify.verify",
}


def __getattr__(name: str):
    import importlib

    if name in _FROM_JAXTYPING:
        import jaxtyping

        return getattr(jaxtyping, name)
    if name == "strategies":
        return importlib.import_module("jaxshard.strategies")
    if name in _ON_FIRST_USE:
        value = getattr(importlib.import_module(_ON_FIRST_USE[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxshard' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_FROM_JAXTYPING, *_ON_FIRST_USE, "strategies"})


__all__ = [
    "abstract_args",
    "annotate",
    "Annotations",
    "AbstractArray",
    "AbstractDtype",
    "AnnotationError",
    "Array",
    "ArrayLike",
    "ArrayRow",
    "axis_rules",
    "BFloat16",
    "Bool",
    "BY_NAME",
    "check",
    "check_finite",
    "check_partitioning",
    "check_range",
    "check_tree",
    "checked",
    "CheckError",
    "Collective",
    "Complex",
    "Complex128",
    "Complex64",
    "config",
    "constrain",
    "deferred_checks",
    "device_put",
    "DTypeLike",
    "Failure",
    "Float",
    "Float16",
    "Float32",
    "Float64",
    "Float8e4m3b11fnuz",
    "Float8e4m3fn",
    "Float8e4m3fnuz",
    "Float8e5m2",
    "Float8e5m2fnuz",
    "flush_checks",
    "get_array_name_format",
    "Inexact",
    "install_import_hook",
    "Int",
    "Int16",
    "Int2",
    "Int32",
    "Int4",
    "Int64",
    "Int8",
    "Integer",
    "jaxtyped",
    "Key",
    "L",
    "launch",
    "load_ipython_extension",
    "make_numpy_struct_dtype",
    "Memory",
    "ModelError",
    "Num",
    "partition_spec",
    "Partitioned",
    "print_bindings",
    "PRNGKeyArray",
    "ProcessOutcome",
    "PyTree",
    "PyTreeDef",
    "Real",
    "Report",
    "Row",
    "Scalar",
    "ScalarLike",
    "set_array_name_format",
    "Shaped",
    "shard_map",
    "sharded",
    "ShardingError",
    "shardings",
    "shardings_of",
    "summary",
    "Summary",
    "TESTED_JAX",
    "tpu_mesh",
    "TypeCheckError",
    "UInt",
    "UInt16",
    "UInt2",
    "UInt32",
    "UInt4",
    "UInt64",
    "UInt8",
    "UntestedVersionWarning",
    "verify",
]
