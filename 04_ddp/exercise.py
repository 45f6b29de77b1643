# Exercise: chapter 04 (04_ddp). This is chapter 03's train.py; add chapter 04's idea where the 22
# TODOs say. A TODO says how the lines below it change and quotes the new comments of the solution
# there. Solve a copy, not this file: a my_*.py file is yours (git ignores it, and the course's
# tests read only this one). Then check your copy:
#     cp -n 04_ddp/exercise.py 04_ddp/my_exercise.py
#     python -m tools.check 04_ddp/my_exercise.py --nproc-per-node 2
# The solution is 04_ddp/train.py (its README shows the diff). `cp -n` never overwrites a copy; to
# start again, copy this file under another name. This file is made by maintainer/make_exercises.py
# from the two scripts.
"""Chapter 03: nn.DataParallel, one process driving several GPUs.

Chapter 02's program, with the model wrapped in nn.DataParallel: every step, one Python process
splits the batch across the GPUs, copies the model onto each, runs the replicas in threads and
gathers their outputs back on GPU 0, where the gradients are summed and the optimizer steps.
Each GPU gets --batch-size sequences. On a CPU or a single GPU there is nothing to split, and the
run is chapter 02's.

    python 03_dataparallel/train.py --gpus 2
"""

# TODO 1/22: the imports: remove (-) and add (+)
#     - from torch import nn
#     - from torch.utils.data import RandomSampler
#     - from common.dataparallel import choose_dataparallel_gpus, in_autocast
#     - from common.device import autocast_context, describe, pick_device, pick_dtype, setup_math
#     - from common.support.preempt import Preemption
#     + import contextlib
#     + import datetime
#     + import os
#     + import platform
#     + import torch.distributed as dist
#     + from torch.nn.parallel import DistributedDataParallel as DDP
#     + from torch.utils.data.distributed import DistributedSampler
#     + from common.device import autocast_context, describe, pick_dtype, setup_math
#     + from common.distributed import (
#     + one_rank_first,
#     + rank_device,
#     + ranks_unlike_rank0,
#     + share_cpu_cores,
#     + start_process_group,
#     + from common.support.preempt_ranks import AgreedPreemption
import sys
from pathlib import Path

# lets `import common` work from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn
from torch.utils.data import RandomSampler

from common.checkpoint import load_checkpoint, restore_training_state, save_checkpoint
from common.config import gpt_config_from_args, parse_args
from common.data import (
    batch_loader,
    describe_global_batch,
    load_splits,
    prepare,
    validation_windows,
)
from common.dataparallel import choose_dataparallel_gpus, in_autocast
from common.device import autocast_context, describe, pick_device, pick_dtype, setup_math
from common.metrics import MetricsLog, Throughput, max_memory_mb
from common.support.errors import CourseError, run_main
from common.support.gpus import peak_flops
from common.support.preempt import Preemption
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


# TODO 2/22: remove the next 22 line(s) of code
class AutocastDataParallel(nn.DataParallel):
    """nn.DataParallel whose replicas compute in the run's number format (bfloat16 or float16),
    and whose loss counts every row once, however the batch splits (see parallel_apply).

    DataParallel runs each GPU's replica in a Python thread of its own and switches autocast on
    there without saying which format. The format belongs to the thread, and a new thread has the
    default, float16: a bfloat16 run would silently compute in float16, with no loss scaling. So
    each replica enters autocast itself, inside its thread, with the format this run chose.
    """

    def __init__(
        self, module, autocast_device: torch.device, autocast_dtype: torch.dtype, **kwargs
    ):
        super().__init__(module, **kwargs)
        self.autocast_device, self.autocast_dtype = autocast_device, autocast_dtype

    def parallel_apply(self, replicas, inputs, kwargs):
        replicas = [in_autocast(r, self.autocast_device, self.autocast_dtype) for r in replicas]
        outputs = super().parallel_apply(replicas, inputs, kwargs)
        # A batch that does not split evenly (a last validation batch of 5 rows: 3 + 2) gives the
        # replicas different shares, and the plain mean of their mean losses would count each row
        # of the smaller share more. Weighted by its rows, the mean of the losses is the mean over
        # all rows. An even split, as every training batch is, gets weights of exactly 1.
        weights = row_weights([len(args[0]) for args in inputs])
        return [(logits, loss * w) for (logits, loss), w in zip(outputs, weights)]


def row_weights(rows: list[int]) -> list[float]:
    """Factors for each replica's mean loss, so that the mean of the weighted losses is the mean
    over all rows: replica i holds rows[i] of them."""
    return [r * len(rows) / sum(rows) for r in rows]


def main():
    # TODO 3/22: change the next 1 line(s) of code:
    #   the same seed on every rank: the copies start equal even before DDP broadcasts rank 0's
    args = parse_args(chapter=3, description=__doc__)
    torch.manual_seed(args.seed)
    # TODO 4/22: change the next 1 line(s) of code into 18:
    #   ---- who is who: torchrun starts WORLD_SIZE copies of this script and tells each its place
    #   ---- torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
    #     MASTER_PORT
    #   this process among all of them: 0 .. world_size - 1
    #   this process among those on this machine: its GPU
    #   Each process drives one GPU, the one its LOCAL_RANK names; on a machine without one, the
    #     CPU.
    #   before any CUDA work, or it would all land on cuda:0
    #   ranks on one CPU share its cores
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    setup_math(device, dtype)
    autocast = autocast_context(device, dtype)
    out_dir = Path(args.out_dir)

    # TODO 5/22: change the next 3 line(s) of code into 10:
    #   ---- the process group: every rank joins it; collectives (all-reduce, broadcast) run in it
    #   ---- NCCL moves CUDA tensors GPU to GPU; gloo moves CPU tensors over TCP.
    #   A collective that waits longer than the timeout for a peer (dead or stuck) fails instead of
    #     hanging.
    #   Under torchrun the ranks meet at MASTER_ADDR:MASTER_PORT; with plain `python` the world is
    #     this process alone. The backend follows the device (--backend auto), and on GPUs the ranks
    #     check that no two of them share one.
    # DataParallel runs one replica per GPU; --gpus picks how many of the visible ones it uses.
    # The settings it cannot run with (more GPUs than visible, the CPU beside visible GPUs,
    # --compile over several GPUs) are refused with one line each (common/dataparallel.py).
    gpu_ids = choose_dataparallel_gpus(device, args.gpus, args.compile, torch.cuda.device_count())
    replicas = max(len(gpu_ids), 1)  # on a CPU: one, the model itself
    # DataParallel takes one batch of all replicas' sequences and cuts it into one per replica
    whole_batch = args.batch_size * replicas

    # ---- data: token files on disk, read as fixed windows of block_size tokens -------------------
    model_config = gpt_config_from_args(args)
    # TODO 6/22: change the next 3 line(s) of code into 8:
    #   Local rank 0 of each machine prepares the token files once; the other ranks there wait for
    #     it (every rank calls one_rank_first), then find the files ready and prepare() does no
    #     work.
    data_folder = prepare(
        args.dataset, args.data_dir, num_proc=args.num_proc, text_column=args.text_column
    )
    train_set, val_set = load_splits(data_folder, model_config.block_size)

    # One optimizer step sees `global_batch` sequences: grad_accum micro-batches, one after another,
    # TODO 7/22: change the next 1 line(s) of code:
    #   on each of world_size ranks at the same time, each of `batch_size` sequences.
    # each of `batch_size` sequences per replica, which DataParallel cuts out of one big batch.
    global_batch = args.batch_size * args.grad_accum * replicas
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
    # The run folder: refused if it holds another run (unless this one continues it) or another
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
    # TODO 8/22: change the next 1 line(s) of code:
    #   DDP broadcasts rank 0's parameters to all ranks here, so every copy starts the same, and
    #     hooks into backward to average the gradients over ranks. The wrapper keeps the real model
    #     in model.module. Its state dict would prefix every name with "module.", so checkpoints
    #     save model.module's, which any chapter can load. On a GPU, device_ids is this rank's GPU,
    #     cuda:LOCAL_RANK.
    # The wrapper keeps the real model in model.module. Its state dict would prefix every name
    # with "module.", so checkpoints save model.module's, which any chapter can load.
    # nn.DataParallel in the run's number format, see the class above; without GPUs (gpu_ids is [])
    # it calls the model as it is
    model = AutocastDataParallel(model, device, dtype, device_ids=gpu_ids)
    raw_model = model.module
    # TODO 9/22: remove the next 1 line(s) of code
    eval_model = model  # DataParallel, not compiled: see the evaluation below
    if args.compile:
        model = torch.compile(model)

    peak = peak_flops(device, dtype)
    # TODO 10/22: change the next 1 line(s) of code:
    #     log(
    print(
        f"device {describe(device)}, {str(dtype).removeprefix('torch.')}; "
        f"model {raw_model.num_params() / 1e6:.2f}M parameters ({args.preset})"
    )
    per_step = describe_global_batch(global_batch, model_config.block_size, steps_per_epoch)
    # TODO 11/22: change the next 13 line(s) of code into 8:
    #     split = f"{args.grad_accum} micro-batches x {world_size} rank(s) x {args.batch_size}"
    #     log(f"global batch: {split} = {per_step}")
    #     averaging = "gradients are averaged over ranks in buckets during backward"
    #     threads = f"; {cpu_threads}" if cpu_threads else ""
    #     log(
    #     f"DDP: {world_size} process(es), one model copy each, backend {backend}; "
    #     f"{averaging}{threads}"
    #     )
    split = f"{args.grad_accum} micro-batches x {replicas} replica(s) x {args.batch_size}"
    print(f"global batch: {split} = {per_step}")
    if replicas > 1:
        print(
            f"DataParallel: 1 process, {replicas} threads, "
            f"one replica per GPU on cuda:0..{replicas - 1}; "
            f"each step scatters the batch, replicates the model and gathers the outputs on cuda:0"
        )
    else:
        print(
            f"DataParallel has nothing to split on one {device.type} device: "
            "the run is chapter 02's"
        )
    # TODO 12/22: change the next 5 line(s) of code into 12:
    #   ---- the data order: epoch e visits the windows in randperm(N) seeded with seed + e
    #     ----------
    #   Every rank draws that same permutation and takes the positions rank, rank + W, rank + 2W,
    #     ... (W = world_size): the ranks' micro-batches of one step together are the G consecutive
    #     positions chapter 01 takes for it. drop_last: an epoch's remainder is dropped, not padded.
    #   only rank 0 writes files and draws the progress bar
    if iter_num:
        print(f"resuming from {out_dir / 'ckpt.pt'} at step {iter_num}")

    metrics = MetricsLog(out_dir / "metrics.jsonl", resume_from=iter_num)
    progress = Progress(total=args.max_iters, initial=iter_num)
    train_config = vars(args) | {"global_batch": global_batch, "chapter": 3}
    model.train()
    # tokens_per_step counts the tokens of all replicas, so MFU is measured against all GPUs' peak
    # TODO 13/22: change the next 2 line(s) of code:
    #     speed = Throughput(
    #     tokens_per_step, raw_model.flops_per_token(), peak, devices=world_size, start=iter_num
    speed = Throughput(
        tokens_per_step, raw_model.flops_per_token(), peak, devices=replicas, start=iter_num
    )
    grad_norm = None  # the last step's gradient norm, a tensor on the device (with --grad-clip)

    def save(step: int) -> None:
        # TODO 14/22: change the next 11 line(s) of code into 12:
        #     """The checkpoint, at every evaluation and when the run is asked to stop (rank 0
        #       writes)."""
        #     if is_rank0:
        #     save_checkpoint(
        #     out_dir,
        #     model_state=model.module.state_dict(),
        #     optimizer_state=optimizer.state_dict(),
        #     iter_num=step,
        #     model_config=model_config,
        #     train_config=train_config,
        #     best_val_loss=best_val_loss,
        #     scaler_state=scaler.state_dict(),
        #     )
        """The checkpoint, at every evaluation and when the run is asked to stop."""
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
    # TODO 15/22: change the next 1 line(s) of code:
    #   (common/support/preempt_ranks.py). The ranks agree on the step to stop at, with an all-
    #     reduce of two numbers every few steps. A worker restarted after a stop stops here too.
    # (common/support/preempt.py)
    preemption = Preemption(args.stop_signal)

    while iter_num < args.max_iters:
        epoch, step_in_epoch = divmod(iter_num, steps_per_epoch)
        # TODO 16/22: change the next 2 line(s) of code into 1:
        #   the permutation of seed + epoch; without this every epoch repeats epoch 0
        # the data order: epoch e visits the windows in randperm(N), drawn from a generator seeded
        # with seed + e
        epoch_generator = torch.Generator().manual_seed(args.seed + epoch)
        sampler = RandomSampler(train_set, generator=epoch_generator)
        # micro-batches of this epoch a resumed run trained on
        skip = step_in_epoch * args.grad_accum
        # TODO 17/22: change the next 2 line(s) of code:
        #     loader = batch_loader(
        #     train_set, sampler, args.batch_size, skip, pin_memory=device.type == "cuda"
        loader = batch_loader(
            train_set, sampler, whole_batch, skip, pin_memory=device.type == "cuda"
        )
        batches = iter(loader)
        for _ in range(step_in_epoch, steps_per_epoch):
            if iter_num >= args.max_iters:
                break
            # ---- one training step ----
            lr = lr_at(iter_num, args)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # TODO 18/22: change the next 9 line(s) of code into 14:
            #   this rank's mean loss over its share of the global batch
            #   DDP averages the gradients over ranks inside backward(). Before the last micro-step
            #     that traffic would be wasted: no_sync() lets this rank's gradients add up locally,
            #     and the last backward averages the sums once.
            #   (B, T) each, built in CPU memory
            #   mean cross-entropy over B * T predictions
            #   the last micro-step's backward all-reduces bucket after bucket of gradients while it
            #     is still computing the rest; when it returns, every rank holds the average this
            #     micro-batch's activations are freed here
            loss = torch.zeros((), device=device)  # the mean loss over the whole global batch
            for _ in range(args.grad_accum):
                x, y = next(batches)  # (replicas * B, T) each, built in CPU memory
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with autocast:
                    # each replica returns its own mean loss: a vector of `replicas` losses on
                    # cuda:0. Every replica has B sequences, so their mean is the mean over the
                    # micro-batch.
                    _, micro_loss = model(x, y)
                    micro_loss = micro_loss.mean()
                    # backward() adds into .grad, so K micro-steps sum K gradients; dividing each
                    # loss by K turns that sum into the gradient of the mean over all K * B
                    # sequences
                    micro_loss = micro_loss / args.grad_accum
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
            if iter_num % args.log_interval == 0 or iter_num == args.max_iters:
                # TODO 19/22: change the next 1 line(s) of code into 2:
                #   the mean over all ranks: a collective, so every rank calls it (SUM works on
                #     every backend)
                loss_value = loss.item()
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
            # TODO 20/22: change the next 4 line(s) of code into 9:
            #   Each rank evaluates every world_size-th window (with raw_model: no gradients,
            #     nothing for DDP to do); the loss sums and window counts are added over ranks, so
            #     every rank gets the mean over all the windows.
            #   the sum of my losses, their count
            if iter_num % args.eval_interval == 0 or iter_num == args.max_iters:
                # the model uncompiled: eval mode and a shorter last batch would each be compiled
                # anew, which takes longer than evaluating without compiling
                val_loss = evaluate(
                    eval_model, val_set, val_windows, whole_batch, device, autocast
                ).item()
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
    # TODO 21/22: change the next 8 line(s) of code into 5:
    #   DDP's promise: the same start and the same averaged gradients keep every copy equal. Check
    #     it bit for bit against rank 0's copy.
    if replicas > 1:  # cuda:0 also holds the optimizer state, the gathered outputs and the loss
        peaks = [
            f"cuda:{i} {torch.cuda.max_memory_allocated(i) / 2**20:,.0f} MiB"
            for i in range(replicas)
        ]
        print("peak memory per GPU: " + ", ".join(peaks))

    if args.sample_tokens:
        print(f"---- a sample from the model ({args.sample_tokens} tokens) ----")
        print(sample_text(raw_model, args.prompt, args.sample_tokens, device, seed=args.seed))


# TODO 22/22: change the next 2 line(s) of code into 6:
#   Every way out (the end, an error, Ctrl-C) leaves the process group, which closes the connections
#     to the other ranks (and NCCL's communicators) cleanly.
if __name__ == "__main__":
    run_main(main, resumable=True)
