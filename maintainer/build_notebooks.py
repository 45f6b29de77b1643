"""Make every chapter's notebook.ipynb from its source, notebook.py (jupytext's percent
format), with outputs.

    python -m maintainer.build_notebooks           # run each notebook.py, write notebook.ipynb
    python -m maintainer.build_notebooks 04_ddp 05_multinode   # only these chapters
    python -m maintainer.build_notebooks --check   # runs nothing: exit 1 if a notebook is stale

Edit notebook.py (any editor, or Jupyter with jupytext installed), never the .ipynb. Each notebook
is executed here in a fresh kernel from its chapter folder, on the course's own data/ folder, and
committed with its outputs so that it reads as a finished notebook where the repository is browsed.
A notebook whose outputs name this machine's folders is not written.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

from common.chapters import CHAPTERS
from common.data import prepare
from layout import REPO
from maintainer import REGENERATE
from tools.launch import child_env

KERNEL = "python3"
# Folders of the machine that runs the notebooks: outputs must not show them
MACHINE_PATHS = [str(REPO), str(Path.home()), str(Path(tempfile.gettempdir()).resolve())]


def source(folder: Path) -> nbformat.NotebookNode:
    """The notebook that folder/notebook.py describes, without outputs: the cells that the
    .ipynb must hold."""
    nb = jupytext.read(folder / "notebook.py")
    nb.metadata = {"kernelspec": nb.metadata["kernelspec"], "language_info": {"name": "python"}}
    for i, cell in enumerate(nb.cells):
        cell.id = f"c{i:02d}"  # stable ids: rebuilding an unchanged notebook changes no cell's id
        cell.metadata = {}
    return nb


def execute(nb: nbformat.NotebookNode, folder: Path, **env: str) -> nbformat.NotebookNode:
    """Run every cell in a fresh kernel started in folder (as Jupyter does); env adds to the
    kernel's environment."""
    kernel_env = child_env(**env)  # one thread a process, as every run of the course's tools
    # the kernel's inline backend draws the figures into the notebook
    kernel_env.pop("MPLBACKEND", None)
    client = NotebookClient(
        nb,
        timeout=240,
        kernel_name=KERNEL,
        record_timing=False,
        resources={"metadata": {"path": str(folder)}},
    )
    client.execute(env=kernel_env)
    return nb


def outputs_text(nb: nbformat.NotebookNode) -> str:
    """Every output of the notebook as text (figures left out), as one string to search."""
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", ""))
            parts.extend(v for k, v in out.get("data", {}).items() if not k.startswith("image/"))
            parts.extend(out.get("traceback", []))
    return "\n".join(p if isinstance(p, str) else "".join(p) for p in parts)


def problems(committed: nbformat.NotebookNode, wanted: nbformat.NotebookNode) -> list[str]:
    """Why a committed notebook is not the executed form of its source (an empty list: it is)."""
    cells = [(c.cell_type, c.source) for c in committed.cells]
    if cells != [(c.cell_type, c.source) for c in wanted.cells]:
        return ["its cells differ from notebook.py's"]
    code = [c for c in committed.cells if c.cell_type == "code"]
    found = []
    if any(c.execution_count is None for c in code):
        found.append("a code cell has not run")
    if any(out.output_type == "error" for c in code for out in c.outputs):
        found.append("a cell failed")
    return found


def build(folder: Path) -> None:
    nb = execute(source(folder), folder)
    failed = problems(nb, source(folder))
    text = outputs_text(nb)
    leaks = [path for path in MACHINE_PATHS if path in text]
    if failed or leaks:
        shown = [line for line in text.splitlines() if any(path in line for path in leaks)] or [
            text[-3000:]
        ]
        print("\n".join(shown), file=sys.stderr)
        raise SystemExit(
            f"error: {folder.name}/notebook.py: {', '.join(failed + leaks)}; nothing written"
        )
    jupytext.write(nb, folder / "notebook.ipynb", fmt="ipynb")
    print(f"wrote {folder.name}/notebook.ipynb")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("chapters", nargs="*", help="chapter folders to build (default: all)")
    parser.add_argument(
        "--check", action="store_true", help="run nothing; exit 1 if a notebook is stale"
    )
    parser.add_argument("--root", type=Path, default=REPO, help="the course's root folder")
    args = parser.parse_args(argv)
    if missing := [
        name for name in args.chapters if not (args.root / name / "notebook.py").exists()
    ]:
        parser.error(
            f"no notebook.py in {', '.join(missing)} (the chapters: {', '.join(CHAPTERS.values())})"
        )
    folders = [args.root / name for name in args.chapters or CHAPTERS.values()]
    folders = [folder for folder in folders if (folder / "notebook.py").exists()]
    if not args.check:
        # the notebooks read the course's data/ folder, as a reader's do: prepared once, beforehand,
        # so that no notebook's outputs show the preparation
        os.environ.pop("COURSE_DATA_DIR", None)
        prepare("shakespeare", REPO / "data")
        for folder in folders:
            build(folder)
        return 0
    stale = 0
    for folder in folders:
        path = folder / "notebook.ipynb"
        found = (
            problems(nbformat.read(path, as_version=4), source(folder))
            if path.exists()
            else ["missing"]
        )
        if found:
            stale += 1
            fix = REGENERATE
            print(f"stale: {path.relative_to(args.root)}: {'; '.join(found)} (run {fix})")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
