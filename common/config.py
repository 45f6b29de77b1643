"""One command line for every chapter.

Every flag means the same in every chapter. A flag that a chapter does not support yet is still
recognised, so that using it too early gets a message naming the chapter that introduces it
instead of argparse's "unrecognized arguments".
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from .chapters import CHAPTERS
from .model import PRESETS, GPTConfig, model_config
from .support.errors import CourseError
from .support.preempt import stop_signal

# flag -> the chapter that introduces it
INTRODUCED_IN = {"--grad-accum": 2, "--gpus": 3, "--backend": 4, "--dist-timeout": 4, "--shared-fs": 5}
# flag -> (the last chapter that uses it, what to say to whoever uses it later; {script}: this chapter's)
RETIRED_AFTER = {
    "--gpus": (
        3,
        "chapter 03's DataParallel flag; here each process drives one GPU and torchrun starts them: "
        "torchrun --standalone --nproc_per_node=N {script}",
    )
}


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be zero or more, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:  # AdamW would refuse it with a traceback, or train on nan
        raise argparse.ArgumentTypeError(f"must be a finite number, zero or more, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the script's docstring as written and shows every default."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line and exit status 2, as every other mistake is."""

    def error(self, message: str):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def build_parser(chapter: int, description: str) -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=f"{CHAPTERS[chapter]}/train.py", description=description, formatter_class=_HelpFormatter
    )

    def later(flag: str, **kwargs):
        """A flag from a later chapter: hidden from --help here, refused when used."""
        if INTRODUCED_IN[flag] > chapter or RETIRED_AFTER.get(flag, (chapter,))[0] < chapter:
            kwargs = {
                "default": None,
                "help": argparse.SUPPRESS,
                **{k: v for k, v in kwargs.items() if k in ("action", "type")},
            }
            if kwargs.get("action") == "store_true":
                kwargs.pop("type", None)
        g.add_argument(flag, **kwargs)

    g = p.add_argument_group("batch and schedule")
    g.add_argument(
        "--batch-size",
        type=positive_int,
        default=8,
        help="micro-batch: sequences per forward pass on one device",
    )
    later("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--max-iters", type=positive_int, default=400, help="optimizer steps to train for")
    g.add_argument("--lr", type=_non_negative_float, default=2e-3, help="peak learning rate")
    g.add_argument(
        "--min-lr",
        type=_non_negative_float,
        default=2e-4,
        help="learning rate at the end of the cosine decay",
    )
    g.add_argument("--warmup-iters", type=_non_negative_int, default=50, help="steps of linear warm-up")
    g.add_argument(
        "--lr-decay-iters",
        type=positive_int,
        default=None,
        help="steps of cosine decay (default: --max-iters)",
    )
    g.add_argument("--weight-decay", type=_non_negative_float, default=0.1)
    g.add_argument("--beta1", type=_fraction, default=0.9)
    g.add_argument("--beta2", type=_fraction, default=0.99)
    g.add_argument(
        "--grad-clip",
        type=_non_negative_float,
        default=1.0,
        help="clip the gradient norm to this; 0 disables",
    )
    g.add_argument("--seed", type=int, default=1337)

    g = p.add_argument_group("model")
    g.add_argument("--preset", choices=list(PRESETS), default="small", help="model size")
    g.add_argument("--n-layer", type=positive_int, default=None, help="override the preset's layers")
    g.add_argument("--n-head", type=positive_int, default=None, help="override the preset's attention heads")
    g.add_argument("--n-embd", type=positive_int, default=None, help="override the preset's width")
    g.add_argument(
        "--block-size", type=positive_int, default=None, help="override the preset's context length"
    )
    g.add_argument("--dropout", type=_fraction, default=0.0)
    g.add_argument(
        "--bias", action=argparse.BooleanOptionalAction, default=True, help="biases in Linear and LayerNorm"
    )
    g.add_argument(
        "--chunked-loss",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the output layer and the loss a few positions at a time (common/chunked_loss.py); "
        "--no-chunked-loss: the plain logits + cross-entropy, same numbers, more memory",
    )
    g.add_argument(
        "--init-from",
        choices=["scratch", "gpt2"],
        default="scratch",
        help="gpt2: start from OpenAI's GPT-2 weights (downloads them once)",
    )

    g = p.add_argument_group("data")
    g.add_argument(
        "--dataset",
        default="shakespeare",
        help="'shakespeare' (offline), a local .txt/.json/.jsonl/.parquet file, "
        "or a Hugging Face data set name",
    )
    g.add_argument(
        "--text-column", default="text", help="the column holding the text in JSON/Parquet/Hub data"
    )
    g.add_argument("--data-dir", default="data", help="where prepared token files are kept")
    g.add_argument(
        "--num-proc", type=positive_int, default=None, help="processes for tokenizing (default: CPUs)"
    )

    g = p.add_argument_group("evaluation, logging and checkpoints")
    g.add_argument(
        "--eval-interval",
        type=positive_int,
        default=100,
        help="evaluate every this many steps (and at the end)",
    )
    g.add_argument(
        "--eval-batches",
        type=positive_int,
        default=20,
        help="validation batches (of the global batch size) per evaluation",
    )
    g.add_argument(
        "--log-interval", type=positive_int, default=10, help="write a metrics line every this many steps"
    )
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
        "--sample-tokens", type=_non_negative_int, default=200, help="tokens to generate at the end; 0 skips"
    )
    g.add_argument("--prompt", default="\n", help="text the final sample starts from")

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
    later(
        "--gpus",
        type=positive_int,
        default=None,
        help="GPUs DataParallel spreads over (default: all visible)",
    )
    later(
        "--backend",
        choices=["auto", "nccl", "gloo"],
        default="auto",
        help="process group backend: NCCL with CUDA, gloo without",
    )
    later(
        "--dist-timeout",
        type=positive_int,
        default=300,
        help="seconds a collective may wait for a peer before the run fails",
    )
    later(
        "--shared-fs",
        action="store_true",
        default=False,
        help="nodes share one file system: only global rank 0 prepares the data",
    )
    return p


def parse_args(chapter: int, description: str, argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser(chapter, description).parse_args(argv)

    def used(flag: str) -> bool:
        return getattr(args, flag.lstrip("-").replace("-", "_")) not in (None, False)

    for flag, introduced in INTRODUCED_IN.items():
        if introduced > chapter and used(flag):
            raise CourseError(
                f"{flag} is introduced in chapter {introduced:02d} ({CHAPTERS[introduced]}); "
                f"this is chapter {chapter:02d}: run {CHAPTERS[introduced]}/train.py to use it"
            )
    for flag, (last, instead) in RETIRED_AFTER.items():
        if chapter > last and used(flag):
            raise CourseError(f"{flag} is " + instead.format(script=f"{CHAPTERS[chapter]}/train.py"))
    if getattr(args, "grad_accum", None) is None:
        args.grad_accum = 1
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.max_iters
    check_out_dir(args.out_dir)
    return args


def check_out_dir(out_dir: str) -> None:
    """--out-dir must be a folder, or a path where one can be made: not an existing file."""
    path = Path(out_dir)
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                raise CourseError(
                    f"--out-dir {out_dir}: {folder} is a file, not a folder; "
                    "give a folder for metrics.jsonl and ckpt.pt (new or an earlier run's)"
                )
            return


def gpt_config_from_args(args: argparse.Namespace) -> GPTConfig:
    try:
        cfg = model_config(
            args.preset,
            n_layer=args.n_layer,
            n_head=args.n_head,
            n_embd=args.n_embd,
            block_size=args.block_size,
            dropout=args.dropout,
            bias=args.bias,
            chunked_loss=args.chunked_loss,
        )
    except ValueError as err:
        raise CourseError(str(err)) from None
    if cfg.n_embd % cfg.n_head:
        raise CourseError(f"--n-embd {cfg.n_embd} must be a multiple of --n-head {cfg.n_head}")
    if args.init_from == "gpt2":
        gpt2 = PRESETS["gpt2"]
        if cfg.block_size > gpt2.block_size:
            raise CourseError(
                f"--block-size {cfg.block_size} is larger than GPT-2's {gpt2.block_size} positions; "
                "use at most that"
            )
        if (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.bias) != (gpt2.n_layer, gpt2.n_head, gpt2.n_embd, True):
            raise CourseError(
                "--init-from gpt2 loads GPT-2's weights: use --preset gpt2 without layer/head/width overrides"
            )
    return cfg
