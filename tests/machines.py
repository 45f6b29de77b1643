"""Machines on one computer, as 05_multinode/machines.sh makes them, for the tests that run across
them: each set under a prefix of its own, removed however its `with` block ends."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from layout import REPO

MACHINES = REPO / "05_multinode" / "machines.sh"


def why_no_machines() -> str | None:
    """Why machines.sh cannot make machines here (None: it can)."""
    if os.geteuid() != 0:
        return "machines.sh needs root (network namespaces)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"no '{tool}' (apt-get install iproute2)"
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"network namespaces are not allowed here ({probe.stderr.strip()})"
    return None


def require_machines() -> None:
    """Skip without root or namespaces (a laptop), but fail in CI, which has both."""
    why = why_no_machines()
    if why is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}: CI runs as root on a machine that allows network namespaces")
    pytest.skip(why)


def machines_sh(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    """`bash 05_multinode/machines.sh ARGS`, as root runs it."""
    proc = subprocess.run(
        ["bash", str(MACHINES), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"machines.sh {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}"
        )
    return proc


def namespaces() -> list[str]:
    """The names `ip netns list` shows."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]


class MachineSet:
    """A set of machines made by machines.sh, under a prefix of its own."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def up(self, machines: int = 2, rate: str = "unlimited") -> str:
        """machines.sh up: the list it prints."""
        up = machines_sh("up", "--prefix", self.prefix, "--machines", str(machines), "--rate", rate)
        return up.stdout

    def down(self) -> None:
        machines_sh("down", "--prefix", self.prefix)

    def run_command(self, machine: int, command: list) -> list[str]:
        """The command line that runs `command` on a machine."""
        words = ["bash", str(MACHINES), "run", "--prefix", self.prefix, str(machine)]
        return words + [str(word) for word in command]

    def sent_bytes(self, machine: int) -> int:
        """The bytes machine `machine`'s eth0 has sent since it was made (the kernel's count)."""
        counter = "/sys/class/net/eth0/statistics/tx_bytes"
        return int(machines_sh("run", "--prefix", self.prefix, str(machine), "cat", counter).stdout)

    def address(self, machine: int) -> str:
        return machines_sh("address", "--prefix", self.prefix, str(machine)).stdout.strip()

    def namespaces(self) -> list[str]:
        """This set's namespaces that exist now."""
        return [name for name in namespaces() if name.startswith(f"{self.prefix}-")]


def static_launch(script: str, node: int, port: int, master: str = "10.0.0.1") -> list[str]:
    """launch_static.sh on a node of 2, one process, starting `script`: the command as a reader
    types it on that machine (with MachineSet.run_command in front)."""
    settings = [f"NODE_RANK={node}", f"MASTER_ADDR={master}", f"MASTER_PORT={port}"]
    settings += ["NNODES=2", "NPROC_PER_NODE=1", f"SCRIPT={script}"]
    return ["env", *settings, "bash", "05_multinode/launch_static.sh"]


def new_prefix() -> str:
    """A name for a set of machines that nobody else uses: t and 8 random hex digits."""
    return "t" + secrets.token_hex(4)


@contextlib.contextmanager
def machine_set(machines: int = 2, rate: str = "unlimited") -> Iterator[MachineSet]:
    """A set of machines, up for the `with` block, removed after it however it ends."""
    require_machines()
    found = MachineSet(new_prefix())
    try:
        found.up(machines, rate)
        yield found
    finally:
        found.down()
