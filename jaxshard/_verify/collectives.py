"""The collectives of a compiled program, read from its HLO text: what kind, how many
bytes, over which mesh axes, and the line of user code each came from (the op
metadata's stack frame)."""

import dataclasses
import functools as ft
import math
import os
import re
import sysconfig
from typing import Any

import numpy as np

from .._sharding.describe import describe_bytes


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


def _relative(filename: str) -> str:
    path = os.path.relpath(filename)
    return filename if path.startswith(os.pardir) else path


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


def _largest_array(type_text: str) -> int:
    sizes = [_size(f"{dtype}[{dims}]") for dtype, dims in _ARRAY.findall(type_text)]
    return max(sizes, default=0)


def _table(text: str, name: str) -> dict[int, str]:
    """A section of the module's header (`FileNames`, `StackFrames`, ...)."""
    out: dict[int, str] = {}
    lines = iter(text.splitlines())
    for line in lines:
        if line.strip() == name:
            break
    for line in lines:
        m = re.match(r"(\d+) (.*)$", line.strip())
        if not m:
            break
        out[int(m.group(1))] = m.group(2)
    return out


def _fields(text: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=([^\s}]+)", text))


Frame = tuple[str, int, str]  # (filename, line, function)


class _Frames:
    """The module's stack frame tables, for the user line of an instruction."""

    def __init__(self, text: str):
        self.files = {k: v.strip('"') for k, v in _table(text, "FileNames").items()}
        self.functions = {
            k: v.strip('"') for k, v in _table(text, "FunctionNames").items()
        }
        self.locations = {
            k: _fields(v) for k, v in _table(text, "FileLocations").items()
        }
        self.frames = {k: _fields(v) for k, v in _table(text, "StackFrames").items()}

    def line(self, frame_id: int) -> tuple[str, int] | None:
        """The `(file, line)` of the frame itself, whoever's code it is."""
        frame = self.frames.get(frame_id)
        if frame is None:
            return None
        location = self.locations.get(int(frame.get("file_location_id", 0)), {})
        filename = self.files.get(int(location.get("file_name_id", 0)))
        return None if filename is None else (filename, int(location.get("line", 0)))

    def user_chain(self, frame_id: int) -> tuple[Frame, ...]:
        """The frames of the user's code that the instruction with this frame was
        made in, innermost first."""
        found, seen = [], set()
        while frame_id in self.frames and frame_id not in seen:
            seen.add(frame_id)
            frame = self.frames[frame_id]
            location = self.locations.get(int(frame.get("file_location_id", 0)), {})
            filename = self.files.get(int(location.get("file_name_id", 0)))
            if filename is not None and _is_user_code(filename):
                function = self.functions.get(int(location.get("function_name_id", 0)))
                found.append((filename, int(location.get("line", 0)), function or "?"))
            frame_id = int(frame.get("parent_frame_id", 0)) - self._shift
        return tuple(found)

    @ft.cached_property
    def _shift(self) -> int:
        """How much the printed `parent_frame_id`s exceed the parents' ids. XLA
        (jax 0.10.2 to 0.12.0.1) prints each parent's id plus one, and so the first
        frame, which has no parent, as its own: a frame that names itself says so."""
        frames = self.frames.items()
        return int(any(k == int(f.get("parent_frame_id", 0)) for k, f in frames))


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARIES = tuple(
    os.path.abspath(p) + os.sep
    for p in {*(sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib"))}
    # jaxshard itself, all of it (an editable install is under no library path): its
    # wrappers are no line of the user's code.
) + (_PACKAGE + os.sep,)
_VALUES = os.path.join(_PACKAGE, "_values") + os.sep


def _is_user_code(filename: str) -> bool:
    if filename.startswith("<"):  # generated: beartype's wrappers
        return False
    return not os.path.abspath(filename).startswith(_LIBRARIES)


def _is_check_code(filename: str) -> bool:
    """Whether `filename` is jaxshard's value checks' (`jaxshard/_values/`), which
    combine their findings across devices with collectives of their own; not
    `jaxshard.shard_map`, whose collectives lay out the model's blocks."""
    path = os.path.abspath(filename)
    return path.startswith(_VALUES) and os.path.basename(path) != "shard_map.py"


def _from_checks(innermost: tuple[str, int] | None, chains: Any, name: str) -> bool:
    """Whether the op `name`, whose innermost frame (whoever's) is `innermost`,
    was made by jaxshard's value checks. JAX keeps the frames of code outside
    itself, so the checks' own files come first: in the compiled program's frames
    (on CPU and TPU alike), else in every lowered op of that name."""
    if innermost is None:
        found = [entry[0] for entry in chains.get(name, ())]
        if not found or None in found:
            return False
        return all(_is_check_code(filename) for filename, _ in found)
    return _is_check_code(innermost[0])


# --- the user's frames, from the lowered module's locations --------------------------
#
# The compiled program's stack frame table gives an op's whole call chain, but not
# every op keeps a frame through XLA's passes (an op made for an input's layout,
# an op whose frame a fusion dropped). The lowered module's debug locations keep
# every op's chain, by op name: `loc("jit(f)/.../dot_general"(#loc8))`,
# `#loc8 = loc(callsite(#loc5 at #loc6))`, `#loc5 = loc("f"(#loc2))`,
# `#loc2 = loc("model.py":6:11 to :21)`.

_LOC = re.compile(r"^#(loc\d*) = loc\((.*)\)\s*$")
_NAMED = re.compile(r'^"((?:[^"\\]|\\.)*)"\(#(loc\d*)\)$')
_CALLSITE = re.compile(r"^callsite\(#(loc\d*) at #(loc\d*)\)$")
_FILE = re.compile(r'^"((?:[^"\\]|\\.)*)":(\d+)')


def user_frames_by_op(module_text: str) -> "_FramesByOp":
    """Op name -> for each op of that name (a name is not unique: `jit(f)/dot_general`
    names every contraction outside a named scope), the `(file, line)` of its
    innermost frame, whoever's, and the frames of the user's code it was made in,
    innermost first; from a lowered module's text with debug info
    (`lowered.as_text(debug_info=True)`). Read when asked: the report asks for the
    collectives' ops only."""
    locs: dict[str, str] = {}
    ops: dict[str, list[str]] = {}  # op name -> the locations of its ops
    for line in module_text.splitlines():
        m = _LOC.match(line)
        if m:
            locs[m[1]] = m[2]
    for key, body in locs.items():
        m = _NAMED.match(body)
        if m and not _FILE.match(locs.get(m[2], "")):  # an op's name, not a frame's
            ops.setdefault(_unescape(m[1]), []).append(m[2])
    return _FramesByOp(locs, ops)


class _FramesByOp:
    """`user_frames_by_op`'s mapping, each op name's entries made on first use."""

    def __init__(self, locs: dict[str, str], ops: dict[str, list[str]]):
        self._locs, self._ops = locs, ops
        self._made: dict[str, list] = {}
        self._memo: dict[str, tuple[Frame, ...]] = {}

    def get(self, name: str, default: Any = ()) -> Any:
        if name not in self._ops:
            return default
        if name not in self._made:
            entries: list = []
            for key in self._ops[name]:
                found = self._frames(key)
                innermost = (found[0][0], found[0][1]) if found else None
                chain = tuple(f for f in found if _is_user_code(f[0]))
                if (innermost, chain) not in entries:
                    entries.append((innermost, chain))
            self._made[name] = entries
        return self._made[name]

    def _frames(self, key: str, depth: int = 0) -> tuple[Frame, ...]:
        """The frames of the location `key`, innermost first."""
        if key in self._memo:
            return self._memo[key]
        body = self._locs.get(key, "unknown")
        if depth > 500 or body == "unknown":
            return ()
        found: tuple[Frame, ...] = ()
        if m := _CALLSITE.match(body):
            found = self._frames(m[1], depth + 1) + self._frames(m[2], depth + 1)
        elif m := _NAMED.match(body):
            inner = _FILE.match(self._locs.get(m[2], ""))
            if inner:  # a function's frame
                found = ((_unescape(inner[1]), int(inner[2]), _unescape(m[1])),)
            else:
                found = self._frames(m[2], depth + 1)
        elif m := _FILE.match(body):
            found = ((_unescape(m[1]), int(m[2]), "?"),)
        self._memo[key] = found
        return found


def _unescape(text: str) -> str:
    return text.replace('\\"', '"').replace("\\'", "'").replace("\\\\", "\\")


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
        moved = max(
            [_largest_array(type_text)] + [_size(types.get(o, "")) for o in operands]
        )
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


def _chain(
    chains: Any, name: str, innermost: tuple[str, int] | None
) -> tuple[Frame, ...]:
    """The user's frames of the op `name` whose innermost frame is `innermost` (or
    of the only op of that name); for an op inside a nested function
    (`.../Embed_0/jit(_take)/gather`, whose own frames are JAX's), those of the
    call that entered it (`.../Embed_0/jit(_take)`)."""
    nested = False
    while "/" in name:  # not the program's own name: its frames are the caller's
        candidates = [c for c in chains.get(name, ()) if c[1]]
        if not nested and innermost is not None:
            matching = [c for c in candidates if c[0] == innermost]
            candidates = matching or candidates
        if len({chain for _, chain in candidates}) == 1:
            return candidates[0][1]
        if candidates:
            return ()  # several ops of that name, none told apart: no guess
        name, nested = name.rpartition("/")[0], True
    return ()


def _cut(chain: tuple[Frame, ...], root: str) -> tuple[Frame, ...]:
    """`chain` up to the frame of the function `root` (its qualified name, or its
    last part), which is kept."""
    short = root.rsplit(".", 1)[-1]
    for i, (_, _, function) in enumerate(chain):
        if function in (root, short) or root.endswith("." + function):
            return chain[: i + 1]
    return chain


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
