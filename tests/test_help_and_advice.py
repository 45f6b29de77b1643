"""What a reader sees before and after a run goes wrong: the defaults in --help, a later chapter's
flag refused with the chapter that introduces it."""

from __future__ import annotations

import re

import pytest

from common.config import CourseParser
from common.support.errors import CourseError
from tools.launch import run_python


def help_entries(text: str) -> dict[str, str]:
    """Each flag of a --help text with its whole help, its wrapped lines joined."""
    entries: dict[str, str] = {}
    flag = None
    for line in text.splitlines():
        match = re.match(r"^  (--[\w-]+)", line)
        if match:
            flag = match.group(1)
            entries[flag] = line
        elif flag is not None and line.startswith("     "):
            entries[flag] += " " + line.strip()
        else:
            flag = None
    return entries


@pytest.mark.quick
def test_help_shows_every_default_once():
    """Chapter 06's --help: chapter 01's flags and the ones chapters 02-06 add in their scripts.
    --stop-signal's value is checked as it is read (usr1 is SIGUSR1)."""
    proc = run_python(["06_fault_tolerance/train.py", "--stop-signal", "usr1", "--help"])
    shown = {flag: text for flag, text in help_entries(proc.stdout).items() if flag != "--help"}
    assert len(shown) > 30
    for flag, text in shown.items():
        assert text.count("(default") == 1, (flag, text)
        assert "(default: None)" not in text, (flag, text)
    for flag in ("--dropout", "--seed", "--weight-decay", "--beta1", "--beta2", "--lr-decay-iters"):
        assert "(default: " in shown[flag], flag
    assert "(default: --max-iters)" in shown["--lr-decay-iters"]
    assert "(default: 0.9)" in shown["--beta1"]
    for flag in ("--grad-accum", "--dist-timeout", "--shared-fs", "--stop-signal"):
        assert flag in shown, flag
    assert "--gpus" not in shown  # chapter 03's alone


def test_a_chapter_shows_only_its_own_flags():
    shown = help_entries(CourseParser(chapter=1, description="").format_help())
    assert "--seed" in shown
    for flag in ("--grad-accum", "--gpus", "--dist-timeout", "--shared-fs", "--stop-signal"):
        assert flag not in shown, flag


@pytest.mark.quick
@pytest.mark.parametrize("chapter", [1, 2, 3, 4, 5])
def test_the_stop_signal_is_chapter_06s(chapter):
    """Chapters 01-05 end at a signal; --stop-signal (save the step, then stop) is chapter 06's."""
    parser = CourseParser(chapter=chapter, description="")
    for words in (["--stop-signal", "USR1"], ["--stop-signal=USR1"]):
        with pytest.raises(CourseError, match=r"^--stop-signal is introduced in chapter 06"):
            parser.parse_args(words)


def test_an_unknown_flag_is_argparses_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        CourseParser(chapter=4, description="").parse_args(["--no-such-flag", "1"])
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error == "error: unrecognized arguments: --no-such-flag 1 (see --help)"
