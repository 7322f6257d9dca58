"""Partition specs in annotations: validation, printing and the compact syntax."""

import re
from collections.abc import Mapping
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from .._errors import AnnotationError
from .dims import dimension


def axes_of(entry: Any) -> tuple[str, ...]:
    """The mesh axes one spec entry names: `None` -> `()`, `"dp"` -> `("dp",)`."""
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    if isinstance(entry, tuple):
        return entry
    return (entry,)


def format_spec(spec: PartitionSpec) -> str:
    """`P('dp', None, ('tp', 'fsdp'), P.UNCONSTRAINED)`."""
    parts = []
    for entry in spec:
        if entry is PartitionSpec.UNCONSTRAINED:
            parts.append("P.UNCONSTRAINED")
        else:
            parts.append(repr(entry))
    return f"P({', '.join(parts)})"


def padded(spec: Any, ndim: int) -> PartitionSpec:
    """`spec` with an entry for each of `ndim` dimensions: `P('dp')` for 3 is
    `P('dp', None, None)` (a spec's trailing `None`s may be left out)."""
    return PartitionSpec(*spec, *[None] * (ndim - len(spec)))


def fill_unconstrained(
    spec: PartitionSpec, actual: Any, sizes: Mapping[str, int] | None = None
) -> PartitionSpec:
    """`spec` with each `P.UNCONSTRAINED` entry taken from the spec `actual` (`None`
    where it has none): what an unconstrained dimension expects is what it has.

    An axis that `spec` names at another position, or (given the mesh's axis
    `sizes`) an axis of size 1, is not taken: the first is a mismatch that the
    position naming it reports, the second splits nothing. Either way the result
    names each axis at most once, as a `NamedSharding` requires.
    """
    if PartitionSpec.UNCONSTRAINED not in tuple(spec):
        return spec
    taken = {a for entry in spec for a in axes_of(entry)}
    found = [*actual, *[None] * len(spec)]

    def fill(entry: Any) -> Any:
        axes = [
            a
            for a in axes_of(entry)
            if a not in taken and (sizes is None or sizes.get(a, 2) != 1)
        ]
        taken.update(axes)
        return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)

    return PartitionSpec(
        *(
            fill(found[i]) if e is PartitionSpec.UNCONSTRAINED else e
            for i, e in enumerate(spec)
        )
    )


def splits(spec: PartitionSpec, sizes: Mapping[str, int]) -> bool:
    """Whether `spec` splits any dimension over a mesh axis of more than one device
    (`P.UNCONSTRAINED` splits nothing it must)."""
    return any(sizes.get(a, 2) != 1 for entry in spec for a in axes_of(entry))


def sharded_type(dtype: Any, shape: tuple[int, ...], spec: PartitionSpec) -> str:
    """An array's type as JAX prints a sharded one: `float32[8@dp,4]`, with the
    global size of each dimension and the mesh axes that split it
    (`16@(dp,fsdp)` for several)."""
    entries = [*spec, *[None] * (len(shape) - len(spec))]
    dims = []
    for size, entry in zip(shape, entries):
        axes = axes_of(entry)
        if len(axes) > 1:
            dims.append(f"{size}@({','.join(axes)})")
        else:
            dims.append(f"{size}@{axes[0]}" if axes else str(size))
    return f"{np.dtype(dtype).name}[{','.join(dims)}]"


def validate_spec(spec: Any, num_dims: int, variadic: bool) -> PartitionSpec:
    """Checks a spec given in an annotation; raises `AnnotationError` if it is wrong."""
    if not isinstance(spec, PartitionSpec):
        raise AnnotationError(
            "The third item of a jaxshard annotation must be a "
            "`jax.sharding.PartitionSpec`, e.g. "
            "`Float[Array, 'batch d', P('dp', None)]`; "
            f"got {spec!r} of type {type(spec).__name__}."
        )
    if not variadic and len(spec) > num_dims:
        raise AnnotationError(
            f"The partition spec {format_spec(spec)} has {len(spec)} entries but the "
            f"shape has only {num_dims} dimensions. A spec has at most one entry per "
            "dimension (trailing `None`s may be left out)."
        )
    seen: set[str] = set()
    for entry in spec:
        for name in axes_of(entry):
            if not isinstance(name, str):
                raise AnnotationError(
                    f"The partition spec {format_spec(spec)} has {name!r} where a mesh "
                    "axis name (a string), a tuple of them, `None` or "
                    "`P.UNCONSTRAINED` is expected."
                )
            if name in seen:
                raise AnnotationError(
                    f"The partition spec {format_spec(spec)} uses mesh axis {name!r} "
                    "twice. Each mesh axis can shard at most one dimension."
                )
            seen.add(name)
    return spec


_TOKEN = re.compile(r"\[([^\]]*)\]|(\S+)")
_BRACKET = re.compile(r"^(?P<dim>.+)/\s*(?P<axes>[A-Za-z_]\w*|\([^()]*\))\s*$")


def parse_compact(text: str) -> tuple[str, PartitionSpec]:
    """`"[batch/dp] seqlen [heads/(tp,fsdp)]"` -> `("batch seqlen heads", P("dp", None,
    ("tp", "fsdp")))`."""
    dims: list[str] = []
    spec: list[Any] = []
    variadic_at = None
    pos = 0
    for match in _TOKEN.finditer(text):
        if text[pos : match.start()].strip():
            break
        pos = match.end()
        inner, plain = match.groups()
        if plain is not None:
            if "[" in plain or "]" in plain:
                raise AnnotationError(
                    f"Cannot parse {text!r}: unbalanced bracket in {plain!r}. Write a "
                    "sharded dimension as `[dim/axis]` or `[dim/(axis1,axis2)]`."
                )
            dim, entry = plain, None
        else:
            found = _BRACKET.match(inner)
            if found is None or not found["dim"].strip():
                raise AnnotationError(
                    f"Cannot parse [{inner}] in {text!r}. A sharded dimension is "
                    "written `[dim/axis]` or `[dim/(axis1,axis2)]`, e.g. `[batch/dp]`."
                )
            dim = found["dim"].strip()
            if " " in dim:
                raise AnnotationError(
                    f"Cannot parse [{inner}] in {text!r}: one bracket holds one "
                    "dimension, with no spaces."
                )
            axes = found["axes"]
            if axes.startswith("("):
                names = tuple(a.strip() for a in axes[1:-1].split(",") if a.strip())
                if not names or not all(n.isidentifier() for n in names):
                    raise AnnotationError(
                        f"Cannot parse the axes {axes} in {text!r}: write a tuple of "
                        "mesh axis names, e.g. `(tp,fsdp)`."
                    )
                entry = names
            else:
                entry = axes
        if dimension(dim).kind == "variadic":
            if entry is not None:
                raise AnnotationError(
                    f"In {text!r} the variadic dimension {dim!r} is sharded, but a "
                    "PartitionSpec shards single dimensions. Shard the dimensions "
                    "before it, or use the long form with an explicit spec."
                )
            variadic_at = len(dims)
        elif entry is not None and variadic_at is not None:
            raise AnnotationError(
                f"In {text!r} the sharded dimension {dim!r} comes after the variadic "
                f"{dims[variadic_at]!r}, so its position in the array is not fixed and "
                "no PartitionSpec can describe it. Use the long form with an explicit "
                "spec, or move the variadic dimensions after the sharded ones."
            )
        dims.append(dim)
        spec.append(entry)
    if text[pos:].strip():
        raise AnnotationError(f"Cannot parse {text!r} near {text[pos:].strip()!r}.")
    if variadic_at is not None:
        # Entries after a variadic dimension would have no fixed position.
        spec = spec[:variadic_at]
    return " ".join(dims), PartitionSpec(*spec)
