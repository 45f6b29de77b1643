"""Every chapter's notebook runs top to bottom on the CPU, and is the one tools/build_notebooks.py makes.

Each notebook is executed in a real Jupyter kernel (nbclient), from its chapter folder, with the
session's prepared corpus (COURSE_DATA_DIR), so a failing cell — including the notebook's own
checks that a chapter matches chapter 01 — fails its test.
"""

from __future__ import annotations

import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from common.chapters import CHAPTERS
from common.launch import REPO

FOLDERS = list(CHAPTERS.values())


@pytest.fixture(scope="session")
def python3_kernel():
    """The `python3` kernel spec; installed for this user only if Jupyter does not know it."""
    from jupyter_client.kernelspec import KernelSpecManager

    if "python3" not in KernelSpecManager().find_kernel_specs():
        subprocess.run(
            [sys.executable, "-m", "ipykernel", "install", "--user", "--name", "python3"], check=True
        )
    return "python3"


def test_notebooks_are_generated_and_have_no_outputs():
    proc = subprocess.run(
        [sys.executable, "tools/build_notebooks.py", "--check"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for chapter in FOLDERS:
        nb = nbformat.read(str(REPO / chapter / "notebook.ipynb"), as_version=4)
        code = [cell for cell in nb.cells if cell.cell_type == "code"]
        assert code and all(not cell.outputs and cell.execution_count is None for cell in code), chapter


@pytest.mark.timeout(300)
@pytest.mark.parametrize("chapter", FOLDERS)
def test_notebook_runs(chapter, data_dir, python3_kernel, monkeypatch):
    monkeypatch.setenv("COURSE_DATA_DIR", str(data_dir))  # the corpus prepared once for the session
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv(
        "MPLBACKEND", raising=False
    )  # the kernel's inline backend: Agg, drawn into the notebook
    folder = REPO / chapter
    nb = nbformat.read(str(folder / "notebook.ipynb"), as_version=4)
    NotebookClient(
        nb, timeout=240, kernel_name=python3_kernel, resources={"metadata": {"path": str(folder)}}
    ).execute()

    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    # the loss curves were drawn (at least one figure came back as a PNG)
    assert any("image/png" in o.get("data", {}) for o in outputs), "no figure was drawn"
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert f"{chapter}/train.py" in text, "the notebook did not run its chapter's script"


def test_the_readme_set_up_installs_jupyter_lab():
    """`pip install -r requirements-dev.txt`, the README's set-up, must give a working `jupyter lab`."""
    assert any(
        line.split(">")[0].split("=")[0].strip() == "jupyterlab"
        for line in (REPO / "requirements-dev.txt").read_text().splitlines()
    )
    assert "pip install -r requirements-dev.txt" in (REPO / "README.md").read_text()
    proc = subprocess.run(
        [sys.executable, "-m", "jupyter", "lab", "--version"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.strip().split(".")[0].isdigit(), proc.stdout + proc.stderr
