"""Contracts written into the source, as a patch to review first: `patch(contracts)`
is each changed file's text before and after, `.diff()` a unified diff that `git
apply` and `patch -p1` take, and `.write()` writes the files.

A pure source transformation (no JAX), made with libcst (`edit`), which gives back
the code it did not change byte for byte: line endings, a byte-order mark, tabs and
comments stay. Nothing already written is overwritten: an annotation that is there
stays (and is reported in `Patch.kept` when it says something else), a function
already checked gets no second decorator, and a name already imported is not
imported again, so a second run on the written files changes nothing.
"""

import dataclasses
import difflib
import os
from collections.abc import Iterable
from typing import Any

from .._verify.files import write_text
from .contracts import Contract, Kept, Missing, relative


@dataclasses.dataclass(frozen=True)
class Change:
    """One file's text before and after its contracts are written (UTF-8; a
    byte-order mark is the text's first character)."""

    path: str
    before: str
    after: str


@dataclasses.dataclass(frozen=True)
class Patch:
    """The contracts of some functions, written into their files' text.

    **Attributes:**

    - `changes`: each file that changes, with its text before and after.
    - `kept`: the annotations already in the source that say something else than
        the contracts: they are kept as they are.
    - `missing`: the contracts (or one annotation of them) not written, and why: a
        function not found, one defined inside another, a parameter it lacks.
    """

    changes: tuple[Change, ...]
    kept: tuple[Kept, ...]
    missing: tuple[Missing, ...]

    def diff(self) -> str:
        """A unified diff of every change, with `a/` and `b/` paths relative to the
        working directory (absolute for a file outside it), as `git diff` prints
        them: `git apply` and `patch -p1` apply it. Empty when nothing changes."""
        return "".join(_unified(change) for change in self.changes)

    def write(self) -> list[str]:
        """Writes each changed file (each whole or not at all), and returns their
        paths. Raises `RuntimeError`, writing nothing, if any of them changed since
        the patch was made."""
        stale = [c.path for c in self.changes if _read(c.path) != c.before]
        if stale:
            raise RuntimeError(
                "jaxshard.annotate: nothing written, as "
                + ", ".join(map(relative, stale))
                + " changed since its contracts were made: annotate again."
            )
        for change in self.changes:
            write_text(change.path, change.after)
        return [change.path for change in self.changes]

    def __str__(self) -> str:
        count = len(self.changes)
        lines = [f"{count} file{'s' if count != 1 else ''} changed."]
        if self.kept:
            lines.append("Annotations kept that say something else:")
            lines += [f"  {kept}" for kept in self.kept]
        if self.missing:
            lines.append("Not written:")
            lines += [f"  {missing}" for missing in self.missing]
        return "\n".join(lines)


def patch(contracts: Iterable[Contract]) -> Patch:
    """The patch that writes `contracts` into their files.

    **Arguments:**

    - `contracts`: the annotations of each function, as source text.

    **Returns:**

    A `Patch`: `.diff()`, `.write()`, and what was `.kept` or is `.missing`.

    !!! Example
        ```python
        contract = Contract(
            "/src/model.py", "mlp", 12, {"x": 'Float[Array, "b d", P("dp", None)]'},
            imports=imports_for({"Float", "Array", "P"}),
        )
        print(patch([contract]).diff())
        ```
    """
    edit = _editor()
    by_file: dict[str, list[Contract]] = {}
    for contract in contracts:
        by_file.setdefault(os.path.abspath(contract.filename), []).append(contract)
    changes, kept, missing = [], [], []
    for path, group in sorted(by_file.items()):
        try:
            with open(path, "rb") as f:
                source = f.read()
        except OSError as e:
            reason = f"its file cannot be read ({e.strerror})"
            missing += [Missing(c, None, reason) for c in group]
            continue
        edited = edit(source, group)
        kept += edited.kept
        missing += edited.missing
        if edited.source != source:
            changes.append(Change(path, _text(source), _text(edited.source)))
    return Patch(tuple(changes), tuple(kept), tuple(missing))


def diff(contracts: Iterable[Contract]) -> str:
    """The unified diff that writes `contracts` (`patch(contracts).diff()`)."""
    return patch(contracts).diff()


def write(contracts: Iterable[Contract]) -> list[str]:
    """Writes `contracts` into their files; returns the files changed."""
    return patch(contracts).write()


def _editor() -> Any:
    """`edit.edit`, which needs libcst, an optional dependency."""
    try:
        from .edit import edit
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "libcst":
            raise
        raise ImportError(
            "jaxshard.annotate writes contracts into source files with libcst, which "
            "is not installed: pip install 'jaxshard[annotate]'."
        ) from None
    return edit


def _text(source: bytes) -> str:
    return source.decode("utf-8")  # a byte-order mark stays, as "\ufeff"


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return _text(f.read())
    except (OSError, UnicodeDecodeError):
        return None


def _unified(change: Change) -> str:
    """`change` as `git diff` prints it (without its `diff --git` line), lines kept
    with their own endings, a last line without one marked so."""
    name = relative(change.path).replace(os.sep, "/")
    before, after = (name, name) if os.path.isabs(name) else (f"a/{name}", f"b/{name}")
    lines = difflib.unified_diff(
        _lines(change.before), _lines(change.after), before, after
    )
    return "".join(
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
        for line in lines
    )


def _lines(text: str) -> list[str]:
    """`text`'s lines with their endings, split at "\\n" only (a form feed or a
    "\\x1c" in a line, which `str.splitlines` splits at, is part of it)."""
    lines = [line + "\n" for line in text.split("\n")]
    lines[-1] = lines[-1][:-1]
    return lines if lines[-1] else lines[:-1]
