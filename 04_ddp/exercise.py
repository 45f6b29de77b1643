# Exercise: chapter 04 (04_ddp). Add its idea to chapter 02's train.py
# where the 20 TODOs say, in a copy (git ignores my_*.py files, and the course's
# tests read only this one), then check it:
#     cp -n 04_ddp/exercise.py 04_ddp/my_exercise.py
#     python -m tools.check 04_ddp/my_exercise.py --nproc-per-node 2
# The solution is 04_ddp/train.py; its README shows the diff. This file is made by
# maintainer/make_exercises.py from the two scripts.
"""Chapter 02: gradient accumulation, a bigger batch than memory holds.

Chapter 01's program, with one change: an optimizer step now adds up the gradients of
--grad-accum micro-batches of --batch-size sequences before it moves the parameters. Only one
micro-batch's activations are in memory at a time, yet the step is the step of the whole batch.

    python 02_grad_accumulation/train.py --batch-size 2 --grad-accum 4   # the same run as 01 with 8
"""

# TODO 1/20: the imports:
#   - from torch.utils.data import RandomSampler
#   - from common.device import autocast_context, describe, pick_device, pick_dtype, setup_math
#   - from common.support.rundir import claim_out_dir
#   + import contextlib
#   + import datetime
#   + import os
#   + import platform
#   + import torch.distributed as dist
#   + from torch.nn.parallel import DistributedDataParallel as DDP
#   + from torch.utils.data.distributed import DistributedSampler
#   + from common.device import autocast_context, describe, pick_dtype, setup_math
#   + from common.distributed import RankLog, claim_out_dir_on_rank0, one_rank_first,
#       ranks_unlike_rank0, ranks_use_gpus, refuse_shared_gpus, require_torchrun, share_cpu_cores
import sys
from pathlib import Path

# lets `import common` work from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.utils.data import RandomSampler

from common.checkpoint import load_checkpoint, restore_training_state, save_checkpoint
from common.config import CourseParser, gpt_config_from_args, positive_int
from common.data import (
    batch_loader,
    count_steps_per_epoch,
    load_splits,
    prepare,
    validation_windows,
)
from common.device import autocast_context, describe, pick_device, pick_dtype, setup_math
from common.metrics import RunLog, Throughput
from common.support.errors import run_main
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
    # TODO 2/20: change the next line of code:
    #     parser = CourseParser(chapter=4, description=__doc__)
    parser = CourseParser(chapter=2, description=__doc__)
    parser.add_argument(
        "--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step"
    )
    # TODO 3/20: add 3 lines of code here:
    #     parser.add_argument(
    #         "--dist-timeout", type=positive_int, default=300, help="seconds a collective may wait"
    #     )
    args = parser.parse_args()
    # TODO 4/20: change the next 2 lines of code into 13 lines:
    #   - who is who: torchrun tells each of the WORLD_SIZE copies its place
    #   - started with plain `python`: one line that gives the torchrun command
    #   - this process among all of them: 0 .. world_size - 1
    #   - this process among those on its machine: its GPU
    #   - log(...) prints on rank 0, which speaks for every rank; log.every_rank(...) on each
    #   - on every rank: the copies start equal, before DDP's broadcast
    #   - Each process drives one GPU: the LOCAL_RANK-th of its own machine, never the RANK-th (on a
    #     second machine of 8 GPUs RANK starts at 8, but its GPUs are 0..7). Without GPUs, the CPU.
    #   - or all CUDA work would land on cuda:0
    #   - ranks on one CPU share its cores
    torch.manual_seed(args.seed)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    setup_math(device, dtype)
    autocast = autocast_context(device, dtype)
    out_dir = Path(args.out_dir)

    # TODO 5/20: add 6 lines of code here:
    #   - the process group: every rank joins it; collectives run in it
    #   - NCCL: GPU to GPU; gloo: CPU over TCP
    #   - a collective that waits longer than this for a peer (dead or stuck) fails instead of
    #     hanging
    #   - every rank meets the others at MASTER_ADDR:MASTER_PORT, which torchrun sets
    #   - two ranks on one GPU: one line, not NCCL's traceback
    # ---- data: token files on disk, read as fixed windows of block_size tokens -------------------
    model_config = gpt_config_from_args(args)
    # TODO 6/20: change the next 3 lines of code into 4 lines:
    #   - Local rank 0 of each machine prepares the token files once; the other ranks there wait for
    #     it (every rank calls one_rank_first), then find the files ready and prepare() does no
    #     work.
    data_folder = prepare(
        args.dataset, args.data_dir, num_proc=args.num_proc, text_column=args.text_column
    )
    train_set, val_set = load_splits(data_folder, model_config.block_size)

    # TODO 7/20: change the next line of code:
    #   - One optimizer step sees `global_batch` sequences: grad_accum micro-batches, one after
    #     another, on each of world_size ranks at the same time, each of `batch_size` sequences.
    # One optimizer step sees `global_batch` sequences: grad_accum micro-batches, one after another.
    global_batch = args.batch_size * args.grad_accum
    tokens_per_step = global_batch * model_config.block_size
    steps_per_epoch = count_steps_per_epoch(train_set, global_batch)
    # every chapter evaluates these windows: eval_batches whole global batches, spread evenly
    val_windows = validation_windows(val_set, args.eval_batches, global_batch)

    # TODO 8/20: change the next line of code:
    #   - the run folder: refused if another run holds it or is using it; rank 0 locks it for all
    # ---- model and optimizer ---------------------------------------------------------------------
    # the run folder: refused if another run holds it or is using it; then locked for this run
    claim_out_dir(out_dir, resume=args.resume)
    checkpoint = None
    if args.resume:
        checkpoint = load_checkpoint(out_dir)
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
    if checkpoint is not None:
        # resuming needs the same global batch and seed; AdamW, the loss scale and RNG go on
        check_resume(checkpoint, global_batch, args.seed)
        iter_num = restore_training_state(checkpoint, optimizer, scaler)
    # TODO 9/20: change the next line of code into 2 lines:
    #   - DDP broadcasts rank 0's parameters to all ranks here (every copy starts the same) and
    #     hooks into backward to average the gradients over ranks (no device_ids: the model is on
    #     this rank's device). Checkpoints save model.module, whose names any chapter loads (no
    #     "module." prefix).
    raw_model = model  # the plain module: its state dict is what checkpoints hold
    if args.compile:
        model = torch.compile(model)

    model_size = f"{raw_model.num_params() / 1e6:.2f}M parameters ({args.preset})"
    # TODO 10/20: change the next line of code:
    #     log(f"device {describe(device)}, {str(dtype).removeprefix('torch.')}; model {model_size}")
    print(f"device {describe(device)}, {str(dtype).removeprefix('torch.')}; model {model_size}")
    per_step = f"{global_batch} sequences x {model_config.block_size} tokens = {tokens_per_step:,}"
    # TODO 11/20: change the next 2 lines of code into 3 lines:
    #     split = f"{args.grad_accum} micro-batches x {world_size} rank(s) x {args.batch_size}"
    #     log(f"DDP: {world_size} process(es), one model copy each, backend {backend}")
    #   (and 1 more in the solution)
    split = f"{args.grad_accum} micro-batches x {args.batch_size}"
    print(f"global batch: {split} = {per_step} tokens per step; {steps_per_epoch} steps per epoch")
    if iter_num:
        # TODO 12/20: change the next line of code:
        #     log(f"resuming from {out_dir / 'ckpt.pt'} at step {iter_num}")
        print(f"resuming from {out_dir / 'ckpt.pt'} at step {iter_num}")

    # TODO 13/20: change the next 3 lines of code into 6 lines:
    #   - the data order: epoch e visits the windows in randperm(N) seeded with seed + e
    #   - Every rank draws that permutation and takes its positions: rank, rank + W, rank + 2W and
    #     so on (W = world_size). One step's micro-batches on all ranks are the G positions chapter
    #     01 takes for it. drop_last: an epoch's remainder is dropped, not padded.
    #   - metrics.jsonl and the lines from rank 0 (log), MFU of all ranks: one call per log step
    train_config = vars(args) | {"global_batch": global_batch}
    # tokens/s and MFU between log lines; metrics.jsonl and the printed lines: one call per log step
    speed = Throughput(tokens_per_step, raw_model.flops_per_token(), device, dtype)
    report = RunLog(out_dir, iter_num, speed)

    while iter_num < args.max_iters:
        epoch = iter_num // steps_per_epoch
        step_in_epoch = iter_num % steps_per_epoch  # > 0 when a resumed run starts mid-epoch
        # TODO 14/20: change the next 2 lines of code into a line:
        #   - the permutation of seed + epoch; without this every epoch repeats epoch 0
        # the data order: epoch e visits the windows in randperm(N), drawn with the seed seed + e
        epoch_generator = torch.Generator().manual_seed(args.seed + epoch)
        sampler = RandomSampler(train_set, generator=epoch_generator)
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
            # TODO 15/20: change the next 9 lines of code into 13 lines:
            #   - the mean loss of this rank's share
            #   - DDP all-reduces the gradients inside backward(); before the last micro-step that
            #     traffic would be wasted, so no_sync() lets them add up on this rank
            #   - backward() adds into .grad, so K micro-steps sum K gradients; each loss divided by
            #     K makes that sum the gradient of the mean over this rank's K * B sequences, which
            #     DDP then averages over the ranks
            #   - the last backward all-reduces bucket after bucket of gradients while it still
            #     computes the rest; this micro-batch's activations are freed here
            loss = torch.zeros((), device=device)  # the mean loss over the whole global batch
            for _ in range(args.grad_accum):
                x, y = next(batches)  # (B, T) each, built in CPU memory
                x = x.to(device, non_blocking=True)
                y = y.to(device, non_blocking=True)
                with autocast:
                    _, micro_loss = model(x, y)  # mean cross-entropy over B * T predictions
                    # backward() adds into .grad, so K micro-steps sum K gradients; each loss
                    # divided by K makes that sum the gradient of the mean over all K * B sequences
                    micro_loss = micro_loss / args.grad_accum
                scaler.scale(micro_loss).backward()  # this micro-batch's activations are freed here
                loss += micro_loss.detach()
            # clipping, the optimizer step and the learning rate act once per global batch
            if args.grad_clip > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            scaler.step(optimizer)  # parameters move against their gradients
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            iter_num += 1
            last_step = iter_num == args.max_iters

            # ---- logging: .item() waits for the device, so only at log intervals ----
            if iter_num % args.log_interval == 0 or last_step:
                # TODO 16/20: change the next line of code into 2 lines:
                #   - the mean over all ranks: a collective, so every rank calls it
                loss_value = loss.item()
                check_finite(iter_num, loss_value)  # a NaN or an inf loss ends the run
                report.step(iter_num, loss_value, lr)

            # ---- evaluation and checkpoint ----
            if iter_num % args.eval_interval == 0 or last_step:
                # the model uncompiled: eval mode would be compiled anew, which takes longer than
                # evaluating without compiling
                val_loss = evaluate(
                    raw_model, val_set, val_windows, args.batch_size, device, autocast
                ).item()
                # before the save: a diverged model never replaces a good checkpoint
                check_finite(iter_num, val_loss, "validation loss")
                # TODO 17/20: change the next line of code into 2 lines:
                #   - one copy is enough: every rank holds the same model
                save_checkpoint(out_dir, iter_num, raw_model, optimizer, scaler, train_config)
                report.evaluation(iter_num, val_loss, out_dir / "ckpt.pt")
    # TODO 18/20: add 3 lines of code here:
    #   - DDP's promise: equal starts and equal averaged gradients keep the copies equal, bit for
    #     bit

    # TODO 19/20: change the next 2 lines of code:
    #     if args.sample_tokens and is_rank0:
    #         log(f"---- a sample from the model ({args.sample_tokens} tokens) ----")
    if args.sample_tokens:
        print(f"---- a sample from the model ({args.sample_tokens} tokens) ----")
        text = sample_text(raw_model, args.prompt, args.sample_tokens, device, seed=args.seed)
        print(text)


if __name__ == "__main__":
    # TODO 20/20: change the next line of code into 5 lines:
    #   - Leave the process group on every way out, an error's too: a rank that ends without it
    #     leaves its peers' connections open until their timeout. After main() has returned, so that
    #     the model, whose DDP or FSDP state uses the group, is freed first.
    run_main(main, resumable=True)
