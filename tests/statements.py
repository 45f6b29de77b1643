"""Find a script's statements by their shape, and edit them: the one place that reads code as code.

A statement is named by a Pattern ("a call to no_sync", "the assignment to skip"), never by a copy
of its text, so that a formatter that rewraps a line, or a comment moved beside it, changes nothing
here. The tests plant mistakes (tests/plants.py) and change the chapters' scripts by editing
statements found this way.
"""

from __future__ import annotations

import ast
import copy
import functools
from dataclasses import dataclass

COMPOUND = (ast.If, ast.For, ast.While, ast.With, ast.AsyncFor, ast.AsyncWith, ast.Try)
DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def indentation(line: str) -> str:
    """The whitespace a line of code starts with."""
    return line[: len(line) - len(line.lstrip())]


def header_end(node: ast.stmt) -> int:
    """The last line (from 1) of a statement; of a compound one, the last line of its header."""
    body = getattr(node, "body", None)
    if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
        return body[0].lineno - 1
    return node.end_lineno or node.lineno


def header_parts(node: ast.stmt) -> list[ast.AST]:
    """What a statement says on its own lines: a compound statement's header, not its body."""
    if isinstance(node, (ast.If, ast.While)):
        return [node.test]
    if isinstance(node, (ast.For, ast.AsyncFor)):
        return [node.target, node.iter]
    if isinstance(node, (ast.With, ast.AsyncWith)):
        return list(node.items)
    if isinstance(node, (*DEFINITIONS, ast.Try)):
        return []
    return [node]


def name_of(expr: ast.AST) -> str | None:
    """The name a call or an assignment target goes by: `f`, `x.f` and `x.y.f` are all `f`."""
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        return expr.attr
    return None


def calls_in(node: ast.stmt) -> list[ast.Call]:
    """The calls a statement makes on its own lines (a compound statement's: in its header)."""
    return [c for part in header_parts(node) for c in ast.walk(part) if isinstance(c, ast.Call)]


def targets_of(node: ast.stmt) -> list[str]:
    """The names a statement assigns to (`x, y = ...` assigns to x and y)."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return []
    names = []
    for target in targets:
        for part in ast.walk(target):
            if isinstance(part, (ast.Name, ast.Attribute)) and not isinstance(part.ctx, ast.Load):
                names.append(name_of(part))
    return names


@dataclass(frozen=True)
class Pattern:
    """A statement's shape. Every part given must hold:

    - call: the statement (a compound one: its header) calls a function of this name;
    - arg: ... whose first argument is this name;
    - assigns: it assigns to this name;
    - uses: a name or attribute of this name appears in it (its header);
    - kind: it is this kind of statement ("if", "for", "with");
    - code: it is this code, compared as code (ast.unparse): a formatter's layout does not count.
    """

    call: str | None = None
    arg: str | None = None
    assigns: str | None = None
    uses: str | None = None
    kind: str | None = None
    code: str | None = None

    def matches(self, node: ast.stmt) -> bool:
        if self.code is not None and ast.unparse(node) != ast.unparse(ast.parse(self.code)):
            return False
        if self.kind is not None and type(node).__name__.lower() != self.kind:
            return False
        if self.assigns is not None and self.assigns not in targets_of(node):
            return False
        if self.call is not None and not any(self._fits(c) for c in calls_in(node)):
            return False
        if self.uses is not None:
            used = {name_of(n) for p in header_parts(node) for n in ast.walk(p)}
            if self.uses not in used:
                return False
        return True

    def _fits(self, call: ast.Call) -> bool:
        if name_of(call.func) != self.call:
            return False
        return self.arg is None or bool(call.args) and name_of(call.args[0]) == self.arg

    def __str__(self) -> str:
        """In words: "the assignment to lr calling lr_at", "a `for` statement using micro_step"."""
        called = f"{self.call}({self.arg}, ...)" if self.arg else f"{self.call}"
        words = []
        if self.kind:
            words.append(f"a `{self.kind}` statement")
        if self.assigns:
            words.append(f"the assignment to {self.assigns}")
        if self.call:
            words.append(f"calling {called}" if words else f"a call to {called}")
        if self.uses:
            words.append(f"using {self.uses}" if words else f"a statement using {self.uses}")
        if self.code:
            words.append(f"`{ast.unparse(ast.parse(self.code))}`")
        return " ".join(words) or "any statement"


def every_statement(tree: ast.AST) -> list[ast.stmt]:
    """Every statement of the tree, in the order of their lines."""
    found = [n for n in ast.walk(tree) if isinstance(n, ast.stmt)]
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


@functools.lru_cache(maxsize=64)
def parsed(source: str) -> ast.Module:
    """The tree of a source, parsed once: the statements found in it are its nodes."""
    return ast.parse(source)


def find(source: str, pattern: Pattern) -> list[ast.stmt]:
    """The statements of `source` that fit the pattern, in line order."""
    return list(found_in(source, pattern))


@functools.lru_cache(maxsize=1024)
def found_in(source: str, pattern: Pattern) -> tuple[ast.stmt, ...]:
    return tuple(node for node in every_statement(parsed(source)) if pattern.matches(node))


def the_one(source: str, pattern: Pattern, script: str) -> ast.stmt:
    """The one statement that fits; anything else raises ValueError naming the script."""
    found = find(source, pattern)
    if len(found) != 1:
        raise ValueError(f"{script}: {len(found)} statements are {pattern}, not one")
    return found[0]


def header(node: ast.stmt) -> str:
    """A statement as normalized code (ast.unparse); a compound statement by its header alone."""
    if isinstance(node, COMPOUND) and not isinstance(node, ast.Try):
        bare = copy.copy(node)
        bare.body = [ast.Pass()]
        if hasattr(bare, "orelse"):
            bare.orelse = []
        return ast.unparse(bare).split("\n")[0]
    if isinstance(node, (*DEFINITIONS, ast.Try)):
        return type(node).__name__
    return ast.unparse(node)


# ---- edits: each takes the source and gives it back changed --------------------------------------


def lines_of(source: str, node: ast.stmt, script: str) -> range:
    """The lines (from 0) of a statement alone on its lines (its trailing comment goes with it)."""
    lines = source.splitlines()
    before = lines[node.lineno - 1].encode()[: node.col_offset].decode()
    after = lines[node.end_lineno - 1].encode()[node.end_col_offset :].decode().strip()
    if before.strip() or after and not after.startswith("#"):
        raise ValueError(f"{script}: `{header(node)}` shares a line with other code")
    return range(node.lineno - 1, node.end_lineno)


def put(source: str, where: range, code: str, indent: str) -> str:
    """`source` with the lines `where` (from 0) replaced by `code`, each line at `indent`."""
    lines = source.splitlines(keepends=True)
    lines[where.start : where.stop] = [f"{indent}{line}\n" for line in code.splitlines()]
    return "".join(lines)


def replace(source: str, pattern: Pattern, code: str, script: str) -> str:
    """The one statement that fits replaced by `code` at its indentation ("": removed)."""
    node = the_one(source, pattern, script)
    where = lines_of(source, node, script)
    return put(source, where, code, indentation(source.splitlines()[where.start]))


def replace_each(source: str, pattern: Pattern, code: str, script: str) -> str:
    """Every statement that fits (at least one) replaced by `code`, each at its indentation."""
    found = find(source, pattern)
    if not found:
        raise ValueError(f"{script}: no statement is {pattern}")
    for node in reversed(found):  # from the last: the lines above keep their numbers
        where = lines_of(source, node, script)
        source = put(source, where, code, indentation(source.splitlines()[where.start]))
    return source


def insert(source: str, pattern: Pattern, code: str, script: str, after: bool = False) -> str:
    """`code` on new lines before (or after) the one statement that fits, at its indentation."""
    node = the_one(source, pattern, script)
    where = lines_of(source, node, script)
    at = where.stop if after else where.start
    return put(source, range(at, at), code, indentation(source.splitlines()[where.start]))


def move(source: str, moved: Pattern, before: Pattern, script: str) -> str:
    """The one statement `moved` taken out and put back before the one statement `before`."""
    node = the_one(source, moved, script)
    lines = source.splitlines(keepends=True)
    text = "".join(
        line.removeprefix(indentation(lines[node.lineno - 1]))
        for line in lines[node.lineno - 1 : node.end_lineno]
    )
    return insert(replace(source, moved, "", script), before, text, script)


def rewrite(source: str, pattern: Pattern, old: str, new: str, script: str) -> str:
    """The one statement that fits, with its sub-expression `old` (compared as code) made `new`."""
    node = the_one(source, pattern, script)
    wanted = ast.dump(ast.parse(old, mode="eval").body)
    replacement = ast.parse(new, mode="eval").body
    changed = copy.deepcopy(node)
    hits = 0
    for parent in ast.walk(changed):
        for name, value in ast.iter_fields(parent):
            if isinstance(value, ast.expr) and ast.dump(value) == wanted:
                setattr(parent, name, copy.deepcopy(replacement))
                hits += 1
            elif isinstance(value, list):
                for i, item in enumerate(value):
                    if isinstance(item, ast.expr) and ast.dump(item) == wanted:
                        value[i] = copy.deepcopy(replacement)
                        hits += 1
    if hits != 1:
        raise ValueError(f"{script}: `{old}` is in {pattern} {hits} times, not once")
    if isinstance(changed, COMPOUND):  # only the header changes: the body stays as written
        lines = source.splitlines(keepends=True)
        first, last = node.lineno - 1, header_end(node)
        indent = indentation(lines[first])
        code = header(changed) + "\n"
        lines[first:last] = [indent + code]
        return "".join(lines)
    return replace(source, pattern, ast.unparse(changed), script)


def wrap(source: str, pattern: Pattern, head: str, script: str) -> str:
    """The one statement that fits, put inside `head` (a compound statement's header: "if x:")."""
    node = the_one(source, pattern, script)
    lines = source.splitlines(keepends=True)
    body = "".join(
        "    " + line.removeprefix(indentation(lines[node.lineno - 1]))
        for line in lines[node.lineno - 1 : node.end_lineno]
    )
    return replace(source, pattern, f"{head}\n{body}", script)
