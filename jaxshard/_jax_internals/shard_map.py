"""Extra outputs of any `shard_map` body (`shard_map_outputs`): how a check inside
a `jax.shard_map` that jaxshard did not make leaves it."""

import contextlib
import threading
from collections.abc import Callable, Iterator

import jax
from jax._src import (
    shard_map as _shard_map_lib,  # shard_map_outputs
)
from jax._src.core import (  # jax.extend.core's; see __init__
    find_top_trace,
    set_current_trace,
)
from jax._src.interpreters.partial_eval import DynamicJaxprTrace  # shard_map_outputs

from .traces import _EVAL_TRACE


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
        self.on_eager: Callable | None = None


_hooks = _Hooks()
_installed = [0]  # threads with a hook in force
_install_lock = threading.Lock()


@contextlib.contextmanager
def shard_map_outputs(
    hook: Callable, on_eager: Callable | None = None
) -> Iterator[None]:
    """While in force, in this thread, every shard_map body traced runs as
    `hook(body)`, which calls `body()` and returns `(outputs, extra, done)`: with
    `done` `None`, the shard_map is unchanged; otherwise `extra` (a pytree of arrays
    the same on every device) leaves it with out_spec `P()` and, outside, `done` is
    called with its value there. Nested uses keep the outer hook. An eager
    shard_map over a concrete mesh is traced (anew at each call) inside
    the context manager `on_eager(mesh)`.

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
    _hooks.hook, _hooks.on_eager = hook, on_eager
    try:
        yield
    finally:
        _hooks.hook = _hooks.on_eager = None
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
    """An eager shard_map, jitted: its body is then traced into a jaxpr. Arguments
    on other devices than the mesh's (`jnp.arange`'s, on one) are first laid out by
    the in_specs, as eager shard_map lays them out: a jit would refuse them."""
    mesh = params["mesh"]
    eager = contextlib.nullcontext()
    if isinstance(mesh, jax.sharding.Mesh):
        if _hooks.on_eager is not None:
            eager = _hooks.on_eager(mesh)
        devices = set(mesh.devices.flat)
        args = [
            x
            if getattr(getattr(x, "sharding", None), "device_set", None) == devices
            else jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
            for x, spec in zip(args, params["in_specs"])
        ]
    made: list = []

    def staged(*inner):
        avals = [jax.typeof(x) for x in inner]
        out = shard_map_p.bind_with_trace(
            find_top_trace(inner), inner, avals, dict(params)
        )
        made.append(out)
        return list(out)

    with eager:
        flat = jax.jit(staged)(*args)
    return made[-1].update(flat)
