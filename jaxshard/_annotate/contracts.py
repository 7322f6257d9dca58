"""What `annotate` asks the writer to write, as source text, and what the writer says
back: a `Contract` per function, the `Import`s its annotations need, and the
annotations it `Kept` or could not write (`Missing`). Plain data: no JAX, no libcst."""

import dataclasses
import os
from collections.abc import Iterable, Mapping
from typing import NamedTuple


class Import(NamedTuple):
    """A name an annotation needs, and where it comes from: `from module import name
    as alias` (`alias` `None` when it is `name`), or `import module` when `name` is
    `None`.

    !!! Example
        `Import("jax.sharding", "PartitionSpec", "P")` is `from jax.sharding import
        PartitionSpec as P`, and binds `P`; `Import("jaxshard")` is `import jaxshard`.
    """

    module: str
    name: str | None = None
    alias: str | None = None

    @property
    def bound(self) -> str:
        """The name the import binds in the module that makes it."""
        if self.alias is not None:
            return self.alias
        return self.name if self.name is not None else self.module.split(".")[0]

    def __str__(self) -> str:
        alias = "" if self.alias is None else f" as {self.alias}"
        if self.name is None:
            return f"import {self.module}{alias}"
        return f"from {self.module} import {self.name}{alias}"


def imports_for(names: Iterable[str]) -> tuple[Import, ...]:
    """Where each name of jaxshard's contracts comes from: `Array` from `jax`, `P` is
    `jax.sharding.PartitionSpec`, and the rest (`Float`, `Int`, `L`, ...) from
    `jaxshard`, whose dtype classes take a partition spec (jaxtyping's do not)."""
    known = {
        "Array": Import("jax", "Array"),
        "P": Import("jax.sharding", "PartitionSpec", "P"),
    }
    return tuple(known.get(name, Import("jaxshard", name)) for name in sorted(names))


@dataclasses.dataclass(frozen=True)
class Contract:
    """The annotations to write on one function (or on the fields of one class), as
    source text.

    **Attributes:**

    - `filename`: the absolute path of the file that defines the function.
    - `qualname`: its `__qualname__` (`"mlp"`, `"Block.__call__"`). A function
        defined inside another (`"f.<locals>.g"`) cannot be written.
    - `lineno`: the line of its `def`, or of its first decorator (a code object's
        `co_firstlineno`): it tells apart definitions of the same name.
    - `params`: parameter name -> its annotation (`'Float[Array, "b d", P("dp",
        None)]'`); for a class, field name -> its annotation.
    - `returns`: the return annotation, or `None` to write none.
    - `imports`: where the names the annotations use come from (`imports_for`).
        Only those the written annotations use are imported.
    - `kind`: `"function"`, or `"class"` for the fields of a dataclass or
        NamedTuple (`qualname` and `lineno` are then the class's).
    """

    filename: str
    qualname: str
    lineno: int
    params: Mapping[str, str]
    returns: str | None = None
    imports: tuple[Import, ...] = ()
    kind: str = "function"

    def what(self, name: str) -> str:
        """How messages name the parameter, field or return value `name`."""
        if self.kind == "class":
            return f"field {name!r}"
        return "the return value" if name == "return" else f"parameter {name!r}"

    @property
    def where(self) -> str:
        """`file:line`, the file relative to the working directory when under it."""
        return f"{relative(self.filename)}:{self.lineno}"


@dataclasses.dataclass(frozen=True)
class Kept:
    """An annotation already in the source that says something else than the
    contract: it is kept as it is, and said (the contract may no longer hold)."""

    contract: Contract
    name: str  # the parameter or field, or "return"
    existing: str
    proposed: str

    def __str__(self) -> str:
        what = self.contract.what(self.name)
        return (
            f"{self.contract.where}: {self.contract.qualname}: {what} keeps its "
            f"annotation {self.existing}; annotate saw {self.proposed}"
        )


@dataclasses.dataclass(frozen=True)
class Missing:
    """A contract, or one annotation of it (`name`: a parameter, or "return"), that
    was not written, and why."""

    contract: Contract
    name: str | None
    reason: str

    def __str__(self) -> str:
        return f"{self.contract.where}: {self.contract.qualname}: {self.reason}"


def relative(filename: str) -> str:
    """`filename` relative to the working directory when under it, else as given."""
    try:
        path = os.path.relpath(filename)
    except ValueError:  # on another drive (Windows)
        return filename
    return filename if path.startswith(os.pardir) else path
