"""What a reader sees before and after a run goes wrong: the defaults in --help, and
the divergence advice."""

from __future__ import annotations

import argparse

import pytest
import torch

from common.config import build_parser
from common.support.errors import CourseError
from common.training import stop_if_diverged


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


def advice(grad_clip, dtype) -> str:
    with pytest.raises(CourseError) as err:
        stop_if_diverged(7, float("nan"), None, None, grad_clip, dtype)
    return str(err.value).split("; try ", 1)[1]


def test_divergence_advice_names_only_what_would_change():
    assert advice(0.0, torch.bfloat16).startswith(
        "a lower --lr, --grad-clip 1.0 or --dtype float32,"
    )
    assert advice(5.0, torch.float32).startswith("a lower --lr or --grad-clip 1.0,")
    assert advice(1.0, torch.float16).startswith("a lower --lr or --dtype float32,")
    # clipping and float32 are on already
    assert advice(1.0, torch.float32).startswith("a lower --lr,")
    assert advice(0.5, torch.float64).startswith("a lower --lr,")
    assert "with --resume" in advice(1.0, torch.float32)
