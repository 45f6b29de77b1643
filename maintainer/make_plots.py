"""The machine helpers bench/slow_link.py imports from here: the pictures are committed files now
(docs/figures/CAPTIONS.md names the runs that drew them), and the helpers live in
maintainer/results.py."""

from maintainer.results import load_average, machine_description

__all__ = ["load_average", "machine_description"]
