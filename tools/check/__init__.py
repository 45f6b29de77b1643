"""Is your script chapter 01's run? `python -m tools.check SCRIPT` runs it next to chapter 01 and
compares them step by step (its --help says how).

One job a module: plan (what the check does for each chapter), runner (starting the runs and
reading what they left), probe (what each rank records), reference (chapter 01's run, cached),
harness (a script beside its reference: the first difference; the tests' parity checks too),
facts (what the comparison found), mistakes (the catalogue), lines (the script's code as quoted),
report (the verdict), __main__ (the command).
"""

from tools.check.reference import corpus_text

__all__ = ["corpus_text"]
