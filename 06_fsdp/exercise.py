# Exercise: chapter 06 (06_fsdp). This is chapter 05's train.py; add chapter 06's idea where the 18
# TODOs say. A TODO says how the lines below it change, and hints: the new comments of the solution
# there (or its code), the defs it adds and the helpers it first calls, with their signatures. Solve
# a copy, not this file: a my_*.py file is yours (git ignores it, and the course's tests read only
# this one). Then check your copy:
#     cp -n 06_fsdp/exercise.py 06_fsdp/my_exercise.py
#     python -m tools.check 06_fsdp/my_exercise.py --nproc-per-node 2
# The solution is 06_fsdp/train.py (its README shows the diff). `cp -n` never overwrites a copy; to
# start again, copy this file under another name. This file is made by maintainer/make_exercises.py
# from the two scripts.
"""Chapter 05: one training job on several machines, which must survive failures and stops.

Chapter 04's program, with what changes when the processes live on several machines ("nodes").
The training step is the same: DDP averages gradients over every rank, wherever it runs. Around it:
each process knows its node as well as its global and local rank and prefixes every line with
them; the token files are prepared once per node, or once in all on a shared file system
(--shared-fs); when torchrun restarts the group after a failure (--max-restarts), the run
continues from its last checkpoint; and a scheduler's stop (SIGTERM, or --stop-signal) saves the
step every rank has reached and exits 75, for the job to be requeued and resumed. Launch recipes for
two machines, SLURM and a two-node simulation on one machine are in this folder (README.md).

    bash 05_multinode/simulate_two_nodes.sh                              # two nodes on this machine
    NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash 05_multinode/launch_static.sh  # node 0 (and 1 on node 1)
"""

# TODO 1/18: the imports: remove (-) and add (+)
#     - import contextlib
#     - from torch.nn.parallel import DistributedDataParallel as DDP
#     - from common.checkpoint import load_checkpoint
#     - from common.device import autocast_context
#     - from common.distributed import ranks_unlike_rank0
#     + from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
#     + from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
#     + from common.checkpoint import check_same_shape
#     + from common.model import GPT
#     + from common.sharding import describe_held_bytes, gather_full_state, held_bytes,
#         load_checkpoint_on_rank0, peak_memory, shard_full_state, start_peak_memory
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
    count_steps_per_epoch,
    describe_global_batch,
    load_splits,
    prepare,
    validation_windows,
)
from common.device import autocast_context, describe, pick_dtype, setup_math
from common.distributed import (
    RankLog,
    agree_on_restart,
    one_rank_first,
    rank_device,
    ranks_unlike_rank0,
    refuse_shared_gpus,
    require_torchrun,
    restart_store,
    share_cpu_cores,
)
from common.metrics import RunLog, Throughput
from common.support.errors import run_main
from common.support.preempt import Preemption
from common.support.preempt_ranks import stop_after_saving, stop_if_stopped_before
from common.support.rundir import claim_out_dir
from common.training import (
    build_model,
    check_finite,
    check_resume,
    evaluate,
    lr_at,
    sample_text,
)


def main():
    # TODO 2/18: change the next 1 line(s) of code:
    #     args = parse_args(chapter=6, description=__doc__)
    args = parse_args(chapter=5, description=__doc__)
    # ---- who is who: torchrun tells each of the WORLD_SIZE copies its place ----------------------
    require_torchrun()  # started with plain `python`: one line that gives the torchrun command
    rank = int(os.environ["RANK"])  # this process among all of them: 0 .. world_size - 1
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])  # this process among those on its machine: its GPU
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    is_rank0 = rank == 0
    # torchrun numbers the machines too: GROUP_RANK is this machine's place among the nodes (other
    # launchers call it NODE_RANK). Training does not depend on it, but every line names it: "which
    # machine?" is the first question when a job of many machines goes wrong.
    node_rank = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", 0)))
    n_nodes = world_size // local_world_size
    # How often torchrun (--max-restarts) has restarted this node's processes after a failure.
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    # log(...) prints on rank 0, which speaks for every rank; log.every_rank(...) on each
    log = RankLog(f"[node {node_rank} rank {rank} local {local_rank}]", speaks=is_rank0)
    # the same seed on every rank: the copies start equal even before DDP broadcasts rank 0's
    torch.manual_seed(args.seed)

    # Each process drives one GPU, the one its LOCAL_RANK names; on a machine without one, the CPU.
    device = rank_device(args.device, local_rank, local_world_size, torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)  # cuda:LOCAL_RANK, or all CUDA work would land on cuda:0
    # ranks on one CPU share its cores
    cpu_threads = share_cpu_cores(local_world_size) if device.type == "cpu" else None
    dtype = pick_dtype(args.dtype, device)
    setup_math(device, dtype)
    # TODO 3/18: remove the next 1 line(s) of code:
    #   gone from the solution: autocast, autocast_context
    autocast = autocast_context(device, dtype)
    out_dir = Path(args.out_dir)

    # ---- the process group: every rank joins it; collectives run in it ---------------------------
    # NCCL moves CUDA tensors GPU to GPU; gloo moves CPU tensors over TCP
    backend = "nccl" if device.type == "cuda" else "gloo"
    # a collective that waits longer than this for a peer (dead or stuck) fails instead of hanging
    timeout = datetime.timedelta(seconds=args.dist_timeout)
    # its own meeting point for every attempt: torchrun's store outlives a restart (--max-restarts)
    store = restart_store(world_size, restart_count, timeout)
    # every rank meets the others at that store, or at MASTER_ADDR:MASTER_PORT (store None)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    refuse_shared_gpus(device, timeout)  # two ranks on one GPU: one line, not NCCL's traceback
    place = f"rank {rank} of {world_size}, local rank {local_rank} of {local_world_size}"
    place += f", node {node_rank} of {n_nodes}"
    log.every_rank(f"process {os.getpid()} on {platform.node()}: {place}, device {device}")

    # ---- data: token files on disk, read as fixed windows of block_size tokens -------------------
    model_config = gpt_config_from_args(args)
    # One-time work: the token files. On node-local disks every machine needs its own copy, so
    # local rank 0 of EVERY node prepares. With --shared-fs all nodes see one --data-dir, where
    # several machines writing the same files at once would corrupt them: global rank 0 alone
    # prepares. The others wait for it (every rank calls one_rank_first), then find the files ready.
    preparer = is_rank0 if args.shared_fs else local_rank == 0
    with one_rank_first(preparer):
        data_folder = prepare(
            args.dataset,
            args.data_dir,
            num_proc=args.num_proc,
            text_column=args.text_column,
            log=log.every_rank,
        )
    train_set, val_set = load_splits(data_folder, model_config.block_size)

    # One optimizer step sees `global_batch` sequences: grad_accum micro-batches, one after another,
    # on each of world_size ranks at the same time, each of `batch_size` sequences.
    global_batch = args.batch_size * args.grad_accum * world_size
    tokens_per_step = global_batch * model_config.block_size
    steps_per_epoch = count_steps_per_epoch(train_set, global_batch)
    # the same in every chapter
    val_windows = validation_windows(val_set, args.eval_batches, global_batch)

    # ---- model and optimizer ---------------------------------------------------------------------
    # torchrun --max-restarts: when a process fails, torchrun stops the group and starts all of them
    # again. A restarted run continues from the checkpoint written before the failure, if there is
    # one yet. The ranks agree on the restart count, and every rank says whether it sees the
    # checkpoint: across machines --out-dir must be on a file system all nodes see.
    restarts, checkpoint_everywhere = agree_on_restart(
        restart_count, out_dir / "ckpt.pt", args.resume
    )
    # The run folder: refused if it holds another run (unless this one continues it) or another
    # run is using it; then locked by rank 0 until it ends, so no second run writes into it.
    claim_out_dir(out_dir, resume=args.resume or restarts > 0)
    checkpoint = None
    # TODO 4/18: change the next 2 line(s) of code:
    #   rank 0 reads ckpt.pt; the others get the step, settings and random state, no tensors
    #   uses common.sharding.load_checkpoint_on_rank0(out_dir: str | Path) -> dict: ckpt.pt, read by
    #       rank 0 alone: the other ranks get the rest of it (the step, the settings, ...
    if args.resume or (restarts > 0 and checkpoint_everywhere):
        checkpoint = load_checkpoint(out_dir)
    if checkpoint is not None:
        check_resume(checkpoint, global_batch, args.seed)
    # TODO 5/18: change the next 1 line(s) of code into 11:
    #   The chapter is for a model too large for one device, so no rank builds it whole. ...
    #   On GPUs FSDP computes in bfloat16 (float16 on older ones) ...
    #   Each transformer block becomes one FSDP unit ...
    #   fully_shard changes the model in place: each parameter is now a DTensor whose local ...
    #   memory for this rank's shards, on its device, not yet filled (the model has no buffers)
    #   AdamW keeps two running averages per parameter, each the shape of the parameter ...
    #   uses common.checkpoint.check_same_shape(checkpoint: dict, config: GPTConfig) -> None: Refuse
    #       to resume a checkpoint into a model of another shape, naming what differs.
    #   uses common.sharding.start_peak_memory(device: torch.device) -> float: Forget the peak so
    #       far and return the memory held now, in MB: on a GPU the tensors' bytes ...
    #   uses common.model.GPT(config: GPTConfig)
    #   uses torch.device, torch.distributed.fsdp.MixedPrecisionPolicy,
    #       torch.distributed.fsdp.fully_shard, model.to_empty
    model = build_model(model_config, args.init_from, checkpoint).to(device)
    # AdamW keeps two running averages per parameter: the optimizer state is twice the model's size.
    optimizer = torch.optim.AdamW(
        model.optimizer_groups(args.weight_decay),
        lr=args.lr,
        betas=(args.beta1, args.beta2),
        fused=device.type == "cuda",
    )
    # TODO 6/18: add 7 line(s) of code here:
    #   Rank 0 alone makes the whole model, in CPU memory: the checkpoint's, or a fresh one from the
    #     seed, chapter 01's. Every rank then takes its rows of it, one tensor at a time.
    #   a fresh optimizer has no state to load
    #   rank 0's; the other ranks' is empty
    #   uses common.sharding.shard_full_state(model: torch.nn.Module, optimizer: Optimizer,
    #       model_state: dict, optimizer_state: dict | None) -> None: Fill this rank's shards from
    #       rank 0's whole tensors (a fresh model's or ckpt.pt's), which ...
    # float16 can underflow small gradients to zero; the scaler multiplies the loss to keep them.
    # TODO 7/18: change the next 1 line(s) of code:
    #   Each rank sees only its shards of the gradients: the sharded scaler agrees over all ranks on
    #     whether a step had an inf, so all of them skip it or none does.
    #   uses torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    iter_num = 0
    best_val_loss = None
    # TODO 8/18: change the next 2 line(s) of code:
    #   resuming: the loss scale and the random state continue where they were
    if checkpoint is not None:
        # resuming: the optimizer's averages, the loss scale and the random state continue
        iter_num = restore_training_state(checkpoint, optimizer, scaler)
        best_val_loss = checkpoint.get("best_val_loss")
    # TODO 9/18: change the next 2 line(s) of code into 4:
    #   rank 0's whole tensors are freed
    #   the most memory this rank held while it built its shards, above what it held before
    #   fully_shard wrapped nothing: the model is the sharded model, its state dict names unchanged
    #   uses common.sharding.peak_memory(device: torch.device) -> float: The most memory held at any
    #       moment since start_peak_memory, in MB, counted as it counts.
    # DDP broadcasts rank 0's parameters to all ranks here (every copy starts the same) and hooks
    # into backward to average the gradients over ranks. Checkpoints save the real model inside,
    # model.module, whose names have no "module." prefix, so that any chapter can load them.
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    raw_model = model.module
    if args.compile:
        model = torch.compile(model)

    model_size = f"{raw_model.num_params() / 1e6:.2f}M parameters ({args.preset})"
    log(f"device {describe(device)}, {str(dtype).removeprefix('torch.')}; model {model_size}")
    per_step = describe_global_batch(global_batch, model_config.block_size, steps_per_epoch)
    split = f"{args.grad_accum} micro-batches x {world_size} rank(s) x {args.batch_size}"
    log(f"global batch: {split} = {per_step}")
    # TODO 10/18: add 1 line(s) of code here:
    #     averaging =
    #         "parameters gathered block by block, gradients reduce-scattered during backward"
    threads = f"; {cpu_threads}" if cpu_threads else ""
    # TODO 11/18: change the next 2 line(s) of code:
    #     share = f"1/{world_size} of the model each"
    #     log(f"FSDP: {world_size} process(es), {share}, backend {backend}; {averaging}{threads}")
    ddp = f"DDP: {world_size} process(es), one model copy each, backend {backend}"
    log(f"{ddp}; gradients are averaged over ranks in buckets during backward{threads}")
    restarted = f"restarted by torchrun (restart {restarts}): " if restarts else ""
    if iter_num:
        log(f"{restarted}resuming from {out_dir / 'ckpt.pt'} at step {iter_num}")
    elif restarted:
        log(f"{restarted}no checkpoint was written yet, starting again from step 0")

    # ---- the data order: epoch e visits the windows in randperm(N) seeded with seed + e ----------
    # Every rank draws that same permutation and takes the positions rank, rank + W, rank + 2W, ...
    # (W = world_size): the ranks' micro-batches of one step together are the G consecutive
    # positions chapter 01 takes for it. drop_last: an epoch's remainder is dropped, not padded.
    sampler = DistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True
    )

    train_config = vars(args) | {"global_batch": global_batch, "world_size": world_size}
    model.train()
    speed = Throughput(tokens_per_step, raw_model.flops_per_token(), device, dtype, world_size)
    # metrics.jsonl and the progress bar from rank 0 (log), MFU of all ranks: one call per log step
    report = RunLog(out_dir, args.max_iters, iter_num, speed, log)

    def save(step: int) -> None:
        # TODO 12/18: change the next 2 line(s) of code into 4:
        #   the others' dicts are empty
        #   uses common.sharding.gather_full_state(model: torch.nn.Module, optimizer: Optimizer) ->
        #       tuple[dict, dict]: The model's and the optimizer's whole tensors, gathered from
        #       every rank's shards into rank ...
        """The checkpoint, at every evaluation and when the run is asked to stop (rank 0 writes)."""
        if is_rank0:
            # TODO 13/18: change the next 4 line(s) of code:
            #     save_checkpoint(
            #         out_dir,
            #         model_state=model_state,
            #         optimizer_state=optimizer_state,
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

    # ---- a scheduler's stop ----------------------------------------------------------------------
    # SIGTERM (or --stop-signal) before a time limit or a preemption: the run saves the step it is
    # in and exits 75, for the job to be requeued and resumed. A rank that stopped alone would leave
    # the others waiting in their next collective, so every `stop_check_every` steps the ranks
    # all-reduce their stop flags, over a CPU group of their own: one rank's signal stops them all
    # after the same step. bench/stop_check.py measures what a check costs.
    preemption = Preemption(args.stop_signal)  # its handler only notes the signal
    stop_group = dist.new_group(backend="gloo", timeout=timeout)
    stop_check_every = 10
    # a worker torchrun restarted after a stop finds the stop's marker and stops too
    stop_if_stopped_before(out_dir, restarts, stop_group)

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
            # TODO 14/18: change the next 11 line(s) of code into 7:
            #   FSDP reduce-scatters the gradients inside backward(); before the last micro-step
            #     that traffic would be wasted, so without sync they add up on this rank, whole and
            #     unsharded (more memory than no_sync() in chapter 04, which adds none)
            #   backward() adds into .grad, so K micro-steps sum K gradients; each loss divided by K
            #     makes that sum the gradient of the mean over all K * B sequences
            #   the last backward reduce-scatters block after block of gradients while it still
            #     computes the rest; this micro-batch's activations are freed here
            #   uses model.set_requires_gradient_sync
            for micro_step in range(args.grad_accum):
                # DDP all-reduces the gradients inside backward(); before the last micro-step that
                # traffic would be wasted, so no_sync() lets them add up on this rank
                sync = contextlib.nullcontext()
                if micro_step < args.grad_accum - 1:
                    sync = model.no_sync()
                with sync:
                    x, y = next(batches)  # (B, T) each, built in CPU memory
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    with autocast:
                        _, micro_loss = model(x, y)  # mean cross-entropy over B * T predictions
                        # backward() adds into .grad, so K micro-steps sum K gradients; each
                        # loss divided by K makes that sum the gradient of the mean over K * B
                        micro_loss = micro_loss / args.grad_accum
                    # the last backward all-reduces bucket after bucket of gradients while it still
                    # computes the rest; this micro-batch's activations are freed here
                    scaler.scale(micro_loss).backward()
                loss += micro_loss.detach()
            # clipping, the optimizer step and the learning rate act once per global batch
            if args.grad_clip > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            scaler.step(optimizer)  # parameters move against their gradients
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            iter_num += 1

            # TODO 15/18: add 4 line(s) of code here:
            #     if iter_num == first_step:
            #         log.every_rank(
            #             f"peak memory, first step: {peak_memory(device) - held_before:.1f} MB"
            #         )
            # ---- logging: .item() waits for the device, so only at log intervals ----
            if iter_num % args.log_interval == 0 or iter_num == args.max_iters:
                # the mean over all ranks: a collective, so every rank calls it
                dist.all_reduce(loss, op=dist.ReduceOp.SUM)
                loss_value = loss.item() / world_size
                check_finite(iter_num, loss_value)  # a NaN or an inf loss ends the run
                report.step(iter_num, loss_value, lr)

            # ---- evaluation and checkpoint ----
            if iter_num % args.eval_interval == 0 or iter_num == args.max_iters:
                # Each rank evaluates every world_size-th window (with raw_model: no gradients,
                # nothing for DDP to do); the loss sums and window counts are added over ranks, so
                # every rank gets the mean over all the windows.
                my_windows = val_windows[rank::world_size]
                # TODO 16/18: change the next 3 line(s) of code into 1:
                #     my_loss = evaluate(raw_model, val_set, my_windows, args.batch_size, device)
                my_loss = evaluate(
                    raw_model, val_set, my_windows, args.batch_size, device, autocast
                )
                my_count = torch.tensor(float(len(my_windows)), device=device)
                # the sum of my losses, their count
                val_stats = torch.stack([my_loss * my_count, my_count])
                dist.all_reduce(val_stats, op=dist.ReduceOp.SUM)
                val_loss = (val_stats[0] / val_stats[1]).item()
                # before the save: a diverged model never replaces a good checkpoint
                check_finite(iter_num, val_loss, "validation loss")
                if best_val_loss is None or val_loss < best_val_loss:
                    best_val_loss = val_loss
                save(iter_num)
                report.evaluation(iter_num, val_loss, out_dir / "ckpt.pt")

            # ---- has any rank been asked to stop? (on the last step, the run just ends) ----
            if iter_num % stop_check_every == 0 and iter_num < args.max_iters:
                # 0, or the number of the signal this rank received; the MAX over ranks stops all
                stop_flag = torch.tensor(float(preemption.signal_number()))
                dist.all_reduce(stop_flag, op=dist.ReduceOp.MAX, group=stop_group)
                stop_signal = int(stop_flag.item())
                if stop_signal:
                    if iter_num % args.eval_interval != 0:  # an evaluation step saved it already
                        save(iter_num)
                    # the stop's marker, then one line and exit status 75: continue with --resume
                    stop_after_saving(iter_num, stop_signal, out_dir, stop_group)
    report.close()
    # TODO 17/18: change the next 4 line(s) of code into 2:
    #   FSDP's promise: each rank holds 1/W of the parameters, the gradients and the optimizer
    #     state.
    #   A tensor of n rows is cut in pieces of ceil(n / W) rows, the last ones shorter or empty.
    #   every forward gathers parameters from all ranks, so all of them generate; rank 0 prints
    #   uses common.sharding.describe_held_bytes(held: dict[str, list[int]]) -> str: One line: what
    #       this rank holds, against what a DDP rank holds, in MB (10^6 bytes).
    #   uses common.sharding.held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) ->
    #       dict[str, list[int]]: Parameter, gradient and optimizer-state bytes: [this rank's, every
    #       DDP rank's] for each.
    # DDP's promise: the same start and the same averaged gradients keep every copy equal. Check it
    # bit for bit against rank 0's copy.
    differing = ranks_unlike_rank0(raw_model)
    verdict = "yes" if differing == 0 else f"NO, {differing} rank(s) differ from rank 0"
    log(f"parameters identical on all {world_size} rank(s): {verdict}")

    # TODO 18/18: change the next 3 line(s) of code into 5:
    #     if args.sample_tokens:
    #         log(f"---- a sample from the model ({args.sample_tokens} tokens) ----")
    #         text = sample_text(raw_model, args.prompt, args.sample_tokens, device, seed=args.seed)
    #         if is_rank0:
    #             print(text)
    if args.sample_tokens and is_rank0:
        log(f"---- a sample from the model ({args.sample_tokens} tokens) ----")
        print(sample_text(raw_model, args.prompt, args.sample_tokens, device, seed=args.seed))


if __name__ == "__main__":
    try:
        run_main(main, resumable=True)
    finally:
        # Every way out (the end, an error, Ctrl-C) leaves the process group, which closes the
        # connections to the other ranks cleanly; after main() has returned, so that the model
        # that holds the group (DDP's, FSDP's) is freed first.
        if dist.is_initialized():
            dist.destroy_process_group()
