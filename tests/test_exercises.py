"""Solving an exercise never breaks the course, and regenerating the exercises never loses a
learner's work: maintainer/make_exercises.py keeps an exercise that holds someone's work as
my_exercise.py (then my_exercise_2.py, ...) before writing it again."""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import re
import subprocess
import textwrap
import tokenize
from dataclasses import dataclass

import pytest

from common.chapters import CHAPTERS, base
from layout import REPO
from maintainer.make_exercises import (
    BODY_LINES,
    HINT_LINES,
    edited_by_hand,
    exercise,
    exercise_of,
    keep_a_copy,
)

PREVIOUS = "def main() -> None:\n    x = 1\n    print(x)\n"


def git(folder, *args) -> None:
    subprocess.run(["git", *args], cwd=folder, check=True, capture_output=True)


def test_only_work_that_git_does_not_hold_is_someones(tmp_path):
    path = tmp_path / "exercise.py"
    path.write_text("# TODO 1/1: change the line below\n" + PREVIOUS)
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "exercise.py")
    git(tmp_path, "-c", "user.name=c", "-c", "user.email=c@c", "commit", "-q", "-m", "given")
    assert not edited_by_hand(path, PREVIOUS)  # as given
    path.write_text(PREVIOUS + "# a note of mine\n")
    assert not edited_by_hand(path, PREVIOUS)  # the code is still the previous chapter's
    path.write_text(PREVIOUS.replace("x = 1", "x = 2"))
    assert edited_by_hand(path, PREVIOUS)  # solved, and not committed
    path.write_text(PREVIOUS.replace("x = 1", "x = ("))
    assert edited_by_hand(path, PREVIOUS)  # half written
    git(tmp_path, "-c", "user.name=c", "-c", "user.email=c@c", "commit", "-qam", "mine")
    path.write_text(PREVIOUS.replace("x = 1", "x = ("))
    assert not edited_by_hand(path, PREVIOUS)  # what git holds can be had again


def test_a_kept_copy_never_overwrites_another(tmp_path):
    path = tmp_path / "exercise.py"
    path.write_text("first")
    assert keep_a_copy(path) == tmp_path / "my_exercise.py"
    path.write_text("second")
    assert keep_a_copy(path) == tmp_path / "my_exercise_2.py"
    assert (tmp_path / "my_exercise.py").read_text() == "first"
    assert (tmp_path / "my_exercise_2.py").read_text() == "second"


def test_each_header_tells_the_learner_to_solve_a_copy():
    for chapter in list(CHAPTERS)[1:]:
        folder = CHAPTERS[chapter]
        header = exercise(chapter).split('"""')[0]
        assert f"cp -n {folder}/exercise.py {folder}/my_exercise.py" in header
        assert f"python -m tools.check {folder}/my_exercise.py" in header
        assert "git checkout" not in header  # it would throw away the learner's work
    assert "my_*.py" in (REPO / ".gitignore").read_text().splitlines()


# ---- what the TODOs tell: every chapter's, made from the scripts as they are now ----------------
# These read chapter N's train.py against chapter N-1's on their own (imports, calls, defs), not
# through the generator's code, so that they hold for whatever the scripts become.

EXERCISES = list(CHAPTERS)[1:]  # chapters 02 .. 07: each has an exercise
TODO = re.compile(r"^(?P<indent> *)# TODO (?P<number>\d+)/(?P<total>\d+): (?P<what>.*)$")


@dataclass
class Todo:
    what: str  # "change the next 2 lines of code into 4 lines:"
    hint: list[str]  # the lines under it, without their "#" and the TODO's indentation

    def text(self) -> str:
        """The TODO on one line, its words one space apart: a wrapped line joins up again."""
        return " ".join(" ".join([self.what, *self.hint]).split())


def todos_of(text: str) -> list[Todo]:
    """Each TODO and its hint: the comment lines under it, indented deeper than its own "# "."""
    lines = text.splitlines()
    todos = []
    for i, line in enumerate(lines):
        found = TODO.match(line)
        if not found:
            continue
        hint = []
        deeper = found["indent"] + "#  "
        for below in lines[i + 1 :]:
            if not below.startswith(deeper) or not below[len(deeper) :].strip():
                break
            hint.append(below[len(found["indent"]) + 1 :])
        todos.append(Todo(found["what"], hint))
    return todos


def source_of(chapter: int) -> str:
    return (REPO / CHAPTERS[chapter] / "train.py").read_text()


def imported(tree: ast.Module) -> dict[str, str]:
    """Every name the module imports -> the path it stands for (`dist` -> torch.distributed)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    head = alias.name.split(".")[0]
                    names[head] = head
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def dotted(expr: ast.AST, names: dict[str, str]) -> str | None:
    """`dist.init_process_group` as torch.distributed.init_process_group; None: not imported."""
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name) or expr.id not in names:
        return None
    return ".".join([names[expr.id], *reversed(parts)])


def used(tree: ast.Module) -> set[str]:
    """The imported names the code refers to in any way, as dotted paths."""
    names = imported(tree)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.Attribute)):
            path = dotted(node, names)
            if path:
                found.add(path)
    return found


def called(tree: ast.Module) -> set[str]:
    """The imported functions and classes the code calls or derives a class from, as paths."""
    names = imported(tree)
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Call):
            targets = [node.func]
        elif isinstance(node, ast.ClassDef):
            targets = node.bases
        for target in targets:
            path = dotted(target, names)
            if path:
                found.add(path)
    return found


def newly_called(chapter: int, package: str) -> list[str]:
    """What chapter N's script calls from `package` ("common", "torch") that N-1's never uses."""
    old = used(ast.parse(source_of(base(chapter))))
    new = called(ast.parse(source_of(chapter)))
    return sorted(p for p in new - old if p.split(".")[0] == package)


def header_as_written(node: ast.FunctionDef, source: str) -> str:
    """A def's header as its source writes it, on one line: `f(x: int, y=2) -> str`."""
    lines = source.splitlines()[node.lineno - 1 : node.body[0].lineno - 1]
    header = " ".join(" ".join(lines).split())
    header = header.removeprefix("def ").removesuffix(":")
    header = header.replace("( ", "(").replace(" )", ")").replace(",)", ")")
    return header


def signature_of(path: str) -> tuple[str, str]:
    """The signature a TODO must show for a helper of common (a class: its __init__ without self),
    and the first line of its docstring, read from the source where Python finds it."""
    module_name, name = path.rsplit(".", 1)
    helper = getattr(importlib.import_module(module_name), name)
    source = textwrap.dedent(inspect.getsource(helper))
    node = ast.parse(source).body[0]
    docstring = ast.get_docstring(node) or ""
    if isinstance(node, ast.ClassDef):
        init = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
        header = header_as_written(init, source)
        header = header.replace("__init__(self, ", f"{name}(").replace(
            "__init__(self)", f"{name}()"
        )
        docstring = docstring or ast.get_docstring(init) or ""
    else:
        header = header_as_written(node, source)
    return f"{module_name}.{header}", " ".join(docstring.split("\n")[0].split())


@pytest.mark.parametrize("chapter", EXERCISES)
def test_the_exercise_is_the_previous_chapters_program_token_for_token(chapter):
    def code_tokens(text: str) -> list[tuple[int, str]]:
        skipped = (tokenize.COMMENT, tokenize.NL)
        tokens = tokenize.generate_tokens(io.StringIO(text).readline)
        return [(t.type, t.string) for t in tokens if t.type not in skipped]

    assert code_tokens(exercise(chapter)) == code_tokens(source_of(base(chapter)))


def named_lines(hint: list[str]) -> int:
    """How many lines of a hint name something (`uses ...`, `def ...`, `class ...`, a class's
    `overrides ...`, an import to add or remove), with the lines they go on over (deeper than a
    comment's next lines)."""
    count = 0
    naming = False
    for line in hint:
        text = line.removeprefix("   ")
        starts = re.match(r"(uses|def|class) |  (overrides|defines|\+|-) ", text)
        if starts:
            naming = True
        elif not text.startswith("    "):
            naming = False
        count += naming
    return count


def hint_words(todo: Todo) -> list[str]:
    """The lines of a hint that say something: not only brackets, signs and dots."""
    return [line for line in todo.hint if line.strip("# -+():,.'\"")]


@pytest.mark.parametrize("chapter", EXERCISES)
def test_every_todo_gives_a_hint_that_fits(chapter):
    """Every TODO says something beyond how many lines change, in about HINT_LINES lines: the
    comments or the code are cut to fit what the TODO must name, which always goes in whole."""
    text = exercise(chapter)
    todos = todos_of(text)
    first = next(found for line in text.splitlines() if (found := TODO.match(line)))
    assert len(todos) == int(first["total"])
    for todo in todos:
        assert hint_words(todo), f"exercise {chapter:02d}: `TODO {todo.what}` gives no hint"
        most = max(HINT_LINES, named_lines(todo.hint) + BODY_LINES)
        assert len(todo.hint) <= most, f"exercise {chapter:02d}: {todo.text()[:80]}"
    assert all(len(line) <= 100 for line in text.splitlines())


@pytest.mark.parametrize("chapter", EXERCISES)
def test_every_hint_is_whole_sentences_and_its_counts_read_as_english(chapter):
    """No hint is cut short with "..." (a comment, a docstring's sentence, a line of code), and no
    count reads "line(s)": what does not fit is left out whole, and the hint says how much."""
    for todo in todos_of(exercise(chapter)):
        said = f"exercise {chapter:02d}: {todo.text()[:80]}"
        assert "(s)" not in todo.what, said
        assert not re.search(r"\b1 lines\b|\bnext 1 line\b", todo.what), said
        for line in todo.hint:
            assert not line.rstrip().endswith("..."), f"{said}: {line}"
            assert not re.search(r"\b1 more \w+s\b|\(\d+ more \w+\(s\)", line), f"{said}: {line}"


@pytest.mark.parametrize("chapter", EXERCISES)
def test_every_new_helper_of_common_is_named_with_its_signature(chapter):
    todos = [todo.text() for todo in todos_of(exercise(chapter))]
    for path in newly_called(chapter, "common"):
        signature, docstring = signature_of(path)
        assert any(signature in todo and docstring in todo for todo in todos), (
            f"exercise {chapter:02d}: no TODO names `{signature}: {docstring}`"
        )


@pytest.mark.parametrize("chapter", EXERCISES)
def test_every_new_name_from_torch_is_named(chapter):
    todos = [todo.text() for todo in todos_of(exercise(chapter))]
    for path in newly_called(chapter, "torch"):
        assert any(path in todo for todo in todos), f"exercise {chapter:02d}: no TODO names {path}"


@pytest.mark.parametrize("chapter", EXERCISES)
def test_every_new_class_names_what_it_overrides(chapter):
    """A class new in the chapter: each method that hands on to its base's (super().name(...)) is
    an override, named in a TODO with its signature as written."""
    source = source_of(chapter)
    old = {n.name for n in ast.parse(source_of(base(chapter))).body if isinstance(n, ast.ClassDef)}
    todos = [todo.text() for todo in todos_of(exercise(chapter))]
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef) or node.name in old or not node.bases:
            continue
        for method in node.body:
            if not isinstance(method, ast.FunctionDef):
                continue
            hands_on = any(
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and call.func.attr == method.name
                and isinstance(call.func.value, ast.Call)
                and isinstance(call.func.value.func, ast.Name)
                and call.func.value.func.id == "super"
                for call in ast.walk(method)
            )
            if hands_on:
                header = header_as_written(method, source)
                assert any(header in todo for todo in todos), (
                    f"exercise {chapter:02d}: no TODO names {node.name}'s override {header}"
                )


# ---- the same, on scripts made up here: what the TODOs say does not hang on today's scripts -----

PREVIOUS_SCRIPT = """\"\"\"A script.\"\"\"

import torch

from common.training import lr_at


def main() -> None:
    # the rate of step 1
    lr = lr_at(1, None)
    torch.manual_seed(0)  # the same draw every run
    x = torch.ones(2)  # two ones
    print(x, lr)


if __name__ == "__main__":
    main()
"""


def test_a_change_whose_comments_all_stood_before_shows_its_code():
    solution = PREVIOUS_SCRIPT.replace(
        "    x = torch.ones(2)  # two ones\n",
        "    x = torch.ones(3)  # two ones\n    y = x * 2\n",
    )
    todos = todos_of(exercise_of(2, PREVIOUS_SCRIPT, solution))
    assert [todo.what for todo in todos] == ["change the next line of code into 2 lines:"]
    assert todos[0].hint == ["     x = torch.ones(3)  # two ones", "     y = x * 2"]


def test_a_helper_and_a_torch_function_new_in_the_chapter_are_named():
    solution = PREVIOUS_SCRIPT.replace(
        "from common.training import lr_at\n",
        "from common.sharding import shard_full_state\nfrom common.training import lr_at\n",
    ).replace(
        "    print(x, lr)\n",
        "    # every rank its rows\n    shard_full_state(x, None, {}, None)\n"
        "    torch.distributed.barrier()\n    print(x, lr)\n",
    )
    todos = [todo.text() for todo in todos_of(exercise_of(2, PREVIOUS_SCRIPT, solution))]
    signature, docstring = signature_of("common.sharding.shard_full_state")
    assert any(signature in todo and docstring in todo for todo in todos), todos
    assert any("torch.distributed.barrier" in todo for todo in todos), todos
    assert not any("lr_at" in todo for todo in todos)  # chapter N-1 used it already


def test_a_new_class_names_its_overrides_and_the_helpers_they_call():
    new_class = (
        "class Wrapped(torch.nn.DataParallel):\n"
        '    """DataParallel whose replicas compute in autocast."""\n\n'
        "    def parallel_apply(self, replicas, inputs, kwargs):\n"
        "        replicas = [in_autocast(r, None, None) for r in replicas]\n"
        "        return super().parallel_apply(replicas, inputs, kwargs)\n\n\n"
    )
    solution = PREVIOUS_SCRIPT.replace(
        "from common.training import lr_at\n",
        "from common.dataparallel import in_autocast\nfrom common.training import lr_at\n",
    ).replace("def main() -> None:\n", new_class + "def main() -> None:\n")
    todos = [todo.text() for todo in todos_of(exercise_of(2, PREVIOUS_SCRIPT, solution))]
    text = " ".join(todos)
    assert "class Wrapped(torch.nn.DataParallel): DataParallel whose replicas" in text
    assert "overrides parallel_apply(self, replicas, inputs, kwargs)" in text
    signature, docstring = signature_of("common.dataparallel.in_autocast")
    assert f"{signature}: {docstring}" in text
    assert "torch.nn.DataParallel" in text


def test_lines_to_remove_say_what_leaves_the_program():
    solution = PREVIOUS_SCRIPT.replace("    torch.manual_seed(0)  # the same draw every run\n", "")
    todos = todos_of(exercise_of(2, PREVIOUS_SCRIPT, solution))
    assert [todo.what for todo in todos] == ["remove the next line of code:"]
    assert todos[0].text().endswith("gone from the solution: torch.manual_seed")
