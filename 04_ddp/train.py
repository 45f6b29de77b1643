"""Chapter 04: DistributedDataParallel, one process per GPU, started by torchrun.

Chapter 03's program, with nn.DataParallel replaced by DistributedDataParallel: torchrun starts
one process per GPU (or several on a CPU), each with its own copy of the model and its own share
of every global batch. During backward, DDP averages the gradients over all processes, so every
copy takes the same optimizer step. Rank 0 prints, logs and writes checkpoints for all of them.
Started with plain `python`, the script runs as a world of one process and says so.

    torchrun --standalone --nproc_per_node=2 04_ddp/train.py
    torchrun --standalone --nproc_per_node=2 04_ddp/train.py --batch-size 4   # the same run as 01 with 8
"""

import contextlib
import datetime
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lets `import common` work from anywhere

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from common.checkpoint import load_checkpoint, restore_training_state, save_checkpoint
from common.config import gpt_config_from_args, parse_args
from common.data import batch_loader, load_splits, prepare, validation_windows
from common.device import autocast_context, describe, pick_device, pick_dtype, setup_math
from common.errors import CourseError, run_main
from common.metrics import MetricsLog, Progress, max_memory_mb, model_flops_utilization, peak_flops
from common.rundir import claim_out_dir
from common.training import build_model, check_resume, evaluate, lr_at, sample_text, stop_if_diverged


def main():
    args = parse_args(chapter=4, description=__doc__)
    torch.manual_seed(args.seed)  # the same on every rank: the copies start equal even before DDP broadcasts rank 0's

    # ---- who is who: torchrun starts WORLD_SIZE copies of this script and tells each its place ----
    launched = "RANK" in os.environ  # torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT
    rank = int(os.environ.get("RANK", 0))  # this process among all of them: 0 .. world_size - 1
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # this process among those on this machine: its GPU
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    is_rank0 = rank == 0

    def log(message: str) -> None:
        """Rank 0 speaks for every rank; its lines say who is speaking."""
        if is_rank0:
            print(f"[rank {rank}] {message}", flush=True)

    if args.gpus:
        raise CourseError("--gpus is chapter 03's DataParallel flag; here each process drives one GPU and torchrun "
                          "starts them: torchrun --standalone --nproc_per_node=N 04_ddp/train.py")
    # NCCL and gloo send CUDA and CPU tensors, not Apple's mps ones: "auto" means CUDA, else the CPU.
    device = pick_device(args.device if args.device != "auto" or torch.cuda.is_available() else "cpu")
    if device.type == "mps":
        raise CourseError("DDP's backends (NCCL, gloo) cannot send mps tensors; use --device cpu")
    if device.type == "cuda":
        if device.index is not None and local_world_size > 1:
            raise CourseError(f"--device {args.device}: under torchrun every rank takes cuda:LOCAL_RANK; use --device cuda")
        # LOCAL_RANK, never RANK: on the second machine RANK starts at 8, but its GPUs are 0..7.
        device = torch.device("cuda", local_rank if device.index is None else device.index)
        if device.index >= torch.cuda.device_count():
            raise CourseError(f"LOCAL_RANK {local_rank}, but this machine has {torch.cuda.device_count()} GPU(s): "
                              f"start at most that many processes per machine (--nproc_per_node)")
        torch.cuda.set_device(device)  # before any CUDA work, or it would all land on cuda:0
    elif local_world_size > 1 and os.environ.get("OMP_NUM_THREADS", "1") == "1":
        # Ranks on one CPU share its cores: an equal share each. Torch alone would give every rank all
        # cores (oversubscribed); torchrun sets OMP_NUM_THREADS=1, which leaves a big CPU mostly idle.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    threads = (f"{os.cpu_count()} cores / {local_world_size} rank(s)" if local_world_size > 1 and os.environ.get("OMP_NUM_THREADS", "1") == "1"
               else "OMP_NUM_THREADS" if "OMP_NUM_THREADS" in os.environ else "torch's default")
    dtype = pick_dtype(args.dtype, device)
    setup_math(device, dtype)
    autocast = autocast_context(device, dtype)
    out_dir = Path(args.out_dir)

    # ---- the process group: every rank joins it; collectives (all-reduce, broadcast) run in it ----
    # NCCL moves CUDA tensors GPU to GPU; gloo moves CPU tensors over TCP.
    backend = args.backend if args.backend != "auto" else "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise CourseError("--backend nccl connects CUDA GPUs, and this run is on the CPU; use --backend gloo (or auto)")
    # A collective that waits longer than the timeout for a peer (dead or stuck) fails instead of hanging.
    timeout = datetime.timedelta(seconds=args.dist_timeout)
    if launched:  # the ranks meet at MASTER_ADDR:MASTER_PORT, which torchrun provides
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    else:  # plain `python`: a world of one needs no meeting point, an in-memory store will do
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    print(f"[rank {rank}] process {os.getpid()} on {platform.node()}: rank {rank} of {world_size}, "
          f"local rank {local_rank}, device {device}", flush=True)
    if not launched:
        log("not started by torchrun, so this is a world of one process (chapter 01's run); for N processes: "
            "torchrun --standalone --nproc_per_node=N 04_ddp/train.py")

    # ---- data: token files on disk, read as fixed windows of block_size tokens -------------------
    model_config = gpt_config_from_args(args)
    # Local rank 0 of each machine prepares the token files once; the other ranks there wait at the
    # barrier (every rank calls it once), then find the files ready and prepare() does no work.
    # Tokenizing a large data set can take hours, far longer than a training collective may wait,
    # so they wait in a group of their own (gloo: a CPU barrier, whatever the backend) with a long timeout.
    preparation = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=6))
    if local_rank != 0:
        dist.barrier(group=preparation)
    data_folder = prepare(args.dataset, args.data_dir, num_proc=args.num_proc, text_column=args.text_column,
                          log=lambda message: print(f"[rank {rank}] {message}", flush=True))
    if local_rank == 0:
        dist.barrier(group=preparation)
    train_set, val_set = load_splits(data_folder, model_config.block_size)

    # One optimizer step sees `global_batch` sequences: grad_accum micro-batches, one after another,
    # on each of world_size ranks at the same time, each of `batch_size` sequences.
    global_batch = args.batch_size * args.grad_accum * world_size
    tokens_per_step = global_batch * model_config.block_size
    steps_per_epoch = len(train_set) // global_batch  # the incomplete last batch of an epoch is dropped
    if steps_per_epoch == 0:
        raise CourseError(f"the training split has {len(train_set)} windows, fewer than one batch of "
                          f"{global_batch}; lower --batch-size or use a larger corpus")
    val_windows = validation_windows(val_set, args.eval_batches, global_batch)  # the same in every stage

    # ---- model and optimizer ---------------------------------------------------------------------
    # The run folder: refused if it holds another run (unless this one continues it) or another
    # run is using it; then locked while `run_lock` stays open (the whole run), so no second run
    # writes into it meanwhile.
    run_lock = claim_out_dir(out_dir, resume=args.resume)
    checkpoint = load_checkpoint(out_dir) if args.resume else None
    if checkpoint is not None:
        check_resume(checkpoint, global_batch, args.seed)
    model = build_model(model_config, args.init_from, checkpoint).to(device)
    # AdamW keeps two running averages per parameter: the optimizer state is twice the model's size.
    optimizer = torch.optim.AdamW(model.optimizer_groups(args.weight_decay), lr=args.lr,
                                  betas=(args.beta1, args.beta2), fused=device.type == "cuda")
    # float16 can underflow small gradients to zero; the scaler multiplies the loss to keep them.
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    # resuming: the optimizer's averages, the loss scale and the random state continue where they were
    iter_num = restore_training_state(checkpoint, optimizer, scaler) if checkpoint is not None else 0
    # DDP broadcasts rank 0's parameters to all ranks here, so every copy starts the same, and hooks
    # into backward to average the gradients over ranks. The wrapper keeps the real model in
    # model.module. Its state dict would prefix every name with "module.", so checkpoints save
    # model.module's, which any chapter can load.
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)  # cuda:LOCAL_RANK
    raw_model = model.module
    if args.compile:
        model = torch.compile(model)

    peak = peak_flops(device, dtype)
    log(f"device {describe(device)}, {str(dtype).removeprefix('torch.')}; "
        f"model {raw_model.num_params() / 1e6:.2f}M parameters ({args.preset})")
    log(f"global batch: {args.grad_accum} micro-batches x {world_size} rank(s) x {args.batch_size} = {global_batch} sequences x {model_config.block_size} tokens = {tokens_per_step:,} tokens per step; "
        f"{steps_per_epoch} steps per epoch")
    log(f"DDP: {world_size} process(es), one model copy each, backend {backend}; gradients are averaged over ranks "
        f"in buckets during backward" + (f"; {torch.get_num_threads()} CPU thread(s) per rank ({threads})" if device.type == "cpu" else ""))
    if iter_num:
        log(f"resuming from {out_dir / 'ckpt.pt'} at step {iter_num}")

    # ---- the data order: epoch e visits the windows in randperm(N) seeded with seed + e ----------
    # Every rank draws that same permutation and takes the positions rank, rank + W, rank + 2W, ...
    # (W = world_size): the ranks' micro-batches of one step together are the G consecutive
    # positions chapter 01 takes for it. drop_last: an epoch's remainder is dropped, not padded.
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed,
                                 drop_last=True)

    # only rank 0 writes files and draws the progress bar
    metrics = MetricsLog(out_dir / "metrics.jsonl", enabled=is_rank0, resume_from=iter_num if checkpoint else None)
    progress = Progress(total=args.max_iters, initial=iter_num, enabled=is_rank0, prefix=f"[rank {rank}] ")
    train_config = vars(args) | {"global_batch": global_batch, "world_size": world_size, "chapter": 4}
    best_val_loss = checkpoint.get("best_val_loss") if checkpoint else None
    model.train()
    last_log_time, last_log_iter = time.perf_counter(), iter_num
    grad_norm = None  # the last step's gradient norm, a tensor on the device (with --grad-clip)

    while iter_num < args.max_iters:
        epoch, step_in_epoch = divmod(iter_num, steps_per_epoch)
        sampler.set_epoch(epoch)  # the permutation of seed + epoch; without this every epoch repeats epoch 0
        batches = iter(batch_loader(train_set, sampler, args.batch_size, skip_batches=step_in_epoch * args.grad_accum,
                                    pin_memory=device.type == "cuda"))
        for _ in range(step_in_epoch, steps_per_epoch):
            if iter_num >= args.max_iters:
                break
            # ---- one training step ----
            lr = lr_at(iter_num, args)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss = torch.zeros((), device=device)  # this rank's mean loss over its share of the global batch
            for micro_step in range(args.grad_accum):
                # DDP averages the gradients over ranks inside backward(). Before the last micro-step
                # that traffic would be wasted: no_sync() lets this rank's gradients add up locally,
                # and the last backward averages the sums once.
                sync = model.no_sync() if micro_step < args.grad_accum - 1 else contextlib.nullcontext()
                with sync:
                    x, y = next(batches)  # (B, T) each, built in CPU memory
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    with autocast:
                        _, micro_loss = model(x, y)  # mean cross-entropy over B * T predictions
                        # backward() adds into .grad, so K micro-steps sum K gradients; dividing each
                        # loss by K turns that sum into the gradient of the mean over all K * B sequences
                        micro_loss = micro_loss / args.grad_accum
                    # the last micro-step's backward all-reduces bucket after bucket of gradients
                    # while it is still computing the rest; when it returns, every rank holds the average
                    scaler.scale(micro_loss).backward()  # this micro-batch's activations are freed here
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
            log_now = iter_num % args.log_interval == 0 or iter_num == args.max_iters
            if log_now:
                # the mean over all ranks: a collective, so every rank calls it (SUM works on every backend)
                dist.all_reduce(loss, op=dist.ReduceOp.SUM)
                loss_value = loss.item() / world_size
                stop_if_diverged(iter_num, loss_value, grad_norm, scaler)  # nan/inf: stop before writing
                elapsed = time.perf_counter() - last_log_time
                tokens_per_sec = (iter_num - last_log_iter) * tokens_per_step / elapsed
                # tokens_per_sec counts the tokens of all ranks, so it is measured against all devices' peak
                mfu = model_flops_utilization(raw_model.flops_per_token(), tokens_per_sec, peak, devices=world_size)
                metrics.write(iter=iter_num, loss=loss_value, lr=lr, tokens_seen=iter_num * tokens_per_step,
                              dt_ms=1000 * elapsed / (iter_num - last_log_iter), tokens_per_sec=tokens_per_sec,
                              mfu=mfu, max_mem_mb=max_memory_mb(device))
                last_log_time, last_log_iter = time.perf_counter(), iter_num
            progress.step(iter_num, loss_value if log_now else None, tokens_per_sec if log_now else None, lr)

            # ---- evaluation and checkpoint ----
            if iter_num % args.eval_interval == 0 or iter_num == args.max_iters:
                # Each rank evaluates every world_size-th window (with raw_model: no gradients, nothing
                # for DDP to do); the loss sums and window counts are added over ranks, so every rank
                # gets the mean over all the windows.
                my_windows = val_windows[rank::world_size]
                val_sum = evaluate(raw_model, val_set, my_windows, args.batch_size, device, autocast) * len(my_windows)
                val_stats = torch.stack([val_sum, torch.tensor(float(len(my_windows)), device=device)])
                dist.all_reduce(val_stats, op=dist.ReduceOp.SUM)
                val_loss = (val_stats[0] / val_stats[1]).item()
                stop_if_diverged(iter_num, val_loss, what="validation loss")  # before the checkpoint
                best_val_loss = val_loss if best_val_loss is None else min(best_val_loss, val_loss)
                metrics.write(iter=iter_num, val_loss=val_loss)
                if is_rank0:
                    save_checkpoint(out_dir, model_state=model.module.state_dict(), optimizer_state=optimizer.state_dict(),
                                    iter_num=iter_num, model_config=model_config, train_config=train_config,
                                    best_val_loss=best_val_loss, scaler_state=scaler.state_dict())
                progress.print(f"step {iter_num}: val loss {val_loss:.4f}, checkpoint saved to {out_dir / 'ckpt.pt'}")
                last_log_time = time.perf_counter()  # evaluation time is not training time
    progress.close()
    # DDP's promise: the same start and the same averaged gradients keep every copy equal. Check it
    # bit for bit against rank 0's copy.
    params = torch.cat([p.detach().reshape(-1) for p in raw_model.parameters()])
    rank0_params = params.clone()
    dist.broadcast(rank0_params, src=0)
    differing = torch.tensor(0.0 if torch.equal(params, rank0_params) else 1.0, device=device)
    dist.all_reduce(differing, op=dist.ReduceOp.SUM)
    log(f"parameters identical on all {world_size} rank(s): "
        + ("yes" if differing.item() == 0 else f"NO, {differing.item():.0f} rank(s) differ from rank 0"))

    if args.sample_tokens and is_rank0:
        log(f"---- a sample from the model ({args.sample_tokens} tokens) ----")
        print(sample_text(raw_model, args.prompt, args.sample_tokens, device, seed=args.seed))


if __name__ == "__main__":
    try:
        run_main(main)
    finally:
        # Every way out (the end, an error, Ctrl-C) leaves the process group, which closes the
        # connections to the other ranks (and NCCL's communicators) cleanly.
        if dist.is_initialized():
            dist.destroy_process_group()
