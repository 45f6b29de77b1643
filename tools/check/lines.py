"""A script's statements as the checker quotes them: code only (never a comment or a docstring),
each on one line, a compound statement by its header."""

from __future__ import annotations

import ast
import re


def header_end(node: ast.stmt) -> int:
    """The last line (from 1) of a statement; of a compound one, the last line of its header."""
    body = getattr(node, "body", None)
    if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
        return body[0].lineno - 1
    return node.end_lineno or node.lineno


def quoted(node: ast.stmt, lines: list[str]) -> str:
    """The statement as the script has it, on one line (a compound one by its header)."""
    text = " ".join(
        line.split("#")[0].strip() for line in lines[node.lineno - 1 : header_end(node)]
    )
    return re.sub(r"([(\[{]) | ([)\]}])|,([)\]}])", r"\1\2\3", text).strip()


def docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)


def code_statements(source: str) -> list[ast.stmt]:
    """Every statement but the docstrings and the bare constants, in line order; [] where the
    source does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found = [n for n in ast.walk(tree) if isinstance(n, ast.stmt) and not docstring(n)]
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def header(node: ast.stmt) -> str:
    """A statement's code, formatting aside: a compound statement's first line alone."""
    return ast.unparse(node).split("\n")[0]
