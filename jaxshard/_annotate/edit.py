"""One file's source with its contracts written in: each function found by its
qualified name (and line, where names repeat), its unannotated parameters and return
value annotated, `@jaxshard.jaxtyped(typechecker=beartype)` directly above its `def`;
each class's fields annotated; and the imports the written annotations need. An
annotation that says only "an array" (`jax.Array`, `jnp.ndarray`) is made precise;
any other is kept.

libcst gives back the code it did not change byte for byte; a signature made longer
than a line is laid out as ruff lays it out, one parameter a line.
"""

import ast
import dataclasses
from collections.abc import Iterator, Sequence

import libcst as cst
from libcst.metadata import ClassScope, MetadataWrapper, PositionProvider, ScopeProvider

from .contracts import Contract, Import, Kept, Missing, relative
from .imports import add_imports, LINE_LENGTH, Naming, Unnameable
from .layout import code, has_comment, one_per_line, width


# The decorator that checks a function's annotations, and what it needs imported.
JAXTYPED = "jaxshard.jaxtyped(typechecker=beartype)"
JAXTYPED_IMPORTS = (Import("jaxshard"), Import("beartype", "beartype"))
# Decorators that already check the annotations of the function they decorate.
_CHECKERS = frozenset({"jaxtyped", "beartype"})
# Annotations that say no more than "a JAX array": a contract takes their place.
_VAGUE = frozenset({"Array", "jax.Array", "jnp.ndarray", "jax.numpy.ndarray"})
_OPTIONAL = frozenset({"Optional", "typing.Optional"})


@dataclasses.dataclass
class Edited:
    """A file's source with its contracts written, and what was not written."""

    source: bytes
    kept: list[Kept]
    missing: list[Missing]


def edit(source: bytes, contracts: Sequence[Contract]) -> Edited:
    """`source` (a file's bytes) with `contracts` written into it."""
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError as e:
        reason = f"its file does not parse (line {e.raw_line}: {e.message})"
        return Edited(source, [], [Missing(c, None, reason) for c in contracts])
    if module.encoding.lower().replace("_", "-") not in ("utf-8", "utf-8-sig"):
        reason = f"its file is encoded in {module.encoding}: only UTF-8 is written"
        return Edited(source, [], [Missing(c, None, reason) for c in contracts])
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    found, missing = _locate(wrapper, contracts)
    writer = _Writer(found, wrapper.resolve(ScopeProvider), module.default_indent)
    written = module.visit(writer)
    written = add_imports(written, writer.imports)
    return Edited(written.bytes, writer.kept, missing + writer.missing)


Definition = cst.FunctionDef | cst.ClassDef


def _locate(
    wrapper: MetadataWrapper, contracts: Sequence[Contract]
) -> tuple[dict[Definition, list[Contract]], list[Missing]]:
    """The `def` (or `class`) of each contract, and the contracts whose `def` is
    not there."""
    positions = wrapper.resolve(PositionProvider)
    defs: dict[tuple[str, type], list[Definition]] = {}
    for qualname, node in _definitions(wrapper.module, ""):
        defs.setdefault((qualname, type(node)), []).append(node)
    found: dict[Definition, list[Contract]] = {}
    missing = []
    for contract in contracts:
        kind = cst.ClassDef if contract.kind == "class" else cst.FunctionDef
        nodes = defs.get((contract.qualname, kind), [])
        node, reason = _pick(nodes, contract, positions)
        if node is None:
            missing.append(Missing(contract, None, reason))
        else:
            found.setdefault(node, []).append(contract)
    return found, missing


def _definitions(node: cst.CSTNode, prefix: str) -> Iterator[tuple[str, Definition]]:
    """Each function and class defined at module level or in a class (at any depth,
    and in `if`, `try`, ... blocks), with its qualified name; not those in
    functions."""
    for child in node.children:
        if isinstance(child, cst.FunctionDef):
            yield prefix + child.name.value, child
        elif isinstance(child, cst.ClassDef):
            yield prefix + child.name.value, child
            yield from _definitions(child.body, f"{prefix}{child.name.value}.")
        elif not isinstance(child, cst.BaseExpression):  # no def is in one
            yield from _definitions(child, prefix)


def _pick(
    nodes: list[Definition], contract: Contract, positions
) -> tuple[Definition | None, str]:
    """The `def` (or `class`) that `contract` is about, or `None` and why none is."""
    if "<locals>" in contract.qualname.split("."):
        return None, (
            "it is defined inside another function, whose annotations are not "
            "written (only functions of modules and methods of classes are)"
        )
    if not nodes:
        what = "class" if contract.kind == "class" else "def"
        return None, f"{relative(contract.filename)} has no {what} of that name"
    if len(nodes) > 1:

        def spans(node: Definition) -> bool:
            first = node.decorators[0] if node.decorators else node
            start = positions[first].start.line
            return start <= contract.lineno <= positions[node.name].start.line

        at = [node for node in nodes if spans(node)]
        if len(at) != 1:
            lines = ", ".join(str(positions[n.name].start.line) for n in nodes)
            return None, (
                f"{relative(contract.filename)} defines it {len(nodes)} times (lines "
                f"{lines}), and {'none' if not at else 'several'} at line "
                f"{contract.lineno}"
            )
        nodes = at
    if isinstance(nodes[0], cst.FunctionDef) and nodes[0].asynchronous is not None:
        return None, "it is an async def, left as it is"
    return nodes[0], ""


class _Writer(cst.CSTTransformer):
    """Writes the contracts of each `def` in `found`, collecting the imports the
    written annotations need, the annotations kept and those not written."""

    def __init__(self, found: dict, scopes, indent: str):
        super().__init__()
        self.found, self.scopes, self.indent = found, scopes, indent
        self.blocks: list[str] = []  # the indentation of each enclosing block
        self.imports: set[Import] = set()
        self.kept: list[Kept] = []
        self.missing: list[Missing] = []

    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> None:
        self.blocks.append(self.indent if node.indent is None else node.indent)

    def leave_IndentedBlock(
        self, original: cst.IndentedBlock, updated: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        self.blocks.pop()
        return updated

    def leave_FunctionDef(
        self, original: cst.FunctionDef, updated: cst.FunctionDef
    ) -> cst.FunctionDef:
        contracts = self.found.get(original, ())
        if not contracts:
            return updated
        scope = self.scopes[original]
        method = isinstance(scope, ClassScope) and not _decorated(
            original, "staticmethod"
        )
        changed = False
        for contract in contracts:
            naming = Naming(scope, (*contract.imports, *JAXTYPED_IMPORTS))
            updated, added = self._annotated(updated, contract, naming, method)
            changed |= added
            updated = self._decorated(updated, contract, naming)
        if changed and width(updated, "".join(self.blocks)) > LINE_LENGTH:
            if not has_comment(updated.whitespace_before_params, updated.params):
                updated = one_per_line(updated, self.indent)
        return updated

    def _annotated(
        self, node: cst.FunctionDef, contract: Contract, naming: Naming, method: bool
    ) -> tuple[cst.FunctionDef, bool]:
        """`node` with the annotations of `contract` where it has none; and whether
        any was written."""
        params = node.params
        implicit = [*params.posonly_params, *params.params][:1] if method else []
        added = False
        for name, text in contract.params.items():
            param, reason = _param(params, name, implicit)
            if param is None:
                self.missing.append(Missing(contract, name, reason))
                continue
            text = _or_none(text, param.default, param.annotation)
            annotation = self._annotation(
                contract, name, text, param.annotation, naming
            )
            if annotation is not None:
                params = _with_param(params, _annotate(param, annotation))
                added = True
        node = node.with_changes(params=params)
        if contract.returns is not None:
            annotation = self._annotation(
                contract, "return", contract.returns, node.returns, naming
            )
            if annotation is not None:
                node, added = node.with_changes(returns=annotation), True
        return node, added

    def _annotation(
        self,
        contract: Contract,
        name: str,
        text: str,
        existing: cst.Annotation | None,
        naming: Naming,
    ) -> cst.Annotation | None:
        """The annotation to write, or `None` where there is one already (reported
        if it says something else) or it cannot be written (reported)."""
        try:
            expression, needed = naming.expression(text)
        except Unnameable as e:
            self.missing.append(Missing(contract, name, f"{contract.what(name)}: {e}"))
            return None
        if existing is not None and not _vague(code(existing.annotation)):
            proposed = code(expression)
            if not _same(code(existing.annotation), proposed):
                self.kept.append(
                    Kept(contract, name, code(existing.annotation), proposed)
                )
            return None
        self.imports |= needed
        if existing is not None:  # "an array", made precise where it stands
            return existing.with_changes(annotation=expression)
        return cst.Annotation(annotation=expression)

    def leave_ClassDef(
        self, original: cst.ClassDef, updated: cst.ClassDef
    ) -> cst.ClassDef:
        """A dataclass's or NamedTuple's field annotations written (`name: T` in
        its body), where they say no more than "an array"."""
        contracts = [c for c in self.found.get(original, ()) if c.kind == "class"]
        if not contracts or not isinstance(updated.body, cst.IndentedBlock):
            return updated
        body = list(updated.body.body)
        for contract in contracts:
            left = dict(contract.params)
            for i, line in enumerate(original.body.body):
                name, field = _field(line)
                if field is None or name not in left:
                    continue
                naming = Naming(self.scopes[field], contract.imports)
                text = _or_none(left.pop(name), field.value, field.annotation)
                annotation = self._annotation(
                    contract, name, text, field.annotation, naming
                )
                if annotation is not None:
                    new = cst.ensure_type(body[i], cst.SimpleStatementLine)
                    assign = cst.ensure_type(new.body[0], cst.AnnAssign)
                    assign = assign.with_changes(annotation=annotation)
                    body[i] = new.with_changes(body=[assign])
            for name in left:
                reason = f"field {name!r} is not declared in its class's body"
                self.missing.append(Missing(contract, name, reason))
        return updated.with_changes(body=updated.body.with_changes(body=body))

    def _decorated(
        self, node: cst.FunctionDef, contract: Contract, naming: Naming
    ) -> cst.FunctionDef:
        """`node` with `@jaxshard.jaxtyped(typechecker=beartype)` directly above its
        `def`, unless a checker decorates it already or it has no annotations."""
        params = node.params
        every = [*params.posonly_params, *params.params, *params.kwonly_params]
        annotated = node.returns is not None or any(p.annotation for p in every)
        if not annotated or any(_checker(d) for d in node.decorators):
            return node
        try:
            expression, needed = naming.expression(JAXTYPED)
        except Unnameable as e:
            reason = f"no @{JAXTYPED} written: {e}"
            self.missing.append(Missing(contract, None, reason))
            return node
        self.imports |= needed
        decorator = cst.Decorator(decorator=expression)
        return node.with_changes(decorators=[*node.decorators, decorator])


def _param(
    params: cst.Parameters, name: str, implicit: list[cst.Param]
) -> tuple[cst.Param | None, str]:
    """The parameter `name` if it may be annotated, else `None` and why not."""
    for param in (*params.posonly_params, *params.params, *params.kwonly_params):
        if param.name.value == name:
            if any(param is p for p in implicit):
                return None, f"parameter {name!r} is the method's own, never annotated"
            return param, ""
    for star, param in (("*", params.star_arg), ("**", params.star_kwarg)):
        if isinstance(param, cst.Param) and param.name.value == name:
            return None, f"parameter {star}{name} is never annotated"
    return None, f"it has no parameter {name!r}"


def _or_none(
    text: str, default: cst.BaseExpression | None, existing: cst.Annotation | None
) -> str:
    """The annotation `text`, or `text | None` where `None` is allowed too: the
    default is `None` (`mask=None`), or the annotation there says "or None"."""
    if text.replace(" ", "").endswith("|None"):
        return text
    none = isinstance(default, cst.Name) and default.value == "None"
    if none or (existing is not None and _vague(code(existing.annotation), True)):
        return f"{text} | None"
    return text


def _annotate(param: cst.Param, annotation: cst.Annotation) -> cst.Param:
    """`x=1` is `x: T = 1` once annotated, as PEP 8 writes it."""
    equal = param.equal
    if param.default is not None:
        space = cst.SimpleWhitespace(" ")
        equal = cst.AssignEqual(whitespace_before=space, whitespace_after=space)
    return param.with_changes(annotation=annotation, equal=equal)


def _with_param(params: cst.Parameters, new: cst.Param) -> cst.Parameters:
    """`params` with the parameter named as `new` replaced by it."""

    def swap(param: cst.Param) -> cst.Param:
        return new if param.name.value == new.name.value else param

    return params.with_changes(
        posonly_params=[swap(p) for p in params.posonly_params],
        params=[swap(p) for p in params.params],
        kwonly_params=[swap(p) for p in params.kwonly_params],
    )


def _field(line: cst.CSTNode) -> tuple[str, cst.AnnAssign | None]:
    """The name and statement of the field a line of a class's body declares
    (`name: T` or `name: T = v`), or `("", None)`."""
    if isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1:
        statement = line.body[0]
        if isinstance(statement, cst.AnnAssign):
            if isinstance(statement.target, cst.Name):
                return statement.target.value, statement
    return "", None


def _vague(annotation: str, optional: bool = False) -> bool:
    """Whether an annotation says only "a JAX array" (or that, or `None`); with
    `optional`, only "a JAX array, or `None`"."""
    node = _expression(annotation)
    if node is None:
        return False
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        arms = [ast.unparse(node.left), ast.unparse(node.right)]
        return "None" in arms and any(a in _VAGUE for a in arms)
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) in _OPTIONAL:
        return ast.unparse(node.slice) in _VAGUE
    return not optional and ast.unparse(node) in _VAGUE


def _decorated(node: cst.FunctionDef, name: str) -> bool:
    return any(_decorator_name(d) == name for d in node.decorators)


def _checker(decorator: cst.Decorator) -> bool:
    """`@jaxtyped(...)`, `@jaxshard.jaxtyped(...)`, `@beartype`, ...: a decorator
    that checks annotations already."""
    return _decorator_name(decorator) in _CHECKERS


def _decorator_name(decorator: cst.Decorator) -> str | None:
    """The last name of a decorator, called or not (`jaxtyped` of
    `@jt.jaxtyped(typechecker=beartype)`)."""
    expression = decorator.decorator
    if isinstance(expression, cst.Call):
        expression = expression.func
    if isinstance(expression, cst.Attribute):
        return expression.attr.value
    return expression.value if isinstance(expression, cst.Name) else None


def _same(existing: str, proposed: str) -> bool:
    """Whether two annotations are the same expression, however spaced or quoted
    (a string annotation is the expression it holds)."""

    def tree(text: str) -> str:
        node = _expression(text)
        return text if node is None else ast.dump(node)

    return tree(existing) == tree(proposed)


def _expression(annotation: str) -> ast.expr | None:
    """The expression an annotation's source is (a string annotation's, the one it
    holds), or `None` if it does not parse."""
    try:
        node = ast.parse(annotation.strip(), mode="eval").body
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node = ast.parse(node.value.strip(), mode="eval").body
    except SyntaxError:
        return None
    return node
