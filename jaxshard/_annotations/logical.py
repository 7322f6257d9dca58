"""Logical axis names: `L("batch", None, "embed")` and `BY_NAME` as the third item of
an annotation, resolved to mesh axes by the rules in force when the annotation is
checked, exactly as flax linen's `logical_to_mesh_axes` resolves them.

The rules live in jaxshard's settings (`jaxshard.axis_rules(...)`), which are part of
`jax.jit`'s cache key: a function traced under one table is traced again under
another. Without them, flax's own rules (`nn.logical_axis_rules`, which nnx shares)
apply, read through flax's public API.
"""

import collections
import contextlib
import dataclasses
import functools as ft
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.sharding import PartitionSpec

from .. import _config
from .._config import AxisRules, interned, normalise
from .._errors import AnnotationError, hide_frames
from .spec import format_spec


UNCONSTRAINED = PartitionSpec.UNCONSTRAINED


class L:
    """A partition spec in logical axis names, for the third item of an annotation:
    `Float[Array, "batch seq embed", jaxshard.L("batch", None, "embed")]`.

    It takes what `PartitionSpec` takes (a name, `None`, a tuple of names, or
    `P.UNCONSTRAINED` per dimension), but the names are logical ("batch", "embed",
    "mlp"), not mesh axes. The rules in force when the annotation is checked
    (`jaxshard.axis_rules`, or flax's `nn.logical_axis_rules`) map them to mesh axes,
    so one annotated model is checked under any rules.
    """

    __slots__ = ("entries",)

    def __init__(self, *entries: Any):
        for entry in entries:
            names = entry if isinstance(entry, tuple) else (entry,)
            for name in names:
                if not (name is None or name is UNCONSTRAINED or isinstance(name, str)):
                    raise AnnotationError(
                        "jaxshard.L takes logical axis names (strings), tuples of "
                        "them, None or P.UNCONSTRAINED, one per dimension; got "
                        f"{entry!r}."
                    )
            if isinstance(entry, tuple) and (None in entry or UNCONSTRAINED in entry):
                raise AnnotationError(
                    f"jaxshard.L: a tuple holds logical axis names only; got {entry!r}."
                )
        self.entries = tuple(entries)

    def __repr__(self) -> str:
        return "L(" + ", ".join(_entry(e) for e in self.entries) + ")"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, L) and self.entries == other.entries

    def __hash__(self) -> int:
        return hash(("L", self.entries))

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(self.entries)

    def __reduce__(self):
        return L, self.entries


def _entry(entry: Any) -> str:
    return "P.UNCONSTRAINED" if entry is UNCONSTRAINED else repr(entry)


class _ByName:
    """`jaxshard.BY_NAME`: the dimension names of the shape string are the logical
    axis names (`Float[Array, "batch seq embed", BY_NAME]` is `L("batch", "seq",
    "embed")`, where a name no rule mentions is unsharded, as is a literal size)."""

    def __repr__(self) -> str:
        return "BY_NAME"

    def __reduce__(self):
        return "BY_NAME"


BY_NAME = _ByName()


# --- rules --------------------------------------------------------------------------


def flax_rules() -> AxisRules | None:
    """flax's active rules (linen's `nn.logical_axis_rules`, which nnx shares), if
    flax is loaded and some are set. Read through `flax.linen.get_logical_axis_rules`:
    a program that never imported flax cannot have set them."""
    linen = sys.modules.get("flax.linen")
    if linen is None:
        return None
    rules = linen.get_logical_axis_rules()
    if not rules:
        return None
    seen, table = _flax_table
    if rules is not seen:  # flax's table is a tuple, read on every check
        try:
            # flax lays out a logical name its rules do not mention unsharded
            # (`logical_to_mesh_axes`): so do its rules here.
            table = dataclasses.replace(
                normalise(rules, unknown="replicated"),
                source="flax's nn.logical_axis_rules",
            )
        except TypeError:
            table = None  # a table flax itself would refuse
        _flax_table[:] = rules, table and interned(table)
    return _flax_table[1]


_flax_table: list = [None, None]  # flax's last table, and it normalised (or None)


def active_rules() -> AxisRules | None:
    """jaxshard's rules in force in this thread, else flax's, else `None`."""
    rules = _config.current().rules
    return rules if rules is not None else flax_rules()


def axis_rules(rules: Any, *, unknown: str = "error", name: str | None = None) -> Any:
    """Sets the rule table that maps logical axis names to mesh axes.

    `with jaxshard.axis_rules(rules): ...` checks every logical annotation in the block
    under `rules`; as a decorator, while the function runs; called on its own, from
    then on in this thread (like `jaxshard.config`). Scopes nest, and the innermost
    wins. The rules are part of `jax.jit`'s cache key: a jitted function called under
    other rules is traced again, so its checks are never those of a stale table.
    `jaxshard.config.update("axis_rules", rules)` sets the default of every thread.

    Without jaxshard's rules, flax's (`nn.logical_axis_rules`, shared by nnx) apply
    when flax is in use.

    **Arguments:**

    - `rules`: a mapping, `(logical name, mesh axes)` pairs in order of precedence,
        as flax and MaxText write them, or a dataclass whose fields are logical names
        (a `ShardingRules` that a code base keeps in its config): the mesh axes a
        name, a tuple (or list) of names, or `None` for unsharded. Resolution is flax
        linen's `logical_to_mesh_axes`: each rule assigns its mesh axes to its
        logical name's dimension if that dimension has none yet and none of those
        mesh axes is used. Or a function of some of the decorated function's
        parameters, by name, that returns such a table: `axis_rules(lambda cfg:
        cfg.rules)` decorates the entry points of a code base that carries its
        rules in its config, so that each call runs under its own config's table,
        and no caller enters a table by hand.
    - `unknown`: a logical name in an `L(...)` spec that no rule mentions is an error
        that lists the known names (`"error"`, the default), or unsharded
        (`"replicated"`, flax's fallback). With `BY_NAME`, such names are unsharded
        either way.
    - `name`: what messages call the table, e.g. `"fsdp_tp"`.

    !!! Example

        ```python
        FSDP_TP = [("batch", "fsdp"), ("embed", "fsdp"), ("mlp", "tp"), ("heads", "tp")]

        with jaxshard.axis_rules(FSDP_TP, name="fsdp_tp"):
            step(params, batch)

        @jaxshard.axis_rules(lambda cfg: cfg.rules)  # a ShardingRules dataclass
        def forward(x, weights, cfg): ...
        ```
    """
    if callable(rules) and not dataclasses.is_dataclass(rules):
        return _FromArguments(rules, unknown, name)
    return _RulesScope(normalise(rules, unknown=unknown, name=name))


class _FromArguments:
    """What `axis_rules(pick)` returns for a function `pick`: a decorator whose
    function runs each call under the table `pick` returns for the call's arguments
    that its parameters name."""

    def __init__(self, pick: Callable, unknown: str, name: str | None):
        try:
            self._names = list(inspect.signature(pick).parameters)
        except (TypeError, ValueError):
            self._names = None
        if not self._names:
            raise TypeError(
                "jaxshard.axis_rules takes a rule table, or a function of the "
                "decorated function's parameters (by name) that returns one, e.g. "
                f"`lambda cfg: cfg.rules`; got {pick!r}, which names no parameter."
            )
        self._pick, self._unknown, self._name = pick, unknown, name
        self._last: tuple = (_UNSET, None)  # the last table picked, normalised

    def __enter__(self) -> None:
        raise TypeError(
            "jaxshard.axis_rules(function) decorates a function whose arguments hold "
            "the rules: put `@jaxshard.axis_rules(lambda cfg: cfg.rules)` above its "
            "`def`. In a `with` statement, give the table itself: "
            "`with jaxshard.axis_rules(cfg.rules):`."
        )

    def __exit__(self, *exc_info) -> None:
        pass

    def _table(self, value: Any) -> AxisRules:
        if value is not self._last[0]:
            table = normalise(value, unknown=self._unknown, name=self._name)
            self._last = (value, table)
        return self._last[1]

    def __call__(self, fn: Callable) -> Callable:
        signature = inspect.signature(fn)
        params = list(signature.parameters.values())
        missing = [n for n in self._names if n not in signature.parameters]
        if missing:
            raise TypeError(
                f"jaxshard.axis_rules: the rules function names "
                f"{', '.join(map(repr, missing))}, which "
                f"{getattr(fn, '__qualname__', fn)} does not take; its parameters "
                f"are {', '.join(map(repr, signature.parameters)) or 'none'}."
            )
        positional = [
            p.name
            for p in params
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        where = [
            (n, positional.index(n) if n in positional else len(params))
            for n in self._names
        ]
        defaults = {n: signature.parameters[n].default for n in self._names}

        @ft.wraps(fn)
        def wrapper(*args, **kwargs):
            picked = {}
            for n, i in where:
                picked[n] = (
                    kwargs[n] if n in kwargs else args[i] if i < len(args)
                    else defaults[n]
                )  # fmt: skip
            try:
                if any(v is inspect.Parameter.empty for v in picked.values()):
                    return fn(*args, **kwargs)  # its own error for a missing argument
                with _RulesScope(self._table(self._pick(**picked))):
                    return fn(*args, **kwargs)
            except Exception as e:
                hide_frames(e)  # a violation in `fn` ends at the user's call
                raise

        return wrapper


_UNSET = object()


class _RulesScope(_config._Scope):
    """What `axis_rules` returns: jaxshard's rules in force from the call on, and,
    when flax is in use, flax's too (`nn.logical_axis_rules`), so that the model's
    own `nn.with_logical_constraint`s and nnx's variables follow the same table.
    flax's rules are not part of jit's cache key, but jaxshard's are: a change
    re-traces, and flax reads the new table while tracing."""

    def __init__(self, table: AxisRules):
        self._table = table
        super().__init__(_config.current()._replace(rules=table))
        linen = sys.modules.get("flax.linen")
        self._flax = None if linen is None else linen.logical_axis_rules(table.rules)
        if self._flax is not None:
            self._flax.__enter__()

    def __exit__(self, *exc_info) -> None:
        if self._flax is not None:
            self._flax.__exit__(*exc_info)
        super().__exit__(*exc_info)

    def _again(self) -> "_RulesScope":
        # The rules over the settings in force at each call, not at decoration.
        return _RulesScope(self._table)


@contextlib.contextmanager
def using(rules: Any) -> Iterator[None]:
    """`rules` in force while the block runs, for the entry points that take a
    `rules=` argument; `None` leaves the rules in force as they are."""
    if rules is None:
        yield
        return
    with _RulesScope(normalise(rules)):
        yield


# --- resolution ---------------------------------------------------------------------


class _Unassigned:
    def __repr__(self) -> str:
        return "unassigned"


_UNASSIGNED = _Unassigned()


def resolve(
    logical: tuple, rules: AxisRules, *, by_name: bool = False
) -> tuple[PartitionSpec, tuple[str, ...]]:
    """The mesh-axis spec of the logical spec `logical` under `rules`, and the
    logical names that no rule mentions.

    flax linen's `logical_to_mesh_axes`, exactly: the rules are taken in order, and a
    rule assigns its mesh axes to the dimension its logical name labels if that
    dimension has none yet and none of the mesh axes is assigned already (a rule
    whose mesh axes are `None` assigns "unsharded"); a name left unassigned is
    unsharded. jaxshard extends it to tuples of logical names on one dimension (as a
    `PartitionSpec` takes tuples of mesh axes): each name is a slot of its own, and
    the dimension gets the mesh axes of its slots, in order.
    """
    slots = [
        (dim, name)
        for dim, entry in enumerate(logical)
        for name in (entry if isinstance(entry, tuple) else (entry,))
    ]
    names = [name for _, name in slots]
    counts = collections.Counter(n for n in names if isinstance(n, str))
    twice = [n for n, c in counts.items() if c > 1]
    if twice:
        raise AnnotationError(
            f"The logical spec {_logical_repr(logical, by_name)} names "
            f"{', '.join(map(repr, twice))} more than once; each logical axis may "
            "label one dimension (flax refuses it too)."
        )
    unknown = tuple(n for n in counts if n not in rules.known)
    result: list[Any] = [_UNASSIGNED if isinstance(n, str) else n for n in names]
    for rule_logical, mesh in rules.rules:
        if rule_logical in names:
            pos = names.index(rule_logical)
            if result[pos] is _UNASSIGNED and _free(mesh, result):
                result[pos] = mesh
    entries: list[Any] = []
    for dim, entry in enumerate(logical):
        assigned = [r for (d, _), r in zip(slots, result) if d == dim]
        if not isinstance(entry, tuple):
            (one,) = assigned
            entries.append(None if one is _UNASSIGNED else one)
            continue
        axes = tuple(a for r in assigned for a in jax.tree_util.tree_leaves(r)
                     if a is not _UNASSIGNED)  # fmt: skip
        entries.append(axes[0] if len(axes) == 1 else axes or None)
    return PartitionSpec(*entries), unknown


def _free(mesh: Any, assigned: list) -> bool:
    """flax's `_mesh_assignment_free`."""
    new = set(jax.tree_util.tree_leaves(mesh)) - {None, UNCONSTRAINED}
    return not new & set(jax.tree_util.tree_leaves(assigned))


def _logical_repr(logical: tuple, by_name: bool) -> str:
    text = "L(" + ", ".join(_entry(e) for e in logical) + ")"
    return f"BY_NAME ({text})" if by_name else text


def explain(
    logical: tuple, by_name: bool, rules: AxisRules, spec: PartitionSpec
) -> str:
    """`the annotation's L('batch', 'embed') is P('dp', None) under the axis rules
    'fsdp' (batch -> 'dp'; embed: no rule)`."""
    parts = []
    for entry in logical:
        for name in entry if isinstance(entry, tuple) else (entry,):
            if not isinstance(name, str):
                continue
            rule = [m for n, m in rules.rules if n == name]
            if not rule:
                parts.append(f"{name}: no rule")
                continue
            used = [m for m in rule if _assigned(m, name, logical, spec)]
            if used:
                parts.append(f"{name} -> {used[0]!r}")
            else:
                axes = " or ".join(repr(m) for m in rule)
                parts.append(f"{name}: {axes} already taken")
    return (
        f"the annotation's {_logical_repr(logical, by_name)} is {format_spec(spec)} "
        f"under {rules.describe()} ({'; '.join(parts)})"
    )


def _assigned(mesh: Any, name: str, logical: tuple, spec: PartitionSpec) -> bool:
    for dim, entry in enumerate(logical):
        names = entry if isinstance(entry, tuple) else (entry,)
        if name in names:
            got = spec[dim] if dim < len(spec) else None
            got_axes = set(jax.tree_util.tree_leaves(got))
            want = set(jax.tree_util.tree_leaves(mesh))
            return (mesh is None and got is None) or (bool(want) and want <= got_axes)
    return False
