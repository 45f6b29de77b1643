"""Make the exercises: the script each chapter builds on, with the chapter's changes marked TODO.

    python -m maintainer.make_exercises          # write 0N_<chapter>/exercise.py, chapter 02 on
    python -m maintainer.make_exercises --check  # exit 1 if one no longer matches the scripts

An exercise is its base's train.py (common/chapters.py) with a TODO above each change of the
published diff, widened to whole statements and comments. A TODO says how many lines of code change
and hints with whole things, never a piece: the solution's new comments there (or else its code),
the defs it adds; the imports' TODO, what the solution imports. An exercise.py that holds someone's
work (its code is not the base's, and git does not hold it) is kept as my_exercise.py (or _N).
"""

import argparse
import ast
import difflib
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from common.chapters import CHAPTERS, base
from layout import REPO
from maintainer import REGENERATE

WIDTH = 100  # the course's line length (ruff.toml)
HINT_LINES = 12  # the most lines of comments or code a hint shows; the rest are counted


def statement_starts(lines: list[str]) -> set[int]:
    """The lines (from 0) a TODO may stand above: not inside a statement, nor a comment's second."""
    inside = set()
    for node in ast.walk(ast.parse("".join(lines))):
        if isinstance(node, ast.stmt):
            body = getattr(node, "body", None)
            end = body[0].lineno - 1 if isinstance(body, list) else node.end_lineno
            inside |= {row for row in range(node.lineno, end) if lines[row].strip()[:1] != "#"}
    comments = {row for row, line in enumerate(lines) if line.strip()[:1] == "#"}
    goes_on = {row for row in comments if row - 1 in comments}
    return set(range(len(lines) + 1)) - inside - goes_on


def changes(old: list[str], new: list[str]) -> list[list[int]]:
    """The differing stretches [i1, i2, j1, j2] of old and new, widened to whole statements."""
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    stretches = [[i1, i2, j1, j2] for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag[0] != "e"]
    old_starts = statement_starts(old)
    new_starts = statement_starts(new)
    merged: list[list[int]] = []
    next_starts = [stretch[0] for stretch in stretches[1:]] + [len(old)]
    for (i1, i2, j1, j2), next_start in zip(stretches, next_starts):
        # the lines between two stretches are the same on both sides: widen both alike
        last_end = merged[-1][1] if merged else -1
        while (i1 not in old_starts or j1 not in new_starts) and i1 > last_end:
            i1, j1 = i1 - 1, j1 - 1
        if i1 <= last_end:  # they meet: one change
            i1, _, j1, _ = merged.pop()
        while (i2 not in old_starts or j2 not in new_starts) and i2 < next_start:
            i2, j2 = i2 + 1, j2 + 1
        merged.append([i1, i2, j1, j2])
    return merged


def is_code(line: str) -> bool:
    return line.strip()[:1] not in "#"  # "" is in it too: a blank line is no code


def comments_of(lines: list[str]) -> list[str]:
    """The comments of the lines, each whole: a block of comment lines is one, a banner its own."""
    comments: list[str] = []
    goes_on = False  # the line above was a comment line that the next one may go on
    for line in lines:
        text = line.partition("#")[2].strip()
        whole = line.lstrip().startswith("#")
        if text and whole and goes_on:
            comments[-1] += " " + text
        elif text and (whole or "  # " in line):
            comments.append(text.strip("- "))
        goes_on = whole and not text.startswith("--")
    return comments


def header(node: ast.FunctionDef | ast.ClassDef, source: str) -> str:
    """A def's or a class's first line as the source writes it, on one line, less its colon."""
    lines = source.splitlines()[node.lineno - 1 : node.body[0].lineno - 1]
    text = " ".join(" ".join(line for line in lines if line.strip()[:1] not in "\"'").split())
    return text.removesuffix(":").replace("( ", "(").replace(",)", ")").replace(" )", ")")


def wrapped(text: str, first: str, later: str) -> list[str]:
    """The text as lines that begin with first, then later, at most WIDTH long."""
    return textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=later)


def what_to_do(old: list[str], new: list[str]) -> str:
    """`change the next 3 lines of code into 5 lines`: what a TODO asks of the lines under it."""
    old_code = sum(map(is_code, old))
    new_code = sum(map(is_code, new))
    the_next = "the next line" if old_code == 1 else f"the next {old_code} lines"
    into = "a line" if new_code == 1 else f"{new_code} lines"
    if old_code == 0:
        return f"add {into} of code here"
    if new_code == 0:
        return f"remove {the_next} of code"
    return f"change {the_next} of code" + (f" into {into}" if new_code != old_code else "")


def hint(old: list[str], new: list[str], first: int, trees: tuple, indent: str) -> list[str]:
    """A TODO's hint: the defs the new lines add; their comments that the old lines lack, each
    whole (where there is none, their code, a statement whole). Each line begins with indent."""
    old_tree, new_tree, solution = trees
    say = indent + "#   "
    lines = []
    defined = [n for n in ast.walk(new_tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    for node in sorted(defined, key=lambda node: node.lineno):
        if first < node.lineno <= first + len(new):
            paragraph = " ".join((ast.get_docstring(node) or "").split("\n\n")[0].split())
            said = re.split(r"(?<=[.!?])\s", paragraph)[0]  # its docstring's first sentence
            text = f"{header(node, solution)}: {said}".removesuffix(": ")
            deeper = say + " " * max(node.col_offset - len(indent), 0)
            lines += wrapped(text, deeper, deeper + "    ")
    said = comments_of(old)
    items = [wrapped(text, say + "- ", say + "  ") for text in comments_of(new) if text not in said]
    if not items and not lines:  # nothing else to say: the code is the hint
        code = textwrap.dedent("".join(filter(is_code, new)))
        for line in code.splitlines():
            if items and (line[:1].isspace() or line[:1] in ")]}"):
                items[-1].append(say + "  " + line)
            else:
                items.append([say + "  " + line])
    shown = []
    left = 0
    for item in items:
        fits = len(shown) + len(item) <= HINT_LINES or not shown
        if fits and max(len(line) for line in item) <= WIDTH:
            shown += item
        else:
            left += 1
    if left:
        shown.append(f"{say}(and {left} more in the solution)")
    return lines + shown


def imports_hint(*trees: ast.Module) -> list[str]:
    """The imports to remove (-) and to add (+): ruff keeps a comment apart from imports."""
    kinds = (ast.Import, ast.ImportFrom)
    imports = [[ast.unparse(n) for n in tree.body if isinstance(n, kinds)] for tree in trees]
    lines = [f"- {statement}" for statement in imports[0] if statement not in imports[1]]
    lines += [f"+ {statement}" for statement in imports[1] if statement not in imports[0]]
    return [line for text in lines for line in wrapped(text, "#   ", "#       ")]


def exercise(chapter: int) -> str:
    """Chapter N's exercise: its base's script with TODOs that lead to its own, under a header."""
    folder = CHAPTERS[chapter]
    solution = (REPO / folder / "train.py").read_text()
    old = (REPO / CHAPTERS[base(chapter)] / "train.py").read_text().splitlines(keepends=True)
    new = solution.splitlines(keepends=True)
    trees = (ast.parse("".join(old)), ast.parse(solution), solution)
    heads = [node for node in trees[0].body if isinstance(node, (ast.Import, ast.ImportFrom))]
    import_lines = range(heads[0].lineno - 1, heads[-1].end_lineno)
    docstring_end = trees[0].body[0].end_lineno
    todos = []  # (the line it stands above, what it asks, its hint)
    if imports_hint(*trees[:2]):
        todos.append((import_lines.start, "# TODO {}: the imports", imports_hint(*trees[:2])))
    for i1, i2, j1, j2 in changes(old, new):
        # a change only to comments or to the docstring leaves the learner no code to write
        code = [
            [line.split("  # ")[0].strip() for line in filter(is_code, lines)]
            for lines in (old[i1:i2], new[j1:j2])
        ]
        if i1 in import_lines or i1 < docstring_end or code[0] == code[1]:
            continue
        at = i1
        while at < i2 and not old[at].strip():
            at += 1  # above the first line that is not blank
        below = next((line for line in old[at:] if line.strip()), "")
        indent = below[: len(below) - len(below.lstrip())]
        lines = hint(old[i1:i2], new[j1:j2], j1, trees, indent)
        todos.append((at, indent + "# TODO {}: " + what_to_do(old[i1:i2], new[j1:j2]), lines))
    blocks = {}
    for number, (at, what, lines) in enumerate(todos, 1):
        todo = what.format(f"{number}/{len(todos)}") + (":" if lines else "")
        blocks[at] = [line + "\n" for line in [todo, *lines]]
    nproc = " --nproc-per-node 2" if chapter >= 4 else ""
    number, start, count = f"{chapter:02d}", f"{base(chapter):02d}", len(todos)
    out = [
        f"# Exercise: chapter {number} ({folder}). Add its idea to chapter {start}'s train.py",
        f"# where the {count} TODOs say, in a copy (git ignores my_*.py files, and the course's",
        "# tests read only this one), then check it:",
        f"#     cp -n {folder}/exercise.py {folder}/my_exercise.py",
        f"#     python -m tools.check {folder}/my_exercise.py{nproc}",
        f"# The solution is {folder}/train.py; its README shows the diff. This file is made by",
        "# maintainer/make_exercises.py from the two scripts.",
    ]
    out = [line + "\n" for line in out]
    for i, line in enumerate(old):
        out += [*blocks.get(i, []), line]
    return "".join(out)


def edited_by_hand(path: Path, previous: str) -> bool:
    """Whether `path` holds someone's work: code not the base's, which git does not hold."""
    try:
        solved = ast.dump(ast.parse(path.read_text())) != ast.dump(ast.parse(previous))
    except SyntaxError:
        solved = True  # half written
    git = ["git", "diff", "--quiet", "HEAD", "--", path.name]
    return solved and subprocess.run(git, cwd=path.parent, capture_output=True).returncode != 0


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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if one is stale")
    check = p.parse_args(argv).check
    stale = []
    for chapter in list(CHAPTERS)[1:]:
        path = REPO / CHAPTERS[chapter] / "exercise.py"
        text = exercise(chapter)
        previous = (REPO / CHAPTERS[base(chapter)] / "train.py").read_text()
        # the TODOs are comments: the exercise is the base's program, token for token
        assert ast.dump(ast.parse(text)) == ast.dump(ast.parse(previous)), f"{path}: broken"
        if path.exists() and path.read_text() == text:
            continue
        if check:
            stale.append(str(path.relative_to(REPO)))
            continue
        if path.exists() and edited_by_hand(path, previous):
            print(f"{path.relative_to(REPO)} held someone's work: kept as {keep_a_copy(path).name}")
        path.write_text(text)
        print(f"wrote {path.relative_to(REPO)}")
    if stale:
        print(f"stale: {', '.join(stale)}: run {REGENERATE}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
