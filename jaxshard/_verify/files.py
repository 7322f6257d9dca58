"""Writing the files a user keeps (a golden snapshot, a report page): whole or not at
all. A save that fails midway (a full disk, a quota, an interrupt) leaves the file
that was there byte for byte, so a committed snapshot is never left truncated for
the next `against=` to trip over."""

import contextlib
import os
import secrets
import stat


def write_text(path: str | os.PathLike, text: str) -> None:
    """Writes `text` (UTF-8, line endings as given) to `path`, as `write_bytes`."""
    write_bytes(path, text.encode("utf-8"))


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Writes `data` to `path`, making its folder if need be.

    The text goes to a new file beside `path`, is flushed to the disk, and only then
    takes `path`'s place (`os.replace`, atomic on POSIX and Windows). On any failure
    the new file is removed, `path` is untouched, and the error propagates. A file
    that was there keeps its permission bits; a new one gets the umask's. A symbolic
    link is followed: the file it points to is replaced, the link kept.
    """
    given, path = os.fspath(path), os.path.realpath(path)
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    try:
        temp, fd = _new_file(path)
    except OSError as e:  # a folder one may not write to: say so of the file asked for
        raise type(e)(e.errno, e.strerror, given) from None
    try:
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileNotFoundError):
            os.chmod(temp, stat.S_IMODE(os.stat(path).st_mode))
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    _sync_folder(folder)


def _new_file(path: str) -> tuple[str, int]:
    """A file of a fresh name beside `path`, open for writing: created with mode
    0o666 less the umask, as `open(path, "w")` would have made `path`."""
    folder, name = os.path.split(path)
    while True:
        temp = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.tmp")
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
            return temp, os.open(temp, flags, 0o666)
        except FileExistsError:  # another writer's: draw another name
            continue


def _sync_folder(folder: str) -> None:
    """Makes the rename itself durable, where the system allows (not on Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
