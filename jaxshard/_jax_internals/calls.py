"""Which call is being traced or compiled: the `jax.jit` call XLA compiles, flax
linen's init, the mesh in JAX's context, and jaxtyping's state (its dimension
bindings, the function it is checking, its array metaclass)."""

import inspect
import os
import sys
import weakref
from typing import Any, NamedTuple

import jax
import jaxtyping
from jax._src import (
    mesh as _mesh_lib,  # the legacy `with mesh:`, for context_mesh
)
from jaxtyping import (
    _array_types as _jaxtyping_arrays,
    _decorator as _jaxtyping_decorator,
    _storage as _jaxtyping_storage,
)


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


# jaxtyping's shape check (`_MetaAbstractArray._check_shape`), for the shapes most
# annotations have: made once per annotation, it then costs a loop over the
# dimensions, where jaxtyping copies its four binding tables per check.

_Named = _jaxtyping_arrays._NamedDim
_Fixed = _jaxtyping_arrays._FixedDim
_ANONYMOUS = _jaxtyping_arrays._anonymous_dim
_NamedVariadic = _jaxtyping_arrays._NamedVariadicDim
_ANY_DIMS = _jaxtyping_arrays._anonymous_variadic_dim  # `...` and `*_`
_shape_storage = _jaxtyping_storage._shape_storage
_treeflatten_storage = _jaxtyping_storage._treeflatten_storage


class VariadicDims(NamedTuple):
    """`simple_dims` of an annotation with a variadic dimension: the dimensions
    before and after it, and its name (`None` for `...` or `*_`)."""

    before: tuple
    name: str | None
    after: tuple


def simple_dims(annotation: Any) -> tuple | VariadicDims | None:
    """The dimensions of a jaxtyping annotation as `(name, size)` pairs (`name` for a
    named one, `size` for a fixed one, neither for `_`), if each is one of those and
    none is broadcastable (`#`) or a tree path (`?`); else `None`. With a variadic
    dimension (`*name`, `...`), a `VariadicDims`."""
    i = annotation.index_variadic
    if i is None:
        return _simple_dims(annotation.dims)
    variadic = annotation.dims[i]
    if variadic is _ANY_DIMS:
        name = None
    elif type(variadic) is _NamedVariadic and not (
        variadic.broadcastable or variadic.treepath
    ):
        name = variadic.name
    else:
        return None
    before = _simple_dims(annotation.dims[:i])
    after = _simple_dims(annotation.dims[i + 1 :])
    if before is None or after is None:
        return None
    return VariadicDims(before, name, after)


def _simple_dims(dims: Any) -> tuple | None:
    out = []
    for dim in dims:
        if dim is _ANONYMOUS:
            out.append((None, None))
        elif getattr(dim, "broadcastable", True):
            return None
        elif type(dim) is _Fixed:
            out.append((None, dim.size))
        elif type(dim) is _Named and not dim.treepath:
            out.append((dim.name, None))
        else:
            return None
    return tuple(out)


def bind_dims(dims: tuple | VariadicDims, shape: tuple) -> bool:
    """jaxtyping's shape check of `shape` against `simple_dims`' `dims`, with its
    effect: whether it passes, each new name then bound in the bindings of the
    jaxtyped call in progress (nothing bound when it fails; in `PyTree`'s tree pass,
    nothing checked), as in jaxtyping 0.3.11. `False` also where jaxtyping's rule
    for a variadic dimension bound as broadcastable (`*#name`) applies: check those
    in full."""
    name = None
    if type(dims) is VariadicDims:
        before, name, after = dims
        i, j = len(before), len(shape) - len(after)
        if j < i:
            return False
        dims, shape, variadic = before + after, shape[:i] + shape[j:], shape[i:j]
    elif len(shape) != len(dims):
        return False
    if getattr(_treeflatten_storage, "value", False):
        return True
    stack = getattr(_shape_storage, "memo_stack", None)
    memo, variadic_memo = stack[-1][:2] if stack else ({}, {})
    added = []
    for (dim, size), n in zip(dims, shape):
        if dim is None:
            if size is not None and size != n:
                break
        else:
            bound = memo.get(dim)
            if bound is None:
                memo[dim] = n
                added.append(dim)
            elif bound != n:
                break
    else:
        if name is None:
            return True
        bound = variadic_memo.get(name)
        if bound is None:
            variadic_memo[name] = (False, variadic)  # pyright: ignore
            return True
        if bound == (False, variadic):  # pyright: ignore
            return True
    for dim in added:
        del memo[dim]
    return False


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


# --- who calls -----------------------------------------------------------------------

_JAX_FILES = os.path.dirname(jax.__file__) + os.sep


def called_by_jax() -> bool:
    """Whether the caller of the function that asks was called by JAX itself: a
    registered dataclass's `__init__` that JAX's tree functions call to rebuild it
    from its leaves (`treedef.unflatten`, called from C by `jax.tree.map`,
    `jax.tree_util.tree_unflatten`, ... in jax's own modules), not one the user
    calls; or by `flax.struct`'s unflatten (flax 0.12). The same on jax 0.10.2 to
    0.12.0.1."""
    filename = sys._getframe(2).f_code.co_filename
    return filename.startswith(_JAX_FILES) or filename.endswith(_FLAX_STRUCT)


_FLAX_STRUCT = os.path.join("flax", "struct.py")
