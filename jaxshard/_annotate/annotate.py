"""`jaxshard.annotate`: contracts written for you. A model is traced and compiled on a
mesh as `verify` does, each call of its own functions is observed (`observe`), and
what was seen becomes annotations (`infer`), written into the source as a patch
(`write`)."""

import contextlib
import dataclasses
import importlib
import inspect
import os
import sys
import types
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from jax.sharding import Mesh

from .._annotations.logical import active_rules, using
from .._config import config
from .._errors import expect, expect_callable
from .._verify.report import Report
from .._verify.verify import verify
from .contracts import Contract, imports_for
from .infer import Finding, Function, functions
from .observe import Held, Observer
from .write import Patch, patch


@dataclasses.dataclass(frozen=True)
class Annotations:
    """The contracts `jaxshard.annotate` found.

    **Attributes:**

    - `functions`: each function seen while the model was traced, with the
        annotation of each array parameter and of its return value, as source text.
    - `findings`: the parameters laid out differently in different calls of one
        function (often a bug): they get no layout in their annotation.
    - `notes`: what was left unannotated, and why.
    - `report`: the `verify` report of the run that observed the model.
    """

    functions: tuple[Function, ...]
    findings: tuple[Finding, ...]
    notes: tuple[str, ...]
    report: Report

    def patch(self) -> Patch:
        """The contracts written into the model's files' text: `.diff()`,
        `.write()`, and the annotations already there that were `.kept` or could
        not be written (`.missing`: a function defined inside another, say)."""
        contracts = [
            Contract(
                f.filename,
                f.qualname,
                f.lineno,
                params={k: v for k, v in f.annotations.items() if k != "return"},
                returns=f.annotations.get("return"),
                imports=imports_for(f.names),
                kind=f.kind,
            )
            for f in self.functions
        ]
        return patch(contracts)

    def diff(self) -> str:
        """A unified diff against the model's files adding the contracts: apply it
        with `git apply` (or `patch -p1`), or call `write()`."""
        return self.patch().diff()

    def write(self) -> list[str]:
        """Writes the contracts into the model's files (each file whole or not at
        all); returns the files changed."""
        return self.patch().write()

    def __str__(self) -> str:
        count = sum(len(f.annotations) for f in self.functions)
        classes = sum(f.kind == "class" for f in self.functions)
        of = f"{len(self.functions) - classes} functions"
        if classes:
            of += f" and {classes} classes"
        lines = [
            f"jaxshard.annotate: {count} annotations in {of} of "
            f"{len({f.filename for f in self.functions})} files."
        ]
        if self.findings:
            lines.append("Laid out differently in different calls (no layout written):")
            lines += [f"  {finding}" for finding in self.findings]
        lines += self.notes
        return "\n".join(lines)


def annotate(
    fn: Callable,
    *,
    mesh: Any,
    values: Mapping[str, Any] | None = None,
    dims: Mapping[str, Any] | None = None,
    dtypes: Any = None,
    rules: Any = None,
    modules: Iterable[Any] | None = None,
) -> Annotations:
    """Observes `fn` traced and compiled on `mesh` and writes the contracts of every
    function of its package that it calls: the shape, dtype and layout of each array
    each takes and returns.

    `fn` is traced and compiled as `jaxshard.verify` does, and each call of every
    Python function defined in the files of `fn`'s package (or of `modules`) made
    while tracing is observed: on Explicit axes each array's layout is its type's,
    on Auto axes the one XLA gave it. A function seen with an array laid out
    differently in different calls is a finding (often the bug), and that
    parameter's annotation says no layout.

    **Arguments:**

    - `fn`: the function (a training step, a model's forward pass; jitted or not).
    - `mesh`: the mesh, as `verify` takes it (simulated CPU devices, or
        `jaxshard.tpu_mesh(...)`).
    - `values`, `dims`, `dtypes`: `fn`'s arguments, as `verify` takes them: `values`
        by parameter name (arrays, `jax.ShapeDtypeStruct`s with shardings, Python
        values), `dims` and `dtypes` for annotated parameters. A size named in
        `dims` is written with that name.
    - `rules`: an axis-rule table: layouts that it maps back to one logical name
        per dimension are written as `L(...)`. By default the rules in force.
    - `modules`: the modules (or their names) whose functions to annotate; by
        default those of `fn`'s package.

    **Returns:**

    An `Annotations`: `.diff()` (a unified diff adding the contracts), `.write()`,
    `.findings`, `.functions`.
    """
    expect_callable("annotate", fn)
    concrete = "a concrete jax.sharding.Mesh (from jaxshard.tpu_mesh or jax.make_mesh)"
    expect(isinstance(mesh, Mesh), "annotate", "mesh", concrete, mesh)
    for name, given in (("dims", dims), ("values", values)):
        expect(given is None or isinstance(given, Mapping), "annotate", name,
               "a dict", given)  # fmt: skip
    files = _files(fn, modules)
    observer = Observer(files)
    with using(rules) if rules is not None else contextlib.nullcontext():
        table = active_rules()
        # Not from verify's cache: what annotate reads is seen while compiling.
        with observer, config(cache_dir=None):
            report = verify(
                fn,
                mesh=mesh,
                values=values,
                dims=dims,
                dtypes=dtypes,
                raise_on_error=False,
            )
    found, findings = functions(observer.seen, _sizes(dims), table, observer.held)
    notes = _notes(observer.trees, observer.blocks, observer.held)
    annotations = Annotations(tuple(found), tuple(findings), notes, report)
    if findings:
        warnings.warn(
            "jaxshard.annotate: laid out differently in different calls (no layout "
            "written): " + "; ".join(map(str, findings)),
            stacklevel=2,
        )
    return annotations


def _sizes(dims: Mapping[str, Any] | None) -> dict[str, int]:
    return {k: v for k, v in (dims or {}).items() if isinstance(v, int)}


def _files(fn: Callable, modules: Iterable[Any] | None) -> set[str]:
    """The source files whose functions are observed: those of `modules`, or of
    `fn`'s package (its module's file alone, outside a package)."""
    if modules is None:
        module = sys.modules.get(getattr(_unwrapped(fn), "__module__", "") or "")
        if module is None:
            raise ValueError(
                f"jaxshard.annotate: cannot tell which module defines {fn!r}; pass "
                "modules=[...] (the modules whose functions to annotate)."
            )
        top = module.__name__.split(".")[0]
        modules = [sys.modules.get(top, module) if top != "__main__" else module]
    files = set()
    for module in modules:
        if isinstance(module, str):
            module = sys.modules.get(module) or _imported(module)
        kind = isinstance(module, types.ModuleType)
        expect(kind, "annotate", "modules", "modules or their names", module)
        files |= _module_files(module)
    return files


def _imported(name: str) -> types.ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        raise ValueError(
            f"jaxshard.annotate: modules names {name!r}, which cannot be imported "
            f"({e}). Pass the modules whose functions to annotate, or their names."
        ) from None


def _module_files(module: types.ModuleType) -> set[str]:
    """A module's file, or every Python file of a package."""
    paths = getattr(module, "__path__", None)
    if paths is None:
        file = getattr(module, "__file__", None)
        return {os.path.abspath(file)} if file else set()
    found = set()
    for root in paths:
        for folder, _, names in os.walk(root):
            found |= {
                os.path.abspath(os.path.join(folder, n))
                for n in names
                if n.endswith(".py")
            }
    return found


def _unwrapped(fn: Callable) -> Any:
    """The function `fn` wraps (a jit, `checked`, `nnx.jit`, a bound method's)."""
    fn = getattr(fn, "__func__", fn)
    return inspect.unwrap(fn) if callable(fn) else fn


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _notes(trees: dict, blocks: dict, held: list[Held]) -> tuple[str, ...]:
    """What the report says of the parameters left unannotated."""
    notes = ()
    unnamed = {(h.qualname, h.name): None for h in held if h.type is None}
    if unnamed:
        listed = ", ".join(f"{function}: {name!r}" for function, name in unnamed)
        notes += (
            f"{_count(len(unnamed), 'parameter holds', 'parameters hold')} "
            "instances of the model's classes whose fields were annotated, but "
            f"were given no type ({listed}): their modules do not name the class. "
            "Annotate each with its class for jaxtyped to check its fields.",
        )
    if blocks:
        notes += (
            f"{_count(len(blocks), 'function', 'functions')} took blocks inside a "
            "shard_map body "
            f"({', '.join(list(blocks)[:6])}), whose arrays got no annotation: an "
            "annotation there describes the whole array a block is part of, which "
            "annotate does not tell.",
        )
    skipped = [f"{function}: {name!r}" for function, name in trees if name != "self"]
    if not skipped:
        return notes
    more = f" and {len(skipped) - 6} more" if len(skipped) > 6 else ""
    listed = ", ".join(skipped[:6]) + more
    holds = _count(
        len(skipped), "parameter or field holds", "parameters or fields hold"
    )
    return notes + (
        f"{holds} pytrees of arrays, not annotated "
        f"({listed}): only the fields of the model's own dataclasses and "
        "NamedTuples are annotated. Hold the arrays in one, or check them with "
        "jaxshard.check_tree.",
    )
