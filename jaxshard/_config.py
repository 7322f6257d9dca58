"""The settings stack: `with jaxshard.config(sharding="off"): ...`, per thread."""

import contextlib
import os
import threading
from collections.abc import Iterator


# name -> (environment variable, valid values; the first is the default)
_SETTINGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "sharding": ("JAXSHARD_SHARDING", ("check", "off")),
}


def _validate(name: str, value: object, source: str) -> str:
    try:
        _, valid = _SETTINGS[name]
    except KeyError:
        raise ValueError(
            f"Unknown jaxshard setting {name!r}. Valid settings are "
            + ", ".join(repr(s) for s in _SETTINGS)
            + "."
        ) from None
    if value not in valid:
        raise ValueError(
            f"Unrecognised value {value!r} for {source}. Valid values are "
            + ", ".join(repr(v) for v in valid)
            + f" (default {valid[0]!r})."
        )
    return value  # pyright: ignore[reportReturnType]


def _process_defaults() -> dict[str, str]:
    defaults = {}
    for name, (env, valid) in _SETTINGS.items():
        value = os.environ.get(env, valid[0]).strip().lower()
        defaults[name] = _validate(name, value, f"`{env}`")
    return defaults


_defaults = _process_defaults()


class _Stack(threading.local):
    def __init__(self):
        self.frames = [_defaults]


_stack = _Stack()


def get(name: str) -> str:
    """The value of setting `name` in force in this thread."""
    return _stack.frames[-1][name]


@contextlib.contextmanager
def config(**settings: str) -> Iterator[None]:
    """Changes jaxshard's settings inside a `with` block, for the current thread.

    Scopes nest: leaving a block restores the settings that were in force when it was
    entered. Each thread starts from the process defaults, which come from environment
    variables.

    **Arguments:**

    - `sharding`: `"check"` (the default; environment variable `JAXSHARD_SHARDING`)
        checks the sharding part of annotations; `"off"` skips it, while dtype and
        shape are still checked. Inside `jax.jit` the setting in force when the function
        is *traced* decides: a program traced with `"off"` carries no sharding checks.

    !!! Example

        ```python
        with jaxshard.config(sharding="off"):
            step(params, batch)  # shapes and dtypes checked, shardings not
        ```
    """
    frame = dict(_stack.frames[-1])
    for name, value in settings.items():
        frame[name] = _validate(name, value, f"jaxshard.config({name}=...)")
    _stack.frames.append(frame)
    try:
        yield
    finally:
        _stack.frames.pop()
