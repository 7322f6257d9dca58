"""Importing the file of a `path/to/model.py:forward` target as Python would run it."""

import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

from .._errors import did_you_mean


def import_file(path: str) -> ModuleType:
    """The module in the file `path`, importable as `python path` would make it.

    A file in a package (its folder, and each one above up to the package's root,
    has an `__init__.py`) is imported as that package's module, `pkg.model`, with
    the folder above the package first on `sys.path`: its relative imports
    (`from .layers import X`) work, as `src/pkg/model.py` in a src layout. Any
    other file is imported under its own name with its folder first on `sys.path`,
    as `python path` puts it: its imports of the modules beside it work. Whatever
    the module raises propagates."""
    folder, file = os.path.split(os.path.abspath(path))
    parts = [os.path.splitext(file)[0]]
    while os.path.isfile(os.path.join(folder, "__init__.py")):
        folder, package = os.path.split(folder)
        parts.insert(0, package)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    if len(parts) > 1:
        return importlib.import_module(
            ".".join(parts[:-1] if file == "__init__.py" else parts)
        )
    name = parts[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # pyright: ignore
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)  # pyright: ignore
    except BaseException:
        del sys.modules[name]
        raise
    return module


def attribute(module: ModuleType, module_name: str, attr: str) -> Any:
    """`module.<attr>`, `attr` dotted (`Model.apply`); a `ValueError` naming the
    part that is missing, and what it is missing from, with a suggestion for a
    misspelling."""
    obj = module
    parts = attr.split(".")
    for i, part in enumerate(parts):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            owner = f"module {module_name!r}"
            if i:
                owner = repr(f"{module_name}:{'.'.join(parts[:i])}")
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise ValueError(
                f"{owner} has no attribute {part!r}.{did_you_mean(part, names)}"
            ) from None
    return obj
