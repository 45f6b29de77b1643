r"""Run by torchrun: which training windows this rank's batches hold, as 04_ddp/train.py builds
them, for epochs 0 and 1 and epoch 0 resumed two batches in (window i starts with the token
i * BLOCK)."""

import json
import os
import sys
from pathlib import Path

from torch.utils.data.distributed import DistributedSampler

from common.data import TokenWindows, batch_loader


def windows(loader, block: int) -> list[int]:
    return [int(first) // block for x, _ in loader for first in x[:, 0]]


def main() -> None:
    tokens, block, batch, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    train_set = TokenWindows(tokens, block)
    # exactly the sampler and loader of 04_ddp/train.py
    sampler = DistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=1337, drop_last=True
    )
    record = {"rank": rank, "world_size": world_size, "n_windows": len(train_set)}
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        record[f"epoch{epoch}"] = windows(batch_loader(train_set, sampler, batch), block)
    sampler.set_epoch(0)
    record["epoch0_skip2"] = windows(batch_loader(train_set, sampler, batch, skip_batches=2), block)
    (out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
