"""Make the exercises: the script each chapter builds on, with the chapter's changes marked TODO.

That script is the train.py of the previous chapter, or of the one common/chapters.py names as
the chapter's base.

    python -m maintainer.make_exercises          # write 0N_<chapter>/exercise.py, chapter 02 on
    python -m maintainer.make_exercises --check  # exit 1 if one no longer matches the scripts

The changes are difflib's, from chapter N-1's train.py to chapter N's, within each top-level
function and class matched by name (a class the chapter drops is removed where it stands, not lined
up with main()). A change that begins inside a statement takes the whole statement, so that no TODO
sits inside brackets, and `ruff format` leaves the exercises as they are; one that begins inside a
comment takes the whole comment. Above the lines each change touches, a TODO says how many lines
to add, change or remove there, and gives a hint of at most about HINT_LINES lines:

- the defs and classes the new lines add, with their signatures and their docstrings' first
  sentences (a class's methods too, each an override where it hands on to its base's);
- the comments of the solution's new lines that the exercise does not show already: they say why,
  the learner writes the code; each is whole, and those that do not fit are counted. Where there
  is no such comment (an import, a print), the code, each line at its own indentation (too long:
  the whole statements that fit, and how many lines more);
- what the new lines call that the previous chapter's script never used: a helper of the course's
  package `common` with its signature, read from its source; torch's functions and classes by
  their path (the imports' TODO says from where);
- for lines to remove, the names that leave the program with them.

Changes only to the docstring or to comments (one at the end of a line too) are left out. The
solution is chapter N's own train.py. The learner solves a copy (ignored by git),
0N_<chapter>/my_exercise.py, and `python -m tools.check 0N_<chapter>/my_exercise.py` tells whether
it is the same run as chapter 01's. An exercise.py that holds someone's work (its code is no
longer the previous chapter's, and git does not hold it) is kept as my_exercise.py, or the next
free my_exercise_N.py, before it is written again.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import io
import re
import shutil
import subprocess
import sys
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path

from common.chapters import CHAPTERS, base
from layout import REPO
from maintainer import REGENERATE
from tools.statements import (
    DEFINITIONS,
    calls_in,
    every_statement,
    header_end,
    indentation,
    targets_of,
)

WIDTH = 100  # the course's line length (ruff.toml)
# The most lines a TODO's hint takes: more is a wall of text that the learner skims. What the TODO
# must name (new definitions, helpers and their signatures) always goes in; of the comments, those
# that fit the rest go in whole, and the hint says how many more the solution has.
HINT_LINES = 12
# ... but the comments or the code keep at least this many lines, however much must be named
BODY_LINES = 6
# The libraries whose functions and classes a TODO names by their path when the chapter first
# calls them: the learner looks them up in the library's documentation. The course's own package
# gets more, its signatures, read from its source (the learner has no other page for them).
NAMED_LIBRARIES = ("torch",)
COURSE_PACKAGE = "common"


def is_comment(line: str) -> bool:
    return line.strip().startswith("#") or not line.strip()


def is_whole_comment(line: str) -> bool:
    """A line that is a comment and nothing else (not blank)."""
    return line.strip().startswith("#")


def code_tokens(lines: list[str]) -> list[tuple[int, str]]:
    """The tokens of the lines without their comments and line breaks: lines that differ only in
    a comment have the same. The lines may end inside brackets: what was read counts."""
    skipped = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    tokens = []
    try:
        for token in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
            if token.type not in skipped:
                tokens.append((token.type, token.string))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        tokens.append((tokenize.ERRORTOKEN, "unfinished"))
    return tokens


def is_trivial(line: str) -> bool:
    """A line that says nothing alone: blank, or only closing brackets and quotes."""
    return not line.strip().strip("()[]{}:,\"'")


def inside_strings(lines: list[str]) -> set[int]:
    """Indexes of the lines that start inside a multi-line string: no comment can go before them."""
    inside = set()
    for token in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
        if token.type == tokenize.STRING and token.end[0] > token.start[0]:
            inside.update(range(token.start[0], token.end[0]))  # 0-based: the lines after the first
    return inside


def import_lines(lines: list[str]) -> range:
    """The lines (from 0) of the module's imports, from the first to the last."""
    tree = ast.parse("".join(lines))
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    return range(imports[0].lineno - 1, imports[-1].end_lineno)


def written_alias(alias: ast.alias) -> str:
    """An imported name as the import writes it: `DistributedDataParallel as DDP`."""
    if alias.asname:
        return f"{alias.name} as {alias.asname}"
    return alias.name


def imported_statements(lines: list[str]) -> list[tuple[str, list[str]]]:
    """The module's imports as (statement's start, names): ("import contextlib", [""]),
    ("from torch import", ["nn"]), a statement spread over lines read as one."""
    tree = ast.parse("".join(lines))
    statements = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                statements.append((f"import {written_alias(alias)}", [""]))
        elif isinstance(node, ast.ImportFrom):
            names = [written_alias(alias) for alias in node.names]
            module = "." * node.level + (node.module or "")
            statements.append((f"from {module} import", names))
    return statements


def imports_todo(old: list[str], new: list[str]) -> list[str]:
    """One TODO for every change to the imports (no comment fits between imports that a formatter
    keeps apart): the names to remove (-), then to add (+), each line an import statement of them
    (the `import x` ones together on one), however the script spreads its imports over lines."""
    before = imported_statements(old)
    after = imported_statements(new)
    names_before = {(start, name) for start, names in before for name in names}
    names_after = {(start, name) for start, names in after for name in names}
    changed = []
    for sign, statements, other in (("-", before, names_after), ("+", after, names_before)):
        modules = []
        froms = []
        for start, names in statements:
            differing = [name for name in names if (start, name) not in other]
            if differing == [""]:
                modules.append(start.removeprefix("import "))
            elif differing:
                froms.append(f"{sign} {start} {', '.join(differing)}")
        if modules:
            changed.append(f"{sign} import {', '.join(modules)}")
        changed += froms
    wrapped_lines = [line for text in changed for line in wrapped(text, "#     ", "    ")]
    return [line + "\n" for line in wrapped_lines]


def docstring_end(lines: list[str]) -> int:
    """The number of lines the module docstring (and anything before it) takes."""
    tree = ast.parse("".join(lines))
    first = tree.body[0] if tree.body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return first.end_lineno
    return 0


def comments_of(lines: list[str]) -> list[str]:
    """The comments of the lines, a comment that goes on over the next lines joined into one; a
    section's banner (`# ---- data ------`) without its run of dashes."""
    comments: list[str] = []
    joins = False  # the last line was a whole-line comment that the next one may go on
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            text = stripped.lstrip("# ").rstrip()
            banner = text.startswith("----")
            text = re.sub(r"\s*-{4,}$", "", text)
            # A line that starts with a capital begins a comment; so does one under a comment that
            # ended a sentence (`nn.DataParallel ...` under `... can load them.`). "..." in a
            # list (`rank, rank + W, ...`) ends none.
            ended = False
            if comments:
                last = comments[-1]
                ended = last.endswith((".", "!", "?")) and not last.endswith("...")
            goes_on = text[:1] in "(`" or (not text[:1].isupper() and not ended)
            if joins and comments and goes_on and not banner:
                comments[-1] += " " + text
            else:
                comments.append(text)
            joins = not banner
            continue
        joins = False
        if "  # " in line:  # a comment at the end of a line of code
            comments.append(line.split("  # ", 1)[1].strip())
    return comments


# ---- what the new lines define and use: named in the TODO, so that no helper must be guessed ----


def imported_names(tree: ast.Module) -> dict[str, str]:
    """Every name the module imports -> the dotted path it stands for: `dist` (import
    torch.distributed as dist) -> torch.distributed, `shard_full_state` (from common.sharding
    import ...) -> common.sharding.shard_full_state."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    head = alias.name.split(".")[0]  # `import torch.nn` binds torch
                    names[head] = head
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                local = alias.asname or alias.name
                names[local] = f"{node.module}.{alias.name}"
    return names


def dotted_path(expr: ast.AST, names: dict[str, str]) -> str | None:
    """The path an expression names through the imports: `dist.init_process_group` ->
    torch.distributed.init_process_group; None when it starts at no imported name (a local
    variable, a call's result)."""
    attributes = []
    while isinstance(expr, ast.Attribute):
        attributes.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name) or expr.id not in names:
        return None
    return ".".join([names[expr.id], *reversed(attributes)])


def referenced_paths(tree: ast.Module) -> set[str]:
    """The paths of every imported name the code refers to, called or not: what a script uses."""
    names = imported_names(tree)
    paths = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.Attribute)):
            path = dotted_path(node, names)
            if path is not None:
                paths.add(path)
    return paths


def called_paths(tree: ast.Module, first: int, end: int) -> list[str]:
    """The imported functions and classes that the lines first..end (from 0) call, or that a class
    defined there derives from, in the order the lines give them."""
    names = imported_names(tree)
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Call):
            targets = [node.func]
        elif isinstance(node, ast.ClassDef):
            targets = list(node.bases)
        for target in targets:
            path = dotted_path(target, names)
            if path is not None and first <= target.lineno - 1 < end:
                found.append((target.lineno, target.col_offset, path))
    ordered = [path for _, _, path in sorted(found)]
    return list(dict.fromkeys(ordered))


def identifiers(tree: ast.Module) -> set[str]:
    """Every name and attribute name the module's code mentions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
    return found


def new_methods(tree: ast.Module, first: int, end: int, known: set[str]) -> list[str]:
    """The methods that the lines first..end (from 0) call on the script's own objects and that
    the previous script never names (`known`), as the lines write them: model.no_sync,
    sampler.set_epoch. Whose they are (DDP's, the sampler's) takes types to know; the learner
    looks them up by name."""
    imported = imported_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value
        while isinstance(owner, ast.Attribute):
            owner = owner.value
        local = isinstance(owner, ast.Name) and owner.id not in imported
        where = node.func.lineno - 1
        if local and node.func.attr not in known and first <= where < end:
            found.append((node.func.lineno, node.func.col_offset, ast.unparse(node.func)))
    ordered = [written for _, _, written in sorted(found)]
    return list(dict.fromkeys(ordered))


@functools.lru_cache(maxsize=64)
def module_source(module: str) -> tuple[str, ast.Module, str] | None:
    """The source and tree of one of the course's modules (common.sharding), read, not imported:
    importing would load torch, and the exercises are made in well under a second. Third: the
    package its relative imports start from (common)."""
    relative = Path(*module.split("."))
    package = module.rpartition(".")[0]
    places = [
        (REPO / relative.with_suffix(".py"), package),
        (REPO / relative / "__init__.py", module),
    ]
    for path, own_package in places:
        if path.is_file():
            source = path.read_text()
            return source, ast.parse(source), own_package
    return None


def definition_of(path: str, hops: int = 0) -> tuple[ast.AST, str] | None:
    """The def or class that a path of the course's package names, and the source it stands in:
    followed through a module that imports it from another (`from .device import parse_device`)."""
    parts = path.split(".")
    found = None
    cut = len(parts) - 1
    while cut > 0 and found is None:
        found = module_source(".".join(parts[:cut]))
        if found is None:
            cut -= 1
    if found is None:
        return None
    source, tree, package = found
    body: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for name in parts[cut:]:  # a name, or a class and its method
        node = next((n for n in body if isinstance(n, DEFINITIONS) and n.name == name), None)
        if node is None:
            break
        body = node.body
    if node is not None:
        return node, source
    if hops > 5 or cut != len(parts) - 1:  # a loop of imports, or a class without the method
        return None
    # not defined there: imported there from another module of the package
    for statement in tree.body:
        if not isinstance(statement, ast.ImportFrom):
            continue
        for alias in statement.names:
            if (alias.asname or alias.name) != parts[-1]:
                continue
            origin = statement.module or ""
            if statement.level:  # relative: `.` is the module's package, `..` the one above
                packages = package.split(".")
                start = packages[: len(packages) - statement.level + 1]
                origin = ".".join(part for part in [*start, origin] if part)
            return definition_of(f"{origin}.{alias.name}", hops + 1)
    return None


def parameters_as_written(arguments: ast.arguments, source: str, skip_first: bool) -> str:
    """A def's parameters as its source writes them, on one line: `model, lr: float = 0.1, *,
    seed=0`. A method's first parameter (self) is left out for a class called by its name."""

    def written(node: ast.AST) -> str:
        text = ast.get_source_segment(source, node) or ast.unparse(node)
        return " ".join(text.split())

    def one(argument: ast.arg, default: ast.expr | None) -> str:
        text = argument.arg
        if argument.annotation is not None:
            text += f": {written(argument.annotation)}"
        if default is not None and argument.annotation is not None:
            text += f" = {written(default)}"  # spaced as PEP 8 spaces an annotated default
        elif default is not None:
            text += f"={written(default)}"
        return text

    positional = [*arguments.posonlyargs, *arguments.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(arguments.defaults))
    defaults += arguments.defaults
    parts = []
    for index, (argument, default) in enumerate(zip(positional, defaults)):
        if index == 0 and skip_first:
            continue
        parts.append(one(argument, default))
        if arguments.posonlyargs and index == len(arguments.posonlyargs) - 1:
            parts.append("/")
    if arguments.vararg is not None:
        parts.append("*" + one(arguments.vararg, None))
    elif arguments.kwonlyargs:
        parts.append("*")
    for argument, default in zip(arguments.kwonlyargs, arguments.kw_defaults):
        parts.append(one(argument, default))
    if arguments.kwarg is not None:
        parts.append("**" + one(arguments.kwarg, None))
    return ", ".join(parts)


def init_of(node: ast.ClassDef) -> ast.FunctionDef | None:
    """A class's own __init__, if it has one."""
    for statement in node.body:
        if isinstance(statement, ast.FunctionDef) and statement.name == "__init__":
            return statement
    return None


def signature_as_written(node: ast.AST, source: str, name: str) -> str:
    """`name(parameters) -> return type` as the def writes them; a class by its __init__ (without
    self), as the learner calls it; a class without an __init__ by its name alone."""
    if isinstance(node, ast.ClassDef):
        init = init_of(node)
        if init is None:
            return name
        return f"{name}({parameters_as_written(init.args, source, skip_first=True)})"
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return name
    signature = f"{name}({parameters_as_written(node.args, source, skip_first=False)})"
    if node.returns is not None:
        returns = ast.get_source_segment(source, node.returns) or ast.unparse(node.returns)
        signature += f" -> {' '.join(returns.split())}"
    return signature


def docstring_line(node: ast.AST) -> str:
    """The first sentence of a def's docstring, whole, on one line (a class without one: its
    __init__'s); "" if none."""
    docstring = ""
    if isinstance(node, DEFINITIONS):
        docstring = ast.get_docstring(node) or ""
    if not docstring and isinstance(node, ast.ClassDef):
        init = init_of(node)
        if init is not None:
            docstring = ast.get_docstring(init) or ""
    paragraph = " ".join(docstring.split("\n\n")[0].split())
    return sentences(paragraph)[0] if paragraph else ""


def sentences(text: str) -> list[str]:
    """A text's sentences, each with its full stop: a sentence ends at ".", "!" or "?" before a
    space and a capital (`rank, rank + W, ...` ends none)."""
    return re.split(r"(?<=[.!?])(?<!\.\.\.) +(?=[A-Z])", text)


def helper_line(path: str) -> str:
    """A helper of the course's package as a TODO names it: `uses common.x.f(a: int) -> str: the
    first sentence of its docstring`; the path alone if its def cannot be found."""
    found = definition_of(path)
    if found is None:
        return f"uses {path}"
    node, source = found
    module, name = path.rsplit(".", 1)
    text = f"uses {module}.{signature_as_written(node, source, name)}"
    docstring = docstring_line(node)
    if docstring:
        text += f": {docstring}"
    return text


def uses_lines(paths: list[str], methods: list[str], named: set[str]) -> list[str]:
    """What a TODO names of what its new lines call for the first time in the exercise (`named`
    holds what earlier TODOs named, and gains these): a helper of the course's package with its
    signature, one line each; the library's names by path and the new methods as written,
    together on one line."""
    helpers = []
    library = []
    for path in paths:
        if path in named:
            continue
        package = path.split(".")[0]
        if package == COURSE_PACKAGE:
            helpers.append(helper_line(path))
            named.add(path)
        elif package in NAMED_LIBRARIES:
            library.append(path)
            named.add(path)
    for method in methods:
        name = method.rsplit(".", 1)[-1]  # named once, whatever object it is called on
        if name not in named:
            library.append(method)
            named.add(name)
    if library:
        helpers.append("uses " + ", ".join(library))
    return helpers


def hands_on_to_base(method: ast.FunctionDef) -> bool:
    """Whether a method calls its base class's method of the same name: super().name(...)."""
    for node in ast.walk(method):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value
        is_super = (
            isinstance(owner, ast.Call)
            and isinstance(owner.func, ast.Name)
            and owner.func.id == "super"
        )
        if is_super and node.func.attr == method.name:
            return True
    return False


def qualified_definitions(tree: ast.Module) -> dict[str, ast.AST]:
    """Every def and class of the module by its qualified name: "main.save", "Model.forward"."""
    found: dict[str, ast.AST] = {}

    def visit(body: list[ast.stmt], outer: str) -> None:
        for node in body:
            if isinstance(node, DEFINITIONS):
                name = f"{outer}{node.name}"
                found[name] = node
                visit(node.body, f"{name}.")
            else:
                for field in ("body", "orelse", "finalbody"):
                    inner = getattr(node, field, None)
                    if isinstance(inner, list):
                        visit(inner, outer)

    visit(tree.body, "")
    return found


def definition_lines(
    old: ast.Module, new: ast.Module, source: str, first: int, end: int
) -> list[str]:
    """The defs and classes that the lines first..end (from 0) of the new script add, as the TODO
    names them: the signature and the docstring's first sentence; for a class, its base classes and
    its methods, each an override where it hands on to the base's method of its name."""
    before = qualified_definitions(old)
    after = qualified_definitions(new)
    lines = []
    for qualified, node in after.items():
        if qualified in before or not first <= node.lineno - 1 < end:
            continue
        owner = qualified.rpartition(".")[0]
        if owner and isinstance(after.get(owner), ast.ClassDef):
            continue  # a method: named with its class, below
        if isinstance(node, ast.ClassDef):
            text = f"class {node.name}"
            if node.bases:
                bases = [ast.get_source_segment(source, base) or "" for base in node.bases]
                text += f"({', '.join(bases)})"
        else:
            text = f"def {signature_as_written(node, source, node.name)}"
        docstring = docstring_line(node)
        if docstring:
            text += f": {docstring}"
        lines.append(text)
        if isinstance(node, ast.ClassDef):
            for method in node.body:
                if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                verb = "defines"
                if node.bases and hands_on_to_base(method):
                    verb = "overrides"
                signature = signature_as_written(method, source, method.name)
                lines.append(f"  {verb} {signature}")
    return lines


def gone_lines(old: ast.Module, new: ast.Module, first: int, end: int) -> list[str]:
    """For lines to remove: what the outermost statements among them define or assign, and the
    imported functions they call, that the new script never mentions: the learner takes out
    their uses too."""
    mentioned = set()
    for node in ast.walk(new):
        if isinstance(node, ast.Name):
            mentioned.add(node.id)
        elif isinstance(node, ast.Attribute):
            mentioned.add(node.attr)
        elif isinstance(node, DEFINITIONS):
            mentioned.add(node.name)
    still_used = referenced_paths(new)
    imported = imported_names(old)
    inside = [node for node in every_statement(old) if first <= node.lineno - 1 < end]
    outermost = [
        node
        for node in inside
        if not any(
            other is not node and other.lineno <= node.lineno <= other.end_lineno
            for other in inside
        )
    ]
    gone = []
    for node in outermost:
        names = []
        if isinstance(node, DEFINITIONS):
            names.append(node.name)
        names += [name for name in targets_of(node) if name and name not in mentioned]
        for call in calls_in(node):
            path = dotted_path(call.func, imported)
            if path is not None and path not in still_used:
                names.append(ast.unparse(call.func))  # as the script writes it: torch.manual_seed
        gone += [name for name in names if name not in gone]
    if not gone:
        return ["the solution has no such lines here"]
    return ["gone from the solution: " + ", ".join(gone)]


@dataclass
class Notes:
    """What a TODO says beyond how many lines change, gathered from both scripts."""

    comments: list[str]  # the new lines' comments that the exercise does not show yet
    definitions: list[str]  # the defs and classes they add, with their signatures
    uses: list[str]  # what they call for the first time: helpers with signatures, library names
    gone: list[str]  # for lines to remove: what leaves the program with them
    tree: ast.Module  # the new script's
    lines: list[str]  # the new script's lines
    first: int  # where the change's new lines begin in them (from 0)


def new_comments(new: list[str], kept: list[str]) -> list[str]:
    """The comments of the new lines that the exercise does not already show (`kept`)."""
    return [comment for comment in comments_of(new) if comment not in kept]


def wrapped(text: str, prefix: str, more: str = "  ") -> list[str]:
    """One item of a hint on lines of at most WIDTH columns, its next lines `more` deeper. Never
    broken inside a word or at a hyphen: --max-restarts stays whole."""
    return textwrap.wrap(
        text,
        WIDTH,
        initial_indent=prefix,
        subsequent_indent=prefix + more,
        break_long_words=False,
        break_on_hyphens=False,
    )


def string_spans(code: str) -> list[tuple[int, int]]:
    """Where the string literals of one line of code are (f-strings whole): no line breaks there.
    A line that ends inside brackets is read as far as it goes."""
    spans = []
    opened = []  # f-strings being read (Python 3.12 gives their parts as tokens of their own)
    fstring_start = getattr(tokenize, "FSTRING_START", None)
    fstring_end = getattr(tokenize, "FSTRING_END", None)
    try:
        for token in tokenize.generate_tokens(io.StringIO(code).readline):
            if token.start[0] > 1:
                break
            if token.type == fstring_start:
                opened.append(token.start[1])
            elif token.type == fstring_end and opened:
                spans.append((opened.pop(), token.end[1]))
            elif token.type == tokenize.STRING and not opened:
                spans.append((token.start[1], token.end[1]))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return spans


def code_wrapped(code: str, prefix: str) -> list[str]:
    """A line of code quoted at `prefix`, in lines of at most WIDTH columns: broken at a space
    outside its strings, the rest 4 columns deeper; inside a string only where it is too long to
    fit otherwise. Nothing is cut."""
    if len(prefix) + len(code) <= WIDTH:
        return [prefix + code]
    spans = string_spans(code)
    fits = WIDTH - len(prefix)
    spaces = [at for at, char in enumerate(code) if char == " " and 0 < at <= fits]
    breaks = [at for at in spaces if not any(a <= at < b for a, b in spans)] or spaces
    if not breaks:  # one word longer than the line: it stays whole, past the width
        return [prefix + code]
    head = code[: breaks[-1]]
    rest = code[breaks[-1] + 1 :].lstrip()
    return [prefix + head, *code_wrapped(rest, prefix + "    ")]


def comment_lines(comments: list[str], prefix: str, room: int) -> list[str]:
    """The comments within `room` lines, each whole: all if they fit; else, in their order, those
    that fit with a line left to say how many more the solution has (the first, however long)."""
    full = [line for comment in comments for line in wrapped(comment, prefix)]
    if len(full) <= room:
        return full
    lines: list[str] = []
    left_out = 0
    for comment in comments:
        text = wrapped(comment, prefix)
        if lines and len(lines) + len(text) > room - 1:
            left_out += 1
            continue
        lines += text
    return lines + [f"{prefix}({counted(left_out, 'more comment')} in the solution)"]


def code_lines(notes: Notes, new: list[str], prefix: str, room: int) -> list[str]:
    """The code of the new lines, each line at its indentation relative to the least indented one.
    More than `room` lines: the outermost statements that begin in them, each whole, in their order
    while they fit, and how many more lines of code the solution has."""
    code = [line.rstrip() for line in new if not is_comment(line)]
    if not code:
        return []
    base = min(len(indentation(line)) for line in code)

    def quoted(text: str) -> list[str]:
        relative = text[base : len(indentation(text))]
        return code_wrapped(text.strip(), prefix + relative)

    lines = [line for text in code for line in quoted(text)]
    if len(lines) <= room:
        return lines
    end = notes.first + len(new)
    starting = [
        node for node in every_statement(notes.tree) if notes.first <= node.lineno - 1 < end
    ]
    outermost = min((node.col_offset for node in starting), default=0)
    # each outermost statement's code lines (all of them, where no statement begins in the change)
    pieces = [
        [
            line.rstrip()
            for line in notes.lines[node.lineno - 1 : min(node.end_lineno, end)]
            if not is_comment(line)
        ]
        for node in starting
        if node.col_offset == outermost
    ] or [[line] for line in code]
    shown: list[str] = []
    shown_code = 0
    for piece in pieces:
        quoted_piece = [line for text in piece for line in quoted(text)]
        if len(shown) + len(quoted_piece) > room - 1:
            break
        shown += quoted_piece
        shown_code += len(piece)
    more = counted(len(code) - shown_code, "more line" if shown else "line")
    return shown + [f"{prefix}({more} of code in the solution)"]


def counted(count: int, noun: str) -> str:
    """`1 line`, `3 lines`: a count as English writes it."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def the_next(count: int) -> str:
    """`the next line`, `the next 3 lines`."""
    return "the next line" if count == 1 else f"the next {count} lines"


def todo_block(
    number: int,
    total: int,
    tag: str,
    old: list[str],
    new: list[str],
    indent: str,
    notes: Notes,
) -> list[str]:
    """A TODO: how the lines below change, then its hint, at most HINT_LINES lines: the new defs
    and classes, with their signatures; the new comments (why), or where the new lines have none
    that the exercise does not show already, their code; what they use for the first time (the
    course's helpers with their signatures, the library's names); for lines to remove, what leaves
    the program with them."""
    code_old = sum(1 for line in old if not is_comment(line))
    code_new = sum(1 for line in new if not is_comment(line))
    # a change whose old lines are comments alone adds its code ("change the next 0 lines" would
    # be no instruction)
    if tag == "insert" or tag == "replace" and code_old == 0:
        what = f"add {counted(code_new, 'line')} of code here"
    elif tag == "delete":
        what = f"remove {the_next(code_old)} of code"
    else:
        what = f"change {the_next(code_old)} of code"
        if code_new != code_old:
            what += f" into {counted(code_new, 'line')}"
    prefix = f"{indent}#   "
    definitions = []
    for text in notes.definitions:  # a class's methods are indented under it
        deeper = text[: len(text) - len(text.lstrip())]
        definitions += wrapped(text.strip(), prefix + deeper, "    ")
    uses = [line for text in notes.uses for line in wrapped(text, prefix, "    ")]
    # what must be named goes in whole; the comments or the code are cut to fit the rest
    room = max(HINT_LINES - len(definitions) - len(uses), BODY_LINES)
    body: list[str] = []
    if tag == "delete":
        body = [line for text in notes.gone for line in wrapped(text, prefix)]
    elif notes.comments:
        body = comment_lines(notes.comments, prefix, room)
    else:  # no new comment to quote: the code is the hint
        body = code_lines(notes, new, f"{indent}#     ", room)
    hint = [*definitions, *body, *uses]
    header = f"{indent}# TODO {number}/{total}: {what}"
    if hint:
        header += ":"
    return [line.rstrip() + "\n" for line in [header, *hint]]


def statement_start(tree: ast.Module, first: int, end: int) -> int:
    """Where a TODO for the lines first..end (from 0) goes: above the outermost statement that the
    change begins inside of and that ends within it; else above the innermost statement (or the
    header of a compound one) that it begins inside of; else at `first`. A TODO comment inside
    brackets would make a formatter spread the call one argument a line."""
    outermost, innermost = None, None
    for node in every_statement(tree):
        if isinstance(node, DEFINITIONS):
            continue
        if not node.lineno - 1 < first < node.end_lineno:
            continue
        if node.end_lineno <= end and (outermost is None or node.lineno < outermost):
            outermost = node.lineno - 1
        last = header_end(node)
        if first < last and (innermost is None or node.lineno - 1 > innermost):
            innermost = node.lineno - 1
    if outermost is not None:
        return outermost
    return innermost if innermost is not None else first


def blocks_of(lines: list[str]) -> list[tuple[str, int, int]]:
    """The module cut at its top-level statements: (name, first line, end) for each function or
    class ("def main"), and the code between them, each with the comments and blanks above it."""
    tree = ast.parse("".join(lines))
    blocks: list[tuple[str, int, int]] = []
    start = 0
    for node in tree.body:
        end = node.end_lineno
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            blocks.append((f"{type(node).__name__} {node.name}", start, end))
        elif blocks and blocks[-1][0] == "code":
            blocks[-1] = ("code", blocks[-1][1], end)
        else:
            blocks.append(("code", start, end))
        start = end
    if start < len(lines):
        blocks.append(("code", start, len(lines)))
    return blocks


def opcodes(old: list[str], new: list[str]) -> list[tuple[str, int, int, int, int]]:
    """difflib's changes from old to new, within each top-level function and class matched by
    name: a class the new script drops is removed where it is, not lined up with main()."""
    a, b = blocks_of(old), blocks_of(new)
    out = []
    matcher = difflib.SequenceMatcher(None, [n for n, *_ in a], [n for n, *_ in b], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            for (_, a1, a2), (_, b1, b2) in zip(a[i1:i2], b[j1:j2]):
                inner = difflib.SequenceMatcher(None, old[a1:a2], new[b1:b2], autojunk=False)
                for t, x1, x2, y1, y2 in inner.get_opcodes():
                    out.append((t, a1 + x1, a1 + x2, b1 + y1, b1 + y2))
            continue
        first_old = a[i1][1] if i1 < i2 else (a[i1][1] if i1 < len(a) else len(old))
        last_old = a[i2 - 1][2] if i1 < i2 else first_old
        first_new = b[j1][1] if j1 < j2 else (b[j1][1] if j1 < len(b) else len(new))
        last_new = b[j2 - 1][2] if j1 < j2 else first_new
        if tag == "replace":  # blocks of other names in the same place: line by line
            inner = difflib.SequenceMatcher(
                None, old[first_old:last_old], new[first_new:last_new], autojunk=False
            )
            for t, x1, x2, y1, y2 in inner.get_opcodes():
                out.append((t, first_old + x1, first_old + x2, first_new + y1, first_new + y2))
        else:
            out.append((tag, first_old, last_old, first_new, last_new))
    return out


def exercise(chapter: int) -> str:
    """Chapter N's exercise, made from the scripts as they are now."""
    previous = (REPO / CHAPTERS[base(chapter)] / "train.py").read_text()
    solution = (REPO / CHAPTERS[chapter] / "train.py").read_text()
    return exercise_of(chapter, previous, solution)


def exercise_of(chapter: int, previous: str, solution: str) -> str:
    """The exercise of chapter N: the script of the chapter it builds on (`previous`) with TODOs
    that lead to its own (`solution`)."""
    folder = CHAPTERS[chapter]
    old = previous.splitlines(keepends=True)
    new = solution.splitlines(keepends=True)
    head = docstring_end(old)
    changes = []
    for tag, i1, i2, j1, j2 in opcodes(old, new):
        if tag == "equal":
            if changes and not all(is_trivial(line) for line in old[i1:i2]):
                changes.append(None)  # real code between two changes: they stay apart
            continue
        # only blanks or brackets between
        if changes and changes[-1] is not None and changes[-1][1] >= head:
            _, a1, _, b1, _ = changes.pop()
            tag = "replace"
            i1, j1 = a1, b1
        changes.append((tag, i1, i2, j1, j2))
    imports = import_lines(old)
    changes = [
        (tag if i2 > i1 and j2 > j1 else ("insert" if j2 > j1 else "delete"), i1, i2, j1, j2)
        for tag, i1, i2, j1, j2 in filter(None, changes)
        if not i1 < head  # the docstring's text
        and i1 not in imports  # the imports: one TODO of their own, below
        # comments only, a comment at the end of a line too: the learner has no code to change
        and code_tokens(old[i1:i2]) != code_tokens(new[j1:j2])
    ]
    blocks = {}
    strings = inside_strings(old)
    import_changes = imports_todo(old, new)
    total = len(changes) + bool(import_changes)
    if import_changes:
        blocks[imports.start] = [
            f"# TODO 1/{total}: the imports: remove (-) and add (+)\n",
            *import_changes,
        ]
    tree = ast.parse("".join(old))
    new_tree = ast.parse("".join(new))
    used_before = referenced_paths(tree)
    known_before = identifiers(tree)
    named: set[str] = set()  # the helpers and library names a TODO has named, each named once
    floor = 0  # where the previous change ends: a TODO never moves above it
    for number, (tag, i1, i2, j1, j2) in enumerate(changes, 1 + bool(import_changes)):
        while tag == "delete" and i1 < i2 and not old[i1].strip():
            i1 += 1  # a removed block: its TODO right above its first line
        while tag == "insert" and i1 < len(old) and not old[i1].strip():
            i1 += 1  # a new block: its TODO above the line it goes before, not after the blanks
        at = i1
        while at in strings:  # before the line where that string starts
            at -= 1
        # above the statement the change begins in, which it then takes whole
        shift = at - statement_start(tree, at, i2)
        at -= shift
        i1 -= shift
        j1 = max(j1 - shift, 0)
        # a change that begins on the second line of a comment: the TODO goes above the whole
        # comment, not into the middle of its sentence, and the comment is quoted whole
        while (
            at > floor
            and j1 > 0
            and is_whole_comment(old[at])
            and is_whole_comment(old[at - 1])
            and indentation(old[at]) == indentation(old[at - 1])
        ):
            at -= 1
            i1 -= 1
            j1 -= 1
        floor = i2
        # the comments right above the TODO stand in the exercise already: not quoted again
        above = at
        while above > 0 and is_whole_comment(old[above - 1]):
            above -= 1
        kept = comments_of(old[above:at]) + comments_of(old[i1:i2])
        paths = [path for path in called_paths(new_tree, j1, j2) if path not in used_before]
        methods = new_methods(new_tree, j1, j2, known_before)
        gone = []
        if tag == "delete":
            gone = gone_lines(tree, new_tree, i1, i2)
        notes = Notes(
            comments=new_comments(new[j1:j2], kept),
            definitions=definition_lines(tree, new_tree, solution, j1, j2),
            uses=uses_lines(paths, methods, named),
            gone=gone,
            tree=new_tree,
            lines=new,
            first=j1,
        )
        # indented as the line it stands above (the next one that is not blank)
        below = next((line for line in old[at:] if line.strip()), "")
        block = todo_block(number, total, tag, old[i1:i2], new[j1:j2], indentation(below), notes)
        blocks.setdefault(at, []).extend(block)
    # What no change's lines showed (a call the diff put where no TODO quotes it) is named under
    # the imports' TODO, or else the first: every new helper is named somewhere.
    everything = [p for p in called_paths(new_tree, 0, len(new)) if p not in used_before]
    left = uses_lines(everything, [], named)
    if left and blocks:
        first_block = blocks[min(blocks)]
        first_block.extend(line + "\n" for text in left for line in wrapped(text, "#   ", "    "))
    about = (
        f"Exercise: chapter {chapter:02d} ({folder}). This is chapter {base(chapter):02d}'s "
        f"train.py; add chapter {chapter:02d}'s idea where the {total} TODOs say. A TODO says how "
        "the lines below it change, and hints: the new comments of the solution there (or its "
        "code), the defs it adds and the helpers it first calls, with their signatures. Solve a "
        "copy, not this file: a my_*.py file is yours (git ignores it, and the course's tests read "
        "only this one). Then check your copy:"
    )
    where_solved = (
        f"The solution is {folder}/train.py (its README shows the diff). `cp -n` never overwrites "
        "a copy; to start again, copy this file under another name. This file is made by "
        "maintainer/make_exercises.py from the two scripts."
    )
    nproc = " --nproc-per-node 2" if chapter >= 4 else ""
    header = [
        *textwrap.wrap(about, 100, initial_indent="# ", subsequent_indent="# "),
        f"#     cp -n {folder}/exercise.py {folder}/my_exercise.py",
        f"#     python -m tools.check {folder}/my_exercise.py{nproc}",
        *textwrap.wrap(where_solved, 100, initial_indent="# ", subsequent_indent="# "),
    ]
    header = [line + "\n" for line in header]
    out = list(header)
    for i, line in enumerate(old):
        out.extend(blocks.get(i, []))
        out.append(line)
    out.extend(blocks.get(len(old), []))
    return "".join(out)


def edited_by_hand(path: Path, previous: str) -> bool:
    """Whether the exercise at `path` holds someone's work, which nothing here may overwrite: its
    code is no longer the previous chapter's script (`previous`), as every exercise made here is,
    and git does not hold it as it is (or cannot say)."""
    try:
        solved = ast.dump(ast.parse(path.read_text())) != ast.dump(ast.parse(previous))
    except SyntaxError:
        solved = True  # half written
    if not solved:
        return False
    proc = subprocess.run(
        ["git", "diff", "--quiet", "HEAD", "--", path.name],
        cwd=path.parent,
        capture_output=True,
    )
    return proc.returncode != 0


def keep_a_copy(path: Path) -> Path:
    """Copy `path` to the first free name my_exercise.py, my_exercise_2.py, ... beside it."""
    copy = path.with_name("my_exercise.py")
    number = 1
    while copy.exists():
        number += 1
        copy = path.with_name(f"my_exercise_{number}.py")
    shutil.copy2(path, copy)
    return copy


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if an exercise is stale"
    )
    args = p.parse_args(argv)
    stale = []
    for chapter in list(CHAPTERS)[1:]:
        path = REPO / CHAPTERS[chapter] / "exercise.py"
        text = exercise(chapter)
        previous = (REPO / CHAPTERS[base(chapter)] / "train.py").read_text()
        # the TODOs are comments: the exercise is the previous chapter's program, token for token
        assert ast.dump(ast.parse(text)) == ast.dump(ast.parse(previous)), (
            f"{path}: a TODO broke the code"
        )
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(REPO)))
        else:
            if path.exists() and path.read_text() != text and edited_by_hand(path, previous):
                kept = keep_a_copy(path)
                print(f"{path.relative_to(REPO)} held someone's work: kept as {kept.name}")
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO)}")
    if stale:
        print(f"stale: {', '.join(stale)}: run {REGENERATE}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
