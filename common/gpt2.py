"""OpenAI's GPT-2 (124M) as a course checkpoint, to train from its weights in any chapter:

    python -m common.gpt2 --out-dir out/gpt2_weights
    python 01_single_gpu/train.py --preset gpt2 --init-from out/gpt2_weights --out-dir out/tuned

`transformers` fetches the weights once (it needs the network then). A --block-size below GPT-2's
1024 keeps the first positions.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import write_checkpoint
from .model import GPT, PRESETS, model_config
from .support.errors import CourseError, run_main
from .support.flags import HelpFormatter, OneLineParser, positive_int

# Hugging Face's GPT-2 names its tensors as this model does, but stores these four as Conv1D, whose
# weight is the transpose of a Linear's.
_HF_TRANSPOSED = (
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
)


def load_hf_gpt2_state_dict(model: GPT, hf_state: dict[str, torch.Tensor]) -> None:
    """Copy a Hugging Face `GPT2LMHeadModel` state dict into `model`, which has GPT-2's shape and at
    most its 1024 positions."""
    ours = model.state_dict()  # detached: copying into it needs no no_grad()
    for name, value in hf_state.items():
        if name.endswith(_HF_TRANSPOSED):
            value = value.t()
        # the first rows: a smaller block_size keeps the first positions, and the vocabulary padded
        # to 50,304 tokens keeps its extra rows
        rows = min(len(value), len(ours[name]))
        ours[name][:rows].copy_(value[:rows])


def main() -> None:
    parser = OneLineParser(
        prog="python -m common.gpt2", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--out-dir", default="out/gpt2_weights", help="where ckpt.pt goes")
    parser.add_argument("--block-size", type=positive_int, default=1024, help="positions kept")
    args = parser.parse_args()
    if args.block_size > PRESETS["gpt2"].block_size:
        raise CourseError(
            f"--block-size {args.block_size} is larger than GPT-2's 1024 positions; "
            "use at most that"
        )
    from transformers import GPT2LMHeadModel  # imported here: nothing else needs it

    try:
        gpt2 = GPT2LMHeadModel.from_pretrained("gpt2")
    except OSError as err:  # transformers raises OSError when it cannot download
        reason = str(err).splitlines()[0][:100]
        raise CourseError(
            f"could not fetch GPT-2's weights ({reason}); it needs the network once"
        ) from None
    config = model_config("gpt2", block_size=args.block_size)
    model = GPT(config)
    load_hf_gpt2_state_dict(model, gpt2.state_dict())
    write_checkpoint(
        args.out_dir,
        model_state=model.state_dict(),
        optimizer_state={},
        iter_num=0,
        model_config=config,
        train_config={"init_from": "gpt2"},
    )
    path = Path(args.out_dir) / "ckpt.pt"
    print(
        f"GPT-2's weights written to {path}: train from them with --preset gpt2 --init-from", end=""
    )
    print(f" {args.out_dir} (and --block-size {args.block_size} if below 1024)")


if __name__ == "__main__":
    run_main(main)
