"""Where a compile-time check was written (`Site`), which call of its function it
was made in (`call_numbers`, `describe_call`), and what it found (`Violation`)."""

import dataclasses
import itertools
import sys
from typing import Any

from jax.sharding import PartitionSpec

from .._jax_internals import (
    checked_calls,
    context_mesh,
)
from .describe import describe_array, named_value, subject, where


# --- compile-time checks ------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Site:
    """Where a compile-time check was written, for its error message."""

    function: str | None  # None: an isinstance check outside any jaxtyped function
    name: str | None
    annotation: str
    spec: PartitionSpec
    array: str
    shape: tuple[int, ...]
    dtype: Any
    axis_types: dict  # of the mesh at trace time: the compiled program's mesh has none
    recorder: Any = None  # a `_verify.recorder.Recorder`, while `jaxshard.verify` runs
    order: int = 0  # the order in which the checks were traced
    calls: tuple = ()  # the jaxtyped calls around the check, outermost first
    value: int = 0  # which traced value was checked (its id, while `held`)
    # The traced value itself, until the program's compile ends: a tracer that died
    # while its trace went on could lend its id to another value (`take_violations`
    # lets go of it).
    held: list = dataclasses.field(default_factory=list, compare=False, repr=False)
    rules: str = ""  # how the axis rules resolved a logical spec, at trace time
    note: str = ""  # what was off when it was traced (`no_mesh_note`)


_orders = itertools.count(1)


def call_numbers(sites: list[Site]) -> dict[int, tuple[int, int]]:
    """Call token -> `(k, n)`: the k-th of the n calls of its function among the
    calls that `sites` (every check of one program) were made in, in program
    order."""
    tokens: dict[str, list[int]] = {}
    for site in sorted(sites, key=lambda s: s.order):
        for function, token in site.calls:
            seen = tokens.setdefault(function, [])
            if token not in seen:
                seen.append(token)
    return {
        token: (k, len(seen))
        for seen in tokens.values()
        for k, token in enumerate(seen, 1)
    }


def describe_call(
    site: Site, numbers: dict[int, tuple[int, int]], short: bool = False, within=None
) -> str:
    """`Block.__call__ #5 of 8 (in Decoder.__call__)`: the function a check was
    made in, which of its calls, and the jaxtyped calls around it (by qualified
    name without the module, if `short`; those around `within`, the function being
    verified, left out)."""

    def label(function: Any, token: int) -> str:
        name = getattr(function, "qualname", function) if short else str(function)
        k, n = numbers.get(token, (1, 1))
        return f"{name} #{k} of {n}" if n > 1 else name

    calls = site.calls
    names = [str(f) for f, _ in calls]
    if within is not None and str(within) in names:
        calls = calls[names.index(str(within)) :]
    if not calls:
        function = site.function
        return str(getattr(function, "qualname", function) if short else function)
    *outer, inner = calls
    while within is not None and outer and str(outer[0][0]) == str(within):
        outer = outer[1:]  # the verified function (decorated or not, or both)
    text = label(*inner)
    if outer:
        text += " (in " + " in ".join(label(*c) for c in reversed(outer)) + ")"
    return text


@dataclasses.dataclass(frozen=True)
class Violation:
    site: Site
    actual: Any  # the sharding XLA chose
    reason: str
    thread: int  # that compiled the program, to which the violation is reported
    call: str = ""  # `describe_call` of the site, once the program's calls are known
    also: tuple = ()  # later checks of the same value, as "function, parameter 'x'"

    def __str__(self):
        site = self.site
        what = subject(site.function and (self.call or site.function), site.name)
        also = f" (passed on to {'; '.join(self.also)})" if self.also else ""
        return (
            f"{what}{also} ({site.array}, annotated {site.annotation}): {self.reason}"
        )


def make_site(annotation, x, aval, recorder=None) -> Site:
    function, name = where(x, annotation)
    calls: tuple = ()
    for function, token in checked_calls() if named_value() is None else ():
        # A function checked by two wrappers (decorated, and again by verify) is
        # one call.
        if not calls or calls[-1][0] != function:
            calls += ((function, token),)
    site = Site(
        function=function,
        name=name,
        annotation=repr(annotation),
        spec=annotation.spec,
        array=describe_array(aval.dtype, aval.shape),
        shape=aval.shape,
        dtype=aval.dtype,
        axis_types=dict(
            zip(aval.sharding.mesh.axis_names, aval.sharding.mesh.axis_types)
        ),
        recorder=recorder,
        order=next(_orders),
        calls=calls,
        value=id(x),
        held=[x],
        rules=annotation.explain() if hasattr(annotation, "explain") else "",
        note=no_mesh_note(),
    )
    if recorder is not None:  # every contract traced, for verify's cache key
        recorder.sites.append(site)
    return site


def no_mesh_note() -> str:
    """While a program that uses flax is traced with no mesh in context, flax's
    logical constraints do nothing: say so, since a contract may fail for that."""
    if "flax.linen" not in sys.modules or context_mesh() is not None:
        return ""
    return (
        "No mesh was in context (`jax.set_mesh`) when the program was traced, so "
        "flax's `nn.with_logical_constraint` and the constraints of "
        "`nn.with_logical_partitioning` did nothing in it: call it inside `with "
        "jax.set_mesh(mesh):`."
    )
