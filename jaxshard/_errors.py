"""jaxshard's exceptions: every contract failure is a `jaxtyping.TypeCheckError`. And
their tracebacks, which end at the user's call: jaxshard's own frames (and those of
the checkers it runs, jaxtyping's and beartype's) are left out, as JAX leaves out its
internals."""

import difflib
import functools as ft
import os
import types
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import jaxtyping
from jaxtyping import (
    AnnotationError as AnnotationError,
    TypeCheckError as TypeCheckError,
)


class ShardingError(TypeCheckError):
    """An array is not sharded the way its annotation says.

    A subclass of `jaxtyping.TypeCheckError`, so code that catches jaxtyping's errors
    catches this one too. The message names the function, the parameter (or the return
    value), the expected and actual partition specs, the mesh, and the array's dtype
    and shape.
    """


ShardingError.__module__ = "jaxshard"


class ModelError(Exception):
    """`jaxshard.verify` could not trace or compile the function, for a reason of its
    own rather than a contract: JAX refused one of its operations (a sharding type
    error on Explicit axes, say). The message names the function, the source line and
    the operation, and `__cause__` is JAX's error."""


ModelError.__module__ = "jaxshard"


class UntestedVersionWarning(UserWarning):
    """The installed jax is outside the range this jaxshard release is tested with."""


UntestedVersionWarning.__module__ = "jaxshard"


def expect(ok: bool, function: str, parameter: str, accepts: str, value: Any) -> None:
    """A public entry point's argument check: unless `ok`, a `TypeError` that names
    the function, the parameter, what it accepts and what it got."""
    if not ok:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise TypeError(
            f"jaxshard.{function}: `{parameter}` takes {accepts}; got {shown} (type "
            f"{type(value).__name__})."
        )


def expect_callable(function: str, fn: Any, parameter: str = "fn") -> None:
    expect(callable(fn), function, parameter, "a function (any callable)", fn)


def did_you_mean(
    names: str | Iterable[str], choices: Iterable[str], inline: bool = False
) -> str:
    """A suggestion, " Did you mean 'dp'?", when a name is close to one of `choices`
    (a misspelled mesh axis, logical name, dimension or option), else "": the end of
    a message, or with `inline`, " (did you mean 'dp'?)" to follow the name inside a
    sentence. For
    several unknown `names`, each that has a close match is named: " Did you mean 'dp'
    for 'db', 'tp' for 'tb'?". The one place that suggests, for every message."""
    names = [names] if isinstance(names, str) else [str(n) for n in names]
    choices = [str(c) for c in choices]
    found = {}
    for name in names:
        others = [c for c in choices if c != name]
        # 0.5, not difflib's 0.6: two-letter mesh axes ('db' for 'dp') match at 0.5.
        close = difflib.get_close_matches(name, others, n=1, cutoff=0.5)
        if close:
            found[name] = close[0]
    if not found:
        return ""
    if len(names) == 1:
        shown = repr(found[names[0]])
    else:
        shown = ", ".join(f"{c!r} for {n!r}" for n, c in found.items())
    return f" (did you mean {shown}?)" if inline else f" Did you mean {shown}?"


# --- tracebacks that end at the user's call -----------------------------------------

# Files whose frames a jaxshard error's traceback leaves out: jaxshard's own, the
# checkers' (jaxtyping's; beartype's generated wrappers are `<@beartype(...)>`), and
# whatever `hide_files` adds (JAX's frames between a compile and its listeners).
_HIDDEN = [
    os.path.dirname(os.path.abspath(__file__)),
    os.path.dirname(jaxtyping.__file__),
]


def hide_files(path: str) -> None:
    """Leaves the frames of `path` (a file, or a folder and all below it) out of
    jaxshard errors' tracebacks too."""
    _HIDDEN.append(os.path.abspath(path))


def _shown(filename: str) -> bool:
    if filename.startswith("<@beartype("):
        return False
    return not any(filename == p or filename.startswith(p + os.sep) for p in _HIDDEN)


def _ours(error: BaseException) -> bool:
    """An error jaxshard or jaxtyping raises on purpose (a violation, a failed check,
    a wrong annotation), not a crash, whose frames would tell the user nothing."""
    module = type(error).__module__
    return module.split(".", 1)[0] in ("jaxshard", "jaxtyping")


def hide_frames(error: BaseException) -> BaseException:
    """`error` with jaxshard's frames (and the checkers') left out of its traceback,
    unless JAX's traceback filtering is off (`JAX_TRACEBACK_FILTERING=off`). Raise
    it again with a bare `raise`, which adds no frame; `raise error` would add the
    raising one."""
    if not _ours(error) or os.environ.get("JAX_TRACEBACK_FILTERING") == "off":
        return error
    kept = None
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    for tb in reversed(frames):
        if _shown(tb.tb_frame.f_code.co_filename):
            kept = types.TracebackType(kept, tb.tb_frame, tb.tb_lasti, tb.tb_lineno)
    return error.with_traceback(kept)


_F = TypeVar("_F", bound=Callable)


def user_facing(fn: _F) -> _F:
    """A public entry point, from whose calls jaxshard's errors come with a
    traceback that ends at the user's call (see `hide_frames`)."""

    @ft.wraps(fn)
    def entry(*args, **kwargs):
        __tracebackhide__ = True
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            hide_frames(e)
            raise

    return entry  # pyright: ignore[reportReturnType]
