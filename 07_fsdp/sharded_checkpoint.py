"""Sharded checkpoints: every rank writes its own shards, and another number of ranks reads them.

Chapter 07's ckpt.pt gathers the whole model into rank 0's memory. For a model too large for
that, torch.distributed.checkpoint (DCP) has every rank write only its own shards, all at once,
and records which rows of which tensor each file holds; ranks cut another way read back the
pieces they need. See docs/deep/SHARDED_CHECKPOINT.md.

    torchrun --standalone --nproc_per_node=2 07_fsdp/sharded_checkpoint.py save --out-dir out/dcp
    torchrun --standalone --nproc_per_node=3 07_fsdp/sharded_checkpoint.py load --out-dir out/dcp

save: the model, sharded as chapter 07 shards it, takes two AdamW steps on random tokens; every
rank writes its shards of the model and of the optimizer state into <out-dir>/ckpt_sharded/, and
rank 0 writes the same state whole to <out-dir>/whole.pt, to compare with. load: the model,
sharded over this run's ranks, reads its shards back, and rank 0 gathers them whole and compares
them with whole.pt.
"""

import argparse
import contextlib
import os
import shutil
import sys
from pathlib import Path

# lets `import common` work from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from common.model import GPT, PRESETS
from common.sharding import gather_full_state, shard_full_state

# inside --out-dir: one file of shards per rank that wrote it, and .metadata, the map of the rows
SHARDED_NAME = "ckpt_sharded"


@contextlib.contextmanager
def sharded_checkpoint_folder(out_dir: Path):
    """A new, empty folder for every rank to write its shards into; put in place of
    <out_dir>/ckpt_sharded only once every rank has finished writing.

    The old checkpoint is moved aside first and deleted last, so a crash at any moment leaves a
    whole checkpoint: the old one, the new one, or (between the two renames) the new one under its
    temporary name and the old one under `.ckpt_sharded.old`. A failure inside the block leaves the
    old one in place.
    """
    final = Path(out_dir) / SHARDED_NAME
    tmp = final.with_name(f".{SHARDED_NAME}.tmp")
    old = final.with_name(f".{SHARDED_NAME}.old")
    is_rank0 = dist.get_rank() == 0
    if is_rank0:
        shutil.rmtree(tmp, ignore_errors=True)  # what a crashed save left
        tmp.mkdir(parents=True)
    dist.barrier()  # the folder exists and is empty before anyone writes into it
    yield tmp
    dist.barrier()  # every rank's shards are written
    if is_rank0:
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()  # no rank goes on (and perhaps saves again) before the new one is in place


def sharded_model(preset: str, device: torch.device) -> tuple[GPT, torch.optim.Optimizer]:
    """Chapter 07's construction: the model on the meta device, sharded, filled from rank 0's
    fresh copy; and AdamW on the shards."""
    with torch.device("meta"):
        model = GPT(PRESETS[preset])
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device=device)
    optimizer = torch.optim.AdamW(model.optimizer_groups(0.1), lr=1e-3)
    full_state_dict = {}
    if dist.get_rank() == 0:
        torch.manual_seed(1337)
        full_state_dict = GPT(PRESETS[preset]).state_dict()
    shard_full_state(model, optimizer, full_state_dict, None)
    return model, optimizer


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("--out-dir", type=Path, required=True, help="where the checkpoint is")
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny", help="model size")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        sys.exit(f"start it with torchrun: torchrun --nproc_per_node=2 {sys.argv[0]} ...")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cpu")
    backend = "gloo"
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    dist.init_process_group(backend)
    model, optimizer = sharded_model(args.preset, device)
    folder = args.out_dir / SHARDED_NAME

    if args.mode == "save":
        torch.manual_seed(rank)  # each rank its own random tokens, as each would read its own data
        for _ in range(2):
            tokens = torch.randint(0, 50257, (2, 17), device=device)
            _, loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        # This rank's shards, as DTensors, under the same names as ckpt.pt's tensors: nothing is
        # gathered, and every rank writes its own file at the same time.
        sharded = {
            "model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, optimizer),
        }
        with sharded_checkpoint_folder(args.out_dir) as tmp:
            dcp.save(sharded, checkpoint_id=tmp)
        # the same state whole, to compare with after the load
        whole = gather_full_state(model, optimizer)
        if rank == 0:
            torch.save(whole, args.out_dir / "whole.pt")
        files = sorted(path.name for path in folder.iterdir())
        print(f"[rank {rank}] {world_size} ranks wrote {folder}: {', '.join(files)}", flush=True)

    if args.mode == "load":
        # The layout of this rank's shards, cut for this world size; DCP fills it with the pieces
        # of the saved shards it covers, whatever number of ranks wrote them.
        sharded = {
            "model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, optimizer),
        }
        dcp.load(sharded, checkpoint_id=folder)
        set_model_state_dict(model, sharded["model"])
        set_optimizer_state_dict(model, optimizer, sharded["optimizer"])
        model_state, optimizer_state = gather_full_state(model, optimizer)
        if rank == 0:
            saved_model, saved_optimizer = torch.load(args.out_dir / "whole.pt", weights_only=True)
            torch.testing.assert_close(model_state, saved_model, rtol=0, atol=0)
            torch.testing.assert_close(optimizer_state, saved_optimizer, rtol=0, atol=0)
            same = f"the {len(model_state)} model tensors and the optimizer state equal the saved"
            print(f"[rank 0] {world_size} ranks read {folder}: {same} ones exactly", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
