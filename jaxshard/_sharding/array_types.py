"""`Float[Array, "batch d", P("dp", None)]`: jaxtyping annotations with a sharding.

Each dtype class here is a subclass of jaxtyping's. With two items it returns
jaxtyping's annotation, made by jaxtyping, whose `.dtype` is the jaxshard class. With a
third item, a `PartitionSpec`, it returns a subclass of that annotation whose
`isinstance` check also checks the sharding (see `layout.py`).
"""

import copyreg
import functools as ft
import typing
from typing import Any, get_args, get_origin

import jax
import jaxtyping
from jax.sharding import NamedSharding, PartitionSpec

from .._annotations import dims, tensors
from .._annotations.logical import active_rules, BY_NAME, explain, L, resolve
from .._annotations.spec import format_spec, parse_compact, validate_spec
from .._errors import AnnotationError, did_you_mean
from .._jax_internals import (
    ArrayMeta,
    bind_dims,
    in_tree_flatten,
    restore_dim_memo,
    save_dim_memo,
    simple_dims,
)
from . import decorator, layout


_MetaAbstractDtype = type(jaxtyping.AbstractDtype)
_union_types = (typing.Union, type(int | str))


class _Shape:
    """Stands in for a block in jaxtyping's shape check, with the global shape."""

    def __init__(self, shape: tuple[int, ...]):
        self.shape = shape


_CONCRETE = layout.CONCRETE
_plain_check = ArrayMeta.__instancecheck_str__


class _MetaShardedArray(ArrayMeta):
    spec: PartitionSpec
    resolves: bool  # whether `spec` depends on the rules in force
    _passed: dict  # the layouts known to pass, by `layout.known_key`: their rank
    _plain: Any  # the jaxtyping annotation this one adds a spec to
    _fast: tuple  # (rank, _passed, dtypes, dims, logical), read at once
    # The fast path: a concrete array of a dtype that passed before (`dtypes`) whose
    # layout passed before (`layout.known_key`, inlined for a NamedSharding: `rank`
    # is the annotation's, -1 for a variadic one, `None` for none; `logical`,
    # whether the layout is known per resolved spec), its shape checked by
    # `bind_dims` where the annotation's dimensions allow (`dims`; else by
    # jaxtyping). Any failure is checked in full below, to say all that is wrong.

    def __instancecheck_str__(cls, obj: Any) -> str:
        if cls._skip_instancecheck:  # see `make_transparent`
            return ""
        rank, passed, dtypes, dims, logical = cls._fast
        if type(obj) in _CONCRETE and obj.dtype in dtypes:
            sharding = obj.sharding
            if type(sharding) is not NamedSharding:
                known = passed.get(layout.known_key(cls, obj))
            else:
                known = passed.get((sharding, cls.known_spec) if logical else sharding)
            if known == rank or (rank == -1 and known == obj.ndim):
                if dims is None:
                    if not _plain_check(cls._plain, obj):
                        return ""
                elif bind_dims(dims, obj.shape):
                    return ""
        elif not layout.is_array_like(obj):
            # Not an array (a node of a tree that `PyTree[...]` asks about, say):
            # jaxtyping's answer, which is all there is to say.
            return _plain_check(cls, obj)
        value = tensors.jax_value(obj)  # a torchax tensor's jax.Array
        if isinstance(value, jax.core.Tracer):
            # Checking a tracer may leave a probe in the program: only once the
            # dtype and shape are known to be right.
            snapshot = save_dim_memo()
            reason = ArrayMeta.__instancecheck_str__(cls, obj)
            if reason or in_tree_flatten():
                return _shape_failure(cls, obj, reason)
            reason = layout.check(cls, obj, value)
        else:
            # A concrete array's check has no side effect: do it first, so that the
            # common passing case needs no snapshot of jaxtyping's dim bindings.
            reason = layout.check(cls, obj, value)
            if not reason:
                reason = _plain_check(cls, obj)
                if not reason and obj is value and not in_tree_flatten():
                    dtypes[obj.dtype] = True  # see the fast path
                return _shape_failure(cls, obj, reason)
            snapshot = save_dim_memo()
            plain = ArrayMeta.__instancecheck_str__(cls, obj)
            if in_tree_flatten():
                return plain
            if plain:
                if not layout.is_array_like(obj):
                    return plain
                if isinstance(value, jax.Array):
                    # Its rank, shape or dtype is wrong: that, not how it is laid
                    # out (which no spec of this rank can describe), is the error.
                    restore_dim_memo(snapshot)
                    return _shape_failure(cls, obj, plain)
                # A numpy array or a scalar: say that it has no sharding.
                reason = f"{plain.rstrip('.')}; {reason}"
        if reason:
            restore_dim_memo(snapshot)
            decorator.note_failure(obj, reason, annotation=cls)
        return reason

    def make_transparent(cls) -> None:
        # jaxtyping's, for the return annotation of a generator checked without a
        # typechecker: from then on the annotation passes anything, as jaxtyping's.
        super().make_transparent()
        cls._fast = (None, {}, {}, None, False)

    def _check_shape(cls, obj, single_memo, variadic_memo, arg_memo) -> str:
        shape = None
        value = tensors.jax_value(obj)
        if isinstance(value, jax.core.Tracer):
            shape = layout.global_shape(cls, value)
        if shape is None or shape == tuple(obj.shape):
            return ArrayMeta._check_shape(
                cls, obj, single_memo, variadic_memo, arg_memo
            )
        reason = ArrayMeta._check_shape(
            cls, _Shape(shape), single_memo, variadic_memo, arg_memo
        )
        if reason:
            reason += (
                f" (inside shard_map this value is one block of the global array: its "
                f"local shape {tuple(obj.shape)} is a global shape of {shape} under "
                f"{format_spec(cls.spec)}; the annotation describes the global array)"
            )
            decorator.note_failure(obj, reason, sharding=False, annotation=cls)
        return reason

    def __repr__(cls) -> str:
        return cls.__name__


def _shape_failure(cls: Any, obj: Any, reason: str) -> str:
    """`reason`, jaxtyping's why an array's shape or dtype is not `cls`'s, noted for
    the enclosing `jaxshard.jaxtyped` call's message (whose error is jaxtyping's
    `TypeCheckError`, now saying why); "" stays ""."""
    if reason and not in_tree_flatten() and layout.is_array_like(obj):
        decorator.note_failure(obj, reason, sharding=False, annotation=cls)
    return reason


class _MetaLogicalArray(_MetaShardedArray):
    """An annotation whose spec names logical axes (`L(...)` or `BY_NAME`): `spec` is
    resolved under the rules in force each time it is read."""

    logical: tuple  # the logical spec's entries
    by_name: bool

    @property
    def spec(cls) -> PartitionSpec:  # pyright: ignore[reportIncompatibleVariableOverride]
        return _resolved(cls.logical, cls.by_name, active_rules())

    @property
    def known_spec(cls) -> PartitionSpec | None:
        """`spec`, or `None` if the rules in force cannot resolve it: what the
        layouts known to pass are kept by (see `layout.known_key`)."""
        try:
            return _resolved(cls.logical, cls.by_name, active_rules())
        except AnnotationError:
            return None

    def explain(cls) -> str:
        """How the rules in force resolve the annotation's logical spec."""
        rules = active_rules()
        spec = _resolved(cls.logical, cls.by_name, rules)
        assert rules is not None
        return explain(cls.logical, cls.by_name, rules, spec)


@ft.lru_cache(maxsize=4096)
def _resolved(logical: tuple, by_name: bool, rules: Any) -> PartitionSpec:
    shown = repr(L(*logical)) if not by_name else f"BY_NAME ({L(*logical)!r})"
    if rules is None:
        raise AnnotationError(
            f"The annotation's spec {shown} names logical axes, but no axis rules are "
            "in force to map them to mesh axes. Set some: `with "
            "jaxshard.axis_rules([('batch', 'dp'), ...]):` (or flax's "
            "`nn.logical_axis_rules`)."
        )
    spec, unknown = resolve(logical, rules, by_name=by_name)
    if unknown and not by_name and rules.unknown == "error":
        known = ", ".join(map(repr, rules.known)) or "none"
        raise AnnotationError(
            f"The annotation's spec {shown} names {', '.join(map(repr, unknown))}"
            f"{did_you_mean(unknown, rules.known, inline=True)}, "
            f"which {rules.describe()} do not mention. The logical names they know: "
            f"{known}. Add a rule (`(name, None)` for unsharded), or pass "
            "`unknown='replicated'` to jaxshard.axis_rules to treat unknown names as "
            "unsharded."
        )
    try:
        return validate_spec(spec, len(spec), False)
    except AnnotationError as e:
        raise AnnotationError(
            f"Under {rules.describe()}, the annotation's spec {shown} is "
            f"{format_spec(spec)}, which is not a valid spec: {e}"
        ) from None


def _pickle_sharded(cls):
    plain = cls.dtype[cls.array_type, cls.dim_str]
    if isinstance(cls, _MetaLogicalArray):
        return with_spec, (plain, BY_NAME if cls.by_name else L(*cls.logical))
    return with_spec, (plain, cls.spec)


copyreg.pickle(_MetaShardedArray, _pickle_sharded)  # pyright: ignore[reportArgumentType]
copyreg.pickle(_MetaLogicalArray, _pickle_sharded)  # pyright: ignore[reportArgumentType]


def with_spec(annotation: Any, spec: Any) -> Any:
    """Adds `spec` to a plain jaxtyping annotation (or to each member of a union)."""
    if get_origin(annotation) in _union_types:
        return typing.Union[tuple(with_spec(a, spec) for a in get_args(annotation))]
    if not (
        isinstance(annotation, type) and issubclass(annotation, jaxtyping.AbstractArray)
    ):
        return annotation  # e.g. `float` in `Float[Array | float, ""]`: no sharding
    variadic = annotation.index_variadic is not None
    logical = None
    if spec is BY_NAME:
        logical = _by_name(annotation)
    elif isinstance(spec, L):
        if not variadic and len(spec) > len(annotation.dims):
            raise AnnotationError(
                f"The logical spec {spec!r} has {len(spec)} entries but the shape has "
                f"only {len(annotation.dims)} dimensions."
            )
        logical = spec.entries
    else:
        spec = validate_spec(spec, len(annotation.dims) - variadic, variadic)
    array_type = getattr(annotation.array_type, "__name__", repr(annotation.array_type))
    array_type = array_type.rsplit(".", 1)[
        -1
    ]  # jax.Array calls itself jaxlib._jax.Array
    name = (
        f"{annotation.dtype.__name__}[{array_type}, '{annotation.dim_str}', "
        f"{format_spec(spec) if logical is None else repr(spec)}]"
    )
    namespace = {"resolves": logical is not None, "_passed": {}, "_plain": annotation}
    rank = -1 if variadic else len(annotation.dims)
    dims = simple_dims(annotation)
    namespace["_fast"] = (rank, namespace["_passed"], {}, dims, logical is not None)
    if logical is None:
        out = _MetaShardedArray(name, (annotation,), {**namespace, "spec": spec})
    else:
        namespace.update(logical=logical, by_name=spec is BY_NAME)
        out = _MetaLogicalArray(name, (annotation,), namespace)
    # beartype wants `repr(A | int)` to start with `repr(A)`: only "builtins" gives
    # a class a union repr without a module prefix.
    out.__module__ = "builtins"
    out.__qualname__ = name
    return out


def _by_name(annotation: Any) -> tuple:
    """`BY_NAME`'s logical spec: each named dimension's name, `None` elsewhere."""
    entries = []
    for dim in dims.dimensions(annotation):
        if dim.kind == "variadic":
            later = [d.name for d in dims.dimensions(annotation)[len(entries) + 1 :]]
            if any(d.isidentifier() for d in later):
                raise AnnotationError(
                    f"BY_NAME cannot place the dimensions after the variadic "
                    f"{dim.token!r} in {annotation.dim_str!r}: their positions in the "
                    "array are not fixed. Use jaxshard.L(...) for the dimensions "
                    "before it, or move the variadic dimension last."
                )
            break
        entries.append(dim.name if dim.kind == "named" else None)
    return tuple(entries)


class _MetaShardedDtype(_MetaAbstractDtype):
    def __getitem__(cls, item):
        # jaxtyping's own `__getitem__`, called on this class: the annotation's
        # `.dtype` is jaxshard's class (a subclass of jaxtyping's), and pickling, which
        # rebuilds an annotation from its `.dtype`, gives jaxshard's back.
        _check_shape_string(cls, item)
        if isinstance(item, tuple) and len(item) == 3:
            array_type, dim_str, spec = item
            plain = super().__getitem__((array_type, dim_str))
            return with_spec(_made(plain, dim_str), spec)
        if isinstance(item, tuple) and len(item) == 2 and "[" in str(item[1]):
            # The compact syntax, `Float[Array, "[batch/dp] d"]`: a static type too.
            array_type, text = item
            dims, spec = parse_compact(text)
            return with_spec(_made(super().__getitem__((array_type, dims)), text), spec)
        out = super().__getitem__(item)
        return (
            _made(out, item[1]) if isinstance(item, tuple) and len(item) == 2 else out
        )


def _check_shape_string(dtype: Any, item: Any) -> None:
    """Raises unless the second item of `Float[Array, ...]` is the shape string:
    jaxtyping would fail on a spec there with an `AttributeError` of its own."""
    if not (isinstance(item, tuple) and len(item) in (2, 3)):
        return  # jaxtyping says what is wrong with a missing shape
    second = item[1]
    if isinstance(second, str) or hasattr(second, "strip"):
        return  # a shape string (jaxtyping reads any that `strip`s)
    name, array = dtype.__name__, _type_name(item[0])
    if not (isinstance(second, (PartitionSpec, L)) or second is BY_NAME):
        raise AnnotationError(
            f"The second item of `{name}[{array}, ...]` must be the shape string, "
            f'e.g. `{name}[{array}, "batch d"]`; got {second!r} of type '
            f"{type(second).__name__}."
        )
    spec = format_spec(second) if isinstance(second, PartitionSpec) else repr(second)
    if len(item) == 3 and isinstance(item[2], str):
        raise AnnotationError(
            f"`{name}[{array}, {spec}, {item[2]!r}]` has the spec before the shape "
            f"string: the shape comes second, the spec third. Write "
            f"`{name}[{array}, {item[2]!r}, {spec}]`."
        )
    rank = max(1, len(second)) if second is not BY_NAME else 2
    example = " ".join(("batch", "seq", "d", "e", "f", "g", "h", "i")[:rank])
    raise AnnotationError(
        f"`{name}[{array}, {spec}]` has no shape string: the second item of a "
        "jaxshard annotation is the array's dimensions, and the spec comes third. "
        f'Write `{name}[{array}, "dims...", {spec}]`, e.g. '
        f'`{name}[{array}, "{example}", {spec}]`.'
    )


def _type_name(array_type: Any) -> str:
    """`Array`, `ndarray | Array`: the array type as an annotation's repr shows it."""
    members = get_args(array_type) if get_origin(array_type) in _union_types else ()
    # Some jax versions' `jax.Array` calls itself `jaxlib._jax.Array`.
    names = (getattr(t, "__name__", repr(t)) for t in members or (array_type,))
    return " | ".join(n.rsplit(".", 1)[-1] for n in names)


def _made(annotation: Any, shown: Any) -> Any:
    """`annotation`, once each symbolic dimension of its shape (`batch-1`) is known
    to be a Python expression: jaxtyping would find out only when it evaluates it,
    at a call. `shown` is the shape string as the user wrote it."""
    for member in get_args(annotation) or (annotation,):
        if isinstance(member, type) and issubclass(member, jaxtyping.AbstractArray):
            for dim in dims.dimensions(member):
                if dim.kind == "symbolic":
                    _expression(dim.name, str(shown))
    return annotation


@ft.lru_cache(maxsize=1024)
def _expression(text: str, dim_str: str) -> None:
    try:
        compile(f"f'{text}'", "<dimension>", "eval")  # jaxtyping's f-string pass
        if "{" not in text:
            compile(text, "<dimension>", "eval")
    except SyntaxError as e:
        raise AnnotationError(
            f"Cannot parse the shape {dim_str!r}: {text!r} is neither a dimension "
            "name, a size nor a Python expression of them "
            f"({e.msg}). Dimensions are separated by spaces, e.g. 'batch d', "
            "'batch-1 2*d'."
        ) from None


def _sharded_dtype(plain) -> Any:
    out = _MetaShardedDtype(plain.__name__, (plain,), {})
    out.__module__ = "jaxshard"
    out.__doc__ = (
        f"jaxtyping's `{plain.__name__}` (a subclass); a third item adds a partition "
        "spec."
    )
    return out


def sharded(dtype: Any, text: str, *, array_type: Any = jax.Array) -> Any:
    """Builds a sharded annotation from the compact syntax.

    A dimension in brackets is sharded: `[dim/axis]`, or `[dim/(axis1,axis2)]` for a
    dimension sharded over several mesh axes. The dimension may be any jaxtyping
    dimension expression (`[batch-1/dp]`).

    **Arguments:**

    - `dtype`: a dtype class, e.g. `jaxshard.Float` (jaxtyping's own dtype classes
        work too).
    - `text`: the dimensions, e.g. `"[batch/dp] seqlen [heads/(tp,fsdp)] d"`.
    - `array_type`: keyword-only, the array type; `jax.Array` by default.

    **Returns:**

    The same annotation as `dtype[array_type, dims, spec]`.

    !!! Example

        ```python
        X = jaxshard.sharded(Float, "[batch/dp] seqlen [heads/(tp,fsdp)] d")
        # Float[Array, 'batch seqlen heads d', P('dp', None, ('tp', 'fsdp'), None)]
        ```
    """
    if not (isinstance(dtype, type) and issubclass(dtype, jaxtyping.AbstractDtype)):
        raise AnnotationError(
            f"sharded(dtype, text) takes a dtype class such as jaxshard.Float as its "
            f"first argument; got {dtype!r}."
        )
    if not isinstance(text, str):
        raise AnnotationError(f"sharded(dtype, text) takes a string; got {text!r}.")
    dims, spec = parse_compact(text)
    return with_spec(dtype[array_type, dims], spec)


def partition_spec(annotation: Any) -> PartitionSpec | None:
    """The partition spec of a sharded annotation.

    **Arguments:**

    - `annotation`: e.g. `Float[Array, "batch d", P("dp", None)]`, or a union of
        annotations that share one spec (as `Float[Array | np.ndarray, ...]` makes).

    **Returns:**

    The `PartitionSpec`, or `None` for an annotation that states no sharding.
    """
    if isinstance(annotation, _MetaShardedArray):
        return annotation.spec
    if get_origin(annotation) in _union_types:
        specs = {partition_spec(a) for a in get_args(annotation)} - {None}
        if len(specs) == 1:
            return specs.pop()
    return None


UInt2 = _sharded_dtype(jaxtyping.UInt2)
UInt4 = _sharded_dtype(jaxtyping.UInt4)
UInt8 = _sharded_dtype(jaxtyping.UInt8)
UInt16 = _sharded_dtype(jaxtyping.UInt16)
UInt32 = _sharded_dtype(jaxtyping.UInt32)
UInt64 = _sharded_dtype(jaxtyping.UInt64)
Int2 = _sharded_dtype(jaxtyping.Int2)
Int4 = _sharded_dtype(jaxtyping.Int4)
Int8 = _sharded_dtype(jaxtyping.Int8)
Int16 = _sharded_dtype(jaxtyping.Int16)
Int32 = _sharded_dtype(jaxtyping.Int32)
Int64 = _sharded_dtype(jaxtyping.Int64)
Float8e4m3b11fnuz = _sharded_dtype(jaxtyping.Float8e4m3b11fnuz)
Float8e4m3fn = _sharded_dtype(jaxtyping.Float8e4m3fn)
Float8e4m3fnuz = _sharded_dtype(jaxtyping.Float8e4m3fnuz)
Float8e5m2 = _sharded_dtype(jaxtyping.Float8e5m2)
Float8e5m2fnuz = _sharded_dtype(jaxtyping.Float8e5m2fnuz)
BFloat16 = _sharded_dtype(jaxtyping.BFloat16)
Float16 = _sharded_dtype(jaxtyping.Float16)
Float32 = _sharded_dtype(jaxtyping.Float32)
Float64 = _sharded_dtype(jaxtyping.Float64)
Complex64 = _sharded_dtype(jaxtyping.Complex64)
Complex128 = _sharded_dtype(jaxtyping.Complex128)
Bool = _sharded_dtype(jaxtyping.Bool)
UInt = _sharded_dtype(jaxtyping.UInt)
Int = _sharded_dtype(jaxtyping.Int)
Integer = _sharded_dtype(jaxtyping.Integer)
Float = _sharded_dtype(jaxtyping.Float)
Complex = _sharded_dtype(jaxtyping.Complex)
Inexact = _sharded_dtype(jaxtyping.Inexact)
Real = _sharded_dtype(jaxtyping.Real)
Num = _sharded_dtype(jaxtyping.Num)
Shaped = _sharded_dtype(jaxtyping.Shaped)
Key = _sharded_dtype(jaxtyping.Key)
