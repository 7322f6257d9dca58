"""The primitives jaxshard adds to programs: the sharding probe, which lowers to the
SPMD partitioner's sharding callback without an effect, and the check accumulator,
which writes `jax.Ref`s (see the package's docstring for the internals each uses)."""

import functools as ft
import threading
import uuid
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax._src.core import Primitive  # jax.extend.core's; see __init__
from jax.interpreters import ad, batching, mlir, partial_eval as pe
from jaxlib.mlir import ir  # what jax.extend.mlir.ir re-exports


# --- the sharding probe -------------------------------------------------------------
#
# `jax.debug.inspect_array_sharding` binds a primitive with a debug *effect* so that it
# survives dead-code elimination. Any effect in a jitted program turns off jit's C++
# fast dispatch, so every later call of the program would pay Python dispatch. The
# probe below lowers to exactly the same custom call (the SPMD partitioner calls back
# with the propagated sharding, then deletes the call: the compiled program has no extra
# operation), but has no effect: a DCE rule keeps it instead.

probe_p = Primitive("jaxshard_sharding_probe")
probe_p.multiple_results = True
# The same probe, on a value whose mesh was known when it was traced (`jax.set_mesh`):
# its lowering needs no device assignment from JAX. A primitive that does (as
# `probe_p`, which builds the mesh from it, like inspect_sharding) makes JAX refuse a
# program whose inputs sit on meshes that differ in their axis types only ("mesh
# should be the same across the entire program"), such as torchax's PRNG key, left on
# an Explicit mesh by an earlier call, beside arrays on an Auto one.
mesh_probe_p = Primitive("jaxshard_sharding_probe_on_mesh")
mesh_probe_p.multiple_results = True


def bind_probe(
    value, callback: Callable[[Any, tuple[int, ...], int], None], mesh: Any = None
) -> None:
    """Calls `callback(sharding, batch_dims, lowered_on)` with the sharding XLA gives
    `value`, when the program is compiled (on an XLA thread).

    `batch_dims` are the positions of `vmap`-added dimensions in that sharding, which
    are not part of the annotation; `lowered_on` is the id of the thread that lowered
    the program, or `None` when JAX evaluates the probe op by op on a concrete array
    (a remat'ed function called outside `jit`, say), with the array's own sharding.
    `mesh` is the concrete mesh in context at trace time, if any: the sharding is
    read against it.
    """
    if mesh is None:
        probe_p.bind(value, callback=callback, batch_dims=())
    else:
        mesh_probe_p.bind(value, callback=callback, batch_dims=(), mesh=mesh)


def _probe_impl(value, *, callback, batch_dims, **params):
    del params
    callback(value.sharding, batch_dims, None)
    return []


def _probe_abstract_eval(aval, **params):
    del aval, params
    return []


if jax.__version_info__ >= (0, 12, 0):
    # jax 0.12.0 and 0.12.0.1: a DCE rule also gets which inputs are live.
    def _probe_dce(used_outputs, live_inputs, eqn):
        del used_outputs, live_inputs
        return [True] * len(eqn.invars), eqn

else:
    # jax 0.10.2 to 0.11.2.
    def _probe_dce(used_outputs, eqn):
        del used_outputs
        return [True] * len(eqn.invars), eqn


def _probe_batch(prim, args, dims, *, batch_dims, **params):
    (value,), (dim,) = args, dims
    if dim is not None:  # batching.not_mapped
        batch_dims = (dim,) + tuple(d + (d >= dim) for d in batch_dims)
    prim.bind(value, batch_dims=batch_dims, **params)
    return [], []


def _probe_jvp(prim, primals, tangents, **params):
    del tangents
    return prim.bind(*primals, **params), []


# Under `grad`, JAX linearizes each primitive; without a rule of its own it traces
# the JVP rule into a jaxpr and partially evaluates it, per probe (a millisecond or
# so of a first call's trace each). The probe has no output: its linearization binds
# it on the primal and has no tangent.
if jax.__version_info__ >= (0, 11, 0):
    # jax 0.11.2 to 0.12.0.1: the rule also returns structured residuals.
    def _probe_linearize(prim, is_vjp, nonzeros, *primals, **params):
        del is_vjp, nonzeros
        prim.bind(*primals, **params)
        return [], [], [], None, lambda residuals, structured, *tangents: []

else:
    # jax 0.10.2.
    def _probe_linearize(prim, is_vjp, nonzeros, *primals, **params):
        del is_vjp, nonzeros
        prim.bind(*primals, **params)
        return [], [], [], lambda residuals, *tangents: []


class _Devices(tuple):
    """A device assignment (a tuple, as JAX asks) that numpy reads as the array it
    keeps. inspect_sharding's lowering rule makes a mesh of `np.array(devices)` at
    every probe, and numpy looks into each device of a plain tuple: 6 ms for a
    6,144-chip slice's, 40 times in a 59B train step's lowering."""

    array: np.ndarray

    def __array__(self, dtype=None, copy=None):
        del copy  # a copy always: the mesh made of it must not share it
        return np.array(self.array, dtype=dtype)


@ft.lru_cache(maxsize=16)
def _devices(devices: tuple) -> _Devices:
    out = _Devices(devices)
    out.array = np.empty(len(devices), dtype=object)
    out.array[:] = devices
    return out


@ft.lru_cache(maxsize=16)
def _mesh_devices(mesh: Any) -> _Devices:
    """`mesh`'s devices in order, as `_devices`."""
    return _devices(tuple(mesh.devices.flat))


# A cache hit in JAX's persistent compilation cache would skip the partitioner, and so
# the check. The custom call carries its callback's address, which can repeat (in
# another process, or after `jax.clear_caches()`), so each lowering also gets a nonce
# of its own: a checked program's cache key never repeats, and it is always checked.
def _probe_lowering(ctx, value, *, callback, batch_dims, mesh=None):
    from jax._src import debugging, sharding_impls

    thread = threading.get_ident()
    context = ctx.module_context.axis_context
    if mesh is not None and isinstance(context, sharding_impls.ShardingContext):
        if context.num_devices != mesh.size:  # e.g. compiled for one device
            callback(
                jax.sharding.SingleDeviceSharding(mesh.devices.flat[0]), (), thread
            )
            return []
        # What inspect_sharding's rule reads: the devices and the mesh's shape.
        devices = _mesh_devices(mesh)
        context = sharding_impls.ShardingContext(
            len(devices), devices, mesh.abstract_mesh
        )
        ctx = ctx.replace(
            module_context=ctx.module_context.replace(axis_context=context)
        )
    elif (
        isinstance(context, sharding_impls.ShardingContext)
        and type(context.device_assignment) is tuple
    ):
        devices = _devices(context.device_assignment)
        context = sharding_impls.ShardingContext(
            context.num_devices, devices, context.abstract_mesh
        )
        ctx = ctx.replace(
            module_context=ctx.module_context.replace(axis_context=context)
        )
    out = debugging._inspect_sharding_lowering_rule(
        ctx, value, callback=lambda sharding: callback(sharding, batch_dims, thread)
    )
    block = ir.InsertionPoint.current.block
    if len(block.operations) and block.operations[-1].name == "stablehlo.custom_call":
        block.operations[-1].attributes["mhlo.frontend_attributes"] = ir.DictAttr.get(
            {"jaxshard_nonce": ir.StringAttr.get(uuid.uuid4().hex)}
        )
    return out


# Partial evaluation (`grad` of a `scan` or `fori_loop` body, `linearize`, `vjp`,
# remat's policies) re-traces a jaxpr with `pe.JaxprTrace`, which keeps an equation
# only if an output it returns is used or it has an effect: a probe on a value not
# known until run time, which returns nothing and has no effect, would be dropped, and
# its check with it. This rule stages the probe where its value is, and keeps it the
# way JaxprTrace keeps an effectful equation (an `EffectHandle` among the trace's
# roots), without giving the program an effect. The same on jax 0.10.2 to 0.12.0.1.
def _probe_partial_eval(prim, trace, tracer, **params):
    from jax._src import core as core_internal, source_info_util
    from jax._src.interpreters import partial_eval as pe_internal

    if tracer.pval.is_known():  # bound where the value is known (the trace above)
        return prim.bind(tracer.pval.get_known(), **params)
    tracer = trace.instantiate_const(tracer)
    names = trace._current_truncated_name_stack()
    source = source_info_util.current().replace(name_stack=names)
    eqn = pe_internal.new_eqn_recipe(
        trace, [tracer], [], prim, params, core_internal.no_effects, source
    )
    trace.effect_handles.append(pe_internal.EffectHandle([tracer], eqn))
    return []


def _register_probes():
    from jax._src import dispatch
    from jax._src.interpreters import ad as ad_internal

    # Like inspect_sharding: lowering needs the device assignment to build the mesh.
    dispatch.prim_requires_devices_during_lowering.add(probe_p)
    for prim in (probe_p, mesh_probe_p):
        prim.def_impl(_probe_impl)
        prim.def_abstract_eval(_probe_abstract_eval)
        pe.dce_rules[prim] = _probe_dce
        pe.custom_partial_eval_rules[prim] = ft.partial(_probe_partial_eval, prim)
        batching.primitive_batchers[prim] = ft.partial(_probe_batch, prim)
        ad.primitive_jvps[prim] = ft.partial(_probe_jvp, prim)
        ad_internal.primitive_linearizations[prim] = ft.partial(_probe_linearize, prim)
        # Each probe's lowering is its own (a callback and a nonce): emitted inline,
        # not as a function of its own that no other probe could call.
        mlir.register_lowering(prim, _probe_lowering, cacheable=False)


_register_probes()


def is_batched(x: Any) -> bool:
    """True if `x` is (or wraps) a `vmap` tracer with a mapped dimension."""
    from jax._src.interpreters.batching import BatchTracer

    while isinstance(x, jax.core.Tracer):
        if isinstance(x, BatchTracer):
            if x.batch_dim is not None:
                return True
            x = x.val
        elif isinstance(x, ad.JVPTracer):
            x = x.primal
        else:
            return False
    return False


# --- the check accumulator ----------------------------------------------------------
#
# A value check writes what it found into a `jax.Ref` that lives outside every trace,
# so the flags leave jit, scan, while, cond and remat the way JAX threads any closed-
# over Ref: as extra, aliased inputs and outputs of the compiled program. JAX's own
# Ref writes refuse to run under vmap, even with unbatched values; this primitive
# instead reduces the batch away (its batching rule) and writes once per check. Its
# discharge rule is the write itself.


def _accumulate_abstract_eval(*args, n_refs, merge, reduce):
    del args, merge, reduce
    from jax._src.state import types as state_types

    effects = set()
    for i in range(n_refs):
        effects |= {state_types.ReadEffect(i), state_types.WriteEffect(i)}
    return [], effects


def _accumulate_impl(*args, n_refs, merge, reduce):
    del reduce
    refs, stats = args[:n_refs], args[n_refs:]
    for ref, new in zip(refs, merge(tuple(r[...] for r in refs), stats)):
        ref[...] = new
    return []


def _discharged(args, n_refs, merge):
    refs, stats = args[:n_refs], args[n_refs:]
    return tuple(merge(tuple(refs), stats)) + (None,) * len(stats), []


if jax.__version_info__ >= (0, 11, 1):
    # jax 0.11.1 to 0.12.0.1: a discharge rule gets a context first.
    def _accumulate_discharge(context, *args, n_refs, merge, reduce):
        del context, reduce
        return _discharged(args, n_refs, merge)

else:
    # jax 0.10.2 and 0.11.0: a discharge rule gets the input and output avals first.
    def _accumulate_discharge(in_avals, out_avals, *args, n_refs, merge, reduce):
        del in_avals, out_avals, reduce
        return _discharged(args, n_refs, merge)


def _accumulate_batch(axis_data, args, dims, *, n_refs, merge, reduce):
    refs, stats = args[:n_refs], args[n_refs:]
    assert all(d is None for d in dims[:n_refs]), "the state lives outside vmap"
    stat_dims = dims[n_refs:]
    if stat_dims[0] is None:
        # The first statistic (what decides the outcome) is the same for the whole
        # batch (say, vmap over jvp's tangents): one evaluation, not `size` of them.
        stats = [
            s if d is None else jax.numpy.take(s, 0, axis=d)
            for s, d in zip(stats, stat_dims)
        ]
        accumulate(refs, tuple(stats), merge, reduce)
        return [], []
    size = axis_data.size
    stats = [
        jax.numpy.broadcast_to(s, (size, *jax.numpy.shape(s)))
        if d is None
        else jax.numpy.moveaxis(s, d, 0)
        for s, d in zip(stats, dims[n_refs:])
    ]
    accumulate(refs, reduce(*stats), merge, reduce)
    return [], []


def _accumulate_jvp(primals, tangents, *, n_refs, merge, reduce):
    del tangents  # checks look at values only
    accumulate_p.bind(*primals, n_refs=n_refs, merge=merge, reduce=reduce)
    return [], []


accumulate_p = Primitive("jaxshard_check_accumulate")
accumulate_p.multiple_results = True


def _register_accumulate() -> None:
    from jax._src.state import discharge as state_discharge

    accumulate_p.def_impl(_accumulate_impl)
    accumulate_p.def_effectful_abstract_eval(_accumulate_abstract_eval)
    state_discharge.register_discharge_rule(accumulate_p)(_accumulate_discharge)
    batching.fancy_primitive_batchers[accumulate_p] = _accumulate_batch
    ad.primitive_jvps[accumulate_p] = _accumulate_jvp


_register_accumulate()


def accumulate(refs: tuple, stats: tuple, merge: Callable, reduce: Callable) -> None:
    """`refs[...] = merge(refs values, stats)`, for `jax.Ref`s made outside any
    trace.

    Under `vmap`, `reduce(*stats)` first turns stats with a leading batch dimension
    into unbatched ones; if the first statistic is not batched, the evaluation counts
    once. Under autodiff only the primal values are used. `merge` and
    `reduce` must be hashable and the same objects each time (they are primitive
    parameters, part of JAX's caches).
    """
    accumulate_p.bind(*refs, *stats, n_refs=len(refs), merge=merge, reduce=reduce)
