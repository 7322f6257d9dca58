"""Where an op of a compiled program came from, in the user's code: the chain of
calls that made it, read from the compiled program's stack frame table, or from the
lowered module's debug locations by op name when the compiled program gives none.
`collectives` places each collective with these."""

import functools as ft
import os
import re
import sysconfig
from typing import Any


def _relative(filename: str) -> str:
    path = os.path.relpath(filename)
    return filename if path.startswith(os.pardir) else path


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
