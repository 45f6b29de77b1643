r"""Preflight: check that every process of a multi-node job can reach every other before a long run.

Run it under torchrun with the very launch line the training job will use, with preflight.py in
place of train.py. In a minute it tells you what a failed hour-long job would have told you late:

1. Every rank prints, before any communication, where it is and what it sees: host, global,
   local and node rank, device, backend, the versions of Python, torch and NCCL, and the
   torchrun and NCCL environment variables that decide how processes find each other. If the
   job then hangs, these lines say which ranks arrived and with what settings.
2. Every rank listens on the address gloo will bind to and connects to every other rank's,
   before the process group exists: a wrong interface fails here in seconds, naming the address,
   where gloo would wait for its whole timeout.
3. A correctness check: every rank contributes a known value to an all-reduce (rank + 1 as an
   integer, and a float tensor) and checks the sum against the formula (W(W+1)/2). A gloo group
   must work too, within --gloo-timeout (chapter 06's stop agreement uses one). All ranks must
   also run the same torch and NCCL versions.
4. The all-reduce bandwidth for a few message sizes, as nccl-tests define it:
   algbw = bytes / time, and busbw = algbw * 2(W-1)/W, the traffic every link carries in a ring
   all-reduce, comparable across world sizes with the link speed of the slowest hop (NVLink,
   InfiniBand, Ethernet).

It exits with status 1 when a check fails, so a job script can refuse to start training.

    torchrun --standalone --nproc_per_node=2 05_multinode/preflight.py    # one machine
    torchrun --nnodes=2 --node_rank=R --nproc_per_node=8 \
        --master_addr=HOST --master_port=29500 05_multinode/preflight.py   # on each node

With --meet, and without torchrun, it checks only this node's network, in a fraction of a second,
before torchrun starts (launch_static.sh and launch_c10d.sh run it so): that the meeting point
resolves and is this machine's own address on the node that hosts it and a reachable one on the
others, and that the interfaces gloo and NCCL will use exist and are not the loopback. torchrun
itself would retry an unreachable MASTER_ADDR for 15 minutes. With --wait SECONDS, it then waits
until every node has passed its own check, or ends naming the nodes that never came.

    python 05_multinode/preflight.py --meet 10.0.0.1:29500 --node-rank 1 --nnodes 2 --wait 300
"""

import argparse
import datetime
import fcntl
import ipaddress
import os
import platform
import socket
import struct
import sys
import time
from pathlib import Path

# lets `import common` work from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.support.errors import CourseError, run_main

# torch is imported where it is needed, under torchrun: the check before torchrun (--meet) must
# take a moment, and importing torch takes seconds.

# The environment variables that decide how processes find each other and how NCCL talks.
WATCHED_VARIABLES = [
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
    "CUDA_VISIBLE_DEVICES",
    "NCCL_DEBUG",
    "NCCL_SOCKET_IFNAME",
    "NCCL_IB_DISABLE",
    "NCCL_IB_HCA",
    "NCCL_P2P_DISABLE",
    "NCCL_NET_GDR_LEVEL",
    "GLOO_SOCKET_IFNAME",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_BLOCKING_WAIT",
    "OMP_NUM_THREADS",
]


def parse_args() -> argparse.Namespace:
    raw = argparse.RawDescriptionHelpFormatter  # the docstring's line breaks kept
    p = argparse.ArgumentParser(
        prog="05_multinode/preflight.py", description=__doc__, formatter_class=raw
    )
    p.add_argument(
        "--backend",
        choices=["auto", "nccl", "gloo"],
        default="auto",
        help="auto: NCCL where CUDA is present, gloo otherwise (default: auto)",
    )
    p.add_argument(
        "--sizes-mb",
        default="1,16,128",
        help="comma-separated all-reduce message sizes in MB (10^6 bytes) (default: 1,16,128)",
    )
    p.add_argument("--iters", type=int, default=10, help="timed all-reduces per size (default: 10)")
    p.add_argument(
        "--gloo-timeout",
        type=int,
        default=30,
        help="seconds the gloo group's check may take before it fails (default: 30)",
    )
    p.add_argument(
        "--timeout",
        type=int,
        default=120,
        help="seconds a collective may wait for a peer before preflight fails (default: 120)",
    )
    p.add_argument(
        "--meet",
        metavar="HOST:PORT",
        help="without torchrun: check only this node's network for a meeting point at HOST:PORT",
    )
    p.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="with --meet: this node's rank; 0 hosts the meeting point (static rendezvous). "
        "Not given: any node may host it (c10d)",
    )
    p.add_argument("--nnodes", default="1", help="with --meet: the number of nodes, N or MIN:MAX")
    p.add_argument(
        "--same-machine",
        action="store_true",
        help="with --meet: every node runs on this machine (simulate_two_nodes.sh), so the "
        "loopback is right",
    )
    p.add_argument(
        "--wait",
        type=int,
        metavar="SECONDS",
        help="with --meet: then wait up to SECONDS for every node at the meeting point, and name "
        "the ones that never came (the launch recipes pass the run's --dist-timeout)",
    )
    args = p.parse_args()
    try:
        args.sizes = [float(s) for s in args.sizes_mb.split(",") if s.strip()]
    except ValueError:
        raise CourseError(
            f"--sizes-mb {args.sizes_mb!r}: give numbers separated by commas, e.g. 1,16,128"
        ) from None
    if not args.sizes or min(args.sizes) <= 0 or args.iters < 1:
        raise CourseError("--sizes-mb needs positive sizes and --iters at least 1")
    return args


def torchrun_ranks() -> tuple[int, int, int, int]:
    """(global rank, local rank, node rank, world size) as torchrun hands them to each process."""
    if "RANK" not in os.environ or "LOCAL_RANK" not in os.environ:
        raise CourseError(
            "preflight.py runs under torchrun, e.g. "
            "torchrun --standalone --nproc_per_node=2 05_multinode/preflight.py"
        )
    # torchrun calls the node's rank GROUP_RANK; SLURM-style launchers often export NODE_RANK
    node_rank = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))
    return (
        int(os.environ["RANK"]),
        int(os.environ["LOCAL_RANK"]),
        node_rank,
        int(os.environ["WORLD_SIZE"]),
    )


# ---- the network: interfaces, the addresses gloo and NCCL use, the meeting point ---------------

# the ioctl that reads an interface's IPv4 address: Linux's number, or macOS's and the BSDs'
SIOCGIFADDR = 0x8915 if sys.platform == "linux" else 0xC0206921


def interfaces() -> dict[str, str | None]:
    """This machine's network interfaces and their IPv4 addresses (None: it has none)."""
    found: dict[str, str | None] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)
            except OSError:  # an interface without an IPv4 address
                found[name] = None
                continue
            found[name] = socket.inet_ntoa(reply[20:24])
    return found


def shown(found: dict[str, str | None]) -> str:
    """lo 127.0.0.1, eth0 10.0.0.2"""
    return ", ".join(f"{name} {address or '(no IPv4 address)'}" for name, address in found.items())


def interface_of(address: str, found: dict[str, str | None]) -> str:
    names = [name for name, own in found.items() if own == address]
    return names[0] if names else "?"


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def can_bind(address: str) -> bool:
    """Whether `address` belongs to this machine: only its own addresses can be bound."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, 0))
        except OSError:
            return False
    return True


def gloo_address(found: dict[str, str | None]) -> tuple[str, str]:
    """The address gloo will bind to, and why; as torch's ProcessGroupGloo chooses it.

    GLOO_SOCKET_IFNAME names the interface. Without it, gloo resolves this machine's host name and
    takes the first of its addresses that it can bind; when none can be, the loopback. Many
    machines resolve their own name to 127.0.1.1 or 127.0.0.1 (/etc/hosts), and then gloo listens
    where no other machine can reach it.
    """
    named = os.environ.get("GLOO_SOCKET_IFNAME")
    if named:
        first = named.split(",")[0]
        if found.get(first) is None:
            raise CourseError(
                f"GLOO_SOCKET_IFNAME={named}, but this machine ({socket.gethostname()}) has no "
                f"interface {first} with an IPv4 address (it has: {shown(found)}): name one of "
                "those, the one on the network between the nodes"
            )
        return found[first], f"{first}, from GLOO_SOCKET_IFNAME={named}"
    host = socket.gethostname()
    try:
        resolved = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        resolved = []
    for *_, sockaddr in resolved:
        address = sockaddr[0]
        if can_bind(address):
            return address, f"{interface_of(address, found)}, the address of the host name {host}"
    return "127.0.0.1", f"the loopback: the host name {host} has no address of this machine"


def nccl_interfaces(found: dict[str, str | None]) -> tuple[list[str], str]:
    """The interfaces NCCL's sockets may use, and why: NCCL_SOCKET_IFNAME's rule, or NCCL's own.

    NCCL_SOCKET_IFNAME is a list of name prefixes (eth matches eth0 and eth1), exact names after
    `=`, or prefixes to leave out after `^` (^docker,lo). Unset, NCCL takes InfiniBand's ib*
    interfaces if there are any, else every one but docker* and lo.
    """
    names = [name for name, address in found.items() if address]
    spec = os.environ.get("NCCL_SOCKET_IFNAME", "")
    if not spec:
        infiniband = [name for name in names if name.startswith("ib")]
        others = [name for name in names if not name.startswith(("docker", "lo"))]
        return infiniband or others or names, "NCCL_SOCKET_IFNAME unset: NCCL's own choice"
    leave_out = spec.startswith("^")
    rule = spec.removeprefix("^")
    exact = rule.startswith("=")
    prefixes = rule.removeprefix("=").split(",")
    chosen = []
    for name in names:
        matches = any(name == p if exact else name.startswith(p) for p in prefixes)
        if matches != leave_out:
            chosen.append(name)
    return chosen, f"NCCL_SOCKET_IFNAME={spec}"


def unreachable(
    address: str, port: int, source: str | None = None, refused_is_reached: bool = True
) -> str | None:
    """Why this machine cannot reach address:port (from the address `source`); None: it can.

    A refused connection counts as reached unless told otherwise: the machine answered, and the
    meeting point's port opens only once torchrun runs there, which may be later than here.
    """
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        try:
            if source is not None:
                s.bind((source, 0))
            s.connect((address, port))
        except ConnectionRefusedError:
            return None if refused_is_reached else "Connection refused"
        except TimeoutError:
            return "no answer within 10 s: a firewall, or no machine at that address"
        except OSError as err:
            return os.strerror(err.errno) if err.errno else str(err)
    return None


def route_source(address: str) -> str:
    """The address this machine sends from to reach `address` (its route; nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((address, 9))
        except OSError:
            return "?"
        return s.getsockname()[0]


def check_meeting_point(args: argparse.Namespace) -> int:
    """--meet: can this node take part? One line that says what it found, or one error."""
    host, _, port_text = args.meet.rpartition(":")
    if not host or not port_text.isdigit():
        raise CourseError(f"--meet {args.meet!r}: give HOST:PORT, e.g. 10.0.0.1:29500")
    port = int(port_text)
    here = socket.gethostname()
    several = int(args.nnodes.split(":")[-1]) > 1 and not args.same_machine
    found = interfaces()
    try:
        address = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as err:
        raise CourseError(
            f"the meeting point {host} does not resolve on this machine ({here}: {err.strerror}): "
            "give node 0's address, or a name that every node resolves"
        ) from None
    local = can_bind(address)
    if args.node_rank == 0 and not local:
        raise CourseError(
            f"MASTER_ADDR={host} is not an address of this machine ({here} has: {shown(found)}): "
            "node 0 hosts the meeting point, so MASTER_ADDR must be one of its addresses that "
            "every node reaches"
        )
    if args.node_rank not in (None, 0) and local and several:
        raise CourseError(
            f"MASTER_ADDR={host} is this machine ({here}) itself, not node 0: set it to node 0's "
            "address, the same on every node"
        )
    if local and several and is_loopback(address):
        raise CourseError(
            f"the meeting point {host} is the loopback ({address}), where no other machine can "
            f"reach this one: give its address on the network between the nodes ({here} has: "
            f"{shown(found)})"
        )
    if local:
        meeting = f"the meeting point {host}:{port} is this machine's"
        toward = address
    else:
        why = unreachable(address, port)
        if why:
            raise CourseError(
                f"this machine ({here}) cannot reach the meeting point {host}:{port} ({why}): "
                "give node 0's address on the network that every node shares"
            )
        toward = route_source(address)
        meeting = f"it reaches {host}:{port} from {toward} ({interface_of(toward, found)})"
    gloo, gloo_why = gloo_address(found)
    hint = f"set GLOO_SOCKET_IFNAME={interface_of(toward, found)}, the interface toward {host}"
    if several and is_loopback(gloo):
        raise CourseError(
            f"gloo would listen on {gloo} ({gloo_why}), which no other machine can reach: {hint}"
        )
    if several and not local:
        why = unreachable(address, port, source=gloo)
        if why:
            raise CourseError(
                f"from gloo's address {gloo} ({gloo_why}) this machine cannot reach {host}:{port} "
                f"({why}): {hint}"
            )
    nccl, nccl_why = nccl_interfaces(found)
    if not nccl:
        raise CourseError(
            f"{nccl_why} matches no interface of this machine ({here} has: {shown(found)})"
        )
    if several and all(is_loopback(found[name]) for name in nccl):
        raise CourseError(
            f"{nccl_why} leaves NCCL only the loopback ({', '.join(nccl)}), which no other "
            f"machine can reach: set NCCL_SOCKET_IFNAME={interface_of(toward, found)}"
        )
    print(
        f"preflight on {here}: {meeting}; gloo listens on {gloo} ({gloo_why}); "
        f"NCCL may use {', '.join(nccl)} ({nccl_why})",
        file=sys.stderr,
        flush=True,
    )
    # MIN:MAX: nodes may come later, and torchrun's own rendezvous decides when they join
    if args.wait is not None and ":" not in args.nnodes:
        wait_for_nodes(args, address, local)
    return 0


def wait_for_nodes(args: argparse.Namespace, address: str, local: bool) -> None:
    """--wait: every node meets at the meeting point before torchrun starts, or this node ends with
    one line naming what it waited for. torchrun's own rendezvous waits 10 minutes by default
    for a node that never comes, and then prints a traceback; a node that failed its check above
    never comes.

    The node at the meeting point (node 0; under c10d the first of the nodes whose address it is)
    listens on its port, and every other node tells it who it is; once all are there, it answers
    each "go" and closes the port, which torchrun then opens. Each node waits `--wait` seconds.
    """
    host, _, port_text = args.meet.rpartition(":")
    port = int(port_text)
    nnodes = int(args.nnodes)
    deadline = time.monotonic() + args.wait
    if args.node_rank is None:
        me = f"{socket.gethostname()} (process {os.getpid()})"
    else:
        me = f"node {args.node_rank}"
    server = None
    if local and args.node_rank in (None, 0):
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind((address, port))
            server.listen(nnodes)
        except OSError as err:
            server.close()
            server = None
            if args.node_rank == 0:
                raise CourseError(
                    f"node 0 cannot listen on its meeting point {host}:{port} ({err.strerror}): "
                    "another program holds that port; choose another MASTER_PORT"
                ) from None
            # under c10d another node on this machine listens there already: meet it
    if server is None:
        join_meeting(args, host, address, port, me, deadline)
        return
    arrived: dict[str, socket.socket] = {}
    with server:
        while len(arrived) < nnodes - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CourseError(never_came(args, host, port, nnodes, list(arrived)))
            server.settimeout(left)
            try:
                peer, _ = server.accept()
            except TimeoutError:
                continue
            peer.settimeout(5)
            try:
                said = peer.recv(256).decode(errors="replace").strip()
            except OSError:
                said = ""
            if said:
                arrived[said] = peer
            else:  # a node's check that the port answers, which says nothing
                peer.close()
        for peer in arrived.values():  # go; each node closes first, so the port is free at once
            with peer:
                peer.sendall(b"go\n")
                try:
                    peer.recv(16)
                except OSError:
                    pass


def never_came(args: argparse.Namespace, host: str, port: int, nnodes: int, came: list) -> str:
    if args.node_rank is not None:
        missing = sorted(set(range(1, nnodes)) - {int(label.split()[-1]) for label in came})
        which = ", ".join(str(rank) for rank in missing)
        return (
            f"waited {args.wait} s at {host}:{port} for node rank(s) {which} of {nnodes}, which "
            "never came: start every node with the same MASTER_ADDR and MASTER_PORT, and read "
            "the missing nodes' own error"
        )
    others = ", ".join(came) or "none"
    return (
        f"waited {args.wait} s at {host}:{port} for {nnodes - 1 - len(came)} more of {nnodes} "
        f"nodes, which never came (came besides this one: {others}): start every node with the "
        "same RDZV_ENDPOINT and RDZV_ID, and read the missing nodes' own error"
    )


def join_meeting(
    args: argparse.Namespace, host: str, address: str, port: int, me: str, deadline: float
) -> None:
    """A node that does not host the meeting point: say who it is there, and wait for "go"."""
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((address, port), timeout=5) as s:
                s.sendall(f"{me}\n".encode())
                s.settimeout(max(deadline - time.monotonic(), 0.1))
                if s.recv(16).startswith(b"go"):
                    return
        except OSError:  # not listening yet, or it ended: try again until the deadline
            pass
        time.sleep(0.5)
    if args.node_rank is None:
        waited_for = f"the node whose address {host}:{port} is"
    else:
        waited_for = f"node rank 0 at {host}:{port}"
    raise CourseError(
        f"waited {args.wait} s for {waited_for}, which never came: start it with the same "
        "address and port, and read its own error"
    )


def versions(device) -> str:
    import torch

    nccl = ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else "-"
    return f"python {platform.python_version()}, torch {torch.__version__}, nccl {nccl}"


def timed_all_reduce(tensor, iters: int, device) -> float:
    """Seconds one all-reduce of `tensor` takes, the slowest rank's average over `iters`."""
    import torch
    import torch.distributed as dist

    for _ in range(2):  # warm-up: the first calls set up connections and buffers
        dist.all_reduce(tensor)
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # NCCL calls return at once; the work is queued on the GPU
    elapsed = torch.tensor(
        [(time.perf_counter() - start) / iters], dtype=torch.float64, device=device
    )
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a collective is as fast as its slowest rank
    return elapsed.item()


def check_gloo_group(rank: int, world_size: int, timeout_s: int) -> str | None:
    """A new gloo group, an all-reduce in it and its end, within `timeout_s`; what went wrong."""
    import torch
    import torch.distributed as dist

    try:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        ones = torch.ones(1)
        dist.all_reduce(ones, group=group)
        dist.destroy_process_group(group)
    except RuntimeError as err:  # gloo's timeouts and refused connections
        reason = str(err).splitlines()[0][:160]
        return (
            f"a gloo group failed within {timeout_s} s ({reason}); set GLOO_SOCKET_IFNAME to the "
            "interface the nodes reach each other on (as NCCL_SOCKET_IFNAME)"
        )
    if ones.item() != world_size:
        return f"gloo all-reduce gave {ones.item():g}, expected {world_size}"
    return None


def check_gloo_addresses(store, rank: int, world_size: int, timeout_s: int) -> list[str]:
    """Every rank listens on the address gloo will bind to, and connects to every other rank's.

    What gloo's own connections will need, tried before the process group exists: an address that
    cannot be reached fails here in seconds, where gloo would wait for its whole timeout. Returns
    what failed, for this rank; the listeners stay open until every rank has tried them all.
    """
    here = socket.gethostname()
    address, why = gloo_address(interfaces())
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.create_server((address, 0), family=family)
    with listener:
        store.set(f"gloo_address/{rank}", f"{address} {listener.getsockname()[1]} {here} {why}")
        failures = []
        for peer in range(world_size):
            if peer == rank:
                continue
            peer_address, peer_port, peer_host, peer_why = (
                store.get(f"gloo_address/{peer}").decode().split(" ", 3)
            )
            reason = unreachable(peer_address, int(peer_port), refused_is_reached=False)
            if reason:
                failures.append(
                    f"rank {rank} on {here} cannot reach rank {peer}'s gloo address "
                    f"{peer_address}:{peer_port} on {peer_host} ({peer_why}): {reason}; set "
                    f"GLOO_SOCKET_IFNAME on {peer_host} to its interface on the network between "
                    "the nodes"
                )
        store.add("gloo_address/failed", len(failures))
        store.add("gloo_address/done", 1)
        deadline = time.monotonic() + timeout_s
        while store.add("gloo_address/done", 0) < world_size:
            if time.monotonic() > deadline:
                failures.append(f"not every rank tried the others' gloo addresses in {timeout_s} s")
                break
            time.sleep(0.05)
    return failures


def main():
    args = parse_args()
    if args.meet:
        return check_meeting_point(args)
    import torch
    import torch.distributed as dist

    from common.distributed import restart_store

    rank, local_rank, node_rank, world_size = torchrun_ranks()
    prefix = f"[node {node_rank} rank {rank} local {local_rank}]"

    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise CourseError(
            "--backend nccl needs CUDA GPUs, and this PyTorch sees none; use --backend gloo"
        )
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise CourseError(
                f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                "lower --nproc_per_node"
            )
        device = torch.device("cuda", local_rank)  # the LOCAL rank picks the GPU on this machine
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    # ---- 1. who is here: printed before any communication, so a hang still leaves these lines ----
    env = " ".join(f"{name}={os.environ.get(name, '-')}" for name in WATCHED_VARIABLES)
    print(
        f"{prefix} host {socket.gethostname()} pid {os.getpid()}, world size {world_size}, "
        f"device {device}, backend {backend}, {versions(device)}; {env}",
        flush=True,
    )

    timeout = datetime.timedelta(seconds=args.timeout)
    # torchrun's store outlives a restart (--max-restarts, pytorch/pytorch#135712), so each attempt
    # meets under its own prefix instead of reading the addresses of the processes that failed
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    store = restart_store(world_size, restart_count, timeout)
    if store is None:  # no store of torchrun's to share: rank 0 hosts one at MASTER_ADDR
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)

    # ---- 2. can every rank reach every other where gloo will listen? --------------------------
    unreached = check_gloo_addresses(store, rank, world_size, args.gloo_timeout)
    for failure in unreached:
        print(f"{prefix} FAILED: {failure}", file=sys.stderr, flush=True)
    if int(store.add("gloo_address/failed", 0)) > 0:
        if rank == 0:
            print("\npreflight FAILED: a rank cannot reach another's gloo address", flush=True)
        return 1
    print(f"{prefix} gloo addresses: every rank reaches every other", flush=True)

    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    try:
        failures = []
        # ---- 3. correctness: known contributions, known sums ----
        ints = torch.tensor([rank + 1], dtype=torch.int64, device=device)
        dist.all_reduce(ints)
        expected = world_size * (world_size + 1) // 2
        if ints.item() != expected:
            failures.append(f"integer all-reduce gave {ints.item()}, expected {expected}")
        # a float tensor of a million elements, whose sums are exact in float32 in any order
        pattern = (torch.arange(1_000_000, device=device) % 8).float()  # (1e6,)
        floats = pattern + (rank + 1)
        dist.all_reduce(floats)
        wrong = (floats != pattern * world_size + expected).sum().item()
        if wrong:
            failures.append(f"float all-reduce: {wrong:,} of {floats.numel():,} elements wrong")
        outcome = "; ".join(failures) if failures else f"OK (sum of rank+1 = {expected})"
        print(f"{prefix} all-reduce check: {outcome}", flush=True)

        # a gloo group as well, whatever the backend: the stop's agreement runs on one. gloo binds
        # to the address of the host's name, 127.0.1.1 where Debian's or Ubuntu's installer wrote
        # /etc/hosts (workstations, virtual machines), so across nodes it can hang where NCCL
        # works; a short timeout turns that hang into a failed check
        gloo_failure = check_gloo_group(rank, world_size, args.gloo_timeout)
        if gloo_failure:
            failures.append(gloo_failure)
        print(f"{prefix} gloo group check: {gloo_failure or 'OK'}", flush=True)

        # every rank must run the same software: a torch or NCCL mismatch breaks
        # collectives or hangs them
        everyone = [None] * world_size
        dist.all_gather_object(everyone, versions(device))
        if len(set(everyone)) > 1:
            failures.append(
                "ranks run different software: "
                + "; ".join(f"rank {r}: {v}" for r, v in enumerate(everyone))
            )

        # one verdict for the whole job: the number of ranks that failed a check
        failed_ranks = torch.tensor([1 if failures else 0], dtype=torch.int64, device=device)
        dist.all_reduce(failed_ranks)

        # ---- 4. bandwidth ----
        rows = []
        for size_mb in args.sizes:
            n = max(1, int(size_mb * 1e6) // 4)
            tensor = torch.ones(n, dtype=torch.float32, device=device)  # (n,) float32: 4 bytes each
            seconds = timed_all_reduce(tensor, args.iters, device)
            algbw = n * 4 / seconds / 1e9  # GB/s, as nccl-tests count them (10^9 bytes)
            busbw = algbw * 2 * (world_size - 1) / world_size
            rows.append((n * 4 / 1e6, seconds * 1e3, algbw, busbw))
            del tensor

        if rank == 0:
            print(
                f"\nall-reduce of float32, {world_size} ranks, backend {backend}, "
                f"slowest rank's mean over {args.iters} calls:"
            )
            print(f"{'size (MB)':>12} {'time (ms)':>12} {'algbw (GB/s)':>14} {'busbw (GB/s)':>14}")
            for size, ms, algbw, busbw in rows:
                print(f"{size:>12.2f} {ms:>12.3f} {algbw:>14.4f} {busbw:>14.4f}")
            verdict = (
                "PASSED" if failed_ranks.item() == 0 else f"FAILED on {failed_ranks.item()} rank(s)"
            )
            nodes = world_size // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            print(f"\npreflight {verdict}: {world_size} ranks on {nodes} node(s)", flush=True)
        for failure in failures:
            print(f"{prefix} FAILED: {failure}", file=sys.stderr, flush=True)
        return 1 if failed_ranks.item() else 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
