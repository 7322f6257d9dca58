"""Does an array's sharding match an annotation's partition spec?

`check` returns "" when it does and a sentence saying what is wrong when it does not,
like jaxtyping's `__instancecheck_str__`. Where the answer is only known when XLA
compiles (inside `jit` on a mesh with Auto axes), `check` returns "" and leaves a probe
in the program; a mismatch found by the probe is raised as `ShardingError` out of the
call that compiled the program (see `_on_compile`).
"""

import math
from typing import Any

import jax
import jax.monitoring
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from .. import _config
from .._annotations import tensors
from .._annotations.spec import (
    axes_of,
    format_spec,
    sharded_type,
    splits,
)
from .._errors import AnnotationError
from .._jax_internals import (
    context_mesh,
    in_linen_init,
    is_batched,
)
from . import decorator
from .compare import compare, invalid, missing_axes, phrase
from .describe import describe_array, describe_mesh
from .probes import add_probe
from .sites import make_site, no_mesh_note


# --- verdicts known: the eager fast path --------------------------------------------
#
# An array's sharding object is usually shared and immutable: once a concrete array
# with a sharding passed an annotation's check, a later array with the same sharding
# object (or an equal one) and rank passes too, in the same context. Each sharded
# annotation keeps the layouts that passed (`_passed`, a few dozen at most); failures
# are never kept, so a failing call always says why in full.

CONCRETE: set[type] = set()  # the types of concrete jax.Arrays met so far
_KNOWN = 64  # layouts kept per annotation


def known_key(annotation, obj: Any) -> Any:
    """What the verdict on the concrete array `obj` depends on besides its rank: its
    sharding, and the mesh in context and whether it is committed unless the sharding
    names its mesh, and for a logical annotation the spec the rules in force give;
    `None` if the spec cannot be resolved."""
    sharding = obj.sharding
    key = (
        sharding
        if type(sharding) is NamedSharding
        else (sharding, context_mesh(), obj.committed)
    )
    if annotation.resolves:
        try:
            return key, annotation.spec
        except AnnotationError:
            return None
    return key


def _remember(annotation, obj: Any) -> None:
    passed = annotation._passed
    key = known_key(annotation, obj)
    if key is None:
        return
    if len(passed) >= _KNOWN:
        passed.clear()  # a program that makes shardings anew: start again
    passed[key] = len(obj.shape)


# --- the checks ---------------------------------------------------------------------


def is_array_like(obj: Any) -> bool:
    """A numpy array or scalar, a Python number, or a jax.Array."""
    return isinstance(obj, (int, float, complex)) or (
        hasattr(obj, "shape") and hasattr(obj, "dtype")
    )


def check(annotation, obj: Any, value: Any) -> str:
    """Why `obj`'s sharding does not satisfy `annotation.spec`; "" if it does.
    `value` is `tensors.jax_value(obj)`: the jax.Array of a torchax tensor."""
    if _config.current().sharding == "off" or in_linen_init():
        return ""  # off; or flax's init, whose dummy batch is not data
    try:
        spec = annotation.spec
    except AnnotationError as e:  # logical names the rules cannot resolve
        return str(e)
    if value is tensors.ELSEWHERE:
        return tensors.elsewhere(obj, format_spec(spec))
    named, obj = obj, value
    if isinstance(obj, jax.core.Tracer):
        return _check_traced(annotation, obj, named)
    if not isinstance(obj, jax.Array):
        return (
            f"this value is a {type(obj).__module__}.{type(obj).__qualname__}, which "
            f"has no sharding, but the annotation expects {format_spec(spec)}. Pass a "
            "jax.Array, e.g. `jax.device_put(x, NamedSharding(mesh, spec))`."
        )
    if named is obj:
        CONCRETE.add(type(obj))
    reason = _check_concrete(annotation, obj, spec)
    if not reason:
        _remember(annotation, obj)
    return reason


def _check_concrete(annotation, obj: Any, spec: PartitionSpec) -> str:
    """`check` of the concrete `jax.Array` `obj`."""
    sharding = obj.sharding
    mesh = None
    if not isinstance(sharding, NamedSharding):
        mesh = context_mesh()
        if mesh is None:
            if len(sharding.device_set) == 1:
                return ""  # code annotated for a pod, running on one device
            return (
                f"this array ({describe_array(obj.dtype, obj.shape)}) is spread over "
                f"{len(sharding.device_set)} devices by a {type(sharding).__name__}, "
                "which names no mesh axes, and there is no mesh in context to read "
                f"the annotation's spec {format_spec(spec)} against. Run the code "
                "inside `with jax.set_mesh(mesh):`."
            )
        if len(sharding.device_set) == 1 and not obj.committed:
            # Made by `jnp` without `device_put`: JAX moves such an array to where
            # it is used, so only a spec that splits a dimension is a mistake.
            reason = invalid(spec, mesh, len(obj.shape))
            if reason:
                array = describe_array(obj.dtype, obj.shape)
                return _with_rules(phrase(array, reason), annotation)
            if not splits(spec, mesh.shape):
                return ""
            return _with_rules(_uncommitted(obj, spec, mesh), annotation)
    reason = compare(spec, sharding, obj.shape, obj.dtype, mesh)
    if not reason:
        return ""
    return _with_rules(phrase(describe_array(obj.dtype, obj.shape), reason), annotation)


def _uncommitted(obj: Any, spec: PartitionSpec, mesh) -> str:
    return (
        f"this array ({describe_array(obj.dtype, obj.shape)}) is on one device, "
        "uncommitted (made without `jax.device_put`), but the annotation expects "
        f"{format_spec(spec)} ({sharded_type(obj.dtype, obj.shape, spec)}), on mesh "
        f"{describe_mesh(mesh)}. Place it as the annotation says: "
        f"`jax.device_put(x, NamedSharding(mesh, {format_spec(spec)}))`."
    )


def is_explicit(obj: Any) -> bool:
    """Whether `obj` is an array or tracer on a mesh whose axes are all Explicit,
    whose layout is part of its type."""
    if not isinstance(obj, jax.Array):
        return False
    mesh = jax.typeof(obj).sharding.mesh
    return not mesh.empty and set(mesh.axis_types) == {AxisType.Explicit}


def explicit_mismatch(annotation: Any, obj: Any, spec: Any = None) -> str:
    """Why `obj`, an array or tracer on a mesh whose axes are all Explicit, is not
    laid out as `annotation` (or `spec`, in its place) says; "" if it is, or if its
    layout is not in its type."""
    value = tensors.jax_value(obj)
    if not is_explicit(value):
        return ""
    aval = jax.typeof(value)
    spec = annotation.spec if spec is None else spec
    reason = compare(spec, aval.sharding, aval.shape, aval.dtype)
    if not reason:
        return ""
    array = describe_array(aval.dtype, aval.shape)
    return _with_rules(phrase(array, reason), annotation)


def _with_rules(reason: str, annotation: Any) -> str:
    """`reason`, and for a logical annotation how the rules resolved it."""
    if not reason or not hasattr(annotation, "explain"):
        return reason
    return f"{reason.rstrip('.')}; {annotation.explain()}."


def _check_traced(annotation, x, named: Any) -> str:
    """The check of the tracer `x`; `named` is the value messages name (the
    torchax tensor around `x`, or `x`)."""
    aval = jax.typeof(x)
    mesh = aval.sharding.mesh
    if not mesh.empty:
        types = set(mesh.axis_types)
        if AxisType.Manual in types:
            reason = _check_manual(annotation.spec, aval, mesh, is_batched(x))
            return _verdict(annotation, named, aval, _with_rules(reason, annotation))
        if types == {AxisType.Explicit}:
            reason = compare(annotation.spec, aval.sharding, aval.shape, aval.dtype)
            if reason:
                reason = phrase(describe_array(aval.dtype, aval.shape), reason)
                reason = _with_rules(reason, annotation)
                reason = f"{reason} {no_mesh_note()}".rstrip()
            return _verdict(annotation, named, aval, reason)
    if decorator.probed_before(x, annotation):
        return ""  # a probe is in the program already; it reports any mismatch
    reason = add_probe(annotation, x, aval, named)
    if not reason:
        decorator.note_probed(x, annotation)
    return reason


def _verdict(annotation, x, aval, reason: str) -> str:
    """`reason`; or, while `jaxshard.verify` records, "" after recording it."""
    recorder = _config.current().recorder
    if recorder is None:
        return reason
    recorder.add(make_site(annotation, x, aval, recorder), aval.sharding, reason)
    return ""


def _check_manual(spec: PartitionSpec, aval, mesh, batched: bool) -> str:
    """Inside `shard_map`: the value is one block of the global array.

    Under `vmap` the mapped dimension may be what varies across devices, and it is not
    part of the annotation: then only the axis names are checked."""
    reason = missing_axes(spec, mesh)
    if reason:
        return phrase(aval.str_short(), reason)
    if len(spec) > len(aval.shape):
        return phrase(
            aval.str_short(),
            f"the annotation's spec {format_spec(spec)} has {len(spec)} entries but "
            f"the array has {len(aval.shape)} dimensions",
        )
    reason = _varies_unsaid(spec, aval, mesh, batched)
    if reason:
        return reason
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    if AxisType.Explicit in types.values() and AxisType.Auto not in types.values():
        # A partly manual shard_map: the other axes are still in the type.
        rest = PartitionSpec(
            *(
                e
                if e is PartitionSpec.UNCONSTRAINED
                else tuple(a for a in axes_of(e) if types[a] != AxisType.Manual) or None
                for e in spec
            )
        )
        reason = compare(rest, aval.sharding, aval.shape, aval.dtype)
        if reason:
            return phrase(aval.str_short(), reason)
    return ""


def _varies_unsaid(spec: PartitionSpec, aval, mesh, batched: bool) -> str:
    """Why a `shard_map` block is not one of the global array `spec` describes: it
    differs across manual axes that `spec` says the array is replicated over; ""
    if not."""
    extra = sorted(_unexplained(spec, aval, mesh))
    if not extra or batched or PartitionSpec.UNCONSTRAINED in tuple(spec):
        return ""
    return (
        f"this block ({aval.str_short()}) differs across the shard_map mesh "
        f"axes {', '.join(map(repr, extra))}, but the annotation's spec "
        f"{format_spec(spec)} says the array is replicated over them (mesh "
        f"{describe_mesh(mesh)})."
    )


def block_mismatch(x: Any, spec: PartitionSpec, annotation: Any = None) -> str:
    """Inside a `shard_map` body, why the block `x` is not one of the global array
    `spec` describes over the axes the body is manual over, which `constrain` and
    `device_put` leave as they are: the check of a `jaxtyped` parameter's block,
    less the other axes, which they lay out. "" if it is, or outside a body.
    `annotation` (if any) says how the rules resolved a logical spec."""
    if not isinstance(x, jax.core.Tracer):
        return ""
    aval = jax.typeof(x)
    mesh = aval.sharding.mesh
    if mesh.empty or AxisType.Manual not in mesh.axis_types:
        return ""
    return _with_rules(_varies_unsaid(spec, aval, mesh, is_batched(x)), annotation)


def _unexplained(spec: PartitionSpec, aval, mesh) -> set[str]:
    """The manual mesh axes of more than one device that a `shard_map` block varies
    over but `spec` does not name: a size-1 axis splits nothing."""
    named = {a for entry in spec for a in axes_of(entry)}
    varying = set(getattr(getattr(aval, "manual_axis_type", None), "varying", ()))
    return {a for a in varying - named if mesh.shape[a] != 1}


def global_shape(annotation: Any, obj: Any) -> tuple[int, ...] | None:
    """Inside `shard_map`, the global shape of which the tracer `obj` is one block
    (see `spec_global_shape`), under `annotation`'s spec; else None."""
    mesh = jax.typeof(obj).sharding.mesh
    if mesh.empty or AxisType.Manual not in mesh.axis_types:
        return None
    try:
        spec = annotation.spec
    except AnnotationError:
        if _config.current().sharding == "off":
            return None  # logical names with no rules: the block's own shape
        raise
    return spec_global_shape(spec, obj)


def spec_global_shape(spec: PartitionSpec, obj: Any) -> tuple[int, ...] | None:
    """Inside `shard_map`, the global shape of which the tracer `obj` is one block,
    as `spec` lays the global array out; else None.

    A dimension is the block's times the sizes of the manual axes its spec entry
    names; the one `P.UNCONSTRAINED` dimension of a spec is also split over the
    axes the block varies over that the spec does not name. (With several
    unconstrained dimensions, which of them such an axis splits is not known: they
    are taken as whole.)"""
    aval = jax.typeof(obj)
    mesh = aval.sharding.mesh
    if mesh.empty or AxisType.Manual not in mesh.axis_types:
        return None
    manual = {
        n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Manual
    }
    sizes = mesh.shape
    entries = list(spec)[: len(aval.shape)]
    factors = [math.prod(sizes[a] for a in axes_of(e) if a in manual) for e in entries]
    factors += [1] * (len(aval.shape) - len(factors))
    loose = [i for i, e in enumerate(entries) if e is PartitionSpec.UNCONSTRAINED]
    if len(loose) == 1 and not is_batched(obj):
        factors[loose[0]] = math.prod(sizes[a] for a in _unexplained(spec, aval, mesh))
    return tuple(d * f for d, f in zip(aval.shape, factors))
