"""`jaxshard.jaxtyped`: jaxtyping's `jaxtyped`, whose errors also say what was wrong
with a sharding."""

import functools as ft
import inspect
import os
import threading
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Literal, overload, ParamSpec, TypeVar

import jax
import jaxtyping
from jaxtyping import TypeCheckError

from .._errors import hide_frames, ShardingError
from .._jax_internals import ArrayMeta, called_by_jax, jit_parameters


class _Notes(threading.local):
    def __init__(self):
        # Per `jaxshard.jaxtyped` call in progress, its notes (`None` for none yet).
        self.frames: list[list[tuple[str, str, str, bool]] | None] = []
        # Per call (by depth), the tracers it probed, by (id, annotation): made
        # when the first probe is, as most calls are eager.
        self.probed: dict[int, dict[tuple[int, Any], Any]] = {}


_notes = _Notes()


def note_failure(
    obj: Any, reason: str, sharding: bool = True, annotation: Any = None
) -> None:
    """Records why a check of `obj` (against `annotation`) failed, for the enclosing
    `jaxshard.jaxtyped` call's error message: a sharding check, or
    (`sharding=False`) the shape check of a `shard_map` block. Costs nothing when no
    such call is active."""
    frames = _notes.frames
    if frames:
        from .describe import where

        function, name = where(obj, annotation)
        notes = frames[-1]
        if notes is None:  # the call's first note (see `_with_notes`)
            notes = frames[-1] = []
        notes.append((function, name, reason, sharding))


def probed_before(x: Any, annotation: Any) -> bool:
    """Whether the enclosing `jaxshard.jaxtyped` call left a probe for the tracer
    `x` and `annotation` already (jaxtyping and beartype each check a parameter:
    one probe is enough). False outside such calls."""
    probed = _notes.probed.get(len(_notes.frames))
    # The tracer itself is held: while it is, its id is its own.
    return probed is not None and probed.get((id(x), annotation)) is x


def note_probed(x: Any, annotation: Any) -> None:
    """Notes, for `probed_before`, that a probe for `x` and `annotation` is in the
    program."""
    depth = len(_notes.frames)
    if depth:
        _notes.probed.setdefault(depth, {})[(id(x), annotation)] = x


def _reasons(notes: list[tuple[str, str, str, bool]]) -> list[str]:
    """Each failed check once, with the function and parameter it concerns."""
    from .describe import subject

    return [
        ("" if function is None else f"{subject(function, name)}: ") + reason
        for function, name, reason, _ in dict.fromkeys(notes)
    ]


def _message(message: str, notes: list, fn: Callable, args: tuple, kwargs: dict):
    """jaxtyping's `message`, its dumps of the arguments cut to a line each, under
    the cause: the first check that failed (a sharding, or why a shape or dtype is
    not the annotation's), or the dimension two arguments bind to different sizes.
    Each failure is said once: those the first line does not say are listed last,
    under "Sharding:" (or "Shape:", where none is a sharding)."""
    from .bindings import cut_dumps, dimension_conflict

    conflict = dimension_conflict(fn, args, kwargs, message)
    message = cut_dumps(message, fn, args, kwargs)
    if conflict:
        name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)}"
        message = f"{name}: {conflict}\n{message}"
    if not notes:
        return message
    unique = list(dict.fromkeys(notes))
    reasons = [r.rstrip(".") + "." for r in _reasons(unique)]
    if not conflict:
        more = f" ({len(reasons) - 1} more below)" if len(reasons) > 1 else ""
        message = f"{reasons[0].rstrip('.')}{more}.\n{message}"
        unique, reasons = unique[1:], reasons[1:]
    if not reasons:
        return message
    title = "Sharding" if any(n[3] for n in unique) else "Shape"
    details = "\n".join(f"- {reason}" for reason in reasons)
    return f"{message}\n----------------------\n{title}:\n{details}"


def _raised_in_body(error: BaseException, fn: Callable) -> bool:
    """Whether `error` came from inside `fn`'s body (the check of a function it
    calls), not from the check of `fn`'s own call: then its message is about that
    other call, whose arguments and dimensions are not `fn`'s."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return True
        tb = tb.tb_next
    return False


# What checks a function's nnx Module arguments against their Variables' metadata
# (`nnx.ModuleParameters`, which `nnx`, a module above this one, puts here when the
# package is imported).
module_parameters: list[Callable] = []


def _with_notes(checked, fn, modules: bool = True):
    """`checked`, whose errors say what was wrong with a sharding; with `modules`,
    an nnx Module argument's Variables are checked against their metadata too (see
    `nnx.ModuleParameters`)."""
    parameters = None
    if modules and module_parameters:
        parameters = module_parameters[0](fn)

    @ft.wraps(fn)
    def wrapper(*args, **kwargs):
        __tracebackhide__ = True
        if getattr(wrapper, "__no_type_check__", False):
            return fn(*args, **kwargs)  # `typing.no_type_check` above this decorator
        # Every call pays for this: the call's notes are a list only once one is
        # made (`note_failure`).
        frames = _notes.frames
        frames.append(None)
        try:
            if parameters is not None and parameters.names != ():
                parameters.check(args, kwargs)
            return checked(*args, **kwargs)
        except TypeCheckError as e:
            if _raised_in_body(e, fn):
                raise  # a check of a call it makes: that call's error, as it is
            notes = frames[-1] or []
            if isinstance(e, ShardingError):
                hide_frames(e)
                raise
            kind = ShardingError if any(n[3] for n in notes) else TypeCheckError
            # One exception whose message stands alone: jaxtyping's, with what
            # the sharding was; not beartype's and jaxtyping's chained under it.
            error = kind(_message(str(e), notes, fn, args, kwargs))
            try:
                raise error from None
            except TypeCheckError:
                hide_frames(error)  # it ends at the user's call
                raise
        finally:
            if _notes.probed:
                _notes.probed.pop(len(frames), None)
            frames.pop()

    wrapper.__jaxshard_jaxtyped__ = True
    return wrapper


def _made_by_the_user(checked: Callable, init: Callable) -> Callable:
    """`__init__`, checked when the user makes an instance, not when JAX rebuilds
    one from its leaves (`jax.tree.map`, `eval_shape`, jit's shardings and
    arguments: a `register_dataclass` class is unflattened through `__init__`),
    whose leaves may be shardings, `ShapeDtypeStruct`s or placeholders."""

    @ft.wraps(init)
    def __init__(self, *args, **kwargs):
        __tracebackhide__ = True
        if called_by_jax() or getattr(__init__, "__no_type_check__", False):
            return init(self, *args, **kwargs)  # (or `typing.no_type_check` above)
        return checked(self, *args, **kwargs)

    __init__.__jaxshard_jaxtyped__ = True  # pyright: ignore[reportFunctionMemberAccess]
    return __init__


_sentinel: Any = object()


def _is_typechecked(fn: Any) -> bool:
    """Whether `fn` is already wrapped by beartype or typeguard: jaxtyping's old
    double-decorator syntax, `@jaxtyped @beartype def f`."""
    if getattr(fn, "__beartype_wrapper", False):
        return True
    filename = getattr(getattr(fn, "__code__", None), "co_filename", "")
    return "typeguard" in filename.replace("\\", "/").split("/")


def _is_unannotated(fn: Any) -> bool:
    """Whether the function `fn` has no annotations: a typechecker, given one, has
    nothing to check and returns it as it is."""
    target = inspect.unwrap(fn)
    return inspect.isroutine(target) and not getattr(target, "__annotations__", None)


def _jaxtyping_jaxtyped(fn: Any, typechecker: Any) -> Any:
    if typechecker is _sentinel:
        if _is_typechecked(fn):
            # The old syntax (`@jaxtyped @beartype`): as jaxtyping has it, warning
            # as it does.
            return jaxtyping.jaxtyped(fn)
        if _is_unannotated(fn):
            # Nothing a typechecker would check: jaxtyping's wrapper, as for the old
            # syntax, but not its warning about that syntax, which the user did not
            # write.
            name = getattr(fn, "__qualname__", repr(fn))
            warnings.warn(
                f"jaxshard.jaxtyped: {name} has no annotations, so there is nothing "
                "to check; annotate its parameters or return value, or leave the "
                "decorator out.",
                stacklevel=_user_frame(),
            )
            return jaxtyping.jaxtyped(fn, typechecker=None)
        import beartype

        typechecker = beartype.beartype
    return jaxtyping.jaxtyped(fn, typechecker=typechecker)


def _user_frame() -> int:
    """The `stacklevel` of a warning about the caller's decorator: the first frame
    outside jaxshard (`@jaxshard.jaxtyped` may recurse, through a classmethod or a
    property)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    here = inspect.currentframe()
    frame, level = (here.f_back if here is not None else None), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


_T = TypeVar("_T")
_Params = ParamSpec("_Params")
_Return = TypeVar("_Return")


# What static type checkers see: the decorated function or class keeps its type.
@overload
def jaxtyped(*, typechecker: Any = _sentinel) -> Callable[[_T], _T]: ...


@overload
def jaxtyped(fn: type[_T], *, typechecker: Any = _sentinel) -> type[_T]: ...


@overload
def jaxtyped(
    fn: Callable[_Params, _Return], *, typechecker: Any = _sentinel
) -> Callable[_Params, _Return]: ...


@overload
def jaxtyped(fn: Literal["context"]) -> AbstractContextManager[None]: ...


def jaxtyped(fn: Any = _sentinel, *, typechecker: Any = _sentinel) -> Any:
    """A drop-in for `jaxtyping.jaxtyped`, with the same arguments and behaviour,
    which also checks without being told which typechecker to use.

    The differences:

    - Without `typechecker=`, parameters and return values are checked with beartype
        (jaxtyping would check nothing and warn). A function already wrapped by
        beartype or typeguard (jaxtyping's old `@jaxtyped @beartype` syntax) is
        treated as jaxtyping treats it: checked once, by that wrapper, with
        jaxtyping's warning recommending the new syntax. A function with no
        annotations, which a typechecker leaves as it is, is wrapped as jaxtyping
        wraps it, with a one-line warning that there is nothing to check.
        `typechecker=None` is jaxtyping's: only `isinstance` checks in the body count.
    - When a sharding check fails, the error is a `jaxshard.ShardingError` (a
        `jaxtyping.TypeCheckError`) whose first line says what was wrong: the
        parameter, the expected and actual specs, the mesh, and the array's dtype and
        shape; other failures are listed after jaxtyping's message. (jaxtyping's own
        message shows only the expected type.) An array of the wrong rank, shape or
        dtype is jaxtyping's `TypeCheckError`, whose first line says which.
    - A parameter annotated with a flax nnx Module class (`model: Decoder`) is
        checked whole, not by its type alone, in an eager call: each Variable that
        carries its partitioning (`nnx.with_partitioning`) against that metadata,
        as `jaxshard.check_tree` checks it, before the call (with a typechecker:
        `typechecker=None` checks no parameter). Inside `jit` its weights are
        tracers and are not checked so: call `jaxshard.check_tree(model)` in the
        step, or before it.

    - A `jax.jit` function (`@jaxtyped @jax.jit def f`) is jitted anew around its
        checked function, with the same static and donated arguments and shardings.
    - A decorated dataclass's `__init__` is checked when the user makes an instance,
        not when JAX rebuilds one from its leaves (a `register_dataclass` class
        under `jax.tree.map`, `eval_shape` or jit's shardings, whose leaves may be
        shapes, `ShapeDtypeStruct`s or shardings): jaxtyping checks those too, and
        fails them.

    `@typing.no_type_check` above it turns checking off, as with jaxtyping's.

    !!! Example

        ```python
        from beartype import beartype

        @jaxshard.jaxtyped(typechecker=beartype)
        def f(x: Float[Array, "batch d", P("dp", None)]) -> Float[Array, "batch"]:
            return x.sum(axis=1)
        ```
    """
    if isinstance(fn, str):
        kwargs = {} if typechecker is _sentinel else {"typechecker": typechecker}
        return jaxtyping.jaxtyped(fn, **kwargs)  # "context"
    if fn is _sentinel:
        return ft.partial(jaxtyped, typechecker=typechecker)
    if isinstance(fn, (classmethod, staticmethod)):
        return type(fn)(jaxtyped(fn.__func__, typechecker=typechecker))
    if isinstance(fn, property):
        parts = (fn.fget, fn.fset, fn.fdel)
        return property(
            *(
                None if p is None else jaxtyped(p, typechecker=typechecker)
                for p in parts
            )
        )
    if inspect.isclass(fn):
        init = fn.__init__
        if getattr(init, "__jaxshard_jaxtyped__", False):
            return fn  # already decorated: one check per call, not two
        out = _jaxtyping_jaxtyped(fn, typechecker)
        if out.__init__ is not init:
            checked = _with_notes(out.__init__, init, typechecker is not None)
            out.__init__ = _made_by_the_user(checked, init)
        return out
    params = jit_parameters(fn)
    if params is not None:  # `@jaxtyped @jax.jit def f`: checked inside the jit
        params = dict(params)
        return jax.jit(jaxtyped(params.pop("fun"), typechecker=typechecker), **params)
    if not callable(fn):
        raise TypeError(
            f"jaxshard.jaxtyped decorates a function, method or class; got {fn!r} of "
            f"type {type(fn).__name__}. Put `@jaxshard.jaxtyped(typechecker=...)` "
            "above a `def` or `class`."
        )
    checked = _jaxtyping_jaxtyped(fn, typechecker)
    if _plain_only(fn):
        return _with_message(checked, fn)
    return _with_notes(checked, fn, typechecker is not None)


def _with_message(checked, fn):
    """`_with_notes` for a function whose annotations are all plain (`_plain_only`):
    no check of its notes anything, so no notes are kept: jaxtyping's error alone is
    rewritten. (A call then costs what jaxtyping's costs, and a Python call.)"""

    @ft.wraps(fn)
    def wrapper(*args, **kwargs):
        __tracebackhide__ = True
        if getattr(wrapper, "__no_type_check__", False):
            return fn(*args, **kwargs)  # `typing.no_type_check` above this decorator
        try:
            return checked(*args, **kwargs)
        except TypeCheckError as e:
            if _raised_in_body(e, fn):
                raise  # a check of a call it makes: that call's error, as it is
            if isinstance(e, ShardingError):
                hide_frames(e)
                raise
            error = TypeCheckError(_message(str(e), [], fn, args, kwargs))
            try:
                raise error from None
            except TypeCheckError:
                hide_frames(error)  # it ends at the user's call
                raise

    wrapper.__jaxshard_jaxtyped__ = True
    return wrapper


_BUILTINS = (int, float, complex, bool, str, bytes, type(None), None)


def _plain_only(fn: Any) -> bool:
    """Whether every annotation of `fn` is a plain jaxtyping array annotation or a
    builtin type, so that no check of its calls can note a sharding. (Anything else,
    a union, a PyTree, a string yet to be resolved, may hold a sharded annotation.)"""
    target = inspect.unwrap(fn)
    annotations = (
        getattr(target, "__annotations__", None) if inspect.isroutine(target) else None
    )
    if not annotations:
        return False
    return all(
        type(a) is ArrayMeta or any(a is b for b in _BUILTINS)
        for a in annotations.values()
    )


def checked_by_jaxshard(fn: Callable) -> Callable:
    """`fn`, with its parameters and return value checked against its annotations.

    A `jax.jit` function is jitted anew around its checked function, with the same
    static arguments and shardings, so the checks see what its `in_shardings` and
    `out_shardings` make of the values. Any other wrapper (`equinox.filter_jit`,
    `flax.nnx.jit`, ...) is checked around: its parameters as they go in, its return
    value as it comes out, and every annotated function it calls."""
    import beartype

    check = ft.partial(jaxtyped, typechecker=beartype.beartype)
    named = str(getattr(fn, "__name__", "")).isidentifier()  # not a lambda
    function = inspect.isfunction(fn) or inspect.ismethod(fn)
    if jit_parameters(fn) is not None or (function and named):
        return check(fn)
    target = inspect.unwrap(fn)

    @ft.wraps(target)
    def through(*args, **kwargs):
        return fn(*args, **kwargs)

    if not named:
        through.__name__ = through.__qualname__ = "function"
    return check(through)
