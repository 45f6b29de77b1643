"""05_multinode/hangs.py: every classic hang, under real torchrun with gloo, ends, is diagnosed, is
fixed; the two mistakes in how the ranks meet run across two machines of machines.sh (skipped
without root; with CI=true they fail). All launches start at once, each with a short timeout."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import start
from machines import machine_set, require_machines, static_launch, why_no_machines

from layout import REPO
from tools.launch import free_port, stop_launchers, torchrun_command

# long end-to-end runs: the slow stage's (python -m pytest -m slow; CI runs it)
pytestmark = pytest.mark.slow

HANGS = REPO / "05_multinode" / "hangs.py"
PG_TIMEOUT = 3  # seconds a collective waits before it fails
STUCK_TIMEOUT = 12  # the stuck case waits longer: the test inspects the stuck rank meanwhile
LAUNCH_LIMIT = 150  # seconds a whole launch may take, start-up of three processes included


class Launch:
    """torchrun of hangs.py with 2 ranks (or `command` and hangs.py's args) in the background; its
    output is read line by line as it comes."""

    def __init__(
        self, args: list, tmp_path, extra: list | None = None, command: list | None = None, **env
    ):
        hangs_args = [*args, "--out-dir", tmp_path]
        cmd = torchrun_command(HANGS, 2, hangs_args, extra=extra)
        if command is not None:
            cmd = [*command, *hangs_args]
        self.started = time.monotonic()
        self.proc = start(cmd, **env)
        self.lines: list[str] = []
        self.reader = threading.Thread(
            target=lambda: self.lines.extend(self.proc.stdout), daemon=True
        )
        self.reader.start()

    def wait_for(self, pattern: str, limit: float = LAUNCH_LIMIT) -> re.Match:
        deadline = self.started + limit
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if found := re.search(pattern, line):
                    return found
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r}:\n" + "".join(self.lines))

    def finish(self) -> tuple[int, str, float]:
        """(exit status, all output, seconds from start to end); stopped if over the limit."""
        try:
            self.proc.wait(timeout=max(1.0, self.started + LAUNCH_LIMIT - time.monotonic()))
        except subprocess.TimeoutExpired:
            stop_launchers([self.proc])
            raise AssertionError(
                "the launch did not end within its limit:\n" + "".join(self.lines)
            ) from None
        self.reader.join(timeout=10)
        return self.proc.returncode, "".join(self.lines), time.monotonic() - self.started


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hangs")
    detail = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    timeout = ["--timeout", PG_TIMEOUT]
    runs = {
        "eval-on-rank0": Launch(["--case", "eval-on-rank0", *timeout], tmp / "eval", **detail),
        "shape": Launch(["--case", "shape", *timeout], tmp / "shape", **detail),
        "order": Launch(["--case", "order", *timeout], tmp / "order", TORCH_FR_BUFFER_SIZE="100"),
        "stuck": Launch(["--case", "stuck", "--timeout", STUCK_TIMEOUT], tmp / "stuck", **detail),
        "dies": Launch(["--case", "dies", *timeout], tmp / "dies"),
        # on one machine, a mistake in how the ranks meet does no harm
        "address-one-machine": Launch(["--case", "address", *timeout], tmp / "address-one"),
        # every fix in one run; the dying rank's fix is the launch line: torchrun restarts the group
        "fixed": Launch(
            ["--case", "all", "--fixed", *timeout],
            tmp / "fixed",
            extra=["--max-restarts=1"],
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        ),
    }
    # and the script started without torchrun, at the same time
    alone = start(
        [sys.executable, HANGS, "--case", "order"], stderr=subprocess.PIPE, new_session=False
    )
    with contextlib.ExitStack() as machines_made:
        # where machines can be made: the two mistakes in how the ranks meet, each on two machines
        # (launch_static.sh with node 0's right address: the mistake is in the script)
        across = {}
        if why_no_machines() is None:
            machines = machines_made.enter_context(machine_set(machines=2))
            for case in ("interface", "address"):
                port = free_port()
                across[case] = [
                    Launch(
                        ["--case", case, *timeout],
                        tmp / f"{case}-machines",
                        command=machines.run_command(node, static_launch(HANGS, node, port)),
                    )
                    for node in (0, 1)
                ]
        yield runs | {"alone": alone, "across machines": across}
        nodes = [run.proc for pair in across.values() for run in pair]
        stop_launchers([run.proc for run in runs.values()] + [alone] + nodes)


def ended_with_failure(run: Launch) -> str:
    status, out, seconds = run.finish()
    assert status != 0, out
    assert seconds < LAUNCH_LIMIT
    return out


def assert_collectives(out: str, op: str, shapes: list[int]) -> None:
    """TORCH_DISTRIBUTED_DEBUG=DETAIL names each rank's collective: an `op` of shape [shapes[r]]."""
    for rank, shape in enumerate(shapes):
        running = rf"Rank {rank} is running collective: CollectiveFingerPrint\(SequenceNumber=\d+, "
        assert re.search(rf"{running}OpType={op}, TensorShape=\[{shape}\]", out), out


@pytest.mark.slow
def test_eval_on_rank0_only_is_named_by_the_collective_check(launches):
    out = ended_with_failure(launches["eval-on-rank0"])
    # rank 0's all-reduce of (sum, count) meets rank 1's all-reduce of the 17 gradients
    assert_collectives(out, "ALLREDUCE", shapes=[2, 17])
    assert re.search(r"\[rank0\]:.*in evaluate", out), out  # rank 0's traceback: inside evaluate()


def test_different_shapes_are_named_by_the_collective_check(launches):
    out = ended_with_failure(launches["shape"])
    assert_collectives(out, "ALLGATHER", shapes=[3, 2])
    assert "Tensor shapes: 3vs 2" in out


def test_different_order_is_named_by_the_flight_recorder(launches):
    out = ended_with_failure(launches["order"])
    # the default: each rank's timeout, nothing more
    assert f"Timed out waiting {PG_TIMEOUT * 1000}ms" in out
    # each rank's last collective, the same sequence number, different operations and callers
    last = dict(
        re.findall(
            r"\[rank (\d)\] flight recorder: last collective (#\d+ gloo:\w+ of shapes \S+, "
            r"called from \w+\(\))",
            out,
        )
    )
    assert last.keys() == {"0", "1"}, out
    expected = {
        "0": r"gloo:broadcast of shapes \[\[1\]\], called from case_order\(\)",
        "1": r"gloo:all_reduce of shapes \[\[\]\], called from mean_loss\(\)",
    }
    for rank, collective in expected.items():
        assert re.fullmatch(rf"#(\d+) {collective}", last[rank]), last
    assert last["0"].split()[0] == last["1"].split()[0]  # the same collective number


def test_a_rank_stuck_in_python_is_found_by_its_stack(launches):
    run = launches["stuck"]
    pid = int(run.wait_for(r"\[rank 1\] pid (\d+):").group(1))
    run.wait_for(r"\[rank 1\] step 2:")  # from here rank 1 polls for the file
    time.sleep(0.5)
    stacks = []
    if shutil.which("py-spy"):  # requirements-dev.txt installs it; it needs permission to trace
        spy = subprocess.run(
            ["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60
        )
        assert spy.returncode == 0, spy.stdout + spy.stderr
        stacks.append(spy.stdout)
    os.kill(pid, signal.SIGUSR1)  # faulthandler: the rank prints its own stack
    run.wait_for(r'File ".*hangs\.py", line \d+ in case_stuck')
    out = ended_with_failure(run)
    stacks.append(out)
    for stack in stacks:
        assert re.search(r"case_stuck", stack), stack
    if len(stacks) == 2:
        assert re.search(r"case_stuck \(.*hangs\.py:\d+\)", stacks[0])  # py-spy's line for the loop
    # the collective check names the rank that never arrived
    assert f"Ranks 1 failed to pass monitoredBarrier in {STUCK_TIMEOUT * 1000} ms" in out, out


def test_a_rank_that_dies_is_the_root_cause_in_torchruns_summary(launches):
    out = ended_with_failure(launches["dies"])
    summary = out.split("Root Cause (first observed failure):")[1]
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)", summary), summary
    assert "error_file: <N/A>" not in summary  # @record wrote the traceback where torchrun finds it
    assert "RuntimeError: rank 1: simulated fault at step 2" in summary


def test_every_fixed_case_finishes(launches):
    status, out, _ = launches["fixed"].finish()
    assert status == 0, out
    assert out.count("rank 1: simulated fault at step 2") >= 1  # the first attempt failed ...
    for rank in (0, 1):
        assert f"[rank {rank}] finished 4 steps" in out  # ... and the restarted group finished
    for line in ("val loss", "mean loss", "worst validation loss"):
        assert re.search(rf"\[rank 0\] step 2: {line} \d", out), line


def test_hangs_outside_torchrun_is_one_clear_error(launches):
    _, stderr = launches["alone"].communicate(timeout=LAUNCH_LIMIT)
    assert launches["alone"].returncode == 2
    assert stderr.strip().splitlines() == [
        "error: hangs.py runs under torchrun, e.g. torchrun --standalone "
        "--nproc_per_node=2 05_multinode/hangs.py --case eval-on-rank0"
    ]


def test_a_mistake_in_how_the_ranks_meet_does_no_harm_on_one_machine(launches):
    status, out, _ = launches["address-one-machine"].finish()
    assert status == 0, out
    assert (
        "[rank 0] case address: on one machine the loopback reaches every rank; the mistake shows "
        "across machines (05_multinode/machines.sh)"
    ) in out
    assert "[rank 1] finished 4 steps" in out


def failed_lines(nodes: list[Launch]) -> dict[int, str]:
    """Each rank's one line on the way out: rank -> what it says, once each node has ended."""
    outputs = [ended_with_failure(node) for node in nodes]
    found = dict(re.findall(r"^\[rank (\d)\] failed: (.*)$", "".join(outputs), re.MULTILINE))
    assert found.keys() == {"0", "1"}, outputs
    return {int(rank): line for rank, line in found.items()}


def test_gloo_on_the_loopback_across_machines_ends_naming_the_address(launches):
    require_machines()
    lines = failed_lines(launches["across machines"]["interface"])
    for line in lines.values():
        assert line.startswith("RuntimeError: Gloo connectFullMesh failed with ")
        assert line.endswith(", gloo with GLOO_SOCKET_IFNAME=lo)")
    # the rank that connects finds nobody at the other's address, 127.0.0.1 on its own machine;
    # the other waits for a connection that never comes
    connecting = [line for line in lines.values() if "Connection refused" in line]
    assert len(connecting) == 1, lines
    assert re.search(r"Connection refused, remote=\[127\.0\.0\.1\]:\d+", connecting[0])


def test_meeting_at_localhost_across_machines_ends_naming_the_address(launches):
    require_machines()
    lines = failed_lines(launches["across machines"]["address"])
    port = re.search(r"MASTER_ADDR=localhost:(\d+)", lines[1]).group(1)
    # rank 1 is on machine 1, where nothing listens at localhost
    assert lines[1].startswith(
        f"DistNetworkError: The client socket has timed out after {PG_TIMEOUT * 1000}ms while "
        f"trying to connect to (localhost, {port})."
    )
    # rank 0 met torchrun's store on its own machine, and waited there for rank 1
    assert lines[0].startswith(f"DistStoreError: wait timeout after {PG_TIMEOUT * 1000}ms")
    for line in lines.values():
        assert line.endswith(
            f"(this rank met at MASTER_ADDR=localhost:{port}, gloo with GLOO_SOCKET_IFNAME=unset)"
        )
