"""What `jaxshard.verify` records: every sharding check made while it traces and
compiles (`Recorder`), as the report's rows."""

import math
import threading
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from .._annotations import tensors
from .._annotations.spec import (
    axes_of,
    fill_unconstrained,
    format_spec,
    sharded_type,
)
from .._jax_internals import varying_axes
from .._sharding.describe import describe_array, describe_sharding
from .._sharding.sites import call_numbers, describe_call, Site
from .frames import _relative
from .report import (
    Row,
)


class Recorder:
    """Collects every sharding check made while `verify` traces and compiles. Checks
    made at compile time report from XLA's threads, hence the lock."""

    def __init__(self, function: Any = None):
        self._lock = threading.Lock()
        self._checks: list[tuple[Site, Any, str, set[str]]] = []
        self.function = function  # the verified function, left out of call chains
        self.sites: list[Site] = []  # every contract traced, checked or not yet

    def add(self, site: Site, actual: Any, reason: str) -> None:
        # Inside a shard_map body, the axes a violating block varies over: it may
        # be no array its annotation describes. Read from the value, which is
        # dropped: the report tells values apart by their checks' order.
        varying = _varying(site.held[0]) if site.held and reason else set()
        site.held.clear()
        with self._lock:
            self._checks.append((site, actual, reason, varying))

    def rows(self) -> tuple[Row, ...]:
        """One row per distinct contract and outcome, in program order; a violation
        also per call it happened in."""
        numbers = call_numbers([check[0] for check in self._checks])
        found: dict[tuple, Row] = {}
        for site, actual, reason, varying in sorted(
            self._checks, key=lambda c: c[0].order
        ):
            block = _in_shard_map(site, actual, varying)
            shape, actual = block or (site.shape, actual)
            row = Row(
                function=_qualname(site.function),
                name=site.name,
                expected=site.spec,
                actual=actual,
                ok=not reason,
                reason=reason,
                annotation=site.annotation,
                array=describe_array(site.dtype, shape) if block else site.array,
                call=(
                    describe_call(site, numbers, short=True, within=self.function)
                    if reason
                    else ""
                ),
                types=_types(site, shape, actual),
                source=_source(site.function),
                block=site.array if block else "",
            )
            key = (row.function, row.name, row.annotation, row.array, row.reason)
            found.setdefault((*key, row.call), row)
        return tuple(found.values())


def _types(site: Site, shape: tuple, actual: Any) -> tuple[str, str]:
    """The expected and the actual layout of an array of `shape` in JAX's notation,
    `float32[8@dp,4]`."""
    if isinstance(actual, PartitionSpec):  # a shard_map block's global array
        expected = fill_unconstrained(site.spec, actual)
        found = sharded_type(site.dtype, shape, actual)
    elif isinstance(actual, str):  # a block that differs where it should not
        expected = fill_unconstrained(site.spec, ())
        found = ""
    elif isinstance(actual, NamedSharding):
        expected = fill_unconstrained(site.spec, actual.spec, actual.mesh.shape)
        found = sharded_type(site.dtype, shape, actual.spec)
    else:
        expected = fill_unconstrained(site.spec, ())
        found = describe_sharding(actual, len(shape))
    return sharded_type(site.dtype, shape, expected), found


def _varying(value: Any) -> set[str]:
    value = tensors.jax_value(value)
    return varying_axes(value) if isinstance(value, jax.core.Tracer) else set()


def _in_shard_map(site: Site, actual: Any, varying: set[str]) -> tuple | None:
    """Inside a `shard_map` body, where a value is one device's block: the global
    array's shape and spec, which the annotation describes (`None` elsewhere). The
    body's manual axes split it as the annotation says; the other axes are the
    block's own. A block that differs over a manual axis the annotation does not
    name is no such array: its spec says so, as text."""
    manual = {a for a, t in site.axis_types.items() if t == AxisType.Manual}
    if not manual or not isinstance(actual, NamedSharding):
        return None
    sizes = actual.mesh.shape
    own = [*actual.spec, *[None] * len(site.shape)]
    given = [*site.spec, *[None] * len(site.shape)]
    shape, entries = [], []
    for size, entry, mine in zip(site.shape, given, own):
        axes = axes_of(entry)
        split = [a for a in axes if a in manual or a in axes_of(mine)]
        split += [a for a in axes_of(mine) if a not in axes]
        shape.append(size * math.prod(sizes[a] for a in split if a in manual))
        entries.append(
            None if not split else split[0] if len(split) == 1 else tuple(split)
        )
    spec = PartitionSpec(*entries)
    named = {a for entry in site.spec for a in axes_of(entry)}
    extra = sorted(a for a in (varying & manual) - named if sizes[a] > 1)
    if extra:  # where it differs is no dimension's: the reason tells
        return tuple(shape), f"{format_spec(spec)}, differing over {', '.join(extra)}"
    return tuple(shape), spec


def _source(function: Any) -> str:
    """`model.py:42`: where the annotated function is defined."""
    source = getattr(function, "source", None)
    return "" if source is None else f"{_relative(source[0])}:{source[1]}"


def _qualname(function: Any) -> str | None:
    return getattr(function, "qualname", function)
