"""Checks XLA answers when it compiles (inside `jit` on Auto axes): a probe left in
the program reports the sharding XLA chose; a mismatch is raised as `ShardingError`
out of the call that compiled the program (`_on_compile`), its likely cause first."""

import dataclasses
import functools as ft
import threading
import weakref
from typing import Any

import jax
import jax.monitoring
from jax.sharding import NamedSharding, PartitionSpec

from .. import _config
from .._errors import ShardingError
from .._jax_internals import (
    bind_probe,
    compiling_call,
    context_mesh,
)
from . import diagnosis
from .compare import compare, phrase
from .describe import subject
from .sites import call_numbers, describe_call, make_site, Site, Violation


_lock = threading.Lock()
_pending: list[Violation] = []
_checked: dict[int, list[Site]] = {}  # thread -> the sites its compiles checked
_compiling: dict[int, int] = {}  # thread id -> how many compiles it has under way


class _Binding(threading.local):
    """The verdicts of probes that JAX evaluated op by op while `add_probe` bound
    them (`vmap` outside `jit` runs its batching rule, and the probe, at once)."""

    found: list | None = None


_binding = _Binding()


# The probes in programs being traced, by value: a value passed from one annotated
# function to the next (a layer's output, the next one's input) gets one probe, which
# reports the sharding XLA gives it to every place that checked it, each with its own
# annotation. An entry lasts as long as its traced value (whose id it is keyed by).
_probes: dict[tuple, tuple[weakref.ref, list[Site]]] = {}


def add_probe(annotation, x, aval, named: Any) -> str:
    """Leaves a probe for the sharding XLA gives `x`: "", or the reason it fails if
    JAX evaluated the probe there and then."""
    recorder = _config.current().recorder
    site = make_site(annotation, named, aval, recorder)
    traced, mesh = aval.sharding.mesh, context_mesh()
    if mesh is not None and (mesh.axis_names, mesh.axis_sizes) != (
        traced.axis_names,
        traced.axis_sizes,
    ):
        mesh = None  # the program's mesh is known only when it is lowered
    key = (id(x), mesh, id(recorder))
    probe = _probes.get(key)
    if probe is not None and probe[0]() is x:
        probe[1].append(site)
        return ""
    sites, evaluated = [site], []
    outer, _binding.found = _binding.found, []
    try:
        bind_probe(x, ft.partial(_on_shardings, sites, evaluated), mesh)
        found = _binding.found
    finally:
        _binding.found = outer
    if not evaluated:  # in the program: other checks of `x` can report through it
        _probes[key] = (weakref.ref(x, ft.partial(_forget, key)), sites)
    return found[0] if found else ""


def _forget(key: tuple, ref: weakref.ref, probes: dict = _probes) -> None:
    # `probes` bound now: a value may die as the interpreter shuts down, when this
    # module's globals are gone.
    probe = probes.get(key)
    if probe is not None and probe[0] is ref:
        del probes[key]


def _on_shardings(
    sites: list[Site], evaluated: list, sharding, batch_dims, lowered_on
) -> None:
    if lowered_on is None:
        evaluated.append(True)
    for site in list(sites):
        _on_sharding(site, sharding, batch_dims, lowered_on)


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
        phrased = phrase(site.array, reason)
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
    ordered = in_program_order(mine, sites) if mine else []
    for site in sites:
        site.held.clear()  # the trace is over: its values' ids are no longer needed
    return ordered, sites


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
        call = compiling_call()
        inputs = None if call is None else diagnosis.inputs_of(call)
        raise ShardingError(format_violations(violations, program, sites, inputs))


def format_violations(
    violations: list[Violation], program: str, sites=(), inputs=()
) -> str:
    """The message for the violations of one program: the likely cause in full,
    and the rest summarised (see `_diagnosis`); `inputs` are the program's input
    arrays by path, `None` if they could not be read."""
    count = len(violations)
    head = (
        f"{count} sharding contract{'s' if count > 1 else ''} violated in {program}, "
        "found when XLA compiled it"
    )
    inputs = None if inputs is None else list(inputs)
    return diagnosis.report(violations, list(sites), head, inputs)


jax.monitoring.register_scalar_listener(_on_compile_start)
jax.monitoring.register_event_duration_secs_listener(_on_compile)
