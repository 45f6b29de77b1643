"""Solving an exercise never breaks the course, and regenerating the exercises never loses a
learner's work: maintainer/make_exercises.py keeps an exercise that holds someone's work as
my_exercise.py (then my_exercise_2.py, ...) before writing it again."""

from __future__ import annotations

import subprocess

from common.chapters import CHAPTERS
from layout import REPO
from maintainer.make_exercises import edited_by_hand, exercise, keep_a_copy

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
