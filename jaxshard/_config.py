"""The settings stack: `with jaxshard.config(sharding="off"): ...`, per thread.

The settings live in a `jax.make_user_context`, so they are part of `jax.jit`'s cache
key: a function traced with checks on is traced again when they are turned off, and
the other way round.
"""

import contextlib
import os
from collections.abc import Iterator
from typing import NamedTuple

import jax


class Settings(NamedTuple):
    sharding: str
    checks: str
    # Set by `jaxshard.verify` while it traces and compiles: checks report to it
    # instead of raising. Part of the jit cache key, so every function is traced anew.
    recorder: object = None
    # Set by `jaxshard.checked` while its function runs: the owner of the checks.
    check_scope: object = None


# name -> (environment variable, valid values; the first is the default)
_SETTINGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "sharding": ("JAXSHARD_SHARDING", ("check", "off")),
    "checks": ("JAXSHARD_CHECKS", ("raise", "deferred", "off")),
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


def _process_defaults() -> Settings:
    values = {}
    for name, (env, valid) in _SETTINGS.items():
        value = os.environ.get(env, "").strip().lower() or valid[0]
        values[name] = _validate(name, value, f"`{env}`")
    return Settings(**values)


_context = jax.make_user_context(default_value=_process_defaults())


def current() -> Settings:
    """The settings in force in this thread."""
    return _context.value


@contextlib.contextmanager
def config(**settings: str) -> Iterator[None]:
    """Changes jaxshard's settings inside a `with` block, for the current thread.

    Scopes nest: leaving a block restores the settings that were in force when it was
    entered. Each thread starts from the process defaults, which come from environment
    variables. The settings are part of `jax.jit`'s cache key, so a jitted function
    called in a different scope is traced again.

    **Arguments:**

    - `sharding`: `"check"` (the default; environment variable `JAXSHARD_SHARDING`)
        checks the sharding part of annotations; `"off"` skips it, while dtype and
        shape are still checked. Inside `jax.jit` the setting in force when the function
        is traced decides: a program traced with `"off"` carries no sharding checks.
    - `checks`: what `jaxshard.check` does (environment variable `JAXSHARD_CHECKS`).
        `"raise"` (the default): a `jaxshard.checked` function reads its error flags
        after each call and raises `jaxshard.CheckError`. `"deferred"`: flags
        accumulate on the device across calls and nothing waits for the device until
        `jaxshard.flush_checks()`. `"off"`: checks are not traced at all; the compiled
        program is the one without them.

    !!! Example

        ```python
        with jaxshard.config(sharding="off"):
            step(params, batch)  # shapes and dtypes checked, shardings not
        ```
    """
    new = current()._replace(
        **{
            name: _validate(name, value, f"jaxshard.config({name}=...)")
            for name, value in settings.items()
        }
    )
    with _context(new):
        yield


@contextlib.contextmanager
def overriding(**settings: object) -> Iterator[None]:
    """Like `config`, for jaxshard's own use: no validation, hidden settings too."""
    with _context(current()._replace(**settings)):
        yield
