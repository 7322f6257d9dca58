"""A verify answered from a cache: the report of a program already verified, stored
under a key of everything that decides it, and given back without compiling.

The key is a SHA-256 of:

- the lowered program's text with its source locations (any change to the model's
    code, a line moved, a static argument, a shape);
- every contract traced, as its site records it (function, parameter, annotation,
    expected spec, logical rules): an annotation changed on the same line;
- the mesh (axis names, sizes and types; each device's platform, kind, id and
    coordinates: a topology), the budgets and the report's notes;
- the versions of jax, jaxlib, libtpu and jaxshard (and a digest of jaxshard's own
    files), and the flags XLA and libtpu read from the environment.

Entries are written whole or not at all (`files.write_bytes`), read back under the
live mesh, and a corrupt entry is a miss with a warning. The folder keeps at most
`JAXSHARD_CACHE_MAX_BYTES` (1 GiB by default), the entries used least recently out
first.
"""

import functools as ft
import hashlib
import importlib.metadata
import io
import os
import pathlib
import pickle
import re
import traceback
import warnings
from typing import Any

import jax
from jax.sharding import Mesh

from .._sharding.decorator import _user_frame
from .._version import __version__
from .files import write_bytes
from .report import Report


_FORMAT = "jaxshard-verify-cache-1"
_SUFFIX = ".report"
_MAX_BYTES = 1 << 30  # the folder's size bound, by default
_ENVIRONMENT = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "JAX_PLATFORMS")


class Cache:
    """The reports of one folder, for one verify: `lookup` makes the key from the
    lowered program and the contracts traced, and says whether it is stored;
    `store` keeps the report made for it."""

    def __init__(self, folder: str, mesh: Mesh, options: tuple, callers: set):
        self.folder, self.mesh, self.options = folder, mesh, options
        # `(file, line)` of each frame that called verify: the lowered program's
        # locations name them too, and where verify is called from decides nothing.
        self.callers = callers
        # The keys of this verify's lowerings: a second one (the value checks
        # compiled out, see `verify._NoCustomPartitioning`) follows from the first.
        self.keys: list[str] = []

    def lookup(self, lowered_text: str, sites: list) -> Report | None:
        """The stored report for this program, or `None`."""
        digest = hashlib.sha256()
        for part in (_FORMAT, *_versions(), *_environment(), *_mesh(self.mesh)):
            digest.update(part.encode() + b"\0")
        digest.update(repr(self.options).encode() + b"\0")
        for site in sorted(sites, key=lambda s: s.order):
            digest.update(_site(site).encode() + b"\0")
        digest.update(_stable(lowered_text, self.callers).encode())
        self.keys.append(digest.hexdigest())
        return self._read(self._path(self.keys[-1]))

    def store(self, report: Report) -> None:
        """Keeps `report` under the key of each `lookup` (the next verify of this
        program finds it at its first lowering), then bounds the folder. A report
        that cannot be stored is left out, with a warning."""
        if not self.keys:
            return
        try:
            data = _dumps(report)
            for key in self.keys:
                write_bytes(self._path(key), data)
        except Exception as e:  # noqa: BLE001 (a cache never fails a verify)
            warnings.warn(
                f"jaxshard.verify: the report was not stored in the cache at "
                f"{self.folder} ({type(e).__name__}: {e}).",
                stacklevel=_user_frame(),  # the user's verify call
            )
            return
        _bound(self.folder, _max_bytes())

    def _path(self, key: str) -> str:
        return os.path.join(self.folder, key[:2], key + _SUFFIX)

    def _read(self, path: str) -> Report | None:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        try:
            report = _loads(data, self.mesh)
            if not isinstance(report, Report):
                raise TypeError(f"it holds a {type(report).__name__}, not a report")
        except Exception as e:  # noqa: BLE001 (a corrupt entry is a miss)
            warnings.warn(
                f"jaxshard.verify: the cache entry {path} cannot be read ({e}); "
                "compiling instead, and writing it anew.",
                stacklevel=_user_frame(),
            )
            return None
        os.utime(path)  # used: the last to go
        return report


def cache_for(folder: str | None, mesh: Mesh, options: tuple) -> Cache | None:
    """The cache of `folder` (`None`: no cache), for a verify called from here."""
    if not folder:
        return None
    callers = {(f.filename, f.lineno) for f in traceback.extract_stack()}
    folder = os.path.abspath(os.path.expanduser(os.fspath(folder)))
    return Cache(folder, mesh, options, callers)


# --- the key --------------------------------------------------------------------------


@ft.cache
def _own_source() -> str:
    """A digest of jaxshard's own files: a development copy changed without a new
    version number is another jaxshard too (about 5 ms, once per process)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _versions() -> list[str]:
    found = [f"jaxshard {__version__} {_own_source()}", f"jax {jax.__version__}"]
    for name in ("jaxlib", "libtpu", "libtpu-nightly"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} -")
    return found


def _environment() -> list[str]:
    return [f"{name}={os.environ.get(name, '')}" for name in _ENVIRONMENT]


def _mesh(mesh: Mesh) -> list[str]:
    devices = [
        (d.platform, d.device_kind, d.id, getattr(d, "coords", None))
        for d in mesh.devices.flat
    ]
    return [repr(dict(mesh.shape)), repr(mesh.axis_types), repr(devices)]


# What differs between two lowerings of one program in two processes: the host
# addresses the custom calls of probes and of custom partitioning (value checks on
# Auto axes) carry, a probe's nonce, and objects' addresses in the names of
# locations (`<@beartype(model) at 0x7f...>`).
_CALLBACKS = r"@(?:InspectSharding|CustomSPMDPartitioning)"
_VOLATILE = (
    (
        re.compile("(" + _CALLBACKS + r'\([^)]*\) \{[^}]*?backend_config = )"[^"]*"'),
        r'\1""',
    ),
    (re.compile(r'jaxshard_nonce = "[0-9a-f]+"'), 'jaxshard_nonce = ""'),
    (re.compile(r" at 0x[0-9a-f]+"), " at 0x"),
)


_LOCATION = re.compile(r'loc\("([^"]+)":(\d+):[^)]*\)')


def _stable(text: str, callers: set) -> str:
    """The lowered program's text without what differs from process to process, nor
    the lines that called verify."""
    for pattern, replacement in _VOLATILE:
        text = pattern.sub(replacement, text)

    def located(m: re.Match) -> str:
        called = (m[1], int(m[2])) in callers
        return 'loc("<caller>")' if called else m[0]

    return _LOCATION.sub(located, text)


def _site(site: Any) -> str:
    function = site.function
    name = getattr(function, "qualname", function)
    return repr(
        (
            name,
            getattr(function, "source", None),
            site.name,
            site.annotation,
            site.spec,
            site.array,
            site.rules,
            site.note,
            [call[0] for call in site.calls],
        )
    )


# --- the entries ----------------------------------------------------------------------


class _Pickler(pickle.Pickler):
    """Stores the report without its devices: the mesh and each device are put
    back from the live mesh, which the key says is the same."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, Mesh):
            return ("mesh",)
        if isinstance(obj, jax.Device):
            return ("device", obj.id)
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, mesh: Mesh):
        super().__init__(io.BytesIO(data))
        self.mesh = mesh
        self.devices = {d.id: d for d in mesh.devices.flat}

    def persistent_load(self, pid: Any) -> Any:
        if pid == ("mesh",):
            return self.mesh
        if isinstance(pid, tuple) and len(pid) == 2 and pid[0] == "device":
            return self.devices[pid[1]]
        raise pickle.UnpicklingError(f"unknown reference {pid!r}")


def _dumps(report: Report) -> bytes:
    stored = Report.__new__(Report)
    stored.__dict__.update(report.__dict__)
    stored.__dict__["compiled"] = None  # XLA's executable stays behind
    out = io.BytesIO()
    out.write(_FORMAT.encode() + b"\n")
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(stored)
    return out.getvalue()


def _loads(data: bytes, mesh: Mesh) -> Any:
    head, _, body = data.partition(b"\n")
    if head != _FORMAT.encode():
        raise ValueError("it is not a jaxshard verify report")
    return _Unpickler(body, mesh).load()


def _max_bytes() -> int:
    given = os.environ.get("JAXSHARD_CACHE_MAX_BYTES", "").strip()
    return int(given) if given.isdigit() else _MAX_BYTES


def _bound(folder: str, limit: int) -> None:
    """Removes the entries used least recently until the folder holds `limit`
    bytes at most (the newest entry stays, whatever its size)."""
    entries = []
    for root, _, names in os.walk(folder):
        for name in names:
            if name.endswith(_SUFFIX):
                path = os.path.join(root, name)
                try:
                    info = os.stat(path)
                except OSError:
                    continue
                entries.append((info.st_mtime, info.st_size, path))
    entries.sort()
    total = sum(size for _, size, _ in entries)
    for _, size, path in entries[:-1]:
        if total <= limit:
            break
        try:
            os.unlink(path)
        except OSError:
            continue
        total -= size
