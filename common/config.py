"""One command line for every chapter: the flags every chapter shares, and the model they describe.
A chapter adds its own flags to CourseParser; every flag means the same in every chapter."""

import argparse
from pathlib import Path

from .chapters import CHAPTERS
from .model import PRESETS, GPTConfig, model_config
from .support.errors import CourseError
from .support.flags import (
    HelpFormatter,
    OneLineParser,
    fraction,
    non_negative_float,
    non_negative_int,
    positive_int,
)

# The flags that later chapters add, each with the chapter that introduces it: an earlier chapter
# refuses them in one line that names that chapter, rather than argparse's "unrecognized".
INTRODUCED_IN = {
    "--grad-accum": 2,
    "--gpus": 3,
    "--dist-timeout": 4,
    "--shared-fs": 5,
    "--stop-signal": 6,
}


class CourseParser(OneLineParser):
    """argparse with the flags of every chapter, in groups; the chapter's own flags go under
    "options" with add_argument. parse_args() refuses a later chapter's flag in one line."""

    def __init__(self, chapter: int, description: str):
        super().__init__(
            prog=f"{CHAPTERS[chapter]}/train.py",
            description=description,
            formatter_class=HelpFormatter,
        )
        self.chapter = chapter
        add_shared_flags(self, out_dir=f"out/{CHAPTERS[chapter]}")

    def parse_args(self, args=None, namespace=None) -> argparse.Namespace:
        parsed, unknown = self.parse_known_args(args, namespace)
        for word in unknown:
            refuse_other_chapters_flag(word.split("=")[0], self.chapter)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        parsed.chapter = self.chapter  # saved with the checkpoints' settings
        if parsed.lr_decay_iters is None:
            parsed.lr_decay_iters = parsed.max_iters
        check_out_dir(parsed.out_dir)
        return parsed


def add_shared_flags(parser: argparse.ArgumentParser, out_dir: str) -> None:
    group = parser.add_argument_group("batch and schedule")
    group.add_argument(
        "--batch-size", type=positive_int, default=8, help="sequences per forward pass"
    )
    group.add_argument(
        "--max-iters", type=positive_int, default=400, help="optimizer steps to train for"
    )
    group.add_argument("--lr", type=non_negative_float, default=2e-3, help="peak learning rate")
    group.add_argument(
        "--min-lr", type=non_negative_float, default=2e-4, help="learning rate after the decay"
    )
    group.add_argument(
        "--warmup-iters", type=non_negative_int, default=50, help="steps of linear warm-up"
    )
    group.add_argument(
        "--lr-decay-iters", type=positive_int, help="steps of cosine decay (default: --max-iters)"
    )
    group.add_argument(
        "--weight-decay", type=non_negative_float, default=0.1, help="AdamW's weight decay"
    )
    group.add_argument(
        "--beta1", type=fraction, default=0.9, help="AdamW's decay of the gradient average"
    )
    group.add_argument(
        "--beta2", type=fraction, default=0.99, help="AdamW's decay of the squared gradients"
    )
    group.add_argument(
        "--grad-clip", type=non_negative_float, default=1.0, help="clip the gradient norm; 0: off"
    )
    group.add_argument(
        "--seed", type=int, default=1337, help="the weights' start and the data order"
    )

    group = parser.add_argument_group("model")
    group.add_argument("--preset", choices=list(PRESETS), default="small", help="model size")
    group.add_argument("--n-layer", type=positive_int, help="the layers (default: the preset's)")
    group.add_argument(
        "--n-head", type=positive_int, help="the attention heads (default: the preset's)"
    )
    group.add_argument("--n-embd", type=positive_int, help="the width (default: the preset's)")
    group.add_argument(
        "--block-size", type=positive_int, help="the context length (default: the preset's)"
    )
    group.add_argument("--dropout", type=fraction, default=0.0, help="dropout probability")
    group.add_argument(
        "--bias", action=argparse.BooleanOptionalAction, default=True, help="biases in layers"
    )
    group.add_argument(
        "--chunked-loss",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the output layer and the loss a few positions at a time (common/chunked_loss.py); "
        "--no-chunked-loss: the plain logits + cross-entropy, same numbers, more memory",
    )
    group.add_argument(
        "--init-from",
        default="scratch",
        help="a run's folder (or ckpt.pt) whose weights to start from (GPT-2's: "
        "python -m common.gpt2)",
    )

    group = parser.add_argument_group("data")
    group.add_argument(
        "--dataset",
        default="shakespeare",
        help="'shakespeare' (offline), a .txt/.json/.jsonl/.parquet file, or a Hugging Face "
        "data set",
    )
    group.add_argument(
        "--text-column", default="text", help="the column holding the text in JSON/Parquet/Hub"
    )
    group.add_argument("--data-dir", default="data", help="where prepared token files are kept")
    group.add_argument(
        "--num-proc", type=positive_int, help="threads for tokenizing (default: CPUs, at most 8)"
    )

    group = parser.add_argument_group("evaluation, logging and checkpoints")
    group.add_argument(
        "--eval-interval", type=positive_int, default=100, help="evaluate every N steps, at the end"
    )
    group.add_argument(
        "--eval-batches", type=positive_int, default=20, help="validation batches per evaluation"
    )
    group.add_argument(
        "--log-interval", type=positive_int, default=10, help="a metrics line every N steps"
    )
    group.add_argument("--out-dir", default=out_dir, help="metrics.jsonl and ckpt.pt go here")
    group.add_argument("--resume", action="store_true", help="continue from <out-dir>/ckpt.pt")
    group.add_argument(
        "--sample-tokens", type=non_negative_int, default=200, help="tokens to generate at the end"
    )
    group.add_argument(
        "--prompt", default="\n", help="text the final sample starts from (default: a newline)"
    )

    group = parser.add_argument_group("hardware")
    group.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    group.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16", "float64"],
        default="auto",
        help="auto: bfloat16 on GPUs with bf16 tensor cores, float16 on older ones, float32 on the "
        "CPU; float64: slow, to tell rounding from bugs",
    )
    group.add_argument("--compile", action="store_true", help="torch.compile the model")


def refuse_other_chapters_flag(flag: str, chapter: int) -> None:
    """Raise a CourseError that names the chapter of `flag`, a flag this chapter does not have."""
    first = INTRODUCED_IN.get(flag)
    if first is None:
        return
    if chapter < first:
        raise CourseError(
            f"{flag} is introduced in chapter {first:02d} ({CHAPTERS[first]}); "
            f"this is chapter {chapter:02d}: run {CHAPTERS[first]}/train.py to use it"
        )
    # DataParallel's flag, chapter 03's alone: from 04 on, torchrun starts the processes
    if flag == "--gpus" and chapter > first:
        raise CourseError(
            f"{flag} is chapter 03's DataParallel flag; here each process drives one GPU and "
            f"torchrun starts them: torchrun --standalone --nproc_per_node=N {CHAPTERS[chapter]}"
            "/train.py"
        )


def check_out_dir(out_dir: str) -> None:
    """The part of --out-dir that exists already must be a folder."""
    path = Path(out_dir)
    existing = [folder for folder in (path, *path.parents) if folder.exists()]
    if existing and not existing[0].is_dir():
        raise CourseError(
            f"--out-dir {out_dir}: {existing[0]} is a file, not a folder; "
            "give a folder for metrics.jsonl and ckpt.pt (new or an earlier run's)"
        )


def gpt_config_from_args(args: argparse.Namespace) -> GPTConfig:
    sizes = {
        k: getattr(args, k)
        for k in ("n_layer", "n_head", "n_embd", "block_size", "dropout", "bias")
    }
    cfg = model_config(args.preset, **sizes, chunked_loss=args.chunked_loss)
    if cfg.n_embd % cfg.n_head:
        raise CourseError(f"--n-embd {cfg.n_embd} must be a multiple of --n-head {cfg.n_head}")
    return cfg
