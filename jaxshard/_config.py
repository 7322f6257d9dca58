"""The settings stack: `with jaxshard.config(sharding="off"): ...`, per thread, and
`jaxshard.config.update(...)` for the process.

What a traced program depends on lives in a `jax.make_user_context`, part of
`jax.jit`'s cache key: a function traced with checks on is traced again when they are
turned off, and the other way round. What only the host reads, whether a `checked`
function reads its checks' findings after each call ("raise") or later ("deferred"),
lives beside it, per thread too, and is not part of the key: switching between those
modes compiles nothing.
"""

import dataclasses
import functools as ft
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jaxtyping

from ._errors import did_you_mean, hide_frames


# --- axis rules: the value of the `rules` setting ---------------------------------


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """A rule table, normalised: `(logical name, mesh axes)` pairs in order of
    precedence, the mesh axes `None`, a name or a tuple of names.

    `unknown`: what a logical name no rule mentions means in an `L(...)` spec,
    `"error"` (the default) or `"replicated"` (flax's fallback). `name`: what messages
    call the table (`"fsdp_tp"`); `source`: where it came from.
    """

    rules: tuple[tuple[str, Any], ...]
    unknown: str = "error"
    name: str | None = None
    source: str = "jaxshard.axis_rules"

    def __hash__(self) -> int:
        # Hashed by every `jax.jit` call while in force (`Settings` is part of its
        # cache key): computed once per table, not per call.
        return self._hash

    @ft.cached_property
    def _hash(self) -> int:
        return hash((self.rules, self.unknown, self.name, self.source))

    def __getstate__(self) -> dict:
        # A string's hash differs between processes: not pickled with the table.
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def known(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(logical for logical, _ in self.rules))

    def describe(self) -> str:
        if self.name:
            return f"the axis rules {self.name!r}"
        return f"the axis rules in force (from {self.source})"


def normalise(rules: Any, *, unknown: str = "error", name: Any = None) -> AxisRules:
    """`rules` (a mapping, `(logical, mesh_axes)` pairs as flax and MaxText write
    them, lists for tuples allowed, or a dataclass whose fields are logical names, as
    code bases keep them in their config) as an `AxisRules`; a clear error for
    anything else."""
    if isinstance(rules, AxisRules):
        return rules
    if dataclasses.is_dataclass(rules) and not isinstance(rules, type):
        name = type(rules).__name__ if name is None else name
        rules = {f.name: getattr(rules, f.name) for f in dataclasses.fields(rules)}
    if unknown not in ("error", "replicated"):
        raise ValueError(
            f"jaxshard.axis_rules: `unknown` is 'error' (a logical name with no rule "
            f"is an error) or 'replicated'; got {unknown!r}."
        )
    if name is not None and not isinstance(name, str):
        raise TypeError(f"jaxshard.axis_rules: `name` takes a string; got {name!r}.")
    pairs = rules.items() if isinstance(rules, Mapping) else rules
    out = []
    try:
        for pair in pairs:
            logical, mesh = pair
            out.append((logical, _mesh_axes(mesh)))
            if not isinstance(logical, str):
                raise ValueError
    except (TypeError, ValueError):
        raise TypeError(
            "jaxshard.axis_rules takes a rule table: a mapping, a dataclass of "
            "logical names or a sequence of (logical name, mesh axes) pairs, the mesh "
            "axes a name, a tuple of names or None, e.g. [('batch', ('dp', 'fsdp')), "
            f"('embed', 'fsdp'), ('mlp', 'tp'), ('seq', None)]; got {_short(rules)}"
            f"{_culprit(pairs)}."
        ) from None
    return interned(AxisRules(tuple(out), unknown, name))


# One object per rule table: `jax.jit` compares the settings in force with those of
# its cache entries on every call, at C speed only when the tables are the same
# object (two equal tables compare through the dataclass's `__eq__`: 2 us a call).
_tables: dict[AxisRules, AxisRules] = {}


def interned(rules: AxisRules) -> AxisRules:
    """The one `AxisRules` object equal to `rules`."""
    if len(_tables) >= 1024:
        _tables.clear()  # a program that makes tables anew
    return _tables.setdefault(rules, rules)


def _culprit(pairs: Any) -> str:
    """`, whose 'embed' is 4096`: the first rule of a table whose mesh axes are not
    mesh axes ("" if there is none)."""
    try:
        for logical, mesh in pairs:
            try:
                _mesh_axes(mesh)
            except ValueError:
                return f", whose {logical!r} is {_short(mesh)}"
    except (TypeError, ValueError):  # not pairs at all
        pass
    return ""


def _mesh_axes(mesh: Any) -> Any:
    if mesh is None or isinstance(mesh, str):
        return mesh
    if isinstance(mesh, (list, tuple)) and all(isinstance(a, str) for a in mesh):
        return tuple(mesh)
    raise ValueError


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --- the settings -------------------------------------------------------------------


class Settings(NamedTuple):
    """The settings a traced program may depend on: `jax.jit`'s cache key holds them."""

    sharding: str
    # "on" or "off": whether checks are traced. Whether their findings are read at
    # once or later is for the host alone (`checks_mode`).
    checks: str
    # Set by `jaxshard.verify` while it traces and compiles: checks report to it
    # instead of raising. Part of the jit cache key, so every function is traced anew.
    recorder: object = None
    # Set by `jaxshard.checked` while its function runs: the owner of the checks.
    check_scope: object = None
    # `jaxshard.axis_rules`: the logical axis rules (an `AxisRules`).
    rules: object = None


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
            + did_you_mean(str(name), _SETTINGS)
        ) from None
    if value not in valid:
        raise ValueError(
            f"Unrecognised value {value!r} for {source}. Valid values are "
            + ", ".join(repr(v) for v in valid)
            + f" (default {valid[0]!r})."
            + did_you_mean(str(value), [str(v) for v in valid])
        )
    return value  # pyright: ignore[reportReturnType]


def _process_defaults() -> dict[str, str]:
    values = {}
    for name, (env, valid) in _SETTINGS.items():
        value = os.environ.get(env, "").strip().lower() or valid[0]
        values[name] = _validate(name, value, f"`{env}`")
    return values


class _Mode(threading.local):
    """The checks mode in force in this thread, "raise", "deferred" or "off" (`None`:
    the process default, `_default_mode`): what a `checked` function's host side
    follows, read on every call. (Whether checks are on is also in `Settings`, for
    the programs; this copy is a cheaper read.)"""

    value: str | None = None


_mode = _Mode()
_defaults = _process_defaults()
_default_mode = [_defaults["checks"]]


class _CacheDir(threading.local):
    """The folder of verify's cache in force in this thread (`given` False: the
    process default, `_default_cache_dir`). Host-only: no program depends on it."""

    given: bool = False
    value: str | None = None


_cache_dir = _CacheDir()
_default_cache_dir = [os.environ.get("JAXSHARD_CACHE_DIR", "").strip() or None]


def cache_dir() -> str | None:
    """The folder `jaxshard.verify` keeps its reports in, or `None` for none."""
    return _cache_dir.value if _cache_dir.given else _default_cache_dir[0]


def _folder(value: Any, source: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)) and os.fspath(value):
        return os.fspath(value)
    raise ValueError(
        f"Unrecognised value {value!r} for {source}: a folder's path (a str or "
        "os.PathLike), or None for no cache."
    )


def _traced(settings: dict[str, str]) -> dict[str, str]:
    """`settings` as the jit key holds them: `checks` only on or off."""
    if "checks" in settings:
        on = settings["checks"] != "off"
        settings = {**settings, "checks": "on" if on else "off"}
    return settings


_context = jax.make_user_context(default_value=Settings(**_traced(_defaults)))


def current() -> Settings:
    """The settings in force in this thread that traced programs depend on."""
    return _context.value


def checks_mode() -> str:
    """The `checks` setting in force in this thread: "raise", "deferred" or "off"."""
    return _mode.value or _default_mode[0]


def _get(name: str) -> Any:
    return checks_mode() if name == "checks" else getattr(current(), name)


class _Scope:
    """What `jaxshard.config(...)` returns: the settings are in force for this thread
    from the call on; `with` (or use as a decorator) puts them back when it ends."""

    def __init__(self, settings: Settings, mode: str | None = None, cache: tuple = ()):
        self._settings, self._mode, self._cache = settings, mode, cache
        self._context = _context(settings)
        self._context.__enter__()
        self._previous = _mode.value
        self._previous_cache = (_cache_dir.given, _cache_dir.value)
        if mode is not None:
            _mode.value = mode
        if cache:  # `(folder,)`: `cache_dir=` was given
            _cache_dir.given, _cache_dir.value = True, cache[0]

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc_info) -> None:
        if self._mode is not None:
            _mode.value = self._previous
        if self._cache:
            _cache_dir.given, _cache_dir.value = self._previous_cache
        self._context.__exit__(*exc_info)

    def _again(self) -> "_Scope":
        """The same scope, in force anew (for each call of a decorated function)."""
        return _Scope(self._settings, self._mode, self._cache)

    def __call__(self, fn: Callable) -> Callable:
        # As a decorator: not in force now, only while `fn` runs.
        self.__exit__(None, None, None)

        @ft.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                with self._again():
                    return fn(*args, **kwargs)
            except Exception as e:
                hide_frames(e)  # a violation in `fn` ends at the user's call
                raise

        return wrapper


class Config:
    """jaxshard's settings, and jaxtyping's.

    `jaxshard.config(sharding=..., checks=...)` changes jaxshard's settings for the
    current thread: in a `with` block, the settings in force before come back when it
    ends (scopes nest, and an exception leaving the block restores them too); used as
    a decorator, they are in force while the function runs; called on its own, from
    then on in this thread, like `jax.set_mesh`. `jaxshard.config.update(name, value)`
    changes the default of every thread, like `jax.config.update`. Each thread starts
    from those defaults, which come from environment variables.

    What a traced program depends on (`sharding`, whether checks are on, the axis
    rules) is part of `jax.jit`'s cache key, so a jitted function called under other
    such settings is traced again; one called in "deferred" mode after "raise" (or
    the other way round), or under settings equal to those it was traced under, is
    not.

    jaxtyping's settings (`jaxtyping_disable`, `jaxtyping_remove_typechecker_stack`)
    are reached through the same object, so `jaxshard.config` can stand in for
    `jaxtyping.config`: `jaxshard.config.update("jaxtyping_disable", True)` and
    `jaxshard.config.jaxtyping_disable` are jaxtyping's.

    **Settings:**

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
    - `cache_dir`: a folder where `jaxshard.verify` keeps its reports (environment
        variable `JAXSHARD_CACHE_DIR`; `None`, the default, keeps none). A verify of
        a program whose code, contracts, mesh, options and versions are those of a
        stored report returns that report without compiling (`report.compiled` is
        then `None`). The folder holds at most `JAXSHARD_CACHE_MAX_BYTES` bytes (1
        GiB), the reports used least recently going first. Its entries are pickles:
        keep it where only you write, as your code.

    !!! Example

        ```python
        with jaxshard.config(sharding="off"):
            step(params, batch)  # shapes and dtypes checked, shardings not

        jaxshard.config.update("checks", "deferred")  # every thread, from now on
        ```
    """

    def __call__(self, **settings: Any) -> _Scope:
        cache = ()
        if "cache_dir" in settings:
            given = settings.pop("cache_dir")
            cache = (_folder(given, "jaxshard.config(cache_dir=...)"),)
        traced = _with(current(), settings, "jaxshard.config({name}=...)")
        return _Scope(traced, _host_mode(settings), cache)

    def update(self, name: str, value: Any) -> None:
        """Sets the default of setting `name` for every thread (`"sharding"`,
        `"checks"`, `"axis_rules"` (a rule table, as `jaxshard.axis_rules` takes, or
        `None`), or one of jaxtyping's, which goes to `jaxtyping.config`)."""
        if isinstance(name, str) and name.lower().startswith("jaxtyping_"):
            jaxtyping.config.update(name, value)
            return
        if name == "axis_rules":
            rules = None if value is None else normalise(value)
            _context.set_global(_context.get_global()._replace(rules=rules))
            return
        if name == "cache_dir":
            source = "jaxshard.config.update('cache_dir', ...)"
            _default_cache_dir[0] = _folder(value, source)
            return
        source = "jaxshard.config.update({name!r}, ...)"
        _context.set_global(_with(_context.get_global(), {name: value}, source))
        mode = _host_mode({name: value})
        if mode is not None:
            _default_mode[0] = mode

    def __getattr__(self, name: str) -> Any:
        if name.startswith("jaxtyping_"):
            return getattr(jaxtyping.config, name)
        if name in _SETTINGS:
            return _get(name)
        if name == "cache_dir":
            return cache_dir()
        raise AttributeError(f"jaxshard.config has no setting {name!r}")

    def __repr__(self) -> str:
        return (
            "jaxshard.config("
            + ", ".join(f"{name}={_get(name)!r}" for name in _SETTINGS)
            + f", cache_dir={cache_dir()!r})"
        )


def _with(base: Settings, settings: dict, source: str) -> Settings:
    return base._replace(
        **_traced(
            {
                name: _validate(name, value, source.format(name=name))
                for name, value in settings.items()
            }
        )
    )


def _host_mode(settings: dict) -> str | None:
    """The checks mode that `settings` (validated) set, if any."""
    return settings.get("checks")


config = Config()


def overriding(**settings: object) -> _Scope:
    """Like `config`, for jaxshard's own use: no validation, hidden settings too."""
    return _Scope(current()._replace(**_traced(settings)), _host_mode(settings))
