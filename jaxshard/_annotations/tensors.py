"""PyTorch tensors on JAX's devices, with torchax: the `jax.Array` behind one.

A torchax tensor (`torchax.tensor.Tensor`) and a view of one (`torchax.view.View`)
are `torch.Tensor`s whose values live in a `jax.Array` (a tracer inside
`torchax.compile` and `torchax.interop.jax_jit`), returned by their `.jax()`. Their
shape and dtype are torch's, which jaxtyping checks; their sharding is that array's.

jaxshard imports neither torch nor torchax: a value can only be a torch tensor if
the program imported torch already, so `sys.modules` is where to look.
"""

import functools as ft
import inspect
import sys
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .._errors import ModelError
from .spec import axes_of


def is_tensor_type(cls: Any) -> bool:
    """Whether `cls` is `torch.Tensor` or a subclass (torch imported or not)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(cls, type) and issubclass(cls, torch.Tensor)


def from_jax(array: Any) -> Any:
    """`array` (or each array in the tree) as a torchax tensor on the 'jax' device
    (no copy)."""
    import torchax

    return torchax.default_env().j2t_iso(array)


# What each type of value is, looked up once per type: not a torch tensor, a tensor on
# the 'jax' device (torchax's Tensor and View, which have `.jax()`), or one elsewhere.
# A type is a torch tensor type only if torch was imported before it existed.
_NOT_TORCH, _ON_JAX, _ELSEWHERE = range(3)
_kinds: dict[type, int] = {}

# What `jax_value` returns for a torch tensor that is not on the 'jax' device.
ELSEWHERE: Any = object()


def _kind(cls: type) -> int:
    if not is_tensor_type(cls):
        return _NOT_TORCH
    return _ON_JAX if callable(getattr(cls, "jax", None)) else _ELSEWHERE


def jax_value(obj: Any) -> Any:
    """The `jax.Array` (or tracer) behind `obj` if it is a tensor on the 'jax'
    device; `obj` itself if it is not a torch tensor; `ELSEWHERE` for a torch tensor
    elsewhere (on the CPU, say)."""
    cls = type(obj)
    kind = _kinds.get(cls)
    if kind is None:
        kind = _kinds[cls] = _kind(cls)
    if kind == _NOT_TORCH:
        return obj
    return obj.jax() if kind == _ON_JAX else ELSEWHERE


def elsewhere(obj: Any, expected: str) -> str:
    """Why a torch tensor not on the 'jax' device fails an annotation with a
    partition spec, and how to put it there."""
    return (
        f"this value is a torch.Tensor on device {str(obj.device)!r}, not on "
        "torchax's 'jax' device, so it has no sharding, but the annotation expects "
        f"{expected}. Put it on the 'jax' device, laid out as the annotation says: "
        "`torchax.default_env().j2t_iso(jax.device_put(t.numpy(), "
        "NamedSharding(mesh, spec)))`, or `t.to('jax').apply_jax(jax.device_put, "
        "NamedSharding(mesh, spec))` inside `with torchax.default_env():`."
    )


def to_jax(tree: Any) -> Any:
    """`tree` with each torchax tensor replaced by its `jax.Array` (no copy)."""
    import torchax

    return torchax.default_env().t2j_iso(tree)


def is_compiled_module(obj: Any) -> bool:
    """Whether `obj` is a torchax-compiled module (`torchax.compile(module)`)."""
    interop = sys.modules.get("torchax.interop")
    return interop is not None and isinstance(obj, interop.JittableModule)


def abstract_weights(module: Any, mesh: Any, what: str) -> dict[str, Any]:
    """The parameters and buffers of the compiled `module`, as abstract arrays laid
    out on `mesh` with the partition specs they have now (replicated if they have
    none)."""
    out = {}
    for name, tensor in {**module.params, **module.buffers}.items():
        value = jax_value(tensor)
        if value is ELSEWHERE:
            raise ModelError(
                f"{what}: the weight {name!r} is a torch.Tensor on device "
                f"{str(tensor.device)!r}, not on torchax's 'jax' device. Move the "
                "module there before compiling it: `model.to('jax')` inside `with "
                "torchax.default_env():`."
            )
        sharding = getattr(value, "sharding", None)
        spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
        missing = [a for e in spec for a in axes_of(e) if a not in mesh.axis_names]
        if missing:
            raise ModelError(
                f"{what}: the weight {name!r} is sharded as {spec} over the mesh "
                f"axes {missing}, which the mesh {dict(mesh.shape)} does not have. "
                "Name the mesh's axes as those the weights are placed on."
            )
        sharding = NamedSharding(mesh, spec)
        out[name] = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
    return out


def module_forward(module: Any) -> Any:
    """The compiled `module`'s own `forward`, bound to the torch module."""
    return module._model.forward


def module_call(module: Any, forward: Any) -> Any:
    """`forward(model, *args)` as a function of the compiled `module`'s weights and
    the arguments, all torchax tensors: `call(weights, *args, **kwargs)`."""
    import torchax

    def call(weights, *args, **kwargs):
        with torchax.default_env():
            return module.functional_call(forward, weights, {}, *args, **kwargs)

    return call


def compiled_function(fn: Any) -> Any:
    """The torch function that `torchax.compile(fn)` or `interop.jax_jit(fn)` made
    `fn` from, for naming it; `None` if `fn` is not one, or torchax keeps it where
    this does not look (it is not part of torchax's API)."""
    interop = sys.modules.get("torchax.interop")
    if not (
        interop is not None
        and isinstance(fn, ft.partial)
        and fn.func is getattr(interop, "call_jax", None)
        and fn.args
    ):
        return None
    try:  # call_jax(call_with_prng) -> jitted -> jax_func = call_torch(torch_fn)
        jitted = inspect.getclosurevars(fn.args[0]).nonlocals["jitted"]
        jax_func = inspect.getclosurevars(jitted.__wrapped__).nonlocals["jax_func"]
        return jax_func.args[0]
    except (AttributeError, KeyError, IndexError, TypeError):
        return None
