"""One command line for every chapter: every flag means the same in every chapter."""

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
from .support.preempt import stop_signal

# flag -> (its first chapter, its last); other chapters hide it from --help and refuse it in one
# line. Every other flag is in every chapter.
CHAPTER_FLAGS = {
    "--grad-accum": (2, 6),
    "--gpus": (3, 3),
    "--dist-timeout": (4, 6),
    "--shared-fs": (5, 6),
    "--stop-signal": (5, 6),
}


def build_parser(chapter: int, description: str) -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=f"{CHAPTERS[chapter]}/train.py",
        description=description,
        formatter_class=HelpFormatter,
    )

    def flag(name: str, **kwargs):
        first, last = CHAPTER_FLAGS.get(name, (1, 6))
        # another chapter's flag: hidden from --help, refused when used
        if not first <= chapter <= last:
            kwargs = {"default": None, "help": argparse.SUPPRESS, "action": kwargs.get("action")}
        group.add_argument(name, **kwargs)

    group = p.add_argument_group("batch and schedule")
    flag("--batch-size", type=positive_int, default=8, help="sequences per forward pass")
    flag("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step")
    flag("--max-iters", type=positive_int, default=400, help="optimizer steps to train for")
    flag("--lr", type=non_negative_float, default=2e-3, help="peak learning rate")
    flag("--min-lr", type=non_negative_float, default=2e-4, help="learning rate after the decay")
    flag("--warmup-iters", type=non_negative_int, default=50, help="steps of linear warm-up")
    flag("--lr-decay-iters", type=positive_int, help="steps of cosine decay (default: --max-iters)")
    flag("--weight-decay", type=non_negative_float, default=0.1, help="AdamW's weight decay")
    flag("--beta1", type=fraction, default=0.9, help="AdamW's decay of the gradient average")
    flag("--beta2", type=fraction, default=0.99, help="AdamW's decay of the squared gradients")
    flag("--grad-clip", type=non_negative_float, default=1.0, help="clip the gradient norm; 0: off")
    flag("--seed", type=int, default=1337, help="the weights' start and the data order")
    group = p.add_argument_group("model")
    flag("--preset", choices=list(PRESETS), default="small", help="model size")
    flag("--n-layer", type=positive_int, help="the layers (default: the preset's)")
    flag("--n-head", type=positive_int, help="the attention heads (default: the preset's)")
    flag("--n-embd", type=positive_int, help="the width (default: the preset's)")
    flag("--block-size", type=positive_int, help="the context length (default: the preset's)")
    flag("--dropout", type=fraction, default=0.0, help="dropout probability")
    flag("--bias", action=argparse.BooleanOptionalAction, default=True, help="biases in layers")
    chunked = (
        "the output layer and the loss a few positions at a time (common/chunked_loss.py); "
        "--no-chunked-loss: the plain logits + cross-entropy, same numbers, more memory"
    )
    flag("--chunked-loss", action=argparse.BooleanOptionalAction, default=True, help=chunked)
    flag(
        "--init-from", choices=["scratch", "gpt2"], default="scratch", help="gpt2: OpenAI's weights"
    )
    group = p.add_argument_group("data")
    corpus = (
        "'shakespeare' (offline), a .txt/.json/.jsonl/.parquet file, or a Hugging Face data set"
    )
    flag("--dataset", default="shakespeare", help=corpus)
    flag("--text-column", default="text", help="the column holding the text in JSON/Parquet/Hub")
    flag("--data-dir", default="data", help="where prepared token files are kept")
    flag("--num-proc", type=positive_int, help="threads for tokenizing (default: CPUs, at most 8)")
    group = p.add_argument_group("evaluation, logging and checkpoints")
    flag(
        "--eval-interval", type=positive_int, default=100, help="evaluate every N steps, at the end"
    )
    flag("--eval-batches", type=positive_int, default=20, help="validation batches per evaluation")
    flag("--log-interval", type=positive_int, default=10, help="a metrics line every N steps")
    flag("--out-dir", default=f"out/{CHAPTERS[chapter]}", help="metrics.jsonl and ckpt.pt go here")
    flag("--resume", action="store_true", help="continue from <out-dir>/ckpt.pt")
    stop = (
        "besides SIGTERM, the signal (e.g. USR1, for sbatch --signal) that makes the run save "
        "the step it is in and stop, to be resumed (exit status 75)"
    )
    flag("--stop-signal", type=stop_signal, default="SIGTERM", help=stop)
    flag(
        "--sample-tokens", type=non_negative_int, default=200, help="tokens to generate at the end"
    )
    flag("--prompt", default="\n", help="text the final sample starts from (default: a newline)")
    group = p.add_argument_group("hardware")
    flag("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    dtype = (
        "auto: bfloat16 on GPUs with bf16 tensor cores, float16 on older ones, float32 on the CPU; "
        "float64: slow, to tell rounding from bugs"
    )
    flag(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16", "float64"],
        default="auto",
        help=dtype,
    )
    flag("--compile", action="store_true", help="torch.compile the model")
    flag("--gpus", type=positive_int, help="GPUs DataParallel spreads over (default: all visible)")
    flag(
        "--dist-timeout",
        type=positive_int,
        default=300,
        help="seconds a collective may wait for a peer",
    )
    flag(
        "--shared-fs", action="store_true", help="nodes share one file system: rank 0 prepares data"
    )
    return p


def parse_args(chapter: int, description: str, argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser(chapter, description).parse_args(argv)
    for flag, (first, last) in CHAPTER_FLAGS.items():
        used = getattr(args, flag.lstrip("-").replace("-", "_")) not in (None, False)
        if used and chapter < first:
            raise CourseError(
                f"{flag} is introduced in chapter {first:02d} ({CHAPTERS[first]}); "
                f"this is chapter {chapter:02d}: run {CHAPTERS[first]}/train.py to use it"
            )
        if used and chapter > last:  # only --gpus, DataParallel's, retires
            raise CourseError(
                f"{flag} is chapter 03's DataParallel flag; here each process drives one GPU and "
                "torchrun starts them: "
                f"torchrun --standalone --nproc_per_node=N {CHAPTERS[chapter]}/train.py"
            )
    args.chapter = chapter  # the script's chapter, saved with its checkpoints' settings
    args.grad_accum = args.grad_accum or 1
    args.lr_decay_iters = args.lr_decay_iters or args.max_iters
    path = Path(args.out_dir)
    # the part of --out-dir that exists already must be a folder
    existing = [folder for folder in (path, *path.parents) if folder.exists()]
    if existing and not existing[0].is_dir():
        raise CourseError(
            f"--out-dir {args.out_dir}: {existing[0]} is a file, not a folder; "
            "give a folder for metrics.jsonl and ckpt.pt (new or an earlier run's)"
        )
    return args


def gpt_config_from_args(args: argparse.Namespace) -> GPTConfig:
    sizes = {
        k: getattr(args, k)
        for k in ("n_layer", "n_head", "n_embd", "block_size", "dropout", "bias")
    }
    cfg = model_config(args.preset, **sizes, chunked_loss=args.chunked_loss)
    if cfg.n_embd % cfg.n_head:
        raise CourseError(f"--n-embd {cfg.n_embd} must be a multiple of --n-head {cfg.n_head}")
    if args.init_from == "gpt2":
        gpt2 = PRESETS["gpt2"]
        if cfg.block_size > gpt2.block_size:
            raise CourseError(
                f"--block-size {cfg.block_size} is larger than GPT-2's 1024 positions; "
                "use at most that"
            )
        shape = (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.bias)
        if shape != (gpt2.n_layer, gpt2.n_head, gpt2.n_embd, True):
            raise CourseError(
                "--init-from gpt2 loads GPT-2's weights: use --preset gpt2 without size overrides"
            )
    return cfg
