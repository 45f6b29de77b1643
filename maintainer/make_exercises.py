"""Make the exercises: each is the previous chapter's train.py with the chapter's changes
marked TODO.

    python -m maintainer.make_exercises          # write 0N_<chapter>/exercise.py, chapters 02 to 05
    python -m maintainer.make_exercises --check  # exit 1 if one no longer matches the scripts

The changes are difflib's, from chapter N-1's train.py to chapter N's, within each top-level
function and class matched by name (a class the chapter drops is removed where it stands, not lined
up with main()). A change that begins inside a statement takes the whole statement, so that no TODO
sits inside brackets, and `ruff format` leaves the exercises as they are. Above the lines each
change touches, a TODO says how many lines to add, change or remove there, with the comments of
the solution's new lines as the hint: they say why, the learner writes the code. A change without
a comment (an import, a print) shows its code. Changes only to the docstring or to comments are
left out. The solution is chapter N's own train.py. The learner solves a copy (ignored by git),
0N_<chapter>/my_exercise.py, and `python -m tools.check 0N_<chapter>/my_exercise.py` tells whether
it is the same run as chapter 01's. An exercise.py that holds someone's work (its code is no
longer the previous chapter's, and git does not hold it) is kept as my_exercise.py, or the next
free my_exercise_N.py, before it is written again.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import io
import shutil
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path

from common.chapters import CHAPTERS
from layout import REPO
from maintainer import REGENERATE
from tools.statements import DEFINITIONS, every_statement, header_end, indentation

WIDTH = 100  # the course's line length (ruff.toml)


def is_comment(line: str) -> bool:
    return line.strip().startswith("#") or not line.strip()


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


def imports_todo(old: list[str], new: list[str]) -> list[str]:
    """One TODO for every change to the imports: the lines to add and to remove (no comment fits
    between imports that a formatter keeps apart)."""
    before = [old[i] for i in import_lines(old) if old[i].strip()]
    after = [new[i] for i in import_lines(new) if new[i].strip()]
    changed = [f"- {line.strip()}" for line in before if line not in after]
    changed += [f"+ {line.strip()}" for line in after if line not in before]
    wrapped = [
        textwrap.wrap(line, WIDTH, initial_indent="#     ", subsequent_indent="#         ")
        for line in changed
    ]
    return [line + "\n" for lines in wrapped for line in lines]


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
    """The comments of the lines, a comment that goes on over the next lines joined into one."""
    comments = []
    joins = False  # the last line was a whole-line comment that the next one may go on
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            text = stripped.lstrip("# ").rstrip()
            goes_on = text[:1].islower() or text[:1] in "(`"
            if joins and comments and goes_on and not text.startswith("----"):
                comments[-1] += " " + text
            else:
                comments.append(text)
            joins = not text.startswith("----")
            continue
        joins = False
        if "  # " in line:  # a comment at the end of a line of code
            comments.append(line.split("  # ", 1)[1].strip())
    return comments


def hint_lines(old: list[str], new: list[str]) -> list[str]:
    """What the TODO quotes of the new lines: their comments that are new; no comments: the code."""
    if comments_of(new):
        kept = set(comments_of(old))
        return [comment for comment in comments_of(new) if comment not in kept]
    return [line.rstrip("\n") for line in new if line.strip()]


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


def todo_block(
    number: int, total: int, tag: str, old: list[str], new: list[str], indent: str
) -> list[str]:
    code_old = sum(1 for line in old if not is_comment(line))
    code_new = sum(1 for line in new if not is_comment(line))
    if tag == "insert":
        what = f"add {code_new} line(s) of code here"
    elif tag == "delete":
        what = f"remove the next {code_old} line(s) of code"
    else:
        what = f"change the next {code_old} line(s) of code" + (
            f" into {code_new}" if code_new != code_old else ""
        )
    quoted = hint_lines(old, new) if code_new else []
    show_code = quoted and not any(line.strip().startswith("#") or "  # " in line for line in new)
    lines = [f"{indent}# TODO {number}/{total}: {what}" + (":" if quoted else "")]
    for text in quoted:
        prefix = f"{indent}#     " if show_code else f"{indent}#   "
        lines += textwrap.wrap(
            text.strip(), WIDTH, initial_indent=prefix, subsequent_indent=prefix + "  "
        )
    return [line.rstrip() + "\n" for line in lines]


def exercise(chapter: int) -> str:
    previous, folder = CHAPTERS[chapter - 1], CHAPTERS[chapter]
    old = (REPO / previous / "train.py").read_text().splitlines(keepends=True)
    new = (REPO / folder / "train.py").read_text().splitlines(keepends=True)
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
        and not all(is_comment(line) for line in old[i1:i2] + new[j1:j2])  # comments only
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
        # indented as the line it stands above (the next one that is not blank)
        below = next((line for line in old[at:] if line.strip()), "")
        block = todo_block(number, total, tag, old[i1:i2], new[j1:j2], indentation(below))
        blocks.setdefault(at, []).extend(block)
    about = (
        f"Exercise: chapter {chapter:02d} ({folder}). This is chapter {chapter - 1:02d}'s "
        f"train.py; add chapter {chapter:02d}'s idea where the {total} TODOs say. A TODO says how "
        "the lines below it change and quotes the new comments of the solution there. Solve a "
        "copy, not this file: a my_*.py file is yours (git ignores it, and the course's tests read "
        "only this one). Then check your copy:"
    )
    solution = (
        f"The solution is {folder}/train.py (its README shows the diff). `cp -n` never overwrites "
        "a copy; to start again, copy this file under another name. This file is made by "
        "maintainer/make_exercises.py from the two scripts."
    )
    nproc = " --nproc-per-node 2" if chapter >= 4 else ""
    header = [
        *textwrap.wrap(about, 100, initial_indent="# ", subsequent_indent="# "),
        f"#     cp -n {folder}/exercise.py {folder}/my_exercise.py",
        f"#     python -m tools.check {folder}/my_exercise.py{nproc}",
        *textwrap.wrap(solution, 100, initial_indent="# ", subsequent_indent="# "),
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
        previous = (REPO / CHAPTERS[chapter - 1] / "train.py").read_text()
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
