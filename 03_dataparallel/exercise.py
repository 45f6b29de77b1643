# Exercise: chapter 03 (03_dataparallel). Add its idea to chapter 02's train.py
# where the 13 TODOs say, in a copy (git ignores my_*.py files, and the course's
# tests read only this one), then check it:
#     cp -n 03_dataparallel/exercise.py 03_dataparallel/my_exercise.py
#     python -m tools.check 03_dataparallel/my_exercise.py
# The solution is 03_dataparallel/train.py; its README shows the diff. This file is made by
# maintainer/make_exercises.py from the two scripts.
"""Chapter 02: gradient accumulation, a bigger batch than memory holds.

Chapter 01's program, with one change: an optimizer step now adds up the gradients of
--grad-accum micro-batches of --batch-size sequences before it moves the parameters. Only one
micro-batch's activations are in memory at a time, yet the step is the step of the whole batch.

    python 02_grad_accumulation/train.py --batch-size 2 --grad-accum 4   # the same run as 01 with 8
"""

# TODO 1/13: the imports:
#   + from torch import nn
#   + from common.dataparallel import choose_dataparallel_gpus, in_autocast
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


# TODO 2/13: add 16 lines of code here:
#   class AutocastDataParallel(nn.DataParallel): nn.DataParallel whose replicas compute in the run's
#       number format (bfloat16 or float16).
#       def __init__(self, module, autocast_device: torch.device, autocast_dtype: torch.dtype,
#           **kwargs)
#       def parallel_apply(self, replicas, inputs, kwargs)
def main():
    # TODO 3/13: change the next 4 lines of code into 7 lines:
    #     parser = CourseParser(chapter=3, description=__doc__)
    #     parser.add_argument(
    #         "--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step"
    #     )
    #   (and 1 more in the solution)
    parser = CourseParser(chapter=2, description=__doc__)
    parser.add_argument(
        "--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step"
    )
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    setup_math(device, dtype)
    autocast = autocast_context(device, dtype)
    out_dir = Path(args.out_dir)

    # TODO 4/13: add 3 lines of code here:
    #   - DataParallel runs one replica per GPU; --gpus picks how many of the visible ones it uses.
    #     The settings it cannot run with (more GPUs than visible, --device cpu on a machine with
    #     GPUs, --compile over several GPUs) are refused with one line each
    #     (common/dataparallel.py).
    #   - on a CPU: one, the model itself
    #   - DataParallel takes one batch of all replicas' sequences and cuts it into one per replica
    # ---- data: token files on disk, read as fixed windows of block_size tokens -------------------
    model_config = gpt_config_from_args(args)
    data_folder = prepare(
        args.dataset, args.data_dir, num_proc=args.num_proc, text_column=args.text_column
    )
    train_set, val_set = load_splits(data_folder, model_config.block_size)

    # TODO 5/13: change the next line of code:
    #   - One optimizer step sees `global_batch` sequences: grad_accum micro-batches, one after
    #     another, each of `batch_size` sequences per replica, which DataParallel cuts out of one
    #     big batch.
    # One optimizer step sees `global_batch` sequences: grad_accum micro-batches, one after another.
    global_batch = args.batch_size * args.grad_accum
    tokens_per_step = global_batch * model_config.block_size
    steps_per_epoch = count_steps_per_epoch(train_set, global_batch)
    # every chapter evaluates these windows: eval_batches whole global batches, spread evenly
    val_windows = validation_windows(val_set, args.eval_batches, global_batch)

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
    # TODO 6/13: change the next line of code into 3 lines:
    #   - nn.DataParallel in the run's number format (the class above); without GPUs (gpu_ids is [])
    #     it calls the model as it is
    #   - The wrapper keeps the real model in model.module. Its state dict would prefix every name
    #     with "module.", so checkpoints save model.module's, which any chapter can load.
    #   - DataParallel, not compiled: see the evaluation below
    raw_model = model  # the plain module: its state dict is what checkpoints hold
    if args.compile:
        model = torch.compile(model)

    model_size = f"{raw_model.num_params() / 1e6:.2f}M parameters ({args.preset})"
    print(f"device {describe(device)}, {str(dtype).removeprefix('torch.')}; model {model_size}")
    per_step = f"{global_batch} sequences x {model_config.block_size} tokens = {tokens_per_step:,}"
    # TODO 7/13: change the next line of code:
    #     split = f"{args.grad_accum} micro-batches x {replicas} replica(s) x {args.batch_size}"
    split = f"{args.grad_accum} micro-batches x {args.batch_size}"
    print(f"global batch: {split} = {per_step} tokens per step; {steps_per_epoch} steps per epoch")
    # TODO 8/13: add 11 lines of code here:
    #     else:
    #         print(
    #             f"DataParallel has nothing to split on one {device.type} device: "
    #             "the run is chapter 02's"
    #         )
    #   (and 1 more in the solution)
    if iter_num:
        print(f"resuming from {out_dir / 'ckpt.pt'} at step {iter_num}")

    train_config = vars(args) | {"global_batch": global_batch}
    # TODO 9/13: change the next line of code:
    #   - tokens/s and MFU between log lines: MFU against the peak of all the replicas' GPUs
    #   - metrics.jsonl and the printed lines: one call per log step
    # tokens/s and MFU between log lines; metrics.jsonl and the printed lines: one call per log step
    speed = Throughput(tokens_per_step, raw_model.flops_per_token(), device, dtype)
    report = RunLog(out_dir, iter_num, speed)

    while iter_num < args.max_iters:
        epoch = iter_num // steps_per_epoch
        step_in_epoch = iter_num % steps_per_epoch  # > 0 when a resumed run starts mid-epoch
        # the data order: epoch e visits the windows in randperm(N), drawn with the seed seed + e
        epoch_generator = torch.Generator().manual_seed(args.seed + epoch)
        sampler = RandomSampler(train_set, generator=epoch_generator)
        # micro-batches of this epoch a resumed run trained on
        skip = step_in_epoch * args.grad_accum
        # TODO 10/13: change the next line of code:
        #     loader = batch_loader(train_set, sampler, whole_batch, skip, device)
        loader = batch_loader(train_set, sampler, args.batch_size, skip, device)
        batches = iter(loader)
        for _ in range(step_in_epoch, steps_per_epoch):
            if iter_num >= args.max_iters:
                break
            # ---- one training step ----
            lr = lr_at(iter_num, args)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss = torch.zeros((), device=device)  # the mean loss over the whole global batch
            for _ in range(args.grad_accum):
                x, y = next(batches)  # (B, T) each, built in CPU memory
                x = x.to(device, non_blocking=True)
                y = y.to(device, non_blocking=True)
                with autocast:
                    # TODO 11/13: change the next line of code into 2 lines:
                    #   - each replica returns its own mean loss: a vector of `replicas` losses on
                    #     cuda:0. Every replica has B sequences, so their mean is the micro-batch's.
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
                loss_value = loss.item()
                check_finite(iter_num, loss_value)  # a NaN or an inf loss ends the run
                report.step(iter_num, loss_value, lr)

            # ---- evaluation and checkpoint ----
            if iter_num % args.eval_interval == 0 or last_step:
                # the model uncompiled: eval mode would be compiled anew, which takes longer than
                # evaluating without compiling
                # TODO 12/13: change the next 3 lines of code:
                #     val_loss = evaluate(
                #         eval_model, val_set, val_windows, whole_batch, device, autocast
                #     ).item()
                val_loss = evaluate(
                    raw_model, val_set, val_windows, args.batch_size, device, autocast
                ).item()
                # before the save: a diverged model never replaces a good checkpoint
                check_finite(iter_num, val_loss, "validation loss")
                save_checkpoint(out_dir, iter_num, raw_model, optimizer, scaler, train_config)
                report.evaluation(iter_num, val_loss, out_dir / "ckpt.pt")
    # TODO 13/13: add 6 lines of code here:
    #   - cuda:0 also holds the optimizer state, the gathered outputs and the loss

    if args.sample_tokens:
        print(f"---- a sample from the model ({args.sample_tokens} tokens) ----")
        text = sample_text(raw_model, args.prompt, args.sample_tokens, device, seed=args.seed)
        print(text)


if __name__ == "__main__":
    run_main(main, resumable=True)
