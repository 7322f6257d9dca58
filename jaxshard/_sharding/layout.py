"""Does an array's sharding match an annotation's partition spec?

`check` returns "" when it does and a sentence saying what is wrong when it does not,
like jaxtyping's `__instancecheck_str__`. Where the answer is only known when XLA
compiles (inside `jit` on a mesh with Auto axes), `check` returns "" and leaves a probe
in the program; a mismatch found by the probe is raised as `ShardingError` out of the
call that compiled the program (see `_on_compile`).
"""

import contextlib
import dataclasses
import functools as ft
import itertools
import math
import sys
import threading
import typing
from collections.abc import Iterator
from typing import Any

import jax
import jax.monitoring
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from .. import _config
from .._annotations import tensors
from .._annotations.spec import (
    axes_of,
    fill_unconstrained,
    format_spec,
    sharded_type,
    splits,
)
from .._errors import AnnotationError, ShardingError
from .._jax_internals import (
    bind_probe,
    checked_call,
    checked_calls,
    compiling_call,
    context_mesh,
    in_linen_init,
    is_batched,
)
from . import diagnosis


# --- descriptions -------------------------------------------------------------------


def describe_mesh(mesh) -> str:
    sizes = ", ".join(f"{name!r}: {size}" for name, size in mesh.shape.items())
    types = {t.name for t in mesh.axis_types}
    return "{" + sizes + "}" + (f" ({'/'.join(sorted(types))} axes)" if types else "")


def describe_devices(mesh) -> str:
    """`256 × TPU v5 lite`."""
    kind = getattr(mesh.devices.flat[0], "device_kind", "?")
    return f"{mesh.devices.size} × {kind}"


def describe_bytes(n: float) -> str:
    """`512 B`, `1.5 KiB`, ..., `16.0 GiB`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def describe_array(dtype, shape) -> str:
    return f"{dtype}[{','.join(map(str, shape))}]"


def describe_sharding(sharding, ndim: int) -> str:
    """How an array is laid out, as the end of "this array is ..."."""
    if isinstance(sharding, NamedSharding):
        spec = PartitionSpec(*sharding.spec, *[None] * (ndim - len(sharding.spec)))
        return f"sharded as {format_spec(spec)}"
    devices = sharding.device_set
    if len(devices) == 1:
        return f"on one device ({next(iter(devices))})"
    return f"laid out by {sharding!r}"


class _Naming(threading.local):
    current: tuple[str, str] | None = None


_naming = _Naming()


@contextlib.contextmanager
def naming(function: str, name: str) -> Iterator[None]:
    """Checks inside the block are reported as `function`'s `name`."""
    outer, _naming.current = _naming.current, (function, name)
    try:
        yield
    finally:
        _naming.current = outer


def subject(function: Any, name: str | None) -> str:
    """How messages name a checked value: `f, parameter 'x'`, `f, the return
    value`, or an `isinstance` check outside any function (`function` is `None`)."""
    if function is None:
        return "a value checked with isinstance outside any jaxtyped function"
    if name == "return":
        return f"{function}, the return value"
    return f"{function}, parameter {name!r}"


def where(obj: Any, annotation: Any = None) -> tuple[str | None, str | None]:
    """`(function, parameter)` naming the value being checked against `annotation`,
    for error messages; `(None, None)` outside any `jaxtyped` function.

    The value is found by identity among the call's parameters and, once the body
    has returned, first in its return value; where the same value was passed twice
    (or returned as it came in), the place whose annotation is `annotation` is the one
    being checked."""
    if _naming.current is not None:
        return _naming.current
    call = checked_call()
    if call is None:
        return None, None
    places = list(call.arguments.items())
    if call.returned:
        places.insert(0, ("return", call.out))
    found = []
    for name, value in places:
        if value is obj:
            found.append(name)
            continue
        try:
            leaves = jax.tree_util.tree_flatten_with_path(value)[0]
        except Exception:
            continue
        found += [name + jax.tree_util.keystr(p) for p, leaf in leaves if leaf is obj]
    if not found:
        return call.function, "<a value checked inside the function>"
    if annotation is not None and len(found) > 1:
        for name in found:
            hint = call.hints.get(name.split("[", 1)[0].split(".", 1)[0])
            if _mentions(hint, annotation):
                return call.function, name
    return call.function, found[0]


def _mentions(hint: Any, annotation: Any, depth: int = 0) -> bool:
    """Whether the type `hint` is `annotation` or has it inside (a union member, a
    tuple's element, a `PyTree`'s leaf type, a NamedTuple's or dataclass's field)."""
    if hint is annotation:
        return True
    if depth > 8 or hint is None:
        return False
    inner = list(typing.get_args(hint))
    leaf = getattr(hint, "leaftype", None)
    if leaf is not None:
        inner.append(leaf)
    if isinstance(hint, type) and (
        dataclasses.is_dataclass(hint) or hasattr(hint, "_fields")
    ):
        try:
            inner += typing.get_type_hints(hint, include_extras=True).values()
        except Exception:
            pass
    return any(_mentions(h, annotation, depth + 1) for h in inner)


# --- comparing shardings ------------------------------------------------------------


def _missing_axes(spec: PartitionSpec, mesh) -> str:
    names = [a for entry in spec for a in axes_of(entry) if a not in mesh.axis_names]
    if not names:
        return ""
    return (
        f"the annotation's spec {format_spec(spec)} names mesh axis "
        f"{', '.join(map(repr, names))}, but the mesh {describe_mesh(mesh)} has "
        f"axes {', '.join(map(repr, mesh.axis_names))}"
    )


def _invalid(spec: PartitionSpec, mesh, ndim: int) -> str:
    """Why `spec` cannot describe an array of `ndim` dimensions on `mesh`; ""."""
    reason = _missing_axes(spec, mesh)
    if not reason and len(spec) > ndim:
        reason = (
            f"the annotation's spec {format_spec(spec)} has {len(spec)} entries but "
            f"the array has {ndim} dimensions"
        )
    return reason


@ft.lru_cache(maxsize=4096)
def compare(spec: PartitionSpec, actual, shape: tuple, dtype, mesh=None) -> str:
    """How `actual` differs from `NamedSharding(mesh, spec)` for an array of `shape`
    and `dtype`, as the end of a sentence, each layout also in JAX's notation
    (`float32[8@dp,4]`); "" if the two are equivalent. `mesh` defaults to `actual`'s
    own."""
    ndim = len(shape)
    if mesh is None:
        mesh = actual.mesh
    reason = _invalid(spec, mesh, ndim)
    if reason:
        return reason
    # Unconstrained dimensions are not checked: take the actual entry there.
    same_mesh = isinstance(actual, NamedSharding) and actual.mesh == mesh
    filled = fill_unconstrained(spec, actual.spec if same_mesh else (), mesh.shape)
    expected = NamedSharding(mesh, filled)
    if expected.is_equivalent_to(actual, ndim):
        return ""
    found = describe_sharding(actual, ndim)
    if isinstance(actual, NamedSharding):
        found += f" ({sharded_type(dtype, shape, actual.spec)})"
    return (
        f"is {found}, but the annotation expects {format_spec(spec)} "
        f"({sharded_type(dtype, shape, expected.spec)}), on mesh {describe_mesh(mesh)}"
    )


def _phrase(array: str, reason: str) -> str:
    if reason.startswith("is "):
        return f"this array ({array}) {reason}."
    return f"{reason} (array {array})."


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
            reason = _invalid(spec, mesh, len(obj.shape))
            if reason:
                array = describe_array(obj.dtype, obj.shape)
                return _with_rules(_phrase(array, reason), annotation)
            if not splits(spec, mesh.shape):
                return ""
            return _with_rules(_uncommitted(obj, spec, mesh), annotation)
    reason = compare(spec, sharding, obj.shape, obj.dtype, mesh)
    if not reason:
        return ""
    return _with_rules(
        _phrase(describe_array(obj.dtype, obj.shape), reason), annotation
    )


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
    return _with_rules(_phrase(array, reason), annotation)


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
                reason = _phrase(describe_array(aval.dtype, aval.shape), reason)
                reason = _with_rules(reason, annotation)
                reason = f"{reason} {no_mesh_note()}".rstrip()
            return _verdict(annotation, named, aval, reason)
    return _add_probe(annotation, x, aval, named)


def _verdict(annotation, x, aval, reason: str) -> str:
    """`reason`; or, while `jaxshard.verify` records, "" after recording it."""
    recorder = _config.current().recorder
    if recorder is None:
        return reason
    recorder.add(_site(annotation, x, aval, recorder), aval.sharding, reason)
    return ""


def _check_manual(spec: PartitionSpec, aval, mesh, batched: bool) -> str:
    """Inside `shard_map`: the value is one block of the global array.

    Under `vmap` the mapped dimension may be what varies across devices, and it is not
    part of the annotation: then only the axis names are checked."""
    reason = _missing_axes(spec, mesh)
    if reason:
        return _phrase(aval.str_short(), reason)
    if len(spec) > len(aval.shape):
        return _phrase(
            aval.str_short(),
            f"the annotation's spec {format_spec(spec)} has {len(spec)} entries but "
            f"the array has {len(aval.shape)} dimensions",
        )
    extra = sorted(_unexplained(spec, aval, mesh))
    if extra and not batched and PartitionSpec.UNCONSTRAINED not in tuple(spec):
        return (
            f"this block ({aval.str_short()}) differs across the shard_map mesh "
            f"axes {', '.join(map(repr, extra))}, but the annotation's spec "
            f"{format_spec(spec)} says the array is replicated over them (mesh "
            f"{describe_mesh(mesh)})."
        )
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
            return _phrase(aval.str_short(), reason)
    return ""


def _unexplained(spec: PartitionSpec, aval, mesh) -> set[str]:
    """The manual mesh axes of more than one device that a `shard_map` block varies
    over but `spec` does not name: a size-1 axis splits nothing."""
    named = {a for entry in spec for a in axes_of(entry)}
    varying = set(getattr(getattr(aval, "manual_axis_type", None), "varying", ()))
    return {a for a in varying - named if mesh.shape[a] != 1}


def global_shape(annotation: Any, obj: Any) -> tuple[int, ...] | None:
    """Inside `shard_map`, the global shape of which the tracer `obj` is one block;
    else None.

    A dimension is the block's times the sizes of the manual axes its spec entry
    names; the one `P.UNCONSTRAINED` dimension of a spec is also split over the
    axes the block varies over that the spec does not name. (With several
    unconstrained dimensions, which of them such an axis splits is not known: they
    are taken as whole.)"""
    aval = jax.typeof(obj)
    mesh = aval.sharding.mesh
    if mesh.empty or AxisType.Manual not in mesh.axis_types:
        return None
    try:
        spec = annotation.spec
    except AnnotationError:
        if _config.current().sharding == "off":
            return None  # logical names with no rules: the block's own shape
        raise
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


# --- compile-time checks ------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Site:
    """Where a compile-time check was written, for its error message."""

    function: str | None  # None: an isinstance check outside any jaxtyped function
    name: str | None
    annotation: str
    spec: PartitionSpec
    array: str
    shape: tuple[int, ...]
    dtype: Any
    axis_types: dict  # of the mesh at trace time: the compiled program's mesh has none
    recorder: Any = None  # a `_verify.Recorder`, while `jaxshard.verify` runs
    order: int = 0  # the order in which the checks were traced
    calls: tuple = ()  # the jaxtyped calls around the check, outermost first
    value: int = 0  # which traced value was checked (its id, while traced)
    rules: str = ""  # how the axis rules resolved a logical spec, at trace time
    note: str = ""  # what was off when it was traced (`no_mesh_note`)


_orders = itertools.count(1)


def call_numbers(sites: list[Site]) -> dict[int, tuple[int, int]]:
    """Call token -> `(k, n)`: the k-th of the n calls of its function among the
    calls that `sites` (every check of one program) were made in, in program
    order."""
    tokens: dict[str, list[int]] = {}
    for site in sorted(sites, key=lambda s: s.order):
        for function, token in site.calls:
            seen = tokens.setdefault(function, [])
            if token not in seen:
                seen.append(token)
    return {
        token: (k, len(seen))
        for seen in tokens.values()
        for k, token in enumerate(seen, 1)
    }


def describe_call(
    site: Site, numbers: dict[int, tuple[int, int]], short: bool = False, within=None
) -> str:
    """`Block.__call__ #5 of 8 (in Decoder.__call__)`: the function a check was
    made in, which of its calls, and the jaxtyped calls around it (by qualified
    name without the module, if `short`; those around `within`, the function being
    verified, left out)."""

    def label(function: Any, token: int) -> str:
        name = getattr(function, "qualname", function) if short else str(function)
        k, n = numbers.get(token, (1, 1))
        return f"{name} #{k} of {n}" if n > 1 else name

    calls = site.calls
    names = [str(f) for f, _ in calls]
    if within is not None and str(within) in names:
        calls = calls[names.index(str(within)) :]
    if not calls:
        function = site.function
        return str(getattr(function, "qualname", function) if short else function)
    *outer, inner = calls
    while within is not None and outer and str(outer[0][0]) == str(within):
        outer = outer[1:]  # the verified function (decorated or not, or both)
    text = label(*inner)
    if outer:
        text += " (in " + " in ".join(label(*c) for c in reversed(outer)) + ")"
    return text


@dataclasses.dataclass(frozen=True)
class Violation:
    site: Site
    actual: Any  # the sharding XLA chose
    reason: str
    thread: int  # that compiled the program, to which the violation is reported
    call: str = ""  # `describe_call` of the site, once the program's calls are known
    also: tuple = ()  # later checks of the same value, as "function, parameter 'x'"

    def __str__(self):
        site = self.site
        what = subject(site.function and (self.call or site.function), site.name)
        also = f" (passed on to {'; '.join(self.also)})" if self.also else ""
        return (
            f"{what}{also} ({site.array}, annotated {site.annotation}): {self.reason}"
        )


_lock = threading.Lock()
_pending: list[Violation] = []
_checked: dict[int, list[Site]] = {}  # thread -> the sites its compiles checked
_compiling: dict[int, int] = {}  # thread id -> how many compiles it has under way


def _site(annotation, x, aval, recorder=None) -> Site:
    function, name = where(x, annotation)
    calls: tuple = ()
    for function, token in checked_calls() if _naming.current is None else ():
        # A function checked by two wrappers (decorated, and again by verify) is
        # one call.
        if not calls or calls[-1][0] != function:
            calls += ((function, token),)
    return Site(
        function=function,
        name=name,
        annotation=repr(annotation),
        spec=annotation.spec,
        array=describe_array(aval.dtype, aval.shape),
        shape=aval.shape,
        dtype=aval.dtype,
        axis_types=dict(
            zip(aval.sharding.mesh.axis_names, aval.sharding.mesh.axis_types)
        ),
        recorder=recorder,
        order=next(_orders),
        calls=calls,
        value=id(x),
        rules=annotation.explain() if hasattr(annotation, "explain") else "",
        note=no_mesh_note(),
    )


def no_mesh_note() -> str:
    """While a program that uses flax is traced with no mesh in context, flax's
    logical constraints do nothing: say so, since a contract may fail for that."""
    if "flax.linen" not in sys.modules or context_mesh() is not None:
        return ""
    return (
        "No mesh was in context (`jax.set_mesh`) when the program was traced, so "
        "flax's `nn.with_logical_constraint` and the constraints of "
        "`nn.with_logical_partitioning` did nothing in it: call it inside `with "
        "jax.set_mesh(mesh):`."
    )


class _Binding(threading.local):
    """The verdicts of probes that JAX evaluated op by op while `_add_probe` bound
    them (`vmap` outside `jit` runs its batching rule, and the probe, at once)."""

    found: list | None = None


_binding = _Binding()


def _add_probe(annotation, x, aval, named: Any) -> str:
    """Leaves a probe for the sharding XLA gives `x`: "", or the reason it fails if
    JAX evaluated the probe there and then."""
    site = _site(annotation, named, aval, _config.current().recorder)
    traced, mesh = aval.sharding.mesh, context_mesh()
    if mesh is not None and (mesh.axis_names, mesh.axis_sizes) != (
        traced.axis_names,
        traced.axis_sizes,
    ):
        mesh = None  # the program's mesh is known only when it is lowered
    outer, _binding.found = _binding.found, []
    try:
        bind_probe(x, ft.partial(_on_sharding, site), mesh)
        found = _binding.found
    finally:
        _binding.found = outer
    return found[0] if found else ""


def _strip(sharding, batch_dims: tuple[int, ...], ndim: int):
    if not batch_dims or not isinstance(sharding, NamedSharding):
        return sharding
    entries = list(sharding.spec) + [None] * (
        ndim + len(batch_dims) - len(sharding.spec)
    )
    kept = [e for i, e in enumerate(entries) if i not in batch_dims]
    return NamedSharding(sharding.mesh, PartitionSpec(*kept))


def _on_sharding(
    site: Site, sharding, batch_dims: tuple[int, ...], lowered_on: int | None
) -> None:
    # Runs on an XLA compiler thread: never raise there (XLA would wrap the error in
    # `JaxRuntimeError: INTERNAL: Error calling inspect_sharding`); record instead.
    # Evaluated op by op (`lowered_on` None), it runs in the user's call: the check
    # that bound it returns the reason, or else it raises.
    try:
        sharding, reason = _verdict_on(site, sharding, batch_dims)
    except Exception as e:  # noqa: BLE001: reported as the check's outcome
        reason = (
            f"jaxshard could not compare the layout XLA chose ({sharding}) with the "
            f"annotation's: {type(e).__name__}: {e}. Please report this"
        )
    if lowered_on is None and reason and _binding.found is not None:
        phrased = _phrase(site.array, reason)
        _binding.found.append(
            f"{phrased[:-1]}; {site.rules}." if site.rules else phrased
        )
        return
    if reason.startswith("is "):
        eager = lowered_on is None
        found = "this array" if eager else "after XLA's sharding propagation it"
        reason = f"{found} {reason}"
    if reason and site.rules:
        reason = f"{reason}; {site.rules}"
    if site.recorder is not None:
        site.recorder.add(site, sharding, reason + "." if reason else "")
        return
    if lowered_on is None:
        if reason:
            violation = Violation(site, sharding, reason + ".", threading.get_ident())
            raise ShardingError(
                "1 sharding contract violated, found when JAX evaluated the program "
                f"op by op:\n- {in_program_order([violation], [])[0]}"
            )
        return
    with _lock:
        # The compiling thread waits for XLA, so it is one of those compiling now:
        # the one that lowered the program, or else the only one.
        compiling = list(_compiling)
        thread = lowered_on
        if lowered_on not in _compiling and len(compiling) == 1:
            (thread,) = compiling
        # Every check, passing or not, for numbering the calls of each function.
        _checked.setdefault(thread, []).append(site)
        if reason:
            _pending.append(Violation(site, sharding, reason + ".", thread))


def _verdict_on(site: Site, sharding, batch_dims: tuple[int, ...]) -> tuple[Any, str]:
    """The sharding XLA chose for the value of `site` (less `vmap`'s dimensions),
    and why it differs from the annotation's ("" if it does not)."""
    sharding = _strip(sharding, batch_dims, len(site.shape))
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        if set(site.axis_types) == set(mesh.axis_names):
            types = tuple(site.axis_types[a] for a in mesh.axis_names)
            sharding = NamedSharding(mesh.update(axis_types=types), sharding.spec)
        return sharding, compare(site.spec, sharding, site.shape, site.dtype)
    if len(sharding.device_set) == 1:
        return sharding, ""
    return sharding, (
        f"XLA spread the array over {len(sharding.device_set)} devices with no "
        "mesh to read the annotation's axis names against. Run the code inside "
        "`with jax.set_mesh(mesh):`"
    )


_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def take_violations(thread: int | None = None) -> tuple[list[Violation], list[Site]]:
    """Removes and returns the violations recorded for programs compiled by `thread`
    (default: this one) or by threads that have ended, in program order, and every
    check those programs made; nothing of them is left behind."""
    thread = threading.get_ident() if thread is None else thread
    alive = {t.ident for t in threading.enumerate()}
    with _lock:
        mine = [v for v in _pending if v.thread == thread or v.thread not in alive]
        _pending[:] = [v for v in _pending if v not in mine]
        sites = []
        for t in [t for t in _checked if t == thread or t not in alive]:
            sites += _checked.pop(t)
    return (in_program_order(mine, sites) if mine else []), sites


def in_program_order(violations: list[Violation], sites: list[Site]) -> list:
    """`violations` in the order their checks were traced, each with its call
    (`Block.__call__ #5 of 8`), and each value once: a value passed on from one
    annotated function to another is reported where it was checked first, with
    where else it went."""
    numbers = call_numbers(sites + [v.site for v in violations])
    out: list[Violation] = []
    first: dict[tuple, int] = {}
    for v in sorted(violations, key=lambda v: v.site.order):
        v = dataclasses.replace(v, call=describe_call(v.site, numbers))
        key = (v.site.value, v.site.spec, v.site.array)
        if key in first:
            kept = out[first[key]]
            if (v.call, v.site.name) == (kept.call, kept.site.name):
                continue  # jaxtyping checks a parameter twice: once is enough
            also = subject(v.call, v.site.name)
            if also not in kept.also:
                out[first[key]] = dataclasses.replace(kept, also=(*kept.also, also))
            continue
        first[key] = len(out)
        out.append(v)
    return out


def _on_compile_start(event: str, start: float, **kwargs) -> None:
    del start, kwargs
    if event == _BACKEND_COMPILE_EVENT:
        thread = threading.get_ident()
        with _lock:
            _compiling[thread] = _compiling.get(thread, 0) + 1


def _on_compile(event: str, duration: float, **kwargs) -> None:
    # JAX reports each backend compile on the thread that asked for it, right after
    # XLA returns (or fails): raising here makes the compiling call (a jitted call, or
    # `.lower(...).compile()`) raise jaxshard's error, and the program is not kept.
    # What the program's checks recorded ends with its compile, violated or not.
    del duration
    if event != _BACKEND_COMPILE_EVENT:
        return
    thread = threading.get_ident()
    with _lock:
        depth = _compiling.pop(thread, 1) - 1
        if depth:  # a compile inside another: its checks belong to the outer one
            _compiling[thread] = depth
            return
        if thread not in _checked and not _pending:
            return
    violations, sites = take_violations(thread)
    if violations:
        program = kwargs.get("fun_name", "the program")
        inputs = diagnosis.inputs_of(compiling_call())
        raise ShardingError(format_violations(violations, program, sites, inputs))


def format_violations(
    violations: list[Violation], program: str, sites=(), inputs=()
) -> str:
    """The message for the violations of one program: the likely cause in full,
    and the rest summarised (see `_diagnosis`); `inputs` are the program's input
    arrays by path, if known."""
    count = len(violations)
    head = (
        f"{count} sharding contract{'s' if count > 1 else ''} violated in {program}, "
        "found when XLA compiled it"
    )
    return diagnosis.report(violations, list(sites), head, list(inputs))


jax.monitoring.register_scalar_listener(_on_compile_start)
jax.monitoring.register_event_duration_secs_listener(_on_compile)
