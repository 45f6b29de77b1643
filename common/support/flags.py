"""The command line's guards: value checks, one-line errors, and flags of other chapters.

A flag that a chapter does not support yet is still recognised (hidden from --help), so that using
it too early gets a message naming the chapter that introduces it instead of "unrecognized arguments".
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from ..chapters import CHAPTERS
from .errors import CourseError

# flag -> (the first chapter that uses it, the last); what to say to whoever uses it after its last
CHAPTER_FLAGS = {"--grad-accum": (2, 5), "--gpus": (3, 3), "--backend": (4, 5), "--dist-timeout": (4, 5)}
CHAPTER_FLAGS["--shared-fs"] = (5, 5)
RETIRED = {
    "--gpus": "chapter 03's DataParallel flag; here each process drives one GPU and torchrun starts them: "
    "torchrun --standalone --nproc_per_node=N {script}"
}


def _checked(name: str, convert, ok, rule: str):
    """An argparse type: `convert` the text, refuse values that are not `ok` with `rule` (one line)."""

    def check(text: str):
        value = convert(text)  # a ValueError here is argparse's "invalid <name> value"
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    check.__name__ = name
    return check


positive_int = _checked("positive_int", int, lambda v: v >= 1, "a positive whole number")
non_negative_int = _checked("non_negative_int", int, lambda v: v >= 0, "zero or more")
# AdamW would refuse a negative value with a traceback, or train on nan
non_negative_float = _checked(
    "non_negative_float", float, lambda v: math.isfinite(v) and v >= 0, "a finite number, zero or more"
)
fraction = _checked("fraction", float, lambda v: 0.0 <= v < 1.0, "in [0, 1)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the script's docstring as written and shows every default once."""

    def _get_help_string(self, action):
        return action.help if "(default" in (action.help or "") else super()._get_help_string(action)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line and exit status 2, as every other mistake is."""

    def error(self, message: str):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def not_in_chapter(chapter: int, flag: str) -> bool:
    """Whether `flag` belongs to other chapters than this one: hidden from --help, refused when used."""
    first, last = CHAPTER_FLAGS.get(flag, (1, 5))
    return not first <= chapter <= last


def refuse_other_chapters_flags(chapter: int, args: argparse.Namespace) -> None:
    for flag, (first, last) in CHAPTER_FLAGS.items():
        if getattr(args, flag.lstrip("-").replace("-", "_")) in (None, False):
            continue  # not used
        if chapter < first:
            raise CourseError(
                f"{flag} is introduced in chapter {first:02d} ({CHAPTERS[first]}); "
                f"this is chapter {chapter:02d}: run {CHAPTERS[first]}/train.py to use it"
            )
        if chapter > last:
            raise CourseError(f"{flag} is " + RETIRED[flag].format(script=f"{CHAPTERS[chapter]}/train.py"))


def check_out_dir(out_dir: str) -> None:
    """--out-dir must be a folder, or a path where one can be made: not an existing file."""
    path = Path(out_dir)
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                raise CourseError(
                    f"--out-dir {out_dir}: {folder} is a file, not a folder; "
                    "give a folder for metrics.jsonl and ckpt.pt (new or an earlier run's)"
                )
            return
