"""Every use of JAX and jaxtyping internals lives here, each behind one small function.

Supported and tested: jax 0.10.2 (Python 3.11), 0.11.2 (3.12) and 0.12.0.1 (3.13), with
jaxtyping 0.3.11. Where the releases differ, a gate on `jax.__version_info__` picks one
definition at import (call sites never branch) and says which versions it covers.
`tests/test_internals.py` pins the behaviour each function relies on, on every version
of the test matrix, so a release that changes it fails there first.

Public APIs used where they exist: `jax.typeof`, `jax.new_ref` and `jax.Ref`,
`jax.sharding.get_mesh`, `jax.core.eval_context`, `jax.extend.core` (`Primitive`,
`find_top_trace`, `set_current_trace`), and the rule tables of `jax.interpreters`
(`ad.primitive_jvps`, `batching.primitive_batchers` and `fancy_primitive_batchers`,
`partial_eval.dce_rules`, `mlir.register_lowering`).

Internals still used, and why (none has a public equivalent in these releases):

- `jax._src.debugging._inspect_sharding_lowering_rule` and
  `jax._src.dispatch.prim_requires_devices_during_lowering`: the sharding probe lowers
  to the SPMD partitioner's sharding callback, as `jax.debug.inspect_array_sharding`
  does, but without its effect (which would cost jit's C++ dispatch). Under
  `jax.set_mesh` the probe hands that rule the mesh's devices itself
  (`jax._src.sharding_impls.ShardingContext`, the lowering context's `replace`).
- `jax._src.interpreters.partial_eval`'s `new_eqn_recipe`, `EffectHandle` and a
  `JaxprTrace`'s `effect_handles`: the probe's partial-eval rule keeps it in the
  forward pass of a differentiated body as an effectful equation is kept, without an
  effect.
- `jax._src.mesh.get_concrete_mesh`: the mesh of `jax.set_mesh` inside `jit`, where
  `jax.sharding.get_mesh` refuses to answer.
- `jax._src.interpreters.batching.BatchTracer`: whether a value is batched by `vmap`
  (the public `ad.JVPTracer` is used to look through autodiff).
- `jax._src.mesh.thread_resources`: the mesh of the legacy `with mesh:`, deprecated
  but still supported by every tested jax and invisible to `jax.sharding.get_mesh`.
- `jax._src.state.types.ReadEffect`/`WriteEffect` and
  `jax._src.state.discharge.register_discharge_rule`: the check accumulator is a
  primitive that writes `jax.Ref`s; JAX has no public way to declare that.
- `jax.Ref._refs._buf`: a Ref's array, read and replaced without an operation (a
  dispatch per Ref per call adds up over a thousand checks).
- `jax.jit(f)._jit_info`: a jitted function's static and donated arguments and its
  shardings.
- `jax._src.dispatch.runtime_tokens`: the errors of failed host-callback checks,
  dropped at exit so that JAX does not raise them a last time there.
- `ShardingTypeError` (by name: JAX does not export it), to word verify's error.
- `aval.manual_axis_type.varying`: the mesh axes a value varies over in `shard_map`.
- `jax._src.shard_map.shard_map_p` (its `bind_with_trace`, replaced on that instance
  only while a `checked` call runs), the FlatTree its body returns
  (`jax._src.tree_util.FlatTree`, `jax._src.flattree`) and
  `jax._src.interpreters.partial_eval.DynamicJaxprTrace`: a check inside any
  shard_map body leaves it as an extra output (`shard_map_outputs`).
- `jax._src.pjit._run_python_pjit`'s frame: the arguments of the `jax.jit` call
  being compiled, whose layouts point at the likely cause of a violation.
- flax linen's module stack (`flax.linen.module._context.module_stack`): whether a
  module method runs under `Module.init`, whose dummy batch activation contracts
  have nothing to say about.
- jaxtyping's `_storage` (dimension bindings, the tree-structure pass of `PyTree`),
  `_decorator`'s wrapper frame (which function is being checked, with which
  arguments and annotations, and whether its return value is) and its array
  metaclass's `__instancecheck_str__`/`_check_shape`, which jaxshard's extends.
"""

import contextlib
import functools as ft
import inspect
import os
import re
import sys
import threading
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jaxtyping
from jax._src import (
    mesh as _mesh_lib,  # the legacy `with mesh:`, for context_mesh
    shard_map as _shard_map_lib,  # shard_map_outputs
)
from jax._src.interpreters.partial_eval import DynamicJaxprTrace  # shard_map_outputs
from jax.experimental.layout import Format
from jax.extend.core import find_top_trace, Primitive, set_current_trace
from jax.extend.mlir import ir
from jax.interpreters import ad, batching, mlir, partial_eval as pe
from jaxtyping import _decorator as _jaxtyping_decorator, _storage as _jaxtyping_storage

from ._errors import UntestedVersionWarning


# --- the jax releases this module is checked against --------------------------------

# pyproject.toml states the same range (tests/test_tpu.py checks they agree).
TESTED_JAX = ">=0.10.2,<0.13"


def _release(version: str) -> tuple[int, ...]:
    """`"0.12.0.1"` -> `(0, 12, 0, 1)`; a suffix such as `.dev2026` is dropped."""
    return tuple(int(p) for p in re.findall(r"(?:^|\.)(\d+)(?=\.|$)", version))


def _warn_if_untested(version: str) -> None:
    low, high = (_release(b.lstrip("<>=")) for b in TESTED_JAX.split(","))
    if not low <= _release(version) < high:
        warnings.warn(
            f"jaxshard is tested with jax{TESTED_JAX} (jax 0.10.2 on Python 3.11, "
            f"0.11.2 on 3.12, 0.12.0.1 on 3.13), but jax {version} is installed: some "
            "checks may fail with errors from JAX's internals. Install a tested jax "
            f"with `pip install 'jax{TESTED_JAX}'`, or a jaxshard release that "
            "supports this one.",
            UntestedVersionWarning,
            stacklevel=3,
        )


_warn_if_untested(jax.__version__)


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
        devices = tuple(mesh.devices.flat)
        context = sharding_impls.ShardingContext(
            len(devices), devices, mesh.abstract_mesh
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

    # Like inspect_sharding: lowering needs the device assignment to build the mesh.
    dispatch.prim_requires_devices_during_lowering.add(probe_p)
    for prim in (probe_p, mesh_probe_p):
        prim.def_impl(_probe_impl)
        prim.def_abstract_eval(_probe_abstract_eval)
        pe.dce_rules[prim] = _probe_dce
        pe.custom_partial_eval_rules[prim] = ft.partial(_probe_partial_eval, prim)
        batching.primitive_batchers[prim] = ft.partial(_probe_batch, prim)
        ad.primitive_jvps[prim] = ft.partial(_probe_jvp, prim)
        mlir.register_lowering(prim, _probe_lowering)


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


# --- the jit call being compiled -----------------------------------------------------


def _pjit_file() -> str:
    from jax._src import pjit

    return pjit.__file__


_PJIT_CALL = ("_run_python_pjit", _pjit_file())


def compiling_call() -> tuple[Any, tuple, dict] | None:
    """`(function, args, kwargs)` of the `jax.jit` call whose program this thread
    compiles (the first call of a jitted function, which compiles it), or `None`
    (`.lower(...).compile()`, say). Read from the locals of JAX's
    `jax._src.pjit._run_python_pjit` frame, the same on jax 0.10.2 to 0.12.0.1.

    Where `eqx.filter_jit` or `nnx.jit` made that call, the user's own call of
    them instead (their arguments as the user passed them, not the wrapper's
    flattened ones): the locals of their wrapper's `__call__(self, *args,
    **kwargs)` frame, outside JAX's, whose `self.__wrapped__` is the user's
    function (equinox 0.13, flax 0.12)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if (code.co_name, code.co_filename) == _PJIT_CALL:
            local = frame.f_locals
            call = local.get("fun"), local.get("args", ()), local.get("kwargs", {})
            return _wrapper_call(frame.f_back) or call
        frame = frame.f_back
    return None


# The modules whose jit wrappers flatten the user's arguments before `jax.jit`.
_JIT_WRAPPERS = (
    os.path.join("equinox", "_jit.py"),
    os.path.join("flax", "nnx", "transforms", "compilation.py"),
)


def _wrapper_call(frame: Any, depth: int = 8) -> tuple[Any, tuple, dict] | None:
    """The user's call of `eqx.filter_jit` or `nnx.jit` among the `depth` frames
    outside `frame`, if one is there."""
    for _ in range(depth):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == "__call__" and code.co_filename.endswith(_JIT_WRAPPERS):
            local = frame.f_locals
            function = getattr(local.get("self"), "__wrapped__", None)
            args, kwargs = local.get("args"), local.get("kwargs")
            if callable(function) and isinstance(args, tuple):
                return function, args, dict(kwargs or {})
        frame = frame.f_back
    return None


# --- flax linen's init ---------------------------------------------------------------


def in_linen_init() -> bool:
    """Whether a flax linen Module's method is running under `Module.init` (or
    `nn.init`, or a `jax.eval_shape` of either): the innermost module on linen's
    module stack (`flax.linen.module._context.module_stack`, flax 0.12) says so with
    its public `is_initializing()`. False when flax is not loaded."""
    linen = sys.modules.get("flax.linen.module")
    if linen is None:
        return False
    stack = getattr(getattr(linen, "_context", None), "module_stack", None)
    module = stack[-1] if stack else None
    if module is None or getattr(module, "scope", None) is None:
        return False
    return module.is_initializing()


# --- the mesh in JAX's context ------------------------------------------------------


def context_mesh() -> jax.sharding.Mesh | None:
    """The concrete mesh set by `jax.set_mesh` (or the legacy `with mesh:`), or
    `None` when there is none; inside `jit` too, where the public
    `jax.sharding.get_mesh` refuses to answer (`jax._src.mesh.get_concrete_mesh`,
    the same on jax 0.10.2 to 0.12.0.1, but for returning `None` on 0.12 where
    earlier releases return an empty mesh)."""
    mesh = _mesh_lib.get_concrete_mesh()
    if mesh is not None and not mesh.empty:
        return mesh
    # The legacy `with mesh:` is visible only here (jax 0.10.2 to 0.12.0.1).
    mesh = _mesh_lib.thread_resources.env.physical_mesh
    return None if mesh.empty else mesh


# --- jaxtyping's state --------------------------------------------------------------


def save_dim_memo() -> tuple:
    """A snapshot of jaxtyping's dim bindings, for `restore_dim_memo`."""
    single, variadic, pytree, arguments = _jaxtyping_storage.get_shape_memo()
    return single.copy(), variadic.copy(), pytree.copy(), arguments


def restore_dim_memo(snapshot: tuple) -> None:
    _jaxtyping_storage.set_shape_memo(*snapshot)


def in_tree_flatten() -> bool:
    """True while `jaxtyping.PyTree` checks only the tree structure of its leaves."""
    return bool(_jaxtyping_storage.get_treeflatten_memo())


_WRAPPER_CODE = ("wrapped_fn_impl", _jaxtyping_decorator.__file__)


class FunctionName(str):
    """`module.qualname`, which also knows its `qualname`, and its `source`: the
    `(file, line)` where it is defined (`None` when it has no Python code)."""

    qualname: str
    source: tuple[str, int] | None = None


def function_name(fn: Any) -> FunctionName:
    qualname = str(getattr(fn, "__qualname__", fn))
    out = FunctionName(f"{getattr(fn, '__module__', '?')}.{qualname}")
    out.qualname = qualname
    try:
        code = inspect.unwrap(getattr(fn, "__func__", fn)).__code__
        out.source = (code.co_filename, code.co_firstlineno)
    except (AttributeError, ValueError):  # a builtin, a class, a cycle of wrappers
        pass
    return out


class CheckedCall(NamedTuple):
    """A `jaxtyped` call being checked: its function, its bound arguments, the
    annotations of its parameters and (under "return") of its return value, and
    whether its body has returned (`out`), so that its return value is being
    checked."""

    function: FunctionName
    arguments: dict[str, Any]
    hints: dict[str, Any]
    returned: bool
    out: Any


def checked_call() -> CheckedCall | None:
    """Which `jaxtyped` function is being checked in this thread, if any: the
    innermost `jaxtyping.jaxtyped` call on the stack.

    Found by looking for jaxtyping's wrapper frame (`wrapped_fn_impl`, whose locals
    hold `bound`, `param_signature`, `full_signature` and, once the body returned,
    `out`: jaxtyping 0.3.11), so it serves jaxtyping's own `jaxtyped`, jaxshard's and
    the import hook.
    """
    for local in _wrapper_frames():
        bound = local.get("bound")
        arguments = dict(bound.arguments) if bound is not None else {}
        hints = {}
        signature = local.get("full_signature") or local.get("param_signature")
        if signature is not None:
            hints = {n: p.annotation for n, p in signature.parameters.items()}
            hints["return"] = signature.return_annotation
        return CheckedCall(
            function_name(local.get("fn")),
            arguments,
            hints,
            "out" in local,
            local.get("out"),
        )
    return None


def checked_calls() -> tuple[tuple[str, int], ...]:
    """The `jaxtyped` calls on this thread's stack, outermost first, as
    `(qualified name, call token)`: a number that tells one call from another (the
    same for the checks of its parameters and of its return value)."""
    calls = [
        (function_name(local.get("fn")), _token(local.get("bound")))
        for local in _wrapper_frames()
    ]
    return tuple(reversed(calls))


def _wrapper_frames():
    """The locals of jaxtyping's wrapper frames on the stack, innermost first."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if (code.co_name, code.co_filename) == _WRAPPER_CODE:
            yield frame.f_locals
        frame = frame.f_back


_tokens: dict[int, tuple[Any, int]] = {}
_next_token = iter(range(1, sys.maxsize))


def _token(bound: Any) -> int:
    # A call's `BoundArguments` lives as long as the call: its id, checked against
    # a weak reference (ids are reused once it is gone), names the call.
    if bound is None:
        return 0
    entry = _tokens.get(id(bound))
    if entry is None or entry[0]() is not bound:
        if len(_tokens) > 4096:
            for key in [k for k, (ref, _) in _tokens.items() if ref() is None]:
                del _tokens[key]
        entry = (weakref.ref(bound), next(_next_token))
        _tokens[id(bound)] = entry
    return entry[1]


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


def jit_parameters(fn: Any) -> dict[str, Any] | None:
    """What `jax.jit` was given for `fn`, or `None` if `fn` is not a `jax.jit`
    function: `fun` (the function it wraps), `static_argnums`, `static_argnames`,
    `donate_argnums`, `donate_argnames`, and `keep_unused`, `compiler_options`,
    `device`, `backend`, `in_shardings` and `out_shardings` when they were given
    (the shardings as pytrees; an unspecified leaf is `None`, a leaf given a layout
    a `jax.experimental.layout.Format` again). Not `inline`, which only matters to a
    call inside a trace.

    Read from jit's own record of its parameters (`_jit_info`), which has no public
    equivalent; the same on jax 0.10.2 to 0.12.0.1.
    """
    info = getattr(fn, "_jit_info", None)
    fun = getattr(fn, "__wrapped__", None)
    if info is None or fun is None or not callable(getattr(fn, "trace", None)):
        return None
    names = ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames")
    try:
        out: dict[str, Any] = {name: tuple(getattr(info, name)) for name in names}
        out["fun"] = fun
        if info.keep_unused:
            out["keep_unused"] = True
        if info.compiler_options_kvs:
            out["compiler_options"] = dict(info.compiler_options_kvs)
        for name in ("device", "backend"):
            if getattr(info, name) is not None:
                out[name] = getattr(info, name)
        for side in ("in", "out"):
            shardings = getattr(info, f"{side}_shardings_leaves")
            layouts = getattr(info, f"{side}_layouts_leaves")
            given = (
                info.user_specified_in_shardings
                if side == "in"
                else not all(_unspecified(x) for x in shardings)
            )
            if not given and all(x is None for x in layouts):
                continue
            leaves = [
                x if layout is None else Format(layout, x)
                for x, layout in zip(
                    [None if _unspecified(x) else x for x in shardings], layouts
                )
            ]
            treedef = getattr(info, f"{side}_shardings_treedef")
            out[f"{side}_shardings"] = jax.tree_util.tree_unflatten(treedef, leaves)
    except (AttributeError, TypeError, ValueError):
        return None
    return out


def _unspecified(x: Any) -> bool:
    return type(x).__name__ == "UnspecifiedValue"


def is_sharding_type_error(e: BaseException) -> bool:
    """Whether `e` is JAX's `ShardingTypeError` (raised on Explicit axes where a
    result's sharding cannot be inferred), which JAX does not export; the same class
    on jax 0.10.2 to 0.12.0.1."""
    return any(c.__name__ == "ShardingTypeError" for c in type(e).__mro__)


# The trace JAX runs op by op in: `find_top_trace(())` is the current trace.
with jax.core.eval_context():
    _EVAL_TRACE = type(find_top_trace(()))


def in_trace() -> bool:
    """Whether JAX is tracing (inside jit, vmap, grad, ...) rather than running op by
    op."""
    return type(find_top_trace(())) is not _EVAL_TRACE


def new_ref_outside_traces(value, sharding=None) -> Any:
    """A `jax.Ref` holding `value` (placed with `sharding`), made outside every trace
    even while tracing (`jax.ensure_compile_time_eval` leaves vmap's trace in
    place)."""
    with jax.core.eval_context():
        return jax.new_ref(jax.device_put(value, sharding))


def current_trace() -> Any:
    """The innermost trace JAX is recording into."""
    return find_top_trace(())


def new_ref_in(trace: Any, value) -> Any:
    """A `jax.Ref` holding `value`, made in `trace` (an enclosing trace: a shard_map
    body, while the current one is, say, a scan body inside it)."""
    with set_current_trace(trace):
        return jax.new_ref(jax.numpy.asarray(value))


def ref_contents(ref) -> Any:
    """The array a `jax.Ref` holds, without running an operation (reading with
    `ref[...]` costs a dispatch per Ref, which adds up over a thousand checks)."""
    return ref._refs._buf


def set_ref_contents(ref, value) -> None:
    """Replaces the array a `jax.Ref` holds with `value` (of the same type and
    placement), without running an operation.

    From jax 0.11 on a Ref's buffer is committed to its devices, and the runtime
    refuses an uncommitted replacement: `value` is committed to the same placement
    first (no copy when it is already there).
    """
    old = ref._refs._buf
    if old.committed and not value.committed:
        value = jax.device_put(value, old.sharding)
    ref._refs._buf = value


def varying_axes(x) -> set[str]:
    """The `shard_map` mesh axes over which `x` differs from device to device (its
    vma): `jax.typeof(x).manual_axis_type.varying` on jax 0.10.2 to 0.12.0.1."""
    manual_type = getattr(jax.typeof(x), "manual_axis_type", None)
    return set(getattr(manual_type, "varying", ()))


# --- extra outputs of any shard_map -----------------------------------------------
#
# Every shard_map (`jax.shard_map`, `jax.experimental.shard_map.shard_map`, `jax.smap`,
# however and whenever the mapped function was made) binds `shard_map_p` with its body
# as a function returning a FlatTree of the outputs, with their flat out_specs as aux
# (`_shard_map`'s `f_wrapped`); the rules of `vmap` and autodiff bind it again on the
# trace below with the body transformed. Where the body is traced into a jaxpr
# (`pe.DynamicJaxprTrace`: under `jit`, `scan`, remat), `shard_map_outputs` runs it
# through a hook that may add outputs. Eagerly, the shard_map is jitted first (eager
# shard_map refuses the Refs in a body with deeper checks). FlatTree is in `tree_util`
# on jax 0.10.2, in `flattree` from 0.11 (checked on 0.11.2 and 0.12.0.1): found by
# import, not by version, as jax's version number does not say which 0.11 moved it.
try:
    from jax._src import flattree as _flattree

    _flatten, _pack = _flattree.flatten, _flattree.pack
except ImportError:  # jax 0.10.2
    from jax._src.tree_util import FlatTree as _FlatTree

    _flatten, _pack = _FlatTree.flatten, _FlatTree.pack

shard_map_p = _shard_map_lib.shard_map_p


class _Hooks(threading.local):
    def __init__(self):
        self.hook: Callable | None = None


_hooks = _Hooks()
_installed = [0]  # threads with a hook in force
_install_lock = threading.Lock()


@contextlib.contextmanager
def shard_map_outputs(hook: Callable) -> Iterator[None]:
    """While in force, in this thread, every shard_map body traced runs as
    `hook(body)`, which calls `body()` and returns `(outputs, extra, done)`: with
    `done` `None`, the shard_map is unchanged; otherwise `extra` (a pytree of arrays
    the same on every device) leaves it with out_spec `P()` and, outside, `done` is
    called with its value there. Nested uses keep the outer hook.

    Installed on `shard_map_p` (an attribute of that instance, which every bind of
    it reads) while any thread has a hook in force, and removed when the last block
    ends, however it ends."""
    if _hooks.hook is not None:
        yield
        return
    with _install_lock:
        if _installed[0] == 0:
            shard_map_p.bind_with_trace = _bind_with_hook
        _installed[0] += 1
    _hooks.hook = hook
    try:
        yield
    finally:
        _hooks.hook = None
        with _install_lock:
            _installed[0] -= 1
            if _installed[0] == 0:
                del shard_map_p.bind_with_trace


def _bind_with_hook(trace, args, avals, params, /):
    """`shard_map_p.bind_with_trace`, the body run through the thread's hook."""
    bind = type(shard_map_p).bind_with_trace
    hook = _hooks.hook
    if hook is None or not isinstance(trace, (DynamicJaxprTrace, _EVAL_TRACE)):
        return bind(shard_map_p, trace, args, avals, params)
    if isinstance(trace, _EVAL_TRACE):
        with set_current_trace(trace):
            return _jitted_bind(args, params)
    (fun,) = params["subfuns"]
    made: list = []

    def body(*inner):
        out, extra, done = hook(lambda: fun(*inner))
        made.append(done)
        if done is None:
            return out
        outputs, specs = out.unpack_aux()
        extra = _flatten(extra)
        specs = (*specs, *[jax.sharding.PartitionSpec()] * len(extra))
        return _pack((outputs, extra)).with_aux(specs)

    out = bind(shard_map_p, trace, args, avals, {**params, "subfuns": (body,)})
    if not made or made[-1] is None:
        return out
    outputs, extra = out.unpack()
    with set_current_trace(trace):  # `bind` takes the trace away while it runs
        made[-1](extra.unflatten())
    return outputs


def _jitted_bind(args, params):
    """An eager shard_map, jitted: its body is then traced into a jaxpr."""
    made: list = []

    def staged(*inner):
        avals = [jax.typeof(x) for x in inner]
        out = shard_map_p.bind_with_trace(
            find_top_trace(inner), inner, avals, dict(params)
        )
        made.append(out)
        return list(out)

    flat = jax.jit(staged)(*args)
    return made[-1].update(flat)


# --- jaxtyping's array check --------------------------------------------------------

# The metaclass of jaxtyping's array annotations. jaxshard's subclass extends its
# `__instancecheck_str__` (the reason a value fails, "" if it passes) and `_check_shape`
# (the shape check against the dimension bindings), as of jaxtyping 0.3.11.
ArrayMeta = type(jaxtyping.AbstractArray)


def drop_callback_errors() -> None:
    """Forgets the errors raised in host callbacks that JAX keeps in its runtime
    tokens (`jax._src.dispatch.runtime_tokens`, the same on jax 0.10.2 to 0.12.0.1),
    which it raises again at every later effects barrier and at exit: it clears the
    tokens only when none of them failed."""
    from jax._src import dispatch

    dispatch.runtime_tokens.clear()
