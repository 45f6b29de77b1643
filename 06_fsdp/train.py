"""Chapter 06: the model's state sharded across the ranks (FSDP).

Chapter 05's program, with DDP replaced by FSDP2 (`fully_shard`). Under DDP every rank holds the
whole model, its gradients and AdamW's two averages: 16 bytes per parameter. Under FSDP each rank
holds 1/W of each (W ranks) and gathers a block's parameters from the others just before it needs
them, for its forward and again for its backward; one reduce-scatter averages the gradients and
leaves each rank its shard. No rank builds the whole model: it is built on the meta device,
sharded, then filled from rank 0's copy. The training is the same: each step takes the same global
batch and gives the same loss as chapter 01's. ckpt.pt still holds the whole model, gathered to
rank 0.

    torchrun --standalone --nproc_per_node=2 06_fsdp/train.py
    torchrun --standalone --nproc_per_node=2 06_fsdp/train.py --batch-size 4   # 01's run with 8
"""

import datetime
import os
import platform
import sys
from pathlib import Path

# lets `import common` work from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.utils.data.distributed import DistributedSampler

from common.checkpoint import check_same_shape, restore_training_state, save_checkpoint
from common.config import gpt_config_from_args, parse_args
from common.data import (
    batch_loader,
    count_steps_per_epoch,
    describe_global_batch,
    load_splits,
    prepare,
    validation_windows,
)
from common.device import describe, pick_dtype, setup_math
from common.distributed import (
    RankLog,
    agree_on_restart,
    one_rank_first,
    rank_device,
    refuse_shared_gpus,
    require_torchrun,
    restart_store,
    share_cpu_cores,
)
from common.metrics import RunLog, Throughput
from common.model import GPT
from common.sharding import (
    describe_held_bytes,
    gather_full_state,
    held_bytes,
    load_checkpoint_on_rank0,
    peak_memory,
    shard_full_state,
    start_peak_memory,
)
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
    args = parse_args(chapter=6, description=__doc__)
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
    # the same seed on every rank: every rank builds the same model, then keeps its shards of it
    torch.manual_seed(args.seed)

    # Each process drives one GPU, the one its LOCAL_RANK names; on a machine without one, the CPU.
    device = rank_device(args.device, local_rank, local_world_size, torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)  # cuda:LOCAL_RANK, or all CUDA work would land on cuda:0
    # ranks on one CPU share its cores
    cpu_threads = share_cpu_cores(local_world_size) if device.type == "cpu" else None
    dtype = pick_dtype(args.dtype, device)
    setup_math(device, dtype)
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
    if args.resume or (restarts > 0 and checkpoint_everywhere):
        # rank 0 reads ckpt.pt; the others get the step, settings and random state, no tensors
        checkpoint = load_checkpoint_on_rank0(out_dir)
    if checkpoint is not None:
        check_resume(checkpoint, global_batch, args.seed)
        check_same_shape(checkpoint, model_config)
    held_before = start_peak_memory(device)
    # The chapter is for a model too large for one device, so no rank builds it whole. On the meta
    # device a tensor has a shape and a type but no storage: this model costs no memory yet.
    with torch.device("meta"):
        model = GPT(model_config)
    # On GPUs FSDP computes in bfloat16 (float16 on older ones): each block's parameters are
    # gathered cast to it, which also halves the bytes sent; the gradients are reduced in float32
    # and the optimizer steps on float32 shards, the master weights. On the CPU (float32, float64)
    # everything stays in the parameters' own type.
    precision = MixedPrecisionPolicy()
    if dtype in (torch.bfloat16, torch.float16):
        precision = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    # Each transformer block becomes one FSDP unit: its parameters are gathered from all ranks just
    # before its forward and freed after it, then gathered again for its backward. The root unit
    # holds the rest: the embeddings, the last LayerNorm and the output layer (tied to the token
    # embedding). FSDP never frees the root's after forward: they stay whole until backward ends.
    # fully_shard changes the model in place: each parameter is now a DTensor whose local tensor
    # is this rank's rows of it (model.parameters() yields the shards).
    for block in model.transformer.h:
        fully_shard(block, mp_policy=precision)
    fully_shard(model, mp_policy=precision)
    # memory for this rank's shards, on its device, not yet filled (the model has no buffers)
    model.to_empty(device=device)
    # AdamW keeps two running averages per parameter, each the shape of the parameter: built on the
    # shards, the optimizer state is sharded too, and every rank updates only its own rows.
    optimizer = torch.optim.AdamW(
        model.optimizer_groups(args.weight_decay),
        lr=args.lr,
        betas=(args.beta1, args.beta2),
        fused=device.type == "cuda",
    )
    # Rank 0 alone makes the whole model, in CPU memory: the checkpoint's, or a fresh one from the
    # seed, chapter 01's. Every rank then takes its rows of it, one tensor at a time.
    whole_model = {}
    if is_rank0:
        whole_model = build_model(model_config, args.init_from, checkpoint).state_dict()
    whole_optimizer = None  # a fresh optimizer has no state to load
    if checkpoint is not None:
        whole_optimizer = checkpoint["optimizer"]  # rank 0's; the other ranks' is empty
    shard_full_state(model, optimizer, whole_model, whole_optimizer)
    # float16 can underflow small gradients to zero; the scaler multiplies the loss to keep them.
    # float16 can underflow small gradients to zero; the scaler multiplies the loss to keep them.
    # Each rank sees only its shards of the gradients: the sharded scaler agrees over all ranks on
    # whether a step had an inf, so all of them skip it or none does.
    scaler = ShardedGradScaler(device.type, enabled=dtype == torch.float16)
    iter_num = 0
    best_val_loss = None
    if checkpoint is not None:
        # resuming: the loss scale and the random state continue where they were
        iter_num = restore_training_state(checkpoint, None, scaler)
        best_val_loss = checkpoint.get("best_val_loss")
    del whole_model, whole_optimizer, checkpoint  # rank 0's whole tensors are freed
    first_step = iter_num + 1
    # the most memory this rank held while it built its shards, above what it held before
    log.every_rank(f"peak memory, construction: {peak_memory(device) - held_before:.1f} MB")
    # fully_shard wrapped nothing: the model is the sharded model, its state dict names unchanged
    raw_model = model
    if args.compile:
        model = torch.compile(model)

    model_size = f"{raw_model.num_params() / 1e6:.2f}M parameters ({args.preset})"
    log(f"device {describe(device)}, {str(dtype).removeprefix('torch.')}; model {model_size}")
    per_step = describe_global_batch(global_batch, model_config.block_size, steps_per_epoch)
    split = f"{args.grad_accum} micro-batches x {world_size} rank(s) x {args.batch_size}"
    log(f"global batch: {split} = {per_step}")
    averaging = "parameters gathered block by block, gradients reduce-scattered during backward"
    threads = f"; {cpu_threads}" if cpu_threads else ""
    share = f"1/{world_size} of the model each"
    log(f"FSDP: {world_size} process(es), {share}, backend {backend}; {averaging}{threads}")
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
        """ckpt.pt, at every evaluation and when the run is asked to stop: the whole tensors, as
        every chapter writes them. Every rank takes part, as each holds a shard of every tensor."""
        model_state, optimizer_state = gather_full_state(model, optimizer)
        if is_rank0:  # the others' dicts are empty
            save_checkpoint(
                out_dir,
                model_state=model_state,
                optimizer_state=optimizer_state,
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
            for micro_step in range(args.grad_accum):
                # FSDP reduce-scatters the gradients inside backward(); before the last micro-step
                # that traffic would be wasted, so without sync they add up on this rank, whole
                # and unsharded (more memory than no_sync() in chapter 04, which adds none)
                model.set_requires_gradient_sync(micro_step == args.grad_accum - 1)
                x, y = next(batches)  # (B, T) each, built in CPU memory
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                _, micro_loss = model(x, y)  # mean cross-entropy over B * T predictions
                # backward() adds into .grad, so K micro-steps sum K gradients; each loss divided
                # by K makes that sum the gradient of the mean over all K * B sequences
                micro_loss = micro_loss / args.grad_accum
                # the last backward reduce-scatters block after block of gradients while it still
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
            if iter_num == first_step:
                log.every_rank(
                    f"peak memory, first step: {peak_memory(device) - held_before:.1f} MB"
                )

            # ---- logging: .item() waits for the device, so only at log intervals ----
            if iter_num % args.log_interval == 0 or iter_num == args.max_iters:
                # the mean over all ranks: a collective, so every rank calls it
                dist.all_reduce(loss, op=dist.ReduceOp.SUM)
                loss_value = loss.item() / world_size
                check_finite(iter_num, loss_value)  # a NaN or an inf loss ends the run
                report.step(iter_num, loss_value, lr)

            # ---- evaluation and checkpoint ----
            if iter_num % args.eval_interval == 0 or iter_num == args.max_iters:
                # Each rank evaluates every world_size-th window (no gradients, but every forward
                # still gathers each block's parameters from all ranks); the loss sums and window
                # counts are added over ranks, so every rank gets the mean over all the windows.
                my_windows = val_windows[rank::world_size]
                my_loss = evaluate(raw_model, val_set, my_windows, args.batch_size, device)
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
    # FSDP's promise: each rank holds 1/W of the parameters, the gradients and the optimizer state.
    # A tensor of n rows is cut in pieces of ceil(n / W) rows, the last ones shorter or empty.
    log.every_rank(describe_held_bytes(held_bytes(raw_model, optimizer)))

    # every forward gathers parameters from all ranks, so all of them generate; rank 0 prints
    if args.sample_tokens:
        log(f"---- a sample from the model ({args.sample_tokens} tokens) ----")
        text = sample_text(raw_model, args.prompt, args.sample_tokens, device, seed=args.seed)
        if is_rank0:
            print(text)


if __name__ == "__main__":
    try:
        run_main(main, resumable=True)
    finally:
        # Every way out (the end, an error, Ctrl-C) leaves the process group, which closes the
        # connections to the other ranks cleanly; after main() has returned, so that the model
        # that holds the group (DDP's, FSDP's) is freed first.
        if dist.is_initialized():
            dist.destroy_process_group()
