"""Every chapter's notebook.py runs top to bottom in a real Jupyter kernel on the CPU (its own
checks included), and the committed notebook.ipynb holds its source's cells, all run."""

from __future__ import annotations

import shutil
import subprocess
import sys

import nbformat
import pytest

from common.chapters import CHAPTERS
from layout import REPO
from maintainer import REGENERATE
from maintainer.build_notebooks import KERNEL, execute, main, source

FOLDERS = list(CHAPTERS.values())


@pytest.fixture(scope="session")
def python3_kernel():
    """The `python3` kernel spec; installed for this user only if Jupyter does not know it."""
    from jupyter_client.kernelspec import KernelSpecManager

    if KERNEL not in KernelSpecManager().find_kernel_specs():
        subprocess.run(
            [sys.executable, "-m", "ipykernel", "install", "--user", "--name", KERNEL], check=True
        )
    return KERNEL


def test_committed_notebooks_are_their_sources_run():
    proc = subprocess.run(
        [sys.executable, "-m", "maintainer.build_notebooks", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_check_names_a_stale_notebook_and_its_fix(tmp_path, capsys):
    chapter = FOLDERS[0]
    (tmp_path / chapter).mkdir()
    for name in ("notebook.py", "notebook.ipynb"):
        shutil.copy(REPO / chapter / name, tmp_path / chapter)
    fix = f"(run {REGENERATE})"
    assert main(["--check", "--root", str(tmp_path)]) == 0

    path = tmp_path / chapter / "notebook.ipynb"
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nbformat.write(nb, path)
    assert main(["--check", "--root", str(tmp_path)]) == 1
    assert f"a code cell has not run {fix}" in capsys.readouterr().out

    with (tmp_path / chapter / "notebook.py").open("a") as f:
        f.write('\n# %%\nprint("a new cell")\n')
    assert main(["--check", "--root", str(tmp_path)]) == 1
    assert (
        f"{chapter}/notebook.ipynb: its cells differ from notebook.py's {fix}"
        in capsys.readouterr().out
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("chapter", FOLDERS)
def test_notebook_runs(chapter, data_dir, python3_kernel):
    folder = REPO / chapter
    # the corpus prepared once for the session, and one thread a process
    nb = execute(source(folder), folder, COURSE_DATA_DIR=str(data_dir))

    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    # the loss curves were drawn (at least one figure came back as a PNG)
    assert any("image/png" in o.get("data", {}) for o in outputs), "no figure was drawn"
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert f"{chapter}/train.py" in text, "the notebook did not run its chapter's script"


def test_the_readme_set_up_installs_jupyter_lab():
    """The README's set-up, `pip install -r requirements-dev.txt`, must give a working
    `jupyter lab`."""
    assert any(
        line.split(">")[0].split("=")[0].strip() == "jupyterlab"
        for line in (REPO / "requirements-dev.txt").read_text().splitlines()
    )
    assert "pip install -r requirements-dev.txt" in (REPO / "README.md").read_text()
    proc = subprocess.run(
        [sys.executable, "-m", "jupyter", "lab", "--version"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().split(".")[0].isdigit(), proc.stdout + proc.stderr
