# Exercise: chapter 05 (05_multinode). This is chapter 04's train.py; add chapter 05's idea where
# the 12 TODOs say. A TODO says how the lines below it change and quotes the new comments of the
# solution there. Solve a copy, not this file: a my_*.py file is yours (git ignores it, and the
# course's tests read only this one). Then check your copy:
#     cp -n 05_multinode/exercise.py 05_multinode/my_exercise.py
#     python -m tools.check 05_multinode/my_exercise.py --nproc-per-node 2
# The solution is 05_multinode/train.py (its README shows the diff). `cp -n` never overwrites a
# copy; to start again, copy this file under another name. This file is made by
# maintainer/make_exercises.py from the two scripts.
"""Chapter 04: DistributedDataParallel, one process per GPU, started by torchrun.

Chapter 03's program, with nn.DataParallel replaced by DistributedDataParallel: torchrun starts
one process per GPU (or several on a CPU), each with its own copy of the model and its own share
of every global batch. During backward, DDP averages the gradients over all processes, so every
copy takes the same optimizer step. Rank 0 prints, logs and writes checkpoints for all of them.
Started with plain `python`, the script runs as a world of one process and says so.

    torchrun --standalone --nproc_per_node=2 04_ddp/train.py
    torchrun --standalone --nproc_per_node=2 04_ddp/train.py --batch-size 4  # 01's run with 8
"""

# TODO 1/12: the imports: remove (-) and add (+)
#     + agree_on_restart,
#     + restart_store,
import contextlib
import datetime
import os
import platform
import sys
from pathlib import Path

# lets `import common` work from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from common.checkpoint import load_checkpoint, restore_training_state, save_checkpoint
from common.config import gpt_config_from_args, parse_args
from common.data import (
    batch_loader,
    describe_global_batch,
    load_splits,
    prepare,
    validation_windows,
)
from common.device import autocast_context, describe, pick_dtype, setup_math
from common.distributed import (
    one_rank_first,
    rank_device,
    ranks_unlike_rank0,
    share_cpu_cores,
    start_process_group,
)
from common.metrics import MetricsLog, Throughput, max_memory_mb
from common.support.errors import CourseError, run_main
from common.support.gpus import peak_flops
from common.support.preempt_ranks import AgreedPreemption
from common.support.progress import Progress
from common.support.rundir import claim_out_dir
from common.training import (
    build_model,
    check_resume,
    evaluate,
    lr_at,
    sample_text,
    stop_if_diverged,
)


def main():
    # TODO 2/12: change the next 1 line(s) of code:
    #     args = parse_args(chapter=5, description=__doc__)
    args = parse_args(chapter=4, description=__doc__)
    # the same seed on every rank: the copies start equal even before DDP broadcasts rank 0's
    torch.manual_seed(args.seed)

    # ---- who is who: torchrun starts WORLD_SIZE copies of this script and tells each its place
    # ---- torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    launched = "RANK" in os.environ
    rank = int(os.environ.get("RANK", 0))  # this process among all of them: 0 .. world_size - 1
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    # this process among those on this machine: its GPU
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    # TODO 3/12: add 3 line(s) of code here:
    #   torchrun numbers the machines too: GROUP_RANK is this machine's place among the nodes (other
    #     launchers call it NODE_RANK). Training does not depend on it, but every line names it:
    #     "which machine?" is the first question when a job of many machines goes wrong.
    #   How often torchrun (--max-restarts) has restarted this node's processes after a failure.
    is_rank0 = rank == 0
    # TODO 4/12: change the next 1 line(s) of code:
    #     who = f"[node {node_rank} rank {rank} local {local_rank}]"
    who = f"[rank {rank}]"

    def say(message: str) -> None:
        """A line from this rank, which says who is speaking."""
        print(f"{who} {message}", flush=True)

    def log(message: str) -> None:
        """A line from rank 0, which speaks for every rank."""
        if is_rank0:
            say(message)

    # Each process drives one GPU, the one its LOCAL_RANK names; on a machine without one, the CPU.
    device = rank_device(args.device, local_rank, local_world_size, torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA work, or it would all land on cuda:0
    # ranks on one CPU share its cores
    cpu_threads = share_cpu_cores(local_world_size) if device.type == "cpu" else None
    dtype = pick_dtype(args.dtype, device)
    setup_math(device, dtype)
    autocast = autocast_context(device, dtype)
    out_dir = Path(args.out_dir)

    # ---- the process group: every rank joins it; collectives (all-reduce, broadcast) run in it
    # ---- NCCL moves CUDA tensors GPU to GPU; gloo moves CPU tensors over TCP.
    # A collective that waits longer than the timeout for a peer (dead or stuck) fails instead of
    # hanging.
    timeout = datetime.timedelta(seconds=args.dist_timeout)
    # TODO 5/12: change the next 2 line(s) of code into 4:
    #   its own meeting point for every attempt: torchrun's store outlives a restart (--max-
    #     restarts)
    #   Under torchrun the ranks meet at that store (or at MASTER_ADDR:MASTER_PORT); with plain
    #     `python` the world is this process alone. The backend follows the device (--backend auto),
    #     and on GPUs the ranks check that no two of them share one.
    # Under torchrun the ranks meet at MASTER_ADDR:MASTER_PORT; with plain `python` the world is
    # this process alone. The backend follows the device (--backend auto), and on GPUs the ranks
    # check that no two of them share one.
    backend = start_process_group(args.backend, device, launched, rank, world_size, timeout)
    place = f"rank {rank} of {world_size}, local rank {local_rank}"
    say(f"process {os.getpid()} on {platform.node()}: {place}, device {device}")
    if not launched:
        # TODO 6/12: change the next 4 line(s) of code:
        #     log(
        #     "not started by torchrun, so this is a world of one process (chapter 01's run); "
        #     "for N processes: "
        #     "torchrun --standalone --nproc_per_node=N 05_multinode/train.py"
        log(
            "not started by torchrun, so this is a world of one process (chapter 01's run); "
            "for N processes: "
            "torchrun --standalone --nproc_per_node=N 04_ddp/train.py"
        )

    # ---- data: token files on disk, read as fixed windows of block_size tokens -------------------
    model_config = gpt_config_from_args(args)
    # TODO 7/12: change the next 1 line(s) of code into 2:
    #   One-time work: the token files. On node-local disks every machine needs its own copy, so
    #     local rank 0 of EVERY node prepares. With --shared-fs all nodes see one --data-dir, where
    #     several machines writing the same files at once would corrupt them: global rank 0 alone
    #     prepares. The others wait for it (every rank calls one_rank_first), then find the files
    #     ready.
    # Local rank 0 of each machine prepares the token files once; the other ranks there wait for it
    # (every rank calls one_rank_first), then find the files ready and prepare() does no work.
    with one_rank_first(local_rank == 0):
        data_folder = prepare(
            args.dataset,
            args.data_dir,
            num_proc=args.num_proc,
            text_column=args.text_column,
            log=say,
        )
    train_set, val_set = load_splits(data_folder, model_config.block_size)

    # One optimizer step sees `global_batch` sequences: grad_accum micro-batches, one after another,
    # on each of world_size ranks at the same time, each of `batch_size` sequences.
    global_batch = args.batch_size * args.grad_accum * world_size
    tokens_per_step = global_batch * model_config.block_size
    # the incomplete last batch of an epoch is dropped
    steps_per_epoch = len(train_set) // global_batch
    if steps_per_epoch == 0:
        raise CourseError(
            f"the training split has {len(train_set)} windows, fewer than one batch of "
            f"{global_batch}; lower --batch-size or use a larger corpus"
        )
    # the same in every chapter
    val_windows = validation_windows(val_set, args.eval_batches, global_batch)

    # ---- model and optimizer ---------------------------------------------------------------------
    # TODO 8/12: add 3 line(s) of code here:
    #   torchrun --max-restarts: when a process fails, torchrun stops the group and starts all of
    #     them again. A restarted run continues from the checkpoint written before the failure, if
    #     there is one yet. The ranks agree on the restart count, and every rank says whether it
    #     sees the checkpoint: across machines --out-dir must be on a file system all nodes see.
    # The run folder: refused if it holds another run (unless this one continues it) or another
    # TODO 9/12: change the next 2 line(s) of code into 4:
    #   run is using it; then locked by rank 0 until it ends, so no second run writes into it.
    # run is using it; then locked until this process ends, so no second run writes into it.
    claim_out_dir(out_dir, resume=args.resume)
    checkpoint = load_checkpoint(out_dir) if args.resume else None
    if checkpoint is not None:
        check_resume(checkpoint, global_batch, args.seed)
    model = build_model(model_config, args.init_from, checkpoint).to(device)
    # AdamW keeps two running averages per parameter: the optimizer state is twice the model's size.
    optimizer = torch.optim.AdamW(
        model.optimizer_groups(args.weight_decay),
        lr=args.lr,
        betas=(args.beta1, args.beta2),
        fused=device.type == "cuda",
    )
    # float16 can underflow small gradients to zero; the scaler multiplies the loss to keep them.
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    iter_num = 0
    best_val_loss = None
    if checkpoint is not None:
        # resuming: the optimizer's averages, the loss scale and the random state continue
        iter_num = restore_training_state(checkpoint, optimizer, scaler)
        best_val_loss = checkpoint.get("best_val_loss")
    # DDP broadcasts rank 0's parameters to all ranks here, so every copy starts the same, and hooks
    # into backward to average the gradients over ranks. The wrapper keeps the real model in
    # model.module. Its state dict would prefix every name with "module.", so checkpoints save
    # model.module's, which any chapter can load. On a GPU, device_ids is this rank's GPU,
    # cuda:LOCAL_RANK.
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    raw_model = model.module
    if args.compile:
        model = torch.compile(model)

    peak = peak_flops(device, dtype)
    log(
        f"device {describe(device)}, {str(dtype).removeprefix('torch.')}; "
        f"model {raw_model.num_params() / 1e6:.2f}M parameters ({args.preset})"
    )
    per_step = describe_global_batch(global_batch, model_config.block_size, steps_per_epoch)
    split = f"{args.grad_accum} micro-batches x {world_size} rank(s) x {args.batch_size}"
    log(f"global batch: {split} = {per_step}")
    averaging = "gradients are averaged over ranks in buckets during backward"
    threads = f"; {cpu_threads}" if cpu_threads else ""
    log(
        f"DDP: {world_size} process(es), one model copy each, backend {backend}; "
        f"{averaging}{threads}"
    )
    # TODO 10/12: add 1 line(s) of code here:
    #     restarted = f"restarted by torchrun (restart {restarts}): " if restarts else ""
    # TODO 11/12: change the next 2 line(s) of code into 4:
    #     if iter_num:
    #     log(f"{restarted}resuming from {out_dir / 'ckpt.pt'} at step {iter_num}")
    #     elif restarted:
    #     log(f"{restarted}no checkpoint was written yet, starting again from step 0")
    if iter_num:
        log(f"resuming from {out_dir / 'ckpt.pt'} at step {iter_num}")

    # ---- the data order: epoch e visits the windows in randperm(N) seeded with seed + e ----------
    # Every rank draws that same permutation and takes the positions rank, rank + W, rank + 2W, ...
    # (W = world_size): the ranks' micro-batches of one step together are the G consecutive
    # positions chapter 01 takes for it. drop_last: an epoch's remainder is dropped, not padded.
    sampler = DistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True
    )

    # only rank 0 writes files and draws the progress bar
    metrics = MetricsLog(out_dir / "metrics.jsonl", enabled=is_rank0, resume_from=iter_num)
    progress = Progress(total=args.max_iters, initial=iter_num, enabled=is_rank0, prefix=f"{who} ")
    # TODO 12/12: change the next 4 line(s) of code:
    #     train_config = vars(args) | {
    #     "global_batch": global_batch,
    #     "world_size": world_size,
    #     "chapter": 5,
    train_config = vars(args) | {
        "global_batch": global_batch,
        "world_size": world_size,
        "chapter": 4,
    }
    model.train()
    # tokens_per_step counts the tokens of all ranks, so MFU is measured against all devices' peak
    speed = Throughput(
        tokens_per_step, raw_model.flops_per_token(), peak, devices=world_size, start=iter_num
    )
    grad_norm = None  # the last step's gradient norm, a tensor on the device (with --grad-clip)

    def save(step: int) -> None:
        """The checkpoint, at every evaluation and when the run is asked to stop (rank 0 writes)."""
        if is_rank0:
            save_checkpoint(
                out_dir,
                model_state=model.module.state_dict(),
                optimizer_state=optimizer.state_dict(),
                iter_num=step,
                model_config=model_config,
                train_config=train_config,
                best_val_loss=best_val_loss,
                scaler_state=scaler.state_dict(),
            )

    # SIGTERM from a scheduler (or --stop-signal): finish the step, save it, stop
    # (common/support/preempt_ranks.py). The ranks agree on the step to stop at, with an all-reduce
    # of two numbers every few steps. A worker restarted after a stop stops here too.
    preemption = AgreedPreemption(args.stop_signal, out_dir, ranks_agree_within=timeout)

    while iter_num < args.max_iters:
        epoch, step_in_epoch = divmod(iter_num, steps_per_epoch)
        # the permutation of seed + epoch; without this every epoch repeats epoch 0
        sampler.set_epoch(epoch)
        # micro-batches of this epoch a resumed run trained on
        skip = step_in_epoch * args.grad_accum
        loader = batch_loader(
            train_set, sampler, args.batch_size, skip, pin_memory=device.type == "cuda"
        )
        batches = iter(loader)
        for _ in range(step_in_epoch, steps_per_epoch):
            if iter_num >= args.max_iters:
                break
            # ---- one training step ----
            lr = lr_at(iter_num, args)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # this rank's mean loss over its share of the global batch
            loss = torch.zeros((), device=device)
            for micro_step in range(args.grad_accum):
                # DDP averages the gradients over ranks inside backward(). Before the last
                # micro-step that traffic would be wasted: no_sync() lets this rank's gradients add
                # up locally, and the last backward averages the sums once.
                sync = (
                    model.no_sync()
                    if micro_step < args.grad_accum - 1
                    else contextlib.nullcontext()
                )
                with sync:
                    x, y = next(batches)  # (B, T) each, built in CPU memory
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    with autocast:
                        _, micro_loss = model(x, y)  # mean cross-entropy over B * T predictions
                        # backward() adds into .grad, so K micro-steps sum K gradients; dividing
                        # each loss by K turns that sum into the gradient of the mean over all K * B
                        # sequences
                        micro_loss = micro_loss / args.grad_accum
                    # the last micro-step's backward all-reduces bucket after bucket of gradients
                    # while it is still computing the rest; when it returns, every rank holds the
                    # average
                    # this micro-batch's activations are freed here
                    scaler.scale(micro_loss).backward()
                loss += micro_loss.detach()
            # clipping, the optimizer step and the learning rate act once per global batch
            if args.grad_clip > 0:
                scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            scaler.step(optimizer)  # parameters move against their gradients
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            iter_num += 1

            # ---- logging: .item() waits for the device, so only at log intervals ----
            if iter_num % args.log_interval == 0 or iter_num == args.max_iters:
                # the mean over all ranks: a collective, so every rank calls it (SUM works on every
                # backend)
                dist.all_reduce(loss, op=dist.ReduceOp.SUM)
                loss_value = loss.item() / world_size
                # nan/inf?
                stop_if_diverged(iter_num, loss_value, grad_norm, scaler, args.grad_clip, dtype)
                figures = speed.measure(iter_num)  # since the last log line
                metrics.write(
                    iter=iter_num,
                    loss=loss_value,
                    lr=lr,
                    **figures,
                    max_mem_mb=max_memory_mb(device),
                )
                progress.step(iter_num, loss_value, figures, lr)  # on the bar, or a line in a file
            else:
                progress.step(iter_num)  # the bar moves on

            # ---- evaluation and checkpoint ----
            if iter_num % args.eval_interval == 0 or iter_num == args.max_iters:
                # Each rank evaluates every world_size-th window (with raw_model: no gradients,
                # nothing for DDP to do); the loss sums and window counts are added over ranks, so
                # every rank gets the mean over all the windows.
                my_windows = val_windows[rank::world_size]
                my_loss = evaluate(
                    raw_model, val_set, my_windows, args.batch_size, device, autocast
                )
                my_count = torch.tensor(float(len(my_windows)), device=device)
                # the sum of my losses, their count
                val_stats = torch.stack([my_loss * my_count, my_count])
                dist.all_reduce(val_stats, op=dist.ReduceOp.SUM)
                val_loss = (val_stats[0] / val_stats[1]).item()
                stop_if_diverged(
                    iter_num, val_loss, None, scaler, args.grad_clip, dtype, "validation loss"
                )
                if best_val_loss is None or val_loss < best_val_loss:
                    best_val_loss = val_loss
                metrics.write(iter=iter_num, val_loss=val_loss)
                save(iter_num)
                saved = f"checkpoint saved to {out_dir / 'ckpt.pt'}"
                progress.print(f"step {iter_num}: val loss {val_loss:.4f}, {saved}")
                speed.restart_clock()  # evaluation time is not training time
            # a stop signal came during this step (on the last step, the run just ends)
            if iter_num < args.max_iters and preemption.requested():
                if iter_num % args.eval_interval != 0:  # an evaluation step saved it already
                    save(iter_num)
                preemption.stop(iter_num)  # one line, exit status 75: continue with --resume
    progress.close()
    # DDP's promise: the same start and the same averaged gradients keep every copy equal. Check it
    # bit for bit against rank 0's copy.
    differing = ranks_unlike_rank0(raw_model)
    verdict = "yes" if differing == 0 else f"NO, {differing} rank(s) differ from rank 0"
    log(f"parameters identical on all {world_size} rank(s): {verdict}")

    if args.sample_tokens and is_rank0:
        log(f"---- a sample from the model ({args.sample_tokens} tokens) ----")
        print(sample_text(raw_model, args.prompt, args.sample_tokens, device, seed=args.seed))


if __name__ == "__main__":
    try:
        run_main(main, resumable=True)
    finally:
        # Every way out (the end, an error, Ctrl-C) leaves the process group, which closes the
        # connections to the other ranks (and NCCL's communicators) cleanly.
        if dist.is_initialized():
            dist.destroy_process_group()
