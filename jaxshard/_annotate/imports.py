"""The names written annotations use: how each is spelled in the scope of the function
it is written on, and the imports added for them, once per file.

A name the scope already binds to the same thing is used as it is. A free name is
imported. A name the scope binds to something else (`P` a parameter dict, `Float`
jaxtyping's) is written qualified instead, `jax.sharding.PartitionSpec(...)`, so that
nothing of the module changes meaning; where the module's own name is taken too, the
annotation is not written (`Unnameable` says why).
"""

from collections.abc import Iterable, Sequence

import libcst as cst
from libcst.helpers import get_full_name_for_node
from libcst.metadata import BuiltinAssignment, Scope

from .contracts import Import


LINE_LENGTH = 88  # ruff's and black's


class Unnameable(Exception):
    """An annotation that cannot be written in its scope; the message says why."""


class Naming:
    """How annotations spell the names of `imports` in `scope`: `expression(text)`
    is the annotation to write, and the imports it needs."""

    def __init__(self, scope: Scope, imports: Iterable[Import]):
        self.scope = scope
        self.imports = {imp.bound: _plain(imp) for imp in imports}

    def expression(self, text: str) -> tuple[cst.BaseExpression, set[Import]]:
        """The annotation `text` as written in this scope, and the imports to add
        for it. Raises `Unnameable` if it does not parse or a name cannot be made."""
        try:
            expression = cst.parse_expression(text)
        except cst.ParserSyntaxError:
            raise Unnameable(f"{text!r} is not a Python expression") from None
        renamer = _Renamer(self)
        written = expression.visit(renamer)
        assert isinstance(written, cst.BaseExpression)
        return written, renamer.needed

    def spelled(self, name: str) -> tuple[str | None, set[Import]]:
        """How `name` is written here (`None`: as it is), and the imports it needs."""
        imp = self.imports.get(name)
        if imp is None:
            return None, set()
        status = _status(self.scope, imp)
        if status == "present":
            return None, set()
        if status == "free":
            return None, {imp}
        owner = Import(imp.module)
        if imp.name is None or _status(self.scope, owner) == "taken":
            raise Unnameable(
                f"cannot write `{name}` ({_origin(imp)}): this module binds `{name}` "
                f"and `{owner.bound}` to other things"
            )
        needed = set() if _status(self.scope, owner) == "present" else {owner}
        return f"{imp.module}.{imp.name}", needed


class _Renamer(cst.CSTTransformer):
    """Writes each name an expression loads as its scope spells it (not attribute
    names, nor keywords of calls), collecting the imports needed."""

    def __init__(self, naming: Naming):
        super().__init__()
        self.naming = naming
        self.needed: set[Import] = set()
        self._not_loads: set[int] = set()

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self._not_loads.add(id(node.attr))

    def visit_Arg(self, node: cst.Arg) -> None:
        if node.keyword is not None:
            self._not_loads.add(id(node.keyword))

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.BaseExpression:
        if id(original) in self._not_loads:
            return updated
        spelled, needed = self.naming.spelled(original.value)
        self.needed |= needed
        return updated if spelled is None else cst.parse_expression(spelled)


def _status(scope: Scope, imp: Import) -> str:
    """Whether `scope` binds `imp.bound` to exactly `imp` ("present"), to nothing
    else that matters ("free": unbound, a builtin, or another module of the same
    package for `import a.b`), or to something else ("taken")."""
    name = imp.bound
    if name not in scope:
        return "free"
    made = [
        _import_of(a.node, name)
        for a in scope[name]
        if not isinstance(a, BuiltinAssignment)
    ]
    if not made:
        return "free"
    if all(m == imp for m in made):
        return "present"
    if all(_same_package(m, imp) for m in made):
        return "present" if imp in made else "free"
    return "taken"


def _same_package(made: Import | None, imp: Import) -> bool:
    """`import a.b` and `import a.c` both bind `a`, to the same module."""
    plain = imp.name is None and imp.alias is None
    return plain and made is not None and made.name is None and made.alias is None


def _import_of(node: cst.CSTNode, name: str) -> Import | None:
    """The import by which statement `node` binds `name`, or `None` (not an import:
    an assignment, a def, a relative or star import)."""
    if isinstance(node, cst.Import):
        for alias in node.names:
            module = get_full_name_for_node(alias.name) or ""
            asname = _asname(alias)
            if (asname or module.split(".")[0]) == name:
                return Import(module, None, asname)
    if isinstance(node, cst.ImportFrom) and not node.relative and node.module:
        if isinstance(node.names, cst.ImportStar):
            return None
        module = get_full_name_for_node(node.module) or ""
        for alias in node.names:
            imported = get_full_name_for_node(alias.name) or ""
            if (_asname(alias) or imported) == name:
                return _plain(Import(module, imported, _asname(alias)))
    return None


def _asname(alias: cst.ImportAlias) -> str | None:
    if alias.asname is None or not isinstance(alias.asname.name, cst.Name):
        return None
    return alias.asname.name.value


def _plain(imp: Import) -> Import:
    """`from m import n as n` is `from m import n`."""
    return imp._replace(alias=None) if imp.alias == imp.name else imp


def _origin(imp: Import) -> str:
    return imp.module if imp.name is None else f"{imp.module}.{imp.name}"


def add_imports(module: cst.Module, needed: Iterable[Import]) -> cst.Module:
    """`module` with `needed` imported: each name of a `from m import ...` already
    among the module's top-level statements joins it, the others are new statements
    after the module's opening imports (after its docstring and `from __future__`)."""
    needed = sorted(dict.fromkeys(_plain(imp) for imp in needed), key=_order)
    if not needed:
        return module
    body = list(module.body)
    new = []
    indent = module.default_indent
    for group in _by_statement(needed):
        index = _statement_of(body, group[0])
        if index is None:
            new.append(_wrapped(_statement(group), indent))
        else:
            body[index] = _wrapped(_joined(body[index], group), indent)
    at = _insertion(body)
    if new and not any(_is_import(s) for s in body[:at]):  # the module's first
        if at == 1:  # after the docstring
            new[0] = new[0].with_changes(leading_lines=[cst.EmptyLine()])
        if at < len(body):
            body[at] = _spaced(body[at])
    return module.with_changes(body=[*body[:at], *new, *body[at:]])


def _spaced(statement: cst.CSTNode) -> cst.CSTNode:
    """`statement` two blank lines below the imports before it (ruff's isort's
    `lines-after-imports`)."""
    lines = list(getattr(statement, "leading_lines", None) or ())
    blank = next((i for i, line in enumerate(lines) if line.comment), len(lines))
    more = [cst.EmptyLine()] * max(0, 2 - blank)
    return statement.with_changes(leading_lines=[*more, *lines])


def _order(imp: Import) -> tuple:
    """`import m` first, then `from m import n`, each by module (isort's order)."""
    return (imp.name is not None, imp.module, imp.name or "", imp.alias or "")


def _by_statement(needed: Sequence[Import]) -> list[list[Import]]:
    """One group per statement: each `import m`, and each module's from-imports."""
    groups: list[list[Import]] = []
    for imp in needed:
        if groups and imp.name is not None and groups[-1][0].module == imp.module:
            groups[-1].append(imp)
        else:
            groups.append([imp])
    return groups


def _statement_of(body: Sequence[cst.CSTNode], imp: Import) -> int | None:
    """The index of the top-level `from imp.module import ...` that more names can
    join (not a star import, not one sharing its line with other statements)."""
    if imp.name is None:
        return None
    for index, statement in enumerate(body):
        if not isinstance(statement, cst.SimpleStatementLine):
            continue
        if len(statement.body) != 1:
            continue
        node = statement.body[0]
        if (
            isinstance(node, cst.ImportFrom)
            and not node.relative
            and node.module is not None
            and get_full_name_for_node(node.module) == imp.module
            and not isinstance(node.names, cst.ImportStar)
        ):
            return index
    return None


def _statement(group: Sequence[Import]) -> cst.SimpleStatementLine:
    text = str(group[0])
    if group[0].name is not None:
        names = ", ".join(str(imp).split(" import ", 1)[1] for imp in group)
        text = f"from {group[0].module} import {names}"
    statement = cst.parse_statement(text + "\n")
    assert isinstance(statement, cst.SimpleStatementLine)
    return statement


def _joined(
    statement: cst.SimpleStatementLine, group: Sequence[Import]
) -> cst.SimpleStatementLine:
    """`from m import a, b` with the names of `group` after its own, in its style
    (one line, or one name a line in parentheses)."""
    node = statement.body[0]
    assert isinstance(node, cst.ImportFrom) and not isinstance(
        node.names, cst.ImportStar
    )
    names = list(node.names)
    between = names[-2].comma if len(names) > 1 else names[-1].comma
    if not isinstance(between, cst.Comma) or len(names) == 1 and node.lpar is None:
        between = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    last = names[-1].comma
    names[-1] = names[-1].with_changes(comma=between)
    for imp in group:
        asname = None if imp.alias is None else cst.AsName(name=cst.Name(imp.alias))
        assert imp.name is not None
        alias = cst.ImportAlias(name=cst.Name(imp.name), asname=asname, comma=between)
        names.append(alias)
    names[-1] = names[-1].with_changes(comma=last)
    return statement.with_changes(body=[node.with_changes(names=names)])


def _wrapped(
    statement: cst.SimpleStatementLine, indent: str
) -> cst.SimpleStatementLine:
    """A from-import longer than a line, as ruff writes it: its names in
    parentheses, one a line (indented by `indent`), each with a comma."""
    node = statement.body[0]
    if not isinstance(node, cst.ImportFrom) or node.lpar is not None:
        return statement
    if isinstance(node.names, cst.ImportStar):
        return statement
    code = cst.Module(body=[statement.with_changes(leading_lines=[])]).code
    if len(code.rstrip("\n").expandtabs(4)) <= LINE_LENGTH:
        return statement
    names = [
        alias.with_changes(comma=cst.Comma(whitespace_after=_newline(indent)))
        for alias in node.names
    ]
    names[-1] = names[-1].with_changes(comma=cst.Comma(whitespace_after=_newline("")))
    wrapped = node.with_changes(
        names=names,
        lpar=cst.LeftParen(whitespace_after=_newline(indent)),
        rpar=cst.RightParen(),
    )
    return statement.with_changes(body=[wrapped])


def _newline(indent: str) -> cst.ParenthesizedWhitespace:
    """A line break inside brackets, the next line indented by `indent` more than
    the statement."""
    return cst.ParenthesizedWhitespace(
        first_line=cst.TrailingWhitespace(),
        empty_lines=[],
        indent=True,
        last_line=cst.SimpleWhitespace(indent),
    )


def _insertion(body: Sequence[cst.CSTNode]) -> int:
    """Where new imports go: after the last import of the module's opening
    statements (its docstring, imports, and `if`/`try` blocks among them)."""
    at = 0
    for index, statement in enumerate(body):
        if _is_import(statement):
            at = index + 1
        elif index == 0 and _is_docstring(statement):
            at = 1
        elif not isinstance(statement, (cst.If, cst.Try, cst.TryStar)):
            break
    return at


def _is_import(statement: cst.CSTNode) -> bool:
    return isinstance(statement, cst.SimpleStatementLine) and all(
        isinstance(s, (cst.Import, cst.ImportFrom)) for s in statement.body
    )


def _is_docstring(statement: cst.CSTNode) -> bool:
    return (
        isinstance(statement, cst.SimpleStatementLine)
        and len(statement.body) == 1
        and isinstance(statement.body[0], cst.Expr)
        and isinstance(
            statement.body[0].value, (cst.SimpleString, cst.ConcatenatedString)
        )
    )
