"""The collectives of a compiled program, read from its HLO text: what kind, how many
bytes, over which mesh axes, and the line of user code each came from (the op
metadata's stack frame)."""

import dataclasses
import functools as ft
import math
import re
from typing import Any

import numpy as np

from .._sharding.describe import describe_bytes
from .frames import _chain, _cut, _Frames, _from_checks, _is_user_code, _relative


KINDS = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective operation of a compiled program.

    **Attributes:**

    - `kind`: `"all-gather"`, `"all-reduce"`, `"reduce-scatter"`, `"all-to-all"` or
        `"collective-permute"` (an asynchronous start/done pair counts once).
    - `bytes`: the bytes it moves per device: the larger of its input and its output
        on one device.
    - `axes`: the mesh axes it spans, as told by its replica groups (or the source and
        target pairs of a permute); `None` when they cannot be told.
    - `filename`, `lineno`, `function`: the line of user code it came from (the
        innermost frame outside JAX, jaxshard and installed packages); `None` when the
        program does not say.
    - `op_name`: JAX's name for the operation it was made for (`jit(f)/dot_general`),
        or the path of the input whose layout it was made for (`params['w1']`).
    - `from_checks`: whether jaxshard's value checks made it, to combine their
        findings across devices (`report.check_collectives`), not the model.
    """

    kind: str
    bytes: int
    axes: tuple[str, ...] | None
    filename: str | None
    lineno: int | None
    function: str | None
    op_name: str
    # The frames of the user's code it was made in, innermost first:
    # `(filename, line, function)`, up to the verified function.
    chain: tuple[tuple[str, int, str], ...] = dataclasses.field(
        default=(), compare=False
    )
    from_checks: bool = False

    @property
    def where(self) -> str:
        """`model.py:95 (einsum) ← :120 (attention) ← :131 (block)`: the line of the
        user's code it came from and the calls that led there (paths relative to the
        working directory when under it); or JAX's op name, saying so, when no line
        of the user's code made it."""
        if self.filename is None:
            if not self.op_name:
                return "(made by XLA, in no line of your code)"
            return f"{self.op_name} (in no line of your code)"
        frames = self.chain or ((self.filename, self.lineno, self.function),)
        parts, last = [], None
        for filename, lineno, function in frames[:4]:
            path = _relative(filename)
            shown = f"{path}:{lineno}" if path != last else f":{lineno}"
            parts.append(f"{shown} ({function})")
            last = path
        return " ← ".join(parts)


_DTYPE_BYTES = {
    "pred": 1, "s2": 1, "u2": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1,
    "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\dm\d\w*)?)\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")


def _size(type_text: str) -> int:
    """Bytes of an HLO type (an array, or the arrays of a tuple)."""
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype.startswith("f8"):
            width = 1
        else:
            width = _DTYPE_BYTES.get(dtype)
            if width is None:
                continue
        shape = [int(d) for d in dims.split(",") if d]
        total += width * math.prod(shape)
    return total


def _moved(op: str, type_text: str, operand_types: list[str]) -> int:
    """The bytes a collective moves per device: the larger of all its inputs and
    all its outputs. XLA's combiners and its CPU all-to-all give one op many
    operands (one per peer, or per merged collective), each part of the data; an
    async `-start` op's result holds its inputs beside its outputs."""
    inputs = sum(_size(t) for t in operand_types)
    outputs = _size(type_text)
    if op.endswith("-start") and outputs > inputs:
        outputs -= inputs
    return max(inputs, outputs)


_IOTA = r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?"


# `replica_groups=mesh['a'=2,'b'=4] {'b'}`, the mesh's devices in order, or
# `replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}` (jax 0.10).
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}"
)


def _groups(attributes: str) -> list[list[int]] | None:
    """The device groups of `replica_groups=` in any of XLA's three notations."""
    m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", attributes)
    if m:
        return [
            [int(d) for d in g.split(",") if d]
            for g in re.findall(r"\{([\d,]*)\}", m[1])
        ]
    m = re.search(
        r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attributes
    )
    if m:
        shape = [int(d) for d in m[1].split(",")]
        dims = [int(d) for d in m[2].split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m[3]:
            ids = ids.transpose([int(d) for d in m[3].split(",")])
        return ids.reshape(shape[0], -1).tolist()
    m = _MESH_GROUPS.search(attributes)
    if m:
        axes = re.findall(r"'(\w+)'=(\d+)", m[1])
        names = [a for a, _ in axes]
        sizes = [int(s) for _, s in axes]
        spanned = [names.index(a) for a in re.findall(r"'(\w+)'", m[4])]
        ids = np.arange(math.prod(sizes))
        if m[2]:  # the mesh's devices, as an iota: `device_ids=([4,2]T(1,0))`
            ids = ids.reshape([int(d) for d in m[2].split(",")])
            if m[3]:
                ids = ids.transpose([int(d) for d in m[3].split(",")])
        ids = ids.reshape(sizes)
        rest = [i for i in range(len(sizes)) if i not in spanned]
        ids = ids.transpose(rest + spanned)
        return ids.reshape(-1, math.prod(sizes[i] for i in spanned) or 1).tolist()
    return None


def _pairs(attributes: str) -> list[list[int]] | None:
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attributes)
    if not m:
        return None
    return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", m[1] + "}")]


def _axes(groups: list[list[int]] | None, mesh: Any) -> tuple[str, ...] | None:
    """The mesh axes along which the devices of the groups differ (device ids index
    the mesh's devices in order)."""
    if not groups or mesh is None:
        return None
    key = tuple(map(tuple, groups))
    return _spanned(key, mesh.devices.shape, tuple(mesh.axis_names))


@ft.lru_cache(maxsize=256)
def _spanned(
    groups: tuple[tuple[int, ...], ...], shape: tuple[int, ...], names: tuple[str, ...]
) -> tuple[str, ...] | None:
    if max(max(g) for g in groups if g) >= math.prod(shape):
        return None
    spanned = set()
    for group in groups:
        coords = np.array(np.unravel_index(group, shape)).T
        for axis in range(len(shape)):
            if len(set(coords[:, axis])) > 1:
                spanned.add(axis)
    return tuple(names[a] for a in sorted(spanned))


def collectives(
    hlo_text: str,
    mesh: Any = None,
    chains: Any = None,
    root: str = "",
    inputs: Any = None,
) -> tuple[Collective, ...]:
    """Every collective in a compiled program's HLO text, in program order.

    `chains` (`user_frames_by_op` of the lowered module) gives each op's frames in
    the user's code, cut after the frame of the function `root` (the function being
    verified): the innermost of them is where a collective came from when the
    compiled program's own frames name none (an op made inside flax, say).
    `inputs` renames the op named for an input (JAX's name for it) as the report
    names the input."""
    chains, inputs = chains or {}, inputs or {}
    types: dict[str, str] = {}
    found = []
    frames = None
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, type_text, op, rest = m.groups()
        types[name] = type_text
        kind = op.removesuffix("-start")
        if kind not in KINDS or op.endswith("-done"):
            continue
        operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
        moved = _moved(op, type_text, [types.get(o, "") for o in operands])
        groups = _pairs(rest) if kind == "collective-permute" else _groups(rest)
        op_name = re.search(r'op_name="([^"]*)"', rest)
        where, innermost, made_in = None, None, ()
        frame = re.search(r"stack_frame_id=(\d+)", rest)
        if frame:
            frames = frames or _Frames(hlo_text)
            made_in = _cut(frames.user_chain(int(frame[1])), root)
            where = made_in[0] if made_in else None
            innermost = frames.line(int(frame[1]))
        elif re.search(r'source_file="([^"]*)"', rest):
            source = re.search(r'source_file="([^"]*)" source_line=(\d+)', rest)
            innermost = (source[1], int(source[2])) if source else None
            if source and _is_user_code(source[1]):
                where = (source[1], int(source[2]), "?")
        # HLO text escapes quotes: `inputs[\\'table\\']`.
        name = op_name[1].replace("\\'", "'") if op_name else ""
        chain = made_in or _cut(_chain(chains, name, innermost), root)
        if where is None and chain:
            where = chain[0]
        found.append(
            Collective(
                kind=kind,
                bytes=moved,
                axes=_axes(groups, mesh),
                filename=where[0] if where else None,
                lineno=where[1] if where else None,
                function=where[2] if where else None,
                op_name=inputs.get(name, name) if where is None else name,
                chain=chain if chain and chain[0] == where else (),
                from_checks=_from_checks(innermost, chains, name),
            )
        )
    return tuple(found)


def summary(found: tuple[Collective, ...]) -> dict[str, int]:
    """Bytes per kind, every kind listed."""
    return {k: sum(c.bytes for c in found if c.kind == k) for k in KINDS}


def distinct(found: tuple[Collective, ...]) -> list[tuple[Collective, int]]:
    """`(collective, how many)` for each distinct collective of `found`, in the
    order first met: those of the same kind, bytes and mesh axes made by the same
    line through the same calls are one (a layer of a Python loop makes its
    collectives once per layer). Where no line of the user's code made them, JAX's
    op name tells them apart; a line's op names differ from layer to layer (flax
    names them by module) and are not compared."""
    counts: dict[tuple, list] = {}
    for c in found:
        place = c.op_name if c.filename is None else (c.filename, c.lineno, c.chain)
        key = (c.kind, c.bytes, c.axes, c.function, place)
        counts.setdefault(key, [c, 0])[1] += 1
    return [(c, n) for c, n in counts.values()]


def describe(c: Collective, count: int = 1) -> str:
    """`all-gather 16.0 MiB ×4 over fsdp at model.py:95 (einsum)`: a distinct
    collective, and how many the program has (`distinct`)."""
    times = f" ×{count}" if count > 1 else ""
    axes = "" if c.axes is None else f" over {', '.join(c.axes) or '(none)'}"
    return f"{c.kind} {describe_bytes(c.bytes)}{times}{axes} at {c.where}"


def most_bytes(found: tuple[Collective, ...]) -> list[tuple[Collective, int]]:
    """`distinct(found)`, the most bytes in all first (a layer's collective made
    in 32 layers before one made once)."""
    return sorted(distinct(found), key=lambda cn: -cn[0].bytes * cn[1])
