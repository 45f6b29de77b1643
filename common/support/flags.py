"""The command line's plumbing: value checks and one-line errors."""

import argparse
import math
import sys
from collections.abc import Callable


def _checked(name: str, convert: Callable, ok: Callable, rule: str) -> Callable:
    """An argparse type: `convert` the text, then refuse a value that is not `ok` in one line."""

    def check(text: str):
        value = convert(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    check.__name__ = name
    return check


positive_int = _checked("positive_int", int, lambda v: v >= 1, "a positive whole number")
non_negative_int = _checked("non_negative_int", int, lambda v: v >= 0, "zero or more")
# AdamW would refuse a negative value with a traceback, or train on nan
non_negative_float = _checked(
    "non_negative_float",
    float,
    lambda v: math.isfinite(v) and v >= 0,
    "a finite number, zero or more",
)
fraction = _checked("fraction", float, lambda v: 0.0 <= v < 1.0, "in [0, 1)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the script's docstring as written and shows every default once."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "(default" in (action.help or ""):  # the help says its default in its own words
            return action.help
        return super()._get_help_string(action)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line and exit status 2, as every other mistake is."""

    def __init__(self, **kwargs):
        super().__init__(**{"formatter_class": HelpFormatter, **kwargs})

    def error(self, message: str):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)
