"""Chapter 05 lab: the classic hangs of a data-parallel job, made on purpose, and how to find them.

Every case runs the same tiny data-parallel training loop (gloo, two ranks are enough) with one
classic mistake at step 2; --fixed runs the loop with the mistake corrected, and it finishes:

    eval-on-rank0  rank 0 evaluates alone, and the evaluation all-reduces its loss
    order          the ranks call two collectives in a different order
    shape          the ranks all-gather tensors of different shapes (an uneven split of the data)
    stuck          one rank is stuck in Python, polling for a file the other rank writes later
    dies           one rank raises an exception and ends (the fix is in the launch line:
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --max-restarts=1 ...)

Two more are mistakes in how the ranks meet, made before the first step by a setup written on one
machine. There the loopback reaches every rank and they do no harm; across machines
(05_multinode/machines.sh, and HANG_LAB.md's commands) no rank ever meets another:

    interface      gloo is told to listen on the loopback (GLOO_SOCKET_IFNAME=lo)
    address        every rank meets at localhost instead of node 0 (MASTER_ADDR=localhost)

    torchrun --standalone --nproc_per_node=2 05_multinode/hangs.py --case eval-on-rank0
    torchrun --standalone --nproc_per_node=2 05_multinode/hangs.py --case eval-on-rank0 --fixed

Each rank prints its PID first. To find the cause (docs/deep/HANG_LAB.md tells the whole story):

    --timeout S                       the process group's timeout: a hang becomes an error after S s
    TORCH_DISTRIBUTED_DEBUG=DETAIL    every collective is first checked against the other ranks'
    kill -USR1 PID                    that rank prints its Python stack (faulthandler)
    py-spy dump --pid PID             the same from outside, with nothing prepared in the program
    TORCH_FR_BUFFER_SIZE=100          a failing rank writes its Flight Recorder (last collectives)
    torchrun's summary                the first rank that failed, with its traceback (@record)

The gradients are averaged with one explicit all-reduce, which is what DDP does in buckets: in
torch 2.13 on the CPU, DDP's constructor crashes (SIGSEGV) under TORCH_DISTRIBUTED_DEBUG=DETAIL.
"""

import argparse
import datetime
import faulthandler
import os
import pickle
import signal
import sys
import time
from pathlib import Path

# lets `import common` work from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from common.support.errors import CourseError, run_main

CASES = ["eval-on-rank0", "order", "shape", "stuck", "dies", "interface", "address"]
# the two mistakes in how the ranks meet, made before the first step: right on one machine
MEETING_CASES = ["interface", "address"]
BUG_STEP = 2  # the mistake strikes after two good steps, in the middle of training
VAL_WINDOWS = 5  # validation examples: 3 for rank 0 and 2 for rank 1, as rank r takes r, r+W, ...


def parse_args() -> argparse.Namespace:
    raw = argparse.RawDescriptionHelpFormatter  # the docstring's line breaks kept
    p = argparse.ArgumentParser(
        prog="05_multinode/hangs.py", description=__doc__, formatter_class=raw
    )
    p.add_argument(
        "--case",
        choices=CASES + ["all"],
        required=True,
        help="all: every case in turn (with --fixed)",
    )
    p.add_argument("--fixed", action="store_true", help="run the case with its mistake corrected")
    p.add_argument(
        "--steps", type=int, default=4, help="training steps (default: 4; the mistake is at step 2)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=20,
        help="seconds a collective waits for the other ranks before it fails (default: 20; "
        "torch's own default is 30 minutes)",
    )
    p.add_argument(
        "--out-dir",
        default="out/05_multinode/hangs",
        help="for the file of the 'stuck' case, and flight_recorder/rank_N: what a failing rank's "
        "Flight Recorder held, when TORCH_FR_BUFFER_SIZE is set (default: out/05_multinode/hangs)",
    )
    args = p.parse_args()
    if args.steps <= BUG_STEP:
        p.error(f"--steps must be larger than {BUG_STEP}: the mistake comes at step {BUG_STEP}")
    return args


# ---- the pieces of a training loop where the classic mistakes live -------------------------------


def validation_losses(model: torch.nn.Module, rank: int, world: int) -> torch.Tensor:
    """This rank's share of the validation examples (r, r+W, ...) and their losses: (n_r,)."""
    torch.manual_seed(1234)  # the same validation set on every rank
    x, y = torch.randn(VAL_WINDOWS, 16), torch.randn(VAL_WINDOWS, 1)
    with torch.no_grad():
        return ((model(x[rank::world]) - y[rank::world]) ** 2).mean(dim=1)


def evaluate(model: torch.nn.Module, rank: int, world: int) -> float:
    """The validation loss: every rank sums its share, one all-reduce adds the sums and counts."""
    losses = validation_losses(model, rank, world)
    totals = torch.tensor([losses.sum().item(), len(losses)])  # (2,): the same shape on every rank
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def case_eval_on_rank0(args, model, rank, world, step):
    if args.fixed:  # every rank evaluates its share; only printing is rank 0's
        val = evaluate(model, rank, world)
        if rank == 0:
            print(f"[rank {rank}] step {step}: val loss {val:.4f}", flush=True)
    elif rank == 0:
        # the mistake: rank 0 alone enters evaluate(), and its all-reduce waits for rank 1
        print(f"[rank {rank}] step {step}: val loss {evaluate(model, rank, world):.4f}", flush=True)


def case_order(args, model, rank, world, step, loss):
    """Two collectives: the mean loss for the log, and rank 0's decision to stop
    (a time limit, say)."""
    stop = torch.tensor([0])

    def mean_loss():
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total.item() / world

    if args.fixed or rank != 0:  # the order every rank must follow: the loss, then the decision
        logged = mean_loss()
        dist.broadcast(stop, src=0)
    else:  # the mistake: rank 0 broadcasts its decision before it logs
        dist.broadcast(stop, src=0)
        logged = mean_loss()
    if rank == 0:
        print(
            f"[rank {rank}] step {step}: mean loss {logged:.4f}, stop {bool(stop.item())}",
            flush=True,
        )


def case_shape(args, model, rank, world, step):
    """Every validation loss on rank 0, to print the worst example: 3 on rank 0, 2 on rank 1."""
    losses = validation_losses(model, rank, world)  # (3,) on rank 0, (2,) on rank 1
    if args.fixed:  # agree on a length first, then pad to it: every rank gathers the same shape
        count = torch.tensor([len(losses)])
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        losses = torch.cat([losses, torch.full((count.item() - len(losses),), float("nan"))])
    gathered = [torch.empty_like(losses) for _ in range(world)]
    dist.all_gather(gathered, losses)  # the mistake, without the fix: shapes (3,) and (2,)
    if rank == 0:
        worst = torch.cat(gathered).nan_to_num(-1).max()
        print(f"[rank {rank}] step {step}: worst validation loss {worst:.4f}", flush=True)


def case_stuck(args, model, rank, world, step, flag: Path):
    """Rank 0 writes a file (a checkpoint, say) that rank 1 then reads."""
    if args.fixed:  # a barrier: the collective every rank reaches, after the write
        if rank == 0:
            flag.write_text(f"step {step}\n")
        dist.barrier()
        return
    if rank == 0:
        # the checkpoint records the validation loss: all ranks must join
        evaluate(model, rank, world)
        flag.write_text(f"step {step}\n")
    else:  # the mistake: rank 1 waits in Python for the file before joining the all-reduce
        while not flag.exists():
            time.sleep(0.1)
        evaluate(model, rank, world)


def meet_as_on_one_machine(case: str) -> None:
    """The ranks' meeting, as a script written on one machine sets it up: right there, where the
    loopback reaches every rank, and wrong across machines."""
    if case == "interface":
        # the mistake: gloo listens on the loopback, where no other machine can reach it
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if case == "address":
        # the mistake: every rank meets at its own machine, not at node 0 (torchrun's MASTER_ADDR)
        os.environ["MASTER_ADDR"] = "localhost"


def case_dies(args, model, rank, world, step):
    # A fault on one rank, such as a GPU that falls off the bus: on the first attempt only, so a
    # group that torchrun restarts (--max-restarts=1) gets through.
    if rank == world - 1 and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0:
        raise RuntimeError(f"rank {rank}: simulated fault at step {step}")


# ---- the training loop ---------------------------------------------------------------------------


def average_gradients(model: torch.nn.Module, world: int) -> None:
    """What DDP does during backward, in one all-reduce (see the README for why not DDP here)."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])  # (17,): 16 weights and a bias
    dist.all_reduce(flat)
    for g, new in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(new.view_as(g) / world)


def train(args, rank: int, world: int) -> None:
    torch.manual_seed(0)  # the same initial weights everywhere
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    flag = Path(args.out_dir) / f"written_by_rank0_{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}"
    for step in range(args.steps):
        torch.manual_seed(100 * step + rank)  # this rank's batch
        x, y = torch.randn(8, 16), torch.randn(8, 1)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        average_gradients(model, world)  # a collective on every rank, every step
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"[rank {rank}] step {step}: loss {loss.item():.4f}", flush=True)
        if step != BUG_STEP:
            continue
        cases = CASES if args.case == "all" else [args.case]
        if "eval-on-rank0" in cases:
            case_eval_on_rank0(args, model, rank, world, step)
        if "order" in cases:
            case_order(args, model, rank, world, step, loss)
        if "shape" in cases:
            case_shape(args, model, rank, world, step)
        if "stuck" in cases:
            flag.parent.mkdir(parents=True, exist_ok=True)
            case_stuck(args, model, rank, world, step, flag)
        if "dies" in cases:
            case_dies(args, model, rank, world, step)
    if rank == 0:
        flag.unlink(missing_ok=True)
    print(f"[rank {rank}] finished {args.steps} steps", flush=True)


def dump_flight_recorder(out_dir: str, rank: int) -> None:
    """This rank's last collectives, as the Flight Recorder kept them (TORCH_FR_BUFFER_SIZE > 0).

    With NCCL, torch dumps these buffers itself when a collective times out. With gloo nothing does,
    so the lab dumps on the way out, and prints the last entry: its sequence number, operation,
    shapes and the line of this file that called it. Compare the ranks' lines.
    """
    if int(os.environ.get("TORCH_FR_BUFFER_SIZE", 0)) <= 0:
        return
    path = Path(out_dir) / "flight_recorder" / f"rank_{rank}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(torch._C._distributed_c10d._dump_fr_trace())
    entries = pickle.loads(path.read_bytes())["entries"]
    if entries:
        last = entries[-1]
        caller = next(
            (f for f in last["frames"] if f["filename"] == __file__), {"name": "?", "line": "?"}
        )
        collective = f"#{last['collective_seq_id']} {last['profiling_name']}"
        print(
            f"[rank {rank}] flight recorder: last collective {collective} "
            f"of shapes {last['input_sizes']}, "
            f"called from {caller['name']}() line {caller['line']}; "
            f"{len(entries)} entries in {path}",
            flush=True,
        )


@record  # a failing rank writes its traceback where torchrun finds it, and torchrun prints it
def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:
        raise CourseError(
            "hangs.py runs under torchrun, e.g. torchrun --standalone --nproc_per_node=2 "
            "05_multinode/hangs.py --case eval-on-rank0"
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # kill -USR1 PID: print the Python stack
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    fixed = " (fixed)" if args.fixed else ""
    debug = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "OFF")
    print(
        f"[rank {rank}] pid {os.getpid()}: case {args.case}{fixed}, "
        f"timeout {args.timeout:g} s, TORCH_DISTRIBUTED_DEBUG={debug}",
        flush=True,
    )
    cases = CASES if args.case == "all" else [args.case]
    one_machine = os.environ["LOCAL_WORLD_SIZE"] == str(world)
    for case in MEETING_CASES:
        if case not in cases or args.fixed:
            continue
        meet_as_on_one_machine(case)
        if rank == 0 and one_machine:
            print(
                f"[rank 0] case {case}: on one machine the loopback reaches every rank; the "
                "mistake shows across machines (05_multinode/machines.sh)",
                flush=True,
            )
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
        train(args, rank, world)
    except Exception as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        where = ""
        if not dist.is_initialized():  # the ranks never met: say where this one looked
            interface = os.environ.get("GLOO_SOCKET_IFNAME", "unset")
            where = (
                f" (this rank met at MASTER_ADDR={os.environ['MASTER_ADDR']}:"
                f"{os.environ['MASTER_PORT']}, gloo with GLOO_SOCKET_IFNAME={interface})"
            )
        print(f"[rank {rank}] failed: {type(err).__name__}: {first_line}{where}", flush=True)
        dump_flight_recorder(args.out_dir, rank)
        raise
    finally:
        if dist.is_initialized():  # not when the ranks never met
            dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
