"""What a reader sees before and after a run goes wrong: the defaults in --help, and
the divergence advice."""

from __future__ import annotations

import argparse

import pytest

from common.config import build_parser, parse_args
from common.support.errors import CourseError
from common.training import check_finite


@pytest.mark.quick
@pytest.mark.parametrize("chapter", [1, 4])
def test_help_shows_every_default_once(chapter):
    parser = build_parser(chapter, "")
    shown = {  # each flag's line of --help, as the formatter expands it
        action.option_strings[0]: parser._get_formatter()._expand_help(action)
        for action in parser._actions
        if action.help != argparse.SUPPRESS and action.option_strings[0] != "-h"
    }
    assert len(shown) > 30
    for flag, text in shown.items():
        assert text.count("(default") == 1, (flag, text)
        assert "(default: None)" not in text, (flag, text)
    for flag in ("--dropout", "--seed", "--weight-decay", "--beta1", "--beta2", "--lr-decay-iters"):
        assert "(default: " in shown[flag], flag
    assert "(default: --max-iters)" in shown["--lr-decay-iters"]
    assert "(default: 0.9)" in shown["--beta1"]
    assert "--seed" in " ".join(parser.format_help().split())


def test_divergence_is_one_line_that_names_the_fix():
    with pytest.raises(CourseError) as err:
        check_finite(7, float("nan"))
    message = str(err.value)
    assert "\n" not in message
    assert message == (
        "the run diverged at step 7: training loss nan; no checkpoint was written from it "
        "(the last one, if any, is intact); try a lower --lr or --dtype float32, "
        "with --resume to continue from the checkpoint"
    )
    check_finite(7, 2.5)  # a finite loss goes on


@pytest.mark.quick
@pytest.mark.parametrize("chapter", [1, 2, 3, 4])
def test_the_stop_signal_is_chapter_05s(chapter):
    """Chapters 01-04 end at a signal; --stop-signal (save the step, then stop) is chapter 05's."""
    with pytest.raises(CourseError, match=r"^--stop-signal is introduced in chapter 05"):
        parse_args(chapter, "", ["--stop-signal", "USR1"])
    assert parse_args(5, "", ["--stop-signal", "USR1"]).stop_signal == "SIGUSR1"
