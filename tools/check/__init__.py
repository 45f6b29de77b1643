"""Is your script chapter 01's run? `python -m tools.check SCRIPT` runs it next to chapter 01 and
compares them step by step (its --help says how).

The modules: reference (each chapter's plan, the runs, the run compared with), probe (what each
rank records), harness (the first difference; the tests' parity checks too), facts (what the
comparison found), mistakes (the catalogue), __main__ (the command and its verdict).
"""

from tools.check.reference import corpus_text

__all__ = ["corpus_text"]
