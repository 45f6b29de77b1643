"""Where the course's parts lie: its root folder (the one `REPO` of the tests, benchmarks and
generators) and the modules of a chapter folder. The chapter scripts do without it: each
finds common/ from its own path, as a lesson should read."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent  # the course's root folder: this file lies in it


def chapter_module(folder: str, name: str) -> ModuleType:
    """A module of a chapter folder (04_ddp/ddp_by_hand.py), imported as `python 04_ddp/...` sees
    it: under its own name, since a folder named 04_ddp is no package name.

    A module that imports a sibling (04_ddp/zero1.py imports ddp_by_hand) finds it when the
    sibling was imported here first.
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
