r"""One process of a torchrun job: who am I, what do I read, and what does the all-reduce give?"""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

from common.data import load_splits, prepare
from common.model import GPT, model_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="data", help="where the prepared corpus lies")
    parser.add_argument("--save-grad", type=Path, help="rank 0 saves the averaged gradient here")
    args = parser.parse_args()

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # set by torchrun
    local_rank, node = int(os.environ["LOCAL_RANK"]), int(os.environ["GROUP_RANK"])
    # meet the other ranks at MASTER_ADDR:MASTER_PORT (torchrun sets both)
    dist.init_process_group("gloo")

    config = model_config("tiny", dropout=0.0)
    train_set, _ = load_splits(prepare("shakespeare", args.data_dir), config.block_size)
    # the global batch is 8 sequences: each rank reads 8 / world_size of them
    sampler = DistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=1337, drop_last=True
    )
    sampler.set_epoch(0)
    mine = list(sampler)[: 8 // world_size]

    # every rank builds the same model (DDP would broadcast rank 0's anyway)
    torch.manual_seed(1337)
    model = GPT(config)
    x = torch.stack([train_set[i][0] for i in mine])
    y = torch.stack([train_set[i][1] for i in mine])
    _, loss = model(x, y)
    loss.backward()
    # this rank's gradient, flattened
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    own_norm = grad.norm().item()
    # the sum over all ranks: what DDP does inside backward(), bucket by bucket
    dist.all_reduce(grad)
    grad /= world_size  # ... and the average
    if rank == 0 and args.save_grad:
        torch.save(grad, args.save_grad)
    ranks = dict(
        rank=rank, local_rank=local_rank, node=node, world_size=world_size, pid=os.getpid()
    )
    numbers = dict(loss=loss.item(), own_grad_norm=own_norm, averaged_grad_norm=grad.norm().item())
    print("RESULT " + json.dumps(dict(**ranks, windows=mine, **numbers)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
