"""What `jaxshard.verify` records: every sharding check made while it traces and
compiles (`Recorder`), as the report's rows."""

import threading
from typing import Any

from jax.sharding import NamedSharding

from .._annotations.spec import fill_unconstrained, sharded_type
from .._sharding.describe import (
    describe_sharding,
)
from .._sharding.sites import call_numbers, describe_call, Site
from .collectives import _relative
from .report import (
    Row,
)


class Recorder:
    """Collects every sharding check made while `verify` traces and compiles. Checks
    made at compile time report from XLA's threads, hence the lock."""

    def __init__(self, function: Any = None):
        self._lock = threading.Lock()
        self._checks: list[tuple[Site, Any, str]] = []
        self.function = function  # the verified function, left out of call chains

    def add(self, site: Site, actual: Any, reason: str) -> None:
        site.held.clear()  # the report tells values apart by their checks' order
        with self._lock:
            self._checks.append((site, actual, reason))

    def rows(self) -> tuple[Row, ...]:
        """One row per distinct contract and outcome, in program order; a violation
        also per call it happened in."""
        numbers = call_numbers([site for site, _, _ in self._checks])
        found: dict[tuple, Row] = {}
        for site, actual, reason in sorted(self._checks, key=lambda c: c[0].order):
            row = Row(
                function=_qualname(site.function),
                name=site.name,
                expected=site.spec,
                actual=actual,
                ok=not reason,
                reason=reason,
                annotation=site.annotation,
                array=site.array,
                call=(
                    describe_call(site, numbers, short=True, within=self.function)
                    if reason
                    else ""
                ),
                types=_types(site, actual),
                source=_source(site.function),
            )
            key = (row.function, row.name, row.annotation, row.array, row.reason)
            found.setdefault((*key, row.call), row)
        return tuple(found.values())


def _types(site: Site, actual: Any) -> tuple[str, str]:
    """The expected and the actual layout in JAX's notation, `float32[8@dp,4]`."""
    if isinstance(actual, NamedSharding):
        expected = fill_unconstrained(site.spec, actual.spec, actual.mesh.shape)
        found = sharded_type(site.dtype, site.shape, actual.spec)
    else:
        expected = fill_unconstrained(site.spec, ())
        found = describe_sharding(actual, len(site.shape))
    return sharded_type(site.dtype, site.shape, expected), found


def _source(function: Any) -> str:
    """`model.py:42`: where the annotated function is defined."""
    source = getattr(function, "source", None)
    return "" if source is None else f"{_relative(source[0])}:{source[1]}"


def _qualname(function: Any) -> str | None:
    return getattr(function, "qualname", function)
