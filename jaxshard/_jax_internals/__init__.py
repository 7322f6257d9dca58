"""Every use of JAX and jaxtyping internals lives here, each behind one small function.

Supported and tested: jax 0.10.2 (Python 3.11), 0.11.2 (3.12) and 0.12.0.1 (3.13), with
jaxtyping 0.3.11. Where the releases differ, a gate on `jax.__version_info__` picks one
definition at import (call sites never branch) and says which versions it covers.
`tests/test_internals.py` pins the behaviour each function relies on, on every version
of the test matrix, so a release that changes it fails there first.

Public APIs used where they exist: `jax.typeof`, `jax.new_ref` and `jax.Ref`,
`jax.sharding.get_mesh`, `jax.core.eval_context`, `jax.extend.core`'s `Primitive`,
`find_top_trace` and `set_current_trace`, and the rule tables of `jax.interpreters`
(`ad.primitive_jvps`, `batching.primitive_batchers` and `fancy_primitive_batchers`,
`partial_eval.dce_rules`, `mlir.register_lowering`).

`jax.extend.core`'s three are taken from `jax._src.core`, where it finds them (the
same objects, tested), and MLIR's `ir` from `jaxlib.mlir`, as `jax.extend.mlir.ir`
does: importing any of `jax.extend` imports all of it, Pallas included, which would
cost `import jaxshard` 25 to 50 ms.

Internals still used, and why (none has a public equivalent in these releases):

- `jax._src.debugging._inspect_sharding_lowering_rule` and
  `jax._src.dispatch.prim_requires_devices_during_lowering`: the sharding probe lowers
  to the SPMD partitioner's sharding callback, as `jax.debug.inspect_array_sharding`
  does, but without its effect (which would cost jit's C++ dispatch). Under
  `jax.set_mesh` the probe hands that rule the mesh's devices itself
  (`jax._src.sharding_impls.ShardingContext`, the lowering context's `replace`).
- `jax._src.interpreters.ad.primitive_linearizations`: the probe's linearize rule
  under `grad` (JAX's fallback traces a primitive's JVP rule into a jaxpr per bind,
  about a millisecond of a first call's trace per probe).
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
- JAX's tree functions calling a registered dataclass's `__init__` from its own
  modules (`called_by_jax`): a class checked by `jaxshard.jaxtyped` is checked when
  the user makes it, not each time JAX rebuilds it from its leaves.
- `jax._src.traceback_util.register_exclusion`: jaxshard's frames (and those of
  `jax.monitoring`, which calls the compile listener) left out of the tracebacks JAX
  filters, as flax and equinox leave out theirs.
- `jax._src.pjit._run_python_pjit`'s frame: the arguments of the `jax.jit` call
  being compiled, whose layouts point at the likely cause of a violation.
- flax linen's module stack (`flax.linen.module._context.module_stack`): whether a
  module method runs under `Module.init`, whose dummy batch activation contracts
  have nothing to say about.
- jaxtyping's `_storage` (dimension bindings, the tree-structure pass of `PyTree`),
  its dimension classes (`_array_types._NamedDim`, `_FixedDim`, `_anonymous_dim`,
  `_NamedVariadicDim`, `_anonymous_variadic_dim`: a sharded annotation's shape
  check, done by jaxshard as jaxtyping does it, without copying the binding tables),
  `_decorator`'s wrapper frame (which function is being checked, with which
  arguments and annotations, and whether its return value is) and its array
  metaclass's `__instancecheck_str__`/`_check_shape`, which jaxshard's extends.
"""

import re
import warnings

import jax

from .._errors import UntestedVersionWarning


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


# Every internal, by what it is for (each module's docstring says more): imported
# after the version check, so that an untested jax warns before anything can fail.
from .calls import (  # noqa: E402
    ArrayMeta as ArrayMeta,
    bind_dims as bind_dims,
    called_by_jax as called_by_jax,
    checked_call as checked_call,
    checked_calls as checked_calls,
    CheckedCall as CheckedCall,
    compiling_call as compiling_call,
    context_mesh as context_mesh,
    drop_callback_errors as drop_callback_errors,
    function_name as function_name,
    FunctionName as FunctionName,
    in_linen_init as in_linen_init,
    in_tree_flatten as in_tree_flatten,
    restore_dim_memo as restore_dim_memo,
    save_dim_memo as save_dim_memo,
    simple_dims as simple_dims,
    VariadicDims as VariadicDims,
)
from .primitives import (  # noqa: E402
    accumulate as accumulate,
    accumulate_p as accumulate_p,
    bind_probe as bind_probe,
    is_batched as is_batched,
    mesh_probe_p as mesh_probe_p,
    probe_p as probe_p,
)
from .shard_map import (  # noqa: E402
    shard_map_outputs as shard_map_outputs,
    shard_map_p as shard_map_p,
)
from .traces import (  # noqa: E402
    current_trace as current_trace,
    hide_from_jax_tracebacks as hide_from_jax_tracebacks,
    in_trace as in_trace,
    is_sharding_type_error as is_sharding_type_error,
    jit_parameters as jit_parameters,
    new_ref_in as new_ref_in,
    new_ref_outside_traces as new_ref_outside_traces,
    ref_contents as ref_contents,
    set_ref_contents as set_ref_contents,
    varying_axes as varying_axes,
)


hide_from_jax_tracebacks()
