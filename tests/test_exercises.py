"""The exercises (maintainer/make_exercises.py): each is its base's script with TODOs, which the
checker refuses as given, and which the published diff turns into the chapter; every hint is made
of whole comments; and regenerating them never loses a learner's work (an exercise that holds
someone's work is kept as my_exercise.py, then my_exercise_2.py, ...)."""

from __future__ import annotations

import re
import subprocess

import pytest

from common.chapters import CHAPTERS, base
from layout import REPO
from maintainer.make_exercises import edited_by_hand, exercise, keep_a_copy

EXERCISES = list(CHAPTERS)[1:]  # chapters 02 on: each has an exercise
TODO = re.compile(r"^(?P<indent> *)# TODO \d+/\d+: ")


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


def todos_of(text: str) -> tuple[list[str], list[list[str]]]:
    """The exercise less its header and its TODOs (each a TODO line and the comment lines under it
    indented deeper than its "# "), and each TODO's hint lines without their "#"."""
    lines = text.splitlines(keepends=True)
    while lines[0].startswith("#"):
        lines.pop(0)  # the header
    code, hints = [], []
    hint_prefix = None
    for line in lines:
        found = TODO.match(line)
        if found:
            hint_prefix = found["indent"] + "#   "
            hints.append([])
        elif hint_prefix and line.startswith(hint_prefix):
            hints[-1].append(line[len(hint_prefix) - 3 :].rstrip())
        else:
            hint_prefix = None
            code.append(line)
    return code, hints


def published_diff(chapter: int) -> str:
    """docs/diffs/: the chapter's diff against its base (maintainer/publish_diffs.py)."""
    return (REPO / "docs" / "diffs" / f"{CHAPTERS[chapter]}.diff").read_text()


def patched(lines: list[str], diff: str) -> str:
    """The lines with a unified diff applied, every context and removed line checked."""
    out, at = [], 0
    for hunk in re.split(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@.*\n", diff, flags=re.M)[1:]:
        if hunk.isdigit():
            start = max(int(hunk) - 1, 0) if hunk != "0" else 0
            out += lines[at:start]
            at = start
            continue
        for line in hunk.splitlines(keepends=True):
            if line[0] in " -":
                assert lines[at] == line[1:], (
                    f"line {at + 1} is {lines[at]!r}, the diff says {line!r}"
                )
                at += 1
            if line[0] in " +":
                out.append(line[1:])
    return "".join(out + lines[at:])


@pytest.mark.parametrize("chapter", EXERCISES)
def test_the_exercise_and_the_published_diff_give_the_chapter(chapter):
    """Less its TODOs, the exercise is its base's script; the published diff makes it the chapter.
    A TODO that stood inside a statement would leave a line of code behind, and fail here."""
    code, _ = todos_of(exercise(chapter))
    base_script = (REPO / CHAPTERS[base(chapter)] / "train.py").read_text()
    assert "".join(code) == base_script, f"exercise {chapter:02d} less its TODOs is not its base"
    solution = (REPO / CHAPTERS[chapter] / "train.py").read_text()
    assert patched(code, published_diff(chapter)) == solution


def whole_comments(source: str) -> set[str]:
    """Every comment of the source, whole, on one line: a run of comment lines is one (a banner,
    `# ---- data ----`, one of its own, without its dashes), a comment after code is another."""
    comments = []
    joined = False  # the line above was a comment line that this one may go on
    for line in source.splitlines():
        text = line.partition("#")[2].strip() if "#" in line else ""
        whole = line.lstrip().startswith("#")
        if whole and joined and text:
            comments[-1] += " " + text
        elif text:
            comments.append(text.strip("- "))
        joined = whole and not text.startswith("--")
    return set(comments)


@pytest.mark.parametrize("chapter", EXERCISES)
def test_every_hint_quotes_whole_comments_of_the_solution(chapter):
    """A hint's every `- ` item is one whole comment of the solution, never a piece of one."""
    solution = (REPO / CHAPTERS[chapter] / "train.py").read_text()
    comments = whole_comments(solution)
    _, hints = todos_of(exercise(chapter))
    assert hints, f"exercise {chapter:02d} has no TODO"
    for hint in hints:
        items = []
        for line in hint:
            if line.startswith("#   - "):
                items.append(line[len("#   - ") :])
            elif line.startswith("#     ") and items:
                items[-1] += " " + line.strip()
        for item in items:
            assert item in comments, f"exercise {chapter:02d}: no whole comment reads {item!r}"
