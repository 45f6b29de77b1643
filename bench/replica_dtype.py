"""Which number format do nn.DataParallel's replicas compute in? (chapter 03's autocast trap)

    python -m bench.replica_dtype --device cuda --dtype bfloat16 --out replica_dtype.json

DataParallel runs each replica's forward in a thread of its own (torch.nn.parallel.parallel_apply)
and enters autocast there without a dtype; the thread then computes in the default format
(float16 on CUDA) whatever the run chose. This script calls a probe module, which records the
dtype of a matmul inside its forward:

    plain       the way torch's parallel_apply calls a replica
    chapter 03  wrapped as chapter 03's DataParallel wraps each replica (dataparallel.in_autocast)

On CUDA the threads are torch's own: parallel_apply with two replicas on GPU 0 (one GPU is enough
to start its threads), and, with two or more GPUs, chapter 03's DataParallel over GPUs 0 and 1. On
a CPU, which parallel_apply refuses, a thread entering autocast as parallel_apply does stands in
for it, so the script's mechanics can be checked anywhere. Exit status 0 when chapter 03's
replicas compute in the chosen format.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import threading
from pathlib import Path

import torch
from torch import nn

from common.dataparallel import in_autocast
from common.device import DTYPES, autocast_context
from layout import REPO


class DtypeProbe(nn.Module):
    """A linear layer that notes the dtype its matmul produced, in every thread that calls it."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 64)
        self.seen: list[str] = []

    def forward(self, x):
        out = self.linear(x)
        self.seen.append(str(out.dtype).removeprefix("torch."))
        return out


def through_threads(replicas, inputs, device: torch.device) -> None:
    """Call each replica in a thread of its own, as DataParallel does."""
    if device.type == "cuda":
        torch.nn.parallel.parallel_apply(
            replicas, inputs, devices=[device.index or 0] * len(replicas)
        )
        return
    # read in the caller's thread, as parallel_apply does
    enabled = torch.is_autocast_enabled("cpu")

    def worker(replica, x):
        with torch.amp.autocast("cpu", enabled=enabled):
            replica(x)

    threads = [threading.Thread(target=worker, args=(r, x)) for r, x in zip(replicas, inputs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--out", default=None, help="write the findings as JSON here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = DTYPES[args.dtype]
    x = torch.randn(4, 64, device=device)
    result = {"device": args.device, "chosen": args.dtype}
    with autocast_context(device, dtype):
        probe = DtypeProbe().to(device)
        through_threads([probe, probe], [x, x], device)
        result["plain"] = probe.seen
        probe = DtypeProbe().to(device)
        wrapped = in_autocast(probe, device, dtype)
        through_threads([wrapped, wrapped], [x, x], device)
        result["chapter03"] = probe.seen
        if device.type == "cuda" and torch.cuda.device_count() >= 2:
            spec = importlib.util.spec_from_file_location(
                "chapter03", REPO / "03_dataparallel" / "train.py"
            )
            chapter03 = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(chapter03)
            probe = DtypeProbe().to("cuda:0")
            chapter03.AutocastDataParallel(probe, device, dtype, device_ids=[0, 1])(
                torch.randn(8, 64, device="cuda:0")
            )
            # the replicas are copies: they note into the same list
            result["chapter03_two_gpus"] = probe.seen
        else:
            result["chapter03_two_gpus"] = "not run: needs 2 GPUs"
    result["passed"] = result["chapter03"] == [args.dtype] * 2
    print(
        f"replicas under DataParallel's threads, chosen {args.dtype}: "
        f"torch's way {result['plain']}, "
        f"chapter 03's {result['chapter03']}; two GPUs: {result['chapter03_two_gpus']} -> "
        f"{'PASS' if result['passed'] else 'FAIL'}"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
