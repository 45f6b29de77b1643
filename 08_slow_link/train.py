"""Chapter 08: data parallelism over a slow link, by communicating rarely (DiLoCo).

Chapter 05's program without DDP: every rank trains its own copy of the model with its own AdamW
for --sync-every (H) steps, sending nothing. Then the copies meet: one all-reduce averages how far
each copy moved in the round (the pseudo-gradient), an outer SGD with Nesterov momentum moves the
global parameters along it, and every copy starts the next round from them. One all-reduce every
H steps instead of one every step: the link carries 1/H of DDP's bytes (1/2H in bfloat16).

    SCRIPT=08_slow_link/train.py bash 05_multinode/simulate_two_nodes.sh --sync-every 10
"""

import copy
import datetime
import os
import platform
import sys
from pathlib import Path

# lets `import common` work from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

from common.checkpoint import restore_training_state, save_checkpoint
from common.config import (
    CourseParser,
    fraction,
    gpt_config_from_args,
    non_negative_float,
    positive_int,
)
from common.data import (
    batch_loader,
    count_steps_per_epoch,
    load_splits,
    prepare,
    validation_windows,
)
from common.device import autocast_context, describe, pick_dtype, setup_math
from common.distributed import (
    RankLog,
    claim_out_dir_on_rank0,
    load_own_copy,
    one_rank_first,
    ranks_unlike_rank0,
    ranks_use_gpus,
    refuse_shared_gpus,
    require_torchrun,
    save_own_copy,
    share_cpu_cores,
)
from common.metrics import RunLog, Throughput
from common.support.errors import run_main
from common.training import (
    build_model,
    check_finite,
    check_resume,
    check_same_flags,
    evaluate,
    lr_at,
    sample_text,
)


def main():
    parser = CourseParser(chapter=8, description=__doc__)
    parser.add_argument(
        "--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step"
    )
    parser.add_argument(
        "--dist-timeout", type=positive_int, default=300, help="seconds a collective may wait"
    )
    parser.add_argument("--shared-fs", action="store_true", help="one file system on all nodes")
    # --sync-every is torchft's name (its LocalSGD and DiLoCo take the outer optimizer as an
    # object). The outer lr and momentum are the DiLoCo paper's; its H was 500, longer runs' H.
    parser.add_argument(
        "--sync-every", type=positive_int, default=50, help="H: inner steps between syncs"
    )
    parser.add_argument(
        "--outer-lr", type=non_negative_float, default=0.7, help="the outer SGD's lr"
    )
    parser.add_argument(
        "--outer-momentum", type=fraction, default=0.9, help="the outer SGD's Nesterov momentum"
    )
    parser.add_argument(
        "--sync-bf16", action="store_true", help="send the pseudo-gradient in bfloat16"
    )
    parser.add_argument(
        "--inner-optimizer", choices=["adamw", "sgd"], default="adamw", help="each copy's own"
    )
    args = parser.parse_args()
    # ---- who is who: torchrun tells each of the WORLD_SIZE copies its place ----------------------
    require_torchrun()  # started with plain `python`: one line that gives the torchrun command
    rank = int(os.environ["RANK"])  # this process among all of them: 0 .. world_size - 1
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])  # this process among those on its machine: its GPU
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    is_rank0 = rank == 0
    # torchrun numbers the machines too: GROUP_RANK is this machine's place (--node-rank, or c10d's
    # choice). Every line names it: "which machine?" comes first when a job of many machines fails.
    node_rank = int(os.environ["GROUP_RANK"])
    # log(...) prints on rank 0, which speaks for every rank; log.every_rank(...) on each
    log = RankLog(f"[node {node_rank} rank {rank} local {local_rank}]", speaks=is_rank0)
    torch.manual_seed(args.seed)  # on every rank: the copies start equal, before the broadcast

    # Each process drives one GPU: the LOCAL_RANK-th of its own machine, never the RANK-th (on a
    # second machine of 8 GPUs RANK starts at 8, but its GPUs are 0..7). Without GPUs, the CPU.
    device = torch.device("cpu")
    if ranks_use_gpus(args.device, local_rank, local_world_size, torch.cuda.device_count()):
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # or all CUDA work would land on cuda:0
    share_cpu_cores(device, local_world_size)  # ranks on one CPU share its cores
    dtype = pick_dtype(args.dtype, device)
    setup_math(device, dtype)
    autocast = autocast_context(device, dtype)
    out_dir = Path(args.out_dir)

    # ---- the process group: every rank joins it; collectives run in it ---------------------------
    backend = "nccl" if device.type == "cuda" else "gloo"  # NCCL: GPU to GPU; gloo: CPU over TCP
    # a collective that waits longer than this for a peer (dead or stuck) fails instead of hanging
    timeout = datetime.timedelta(seconds=args.dist_timeout)
    # every rank meets the others at MASTER_ADDR:MASTER_PORT, which torchrun sets
    dist.init_process_group(backend, timeout=timeout)
    refuse_shared_gpus(device, timeout)  # two ranks on one GPU: one line, not NCCL's traceback
    place = f"rank {rank} of {world_size}, local rank {local_rank}"
    log.every_rank(f"process {os.getpid()} on {platform.node()}: {place}, device {device}")

    # ---- data: token files on disk, read as fixed windows of block_size tokens -------------------
    model_config = gpt_config_from_args(args)
    # On node-local disks every machine needs its own token files: local rank 0 of EVERY node
    # prepares them. With --shared-fs all nodes see one --data-dir, where two machines writing the
    # same files would corrupt them: global rank 0 alone prepares. The others wait for it.
    preparer = local_rank == 0
    if args.shared_fs:
        preparer = is_rank0
    with one_rank_first(preparer):
        data_folder = prepare(
            args.dataset, args.data_dir, args.num_proc, args.text_column, log=log.every_rank
        )
    train_set, val_set = load_splits(data_folder, model_config.block_size)

    # One optimizer step sees `global_batch` sequences: grad_accum micro-batches, one after another,
    # on each of world_size ranks at the same time, each of `batch_size` sequences.
    global_batch = args.batch_size * args.grad_accum * world_size
    tokens_per_step = global_batch * model_config.block_size
    steps_per_epoch = count_steps_per_epoch(train_set, global_batch)
    # every chapter evaluates these windows: eval_batches whole global batches, spread evenly
    val_windows = validation_windows(val_set, args.eval_batches, global_batch)

    # ---- model and optimizer ---------------------------------------------------------------------
    # the run folder: refused if another run holds it or is using it; rank 0 locks it for all
    claim_out_dir_on_rank0(out_dir, resume=args.resume)
    checkpoint = None
    own_copy = None
    if args.resume:
        # ckpt.pt and this rank's own copy, from its node's disk: the same ranks on the same nodes
        checkpoint, own_copy = load_own_copy(out_dir)
    # The global parameters, the same on every rank: they change only at a sync. The checkpoint's
    # model is this one, which any chapter loads.
    global_model = build_model(model_config, args.init_from, checkpoint).to(device)
    # what this rank hands to collectives, by kind, in bytes (a few small ones aside: barriers)
    bytes_sent = {"first parameters": 0, "pseudo-gradients": 0, "logged losses": 0}
    # every copy starts as rank 0's (DDP did this broadcast for chapter 05)
    for param in global_model.parameters():
        dist.broadcast(param.data, src=0)
        bytes_sent["first parameters"] += param.numel() * param.element_size()
    # This rank's copy, which trains alone between syncs: no DDP, so backward sends nothing.
    raw_model = copy.deepcopy(global_model)
    # The inner optimizer, this rank's own. AdamW keeps two running averages per parameter; plain
    # SGD (--inner-optimizer sgd, no momentum) with --outer-lr 1 --outer-momentum 0 makes H = 1
    # the same run as DDP with SGD.
    if args.inner_optimizer == "adamw":
        optimizer = torch.optim.AdamW(
            raw_model.optimizer_groups(args.weight_decay),
            lr=args.lr,
            betas=(args.beta1, args.beta2),
            fused=device.type == "cuda",
        )
    else:
        optimizer = torch.optim.SGD(raw_model.optimizer_groups(args.weight_decay), lr=args.lr)
    # The outer optimizer moves the global parameters along the ranks' mean pseudo-gradient, as
    # if it were a gradient. Nesterov momentum 0.9 and lr 0.7 are the DiLoCo paper's; momentum 0
    # and lr 1 make a sync plain parameter averaging (local SGD).
    outer_optimizer = torch.optim.SGD(
        global_model.parameters(),
        lr=args.outer_lr,
        momentum=args.outer_momentum,
        nesterov=args.outer_momentum > 0,
    )
    # float16 can underflow small gradients to zero; the scaler multiplies the loss to keep them.
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    iter_num = 0
    round_start = 0  # the step after which this round's inner steps began (the last sync's)
    if checkpoint is not None:
        # resuming needs the same global batch and seed; the outer momentum and RNG go on
        check_resume(checkpoint, global_batch, args.seed)
        # and the same rounds: another H or outer step would change them without a word
        round_flags = ["sync_every", "outer_lr", "outer_momentum", "inner_optimizer", "sync_bf16"]
        check_same_flags(checkpoint, args, round_flags)
        iter_num = restore_training_state(checkpoint, outer_optimizer, scaler)
        # mid-round, every copy has moved on its own: each rank takes back its own and its AdamW
        raw_model.load_state_dict(own_copy["model"])
        optimizer.load_state_dict(own_copy["optimizer"])
        round_start = checkpoint["round_start"]
    model = raw_model
    if args.compile:
        model = torch.compile(raw_model)

    model_size = f"{raw_model.num_params() / 1e6:.2f}M parameters ({args.preset})"
    log(f"device {describe(device)}, {str(dtype).removeprefix('torch.')}; model {model_size}")
    per_step = f"{global_batch} sequences x {model_config.block_size} tokens = {tokens_per_step:,}"
    split = f"{args.grad_accum} micro-batches x {world_size} rank(s) x {args.batch_size}"
    log(f"global batch: {split} = {per_step} tokens per step; {steps_per_epoch} steps per epoch")
    every = f"a sync every {args.sync_every} steps"
    outer = f"outer SGD lr {args.outer_lr}, momentum {args.outer_momentum}"
    log(f"DiLoCo: {world_size} copies, {args.inner_optimizer} each, {every}, {outer}, {backend}")
    if iter_num:
        log(f"resuming from {out_dir / 'ckpt.pt'} at step {iter_num}")

    # ---- the data order: epoch e visits the windows in randperm(N) seeded with seed + e ----------
    # Every rank draws that permutation and takes its positions: rank, rank + W, rank + 2W and so on
    # (W = world_size). One step's micro-batches on all ranks are the G positions chapter 01 takes
    # for it. drop_last: an epoch's remainder is dropped, not padded.
    sampler = DistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True
    )

    train_config = vars(args) | {"global_batch": global_batch, "world_size": world_size}
    speed = Throughput(tokens_per_step, raw_model.flops_per_token(), device, dtype, world_size)
    # metrics.jsonl and the lines from rank 0 (log), MFU of all ranks: one call per log step
    report = RunLog(out_dir, iter_num, speed, log)
    first_step = iter_num

    while iter_num < args.max_iters:
        epoch = iter_num // steps_per_epoch
        step_in_epoch = iter_num % steps_per_epoch  # > 0 when a resumed run starts mid-epoch
        # the permutation of seed + epoch; without this every epoch repeats epoch 0
        sampler.set_epoch(epoch)
        # micro-batches of this epoch a resumed run trained on
        skip = step_in_epoch * args.grad_accum
        loader = batch_loader(train_set, sampler, args.batch_size, skip, device)
        batches = iter(loader)
        for _ in range(step_in_epoch, steps_per_epoch):
            if iter_num >= args.max_iters:
                break
            # ---- one training step ----
            lr = lr_at(iter_num, args)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss = torch.zeros((), device=device)  # the mean loss of this rank's share
            for _ in range(args.grad_accum):
                x, y = next(batches)  # (B, T) each, built in CPU memory
                x = x.to(device, non_blocking=True)
                y = y.to(device, non_blocking=True)
                with autocast:
                    _, micro_loss = model(x, y)  # mean cross-entropy over B * T predictions
                    # backward() adds into .grad, so K micro-steps sum K gradients; each loss
                    # divided by K makes that sum the gradient of the mean over this rank's
                    # K * B sequences
                    micro_loss = micro_loss / args.grad_accum
                # this rank's gradient only: nothing is sent, whatever the link
                scaler.scale(micro_loss).backward()
                loss += micro_loss.detach()
            # the inner step: this rank's copy moves against its own gradient, alone
            if args.grad_clip > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            iter_num += 1
            last_step = iter_num == args.max_iters

            # ---- the sync: every H steps (and at the end), the copies meet ----
            if iter_num - round_start == args.sync_every or last_step:
                # The pseudo-gradient: how far this copy moved from the global parameters in the
                # round, pointing back (as a gradient points uphill). One flat tensor, so that the
                # round's communication is one all-reduce.
                global_params = list(global_model.parameters())
                moved = [
                    g.detach() - p.detach() for g, p in zip(global_params, raw_model.parameters())
                ]
                pseudo_grad = torch.cat([m.flatten() for m in moved])  # (num_params,)
                # this rank's share of the mean: the sum stays in range, in bfloat16 too
                sent = pseudo_grad / world_size
                if args.sync_bf16:
                    sent = sent.to(torch.bfloat16)  # half the bytes on the link
                dist.all_reduce(sent, op=dist.ReduceOp.SUM)  # the round's one all-reduce
                bytes_sent["pseudo-gradients"] += sent.numel() * sent.element_size()
                mean_pseudo_grad = sent.to(pseudo_grad.dtype)
                # the outer step: the mean pseudo-gradient is the global parameters' gradient
                sizes = [g.numel() for g in global_params]
                for g, chunk in zip(global_params, mean_pseudo_grad.split(sizes)):
                    g.grad = chunk.view_as(g)
                outer_optimizer.step()
                outer_optimizer.zero_grad(set_to_none=True)
                # every copy starts the next round from the new global parameters
                with torch.no_grad():
                    for p, g in zip(raw_model.parameters(), global_params):
                        p.copy_(g)
                round_start = iter_num

            # ---- logging: .item() waits for the device, so only at log intervals ----
            if iter_num % args.log_interval == 0 or last_step:
                # the mean over all ranks: a collective, so every rank calls it
                dist.all_reduce(loss, op=dist.ReduceOp.SUM)
                bytes_sent["logged losses"] += loss.numel() * loss.element_size()
                loss_value = loss.item() / world_size
                check_finite(iter_num, loss_value)  # a NaN or an inf loss ends the run
                report.step(iter_num, loss_value, lr)

            # ---- evaluation and checkpoint ----
            if iter_num % args.eval_interval == 0 or last_step:
                # The global parameters, the last sync's: every rank holds the same, and
                # evaluates the same windows with them, so all get the same loss.
                val_loss = evaluate(
                    global_model, val_set, val_windows, args.batch_size, device, autocast
                ).item()
                # before the save: a diverged model never replaces a good checkpoint
                check_finite(iter_num, val_loss, "validation loss")
                # mid-round every copy and its AdamW differ: each rank saves its own where it runs
                save_own_copy(out_dir, iter_num, raw_model, optimizer)
                # ckpt.pt: the global parameters, the same on every rank; one per node, as the data
                if preparer:
                    more = {"round_start": round_start}
                    save_checkpoint(
                        out_dir, iter_num, global_model, outer_optimizer, scaler, train_config, more
                    )
                report.evaluation(iter_num, val_loss, out_dir / "ckpt.pt")
    steps = iter_num - first_step
    if steps:
        per_step = bytes_sent["pseudo-gradients"] / steps
        sent = f"sent {bytes_sent['pseudo-gradients']:,} bytes of pseudo-gradients in {steps} steps"
        losses = f"{bytes_sent['logged losses']:,} bytes of logged losses"
        first = f"{bytes_sent['first parameters']:,} bytes of the first parameters"
        log(f"{sent} ({per_step:,.0f} per step), {losses}, 0 bytes of checkpoints, {first}")
    # the last sync reset every copy to the global parameters: they are equal, bit for bit
    differing = ranks_unlike_rank0(raw_model)
    verdict = "yes" if differing == 0 else f"NO, {differing} rank(s) differ from rank 0"
    log(f"parameters identical on all {world_size} rank(s): {verdict}")

    if args.sample_tokens and is_rank0:
        log(f"---- a sample from the model ({args.sample_tokens} tokens) ----")
        text = sample_text(raw_model, args.prompt, args.sample_tokens, device, seed=args.seed)
        print(text)


if __name__ == "__main__":
    try:
        run_main(main, resumable=True)
    finally:
        # Leave the process group on every way out, an error's too: a rank that ends without it
        # leaves its peers' connections open until their timeout. After main() has returned, so
        # that the model, whose DDP or FSDP state uses the group, is freed first.
        if dist.is_initialized():
            dist.destroy_process_group()
