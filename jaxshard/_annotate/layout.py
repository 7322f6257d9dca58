"""A signature made longer than a line by its annotations, laid out as ruff lays it
out: one parameter a line, each with a comma (unless a comment in it says the author
laid it out by hand)."""

import libcst as cst


def code(node: cst.CSTNode) -> str:
    """The source of `node`."""
    return cst.Module(body=[]).code_for_node(node)


def has_comment(*nodes: cst.CSTNode) -> bool:
    return any(
        isinstance(node, cst.Comment) or has_comment(*node.children) for node in nodes
    )


def width(node: cst.FunctionDef, prefix: str) -> int:
    """The widest line of `node`'s signature, from `def` to its colon, indented by
    `prefix` (tabs count 4)."""
    body = cst.SimpleStatementSuite(body=[cst.Expr(cst.Ellipsis())])
    header = node.with_changes(
        decorators=[], leading_lines=[], lines_after_decorators=[], body=body
    )
    text = code(header).rstrip("\n").removesuffix(" ...")
    return max(len((prefix + line).expandtabs(4)) for line in text.split("\n"))


def one_per_line(node: cst.FunctionDef, indent: str) -> cst.FunctionDef:
    """`node`'s signature as ruff lays out one too long for a line: each parameter
    on its own line (indented by `indent` more than the `def`), with a comma."""
    params = node.params
    if not _elements(params):
        return node

    def newline(last: str) -> cst.ParenthesizedWhitespace:
        return cst.ParenthesizedWhitespace(
            first_line=cst.TrailingWhitespace(),
            empty_lines=[],
            indent=True,
            last_line=cst.SimpleWhitespace(last),
        )

    count = len(_elements(params))
    commas = iter(
        cst.Comma(whitespace_after=newline(indent if i < count - 1 else ""))
        for i in range(count)
    )

    def laid(element):
        if element is None or isinstance(element, cst.MaybeSentinel):
            return element
        if isinstance(element, cst.Param):
            none = cst.SimpleWhitespace("")
            return element.with_changes(comma=next(commas), whitespace_after_param=none)
        if isinstance(element, cst.ParamSlash):
            none = cst.SimpleWhitespace("")
            return element.with_changes(comma=next(commas), whitespace_after=none)
        return element.with_changes(comma=next(commas))  # a bare `*`

    laid_out = params.with_changes(
        posonly_params=[laid(p) for p in params.posonly_params],
        posonly_ind=laid(params.posonly_ind),
        params=[laid(p) for p in params.params],
        star_arg=laid(params.star_arg),
        kwonly_params=[laid(p) for p in params.kwonly_params],
        star_kwarg=laid(params.star_kwarg),
    )
    return node.with_changes(params=laid_out, whitespace_before_params=newline(indent))


def _elements(params: cst.Parameters) -> list[cst.CSTNode]:
    """The parameters, `/` and bare `*` of a signature, in order."""
    every = [
        *params.posonly_params,
        params.posonly_ind,
        *params.params,
        params.star_arg,
        *params.kwonly_params,
        params.star_kwarg,
    ]
    return [e for e in every if isinstance(e, cst.CSTNode)]
