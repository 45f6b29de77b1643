"""One command line for every chapter: every flag means the same in every chapter."""

from __future__ import annotations

import argparse

from .chapters import CHAPTERS
from .model import PRESETS, GPTConfig, model_config
from .support.errors import CourseError
from .support.flags import (
    HelpFormatter,
    OneLineParser,
    check_out_dir,
    fraction,
    non_negative_float,
    non_negative_int,
    not_in_chapter,
    positive_int,
    refuse_other_chapters_flags,
)
from .support.preempt import stop_signal


def build_parser(chapter: int, description: str) -> argparse.ArgumentParser:
    prog = f"{CHAPTERS[chapter]}/train.py"
    p = OneLineParser(prog=prog, description=description, formatter_class=HelpFormatter)

    def later(flag: str, **kwargs):
        """A flag of another chapter: hidden from --help here, refused when used."""
        if not_in_chapter(chapter, flag):
            kwargs = {"default": None, "help": argparse.SUPPRESS, "action": kwargs.get("action")}
        g.add_argument(flag, **kwargs)

    g = p.add_argument_group("batch and schedule")
    g.add_argument("--batch-size", type=positive_int, default=8, help="sequences per forward pass")
    later("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--max-iters", type=positive_int, default=400, help="optimizer steps to train for")
    g.add_argument("--lr", type=non_negative_float, default=2e-3, help="peak learning rate")
    g.add_argument("--min-lr", type=non_negative_float, default=2e-4, help="learning rate after the decay")
    g.add_argument("--warmup-iters", type=non_negative_int, default=50, help="steps of linear warm-up")
    g.add_argument("--lr-decay-iters", type=positive_int, help="steps of cosine decay (default: --max-iters)")
    g.add_argument("--weight-decay", type=non_negative_float, default=0.1, help="AdamW's weight decay")
    g.add_argument("--beta1", type=fraction, default=0.9, help="AdamW's decay of the gradient average")
    g.add_argument("--beta2", type=fraction, default=0.99, help="AdamW's decay of the squared gradients")
    g.add_argument("--grad-clip", type=non_negative_float, default=1.0, help="clip the gradient norm; 0: off")
    g.add_argument("--seed", type=int, default=1337, help="the weights' start and the data order")

    g = p.add_argument_group("model")
    g.add_argument("--preset", choices=list(PRESETS), default="small", help="model size")
    g.add_argument("--n-layer", type=positive_int, help="the layers (default: the preset's)")
    g.add_argument("--n-head", type=positive_int, help="the attention heads (default: the preset's)")
    g.add_argument("--n-embd", type=positive_int, help="the width (default: the preset's)")
    g.add_argument("--block-size", type=positive_int, help="the context length (default: the preset's)")
    g.add_argument("--dropout", type=fraction, default=0.0, help="dropout probability")
    g.add_argument("--bias", action=argparse.BooleanOptionalAction, default=True, help="biases in layers")
    g.add_argument(
        "--chunked-loss",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the output layer and the loss a few positions at a time (common/chunked_loss.py); "
        "--no-chunked-loss: the plain logits + cross-entropy, same numbers, more memory",
    )
    g.add_argument(
        "--init-from", choices=["scratch", "gpt2"], default="scratch", help="gpt2: OpenAI's weights"
    )

    g = p.add_argument_group("data")
    corpus = "'shakespeare' (offline), a .txt/.json/.jsonl/.parquet file, or a Hugging Face data set"
    g.add_argument("--dataset", default="shakespeare", help=corpus)
    g.add_argument("--text-column", default="text", help="the column holding the text in JSON/Parquet/Hub")
    g.add_argument("--data-dir", default="data", help="where prepared token files are kept")
    g.add_argument("--num-proc", type=positive_int, help="threads for tokenizing (default: CPUs, at most 8)")

    g = p.add_argument_group("evaluation, logging and checkpoints")
    g.add_argument(
        "--eval-interval", type=positive_int, default=100, help="evaluate every N steps, at the end"
    )
    g.add_argument("--eval-batches", type=positive_int, default=20, help="validation batches per evaluation")
    g.add_argument("--log-interval", type=positive_int, default=10, help="a metrics line every N steps")
    g.add_argument("--out-dir", default=f"out/{CHAPTERS[chapter]}", help="metrics.jsonl and ckpt.pt go here")
    g.add_argument("--resume", action="store_true", help="continue from <out-dir>/ckpt.pt")
    g.add_argument(
        "--stop-signal",
        type=stop_signal,
        default="SIGTERM",
        help="besides SIGTERM, the signal (e.g. USR1, for sbatch --signal) that makes the run save "
        "the step it is in and stop, to be resumed (exit status 75)",
    )
    g.add_argument(
        "--sample-tokens", type=non_negative_int, default=200, help="tokens to generate at the end"
    )
    g.add_argument("--prompt", default="\n", help="text the final sample starts from (default: a newline)")

    g = p.add_argument_group("hardware")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    g.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16", "float64"],
        default="auto",
        help="auto: bfloat16 on GPUs with bf16 tensor cores, float16 on older ones, float32 on the CPU; "
        "float64: slow, to tell rounding from bugs",
    )
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    later("--gpus", type=positive_int, help="GPUs DataParallel spreads over (default: all visible)")
    later("--backend", choices=["auto", "nccl", "gloo"], default="auto", help="NCCL with CUDA, gloo without")
    later("--dist-timeout", type=positive_int, default=300, help="seconds a collective may wait for a peer")
    later("--shared-fs", action="store_true", help="nodes share one file system: rank 0 prepares data")
    return p


def parse_args(chapter: int, description: str, argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser(chapter, description).parse_args(argv)
    refuse_other_chapters_flags(chapter, args)
    args.grad_accum = args.grad_accum or 1
    args.lr_decay_iters = args.lr_decay_iters or args.max_iters
    check_out_dir(args.out_dir)
    return args


def gpt_config_from_args(args: argparse.Namespace) -> GPTConfig:
    overrides = {
        k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd", "block_size", "dropout", "bias")
    }
    cfg = model_config(args.preset, **overrides, chunked_loss=args.chunked_loss)
    if cfg.n_embd % cfg.n_head:
        raise CourseError(f"--n-embd {cfg.n_embd} must be a multiple of --n-head {cfg.n_head}")
    if args.init_from == "gpt2":
        gpt2 = PRESETS["gpt2"]
        if cfg.block_size > gpt2.block_size:
            raise CourseError(
                f"--block-size {cfg.block_size} is larger than GPT-2's 1024 positions; use at most that"
            )
        if (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.bias) != (gpt2.n_layer, gpt2.n_head, gpt2.n_embd, True):
            raise CourseError(
                "--init-from gpt2 loads GPT-2's weights: use --preset gpt2 without size overrides"
            )
    return cfg
