"""Print text from the model in any chapter's checkpoint.

    python -m common.sample --out-dir out/01_single_gpu --prompt "ROMEO:" --tokens 200

The checkpoint holds the model's configuration, so the same command reads every chapter's.
"""

from __future__ import annotations

import torch

from .checkpoint import load_checkpoint
from .device import pick_device
from .model import GPT, GPTConfig
from .support.errors import run_main
from .support.flags import HelpFormatter, OneLineParser, positive_int
from .training import sample_text


def main() -> None:
    parser = OneLineParser(
        prog="python -m common.sample", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--out-dir", default="out/01_single_gpu", help="a run's folder (or a ckpt.pt file)"
    )
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    parser.add_argument(
        "--tokens", type=positive_int, default=200, help="how many tokens to generate"
    )
    parser.add_argument("--num-samples", type=positive_int, default=1, help="texts to write")
    parser.add_argument(
        "--temperature", type=float, default=0.8, help="below 1: safer choices; above 1: wilder"
    )
    parser.add_argument(
        "--top-k", type=int, default=200, help="sample only among the k likeliest tokens"
    )
    parser.add_argument(
        "--seed", type=int, default=1337, help="the first text's seed; the next add 1"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    args = parser.parse_args()

    checkpoint = load_checkpoint(args.out_dir)
    device = pick_device(args.device)
    model = GPT(GPTConfig(**checkpoint["model_config"]))
    model.load_state_dict(checkpoint["model"])
    model.to(device)
    chapter = checkpoint.get("train_config", {}).get("chapter", "?")
    print(f"# checkpoint of chapter {chapter} at step {checkpoint['iter_num']}")
    for i in range(args.num_samples):
        print(
            sample_text(
                model,
                args.prompt,
                args.tokens,
                device,
                args.temperature,
                args.top_k,
                seed=args.seed + i,
            )
        )
        print("---")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    run_main(main)
