"""A plain model of one data-parallel training step on W devices (docs/deep/SCALING.md).

    python -m bench.scaling_model                      # the on-paper tables for GPT-2 124M on H100s
    python -m bench.scaling_model --busbw 0.4 --compute-ms 400 --preset small   # one predicted step

A step is compute t_c plus the all-reduce that backward (2/3 t_c) does not hide; the all-reduce of
n bytes takes 2(W-1)/W x n / busbw, busbw as 05_multinode/preflight.py measures it. DDP's bucket
with the tied embedding (wte, also lm_head) is final only when backward reaches the first layer, so
its all-reduce cannot overlap. docs/deep/SCALING.md states the model and what it leaves out.
"""

from __future__ import annotations

import argparse
import functools

# DistributedDataParallel(bucket_cap_mb=25), its default
BUCKET_CAP_BYTES = 25 * 2**20
# backward's share of a step's compute: it does twice the matrix multiplications of forward
BACKWARD_SHARE = 2 / 3
# float32 gradients: autocast computes in bf16 but keeps weights and grads in fp32
GRAD_BYTES_PER_PARAM = 4

# Links, as all-reduce bus bandwidth per GPU in bytes/s. Sources:
#   NVLink: H100 SXM data sheet, NVLink 900 GB/s per GPU in both directions (450 GB/s each way);
#           nccl-tests all_reduce_perf on 8 x H100 SXM reaches 460-480 GB/s busbw (NVLink SHARP).
#   InfiniBand: DGX H100 User Guide, 8 single-port ConnectX-7 at 400 Gb/s = 50 GB/s per GPU;
#               a ring across nodes then carries 8 x 50 = 400 GB/s per node, the busbw ceiling.
#   400 Gb/s per node (one NIC for 8 GPUs): 50 GB/s; Ethernet, 100 Gb/s per node: 12.5 GB/s.
# Line rates are ceilings: measured busbw is lower, so these predictions are optimistic.
HARDWARE = {
    "peak_flops": 989e12,  # H100 SXM, dense bf16 (data sheet: 1,979 TFLOP/s with sparsity)
    "mfu": 0.40,  # an assumption: what a well-tuned GPT-2 124M run reaches on one H100
    "nvlink_busbw": 470e9,
    "links": {  # between nodes: busbw of a ring across nodes
        "InfiniBand 8 x 400 Gb/s per node": 400e9,
        "InfiniBand 400 Gb/s per node": 50e9,
        "Ethernet 100 Gb/s per node": 12.5e9,
    },
}
# the JAX scaling book, GPU chapter: 990e12 FLOP/s / 450e9 B/s within an H100 node
JAX_TOKENS_PER_GPU = 2200


def ring_allreduce_seconds(nbytes: float, world: int, busbw: float) -> float:
    """A ring all-reduce of nbytes over world ranks at bus bandwidth busbw (bytes/s)."""
    if world == 1:
        return 0.0
    return 2 * (world - 1) / world * nbytes / busbw


@functools.cache
def gradient_layout(preset: str) -> dict:
    """Gradient bytes of the course GPT, and the bytes of DDP's last bucket (the tied embedding's).

    DDP fills buckets in the reverse order of the layers; the tied wte matrix, registered first,
    comes last. A bucket closes once it holds 25 MiB or more."""
    import torch

    from common.model import GPT, model_config

    with torch.device("meta"):  # shapes only, no memory
        model = GPT(model_config(preset, dropout=0.0))
    sizes = [p.numel() * GRAD_BYTES_PER_PARAM for p in reversed(list(model.parameters()))]
    buckets = []
    current = 0
    for size in sizes:
        current += size
        if current >= BUCKET_CAP_BYTES:
            buckets.append(current)
            current = 0
    if current:
        buckets.append(current)
    return {
        "preset": preset,
        "params": sum(sizes) // GRAD_BYTES_PER_PARAM,
        "grad_bytes": sum(sizes),
        "last_bucket_bytes": buckets[-1],
        "buckets": len(buckets),
        "wte_bytes": model.transformer.wte.weight.numel() * GRAD_BYTES_PER_PARAM,
        "flops_per_token": model.flops_per_token(),
    }


def predict(compute_s: float, preset: str, busbw: float, world: int) -> dict:
    """The model above for one step of the course GPT of `preset`: every time in seconds. Across
    machines, the link between them is the ring's slowest hop, so its busbw is the one that
    counts."""
    layout = gradient_layout(preset)
    backward = BACKWARD_SHARE * compute_s
    last = ring_allreduce_seconds(layout["last_bucket_bytes"], world, busbw)
    others = ring_allreduce_seconds(
        layout["grad_bytes"] - layout["last_bucket_bytes"], world, busbw
    )
    exposed = last + max(0.0, others - backward)
    step = compute_s + exposed
    return {
        "compute_s": compute_s,
        "backward_s": backward,
        "allreduce_s": last + others,
        "last_bucket_s": last,
        "exposed_s": exposed,
        "step_s": step,
        "comm_share": exposed / step,
        "efficiency": compute_s / step,
        # the tokens per GPU from which backward hides every bucket but the last, and from which
        # the last alone leaves 90% efficiency (t_c >= 9 x its all-reduce), per second of compute
        "hide_s": others / BACKWARD_SHARE,
        "for_90_s": max(others / BACKWARD_SHARE, 9 * last),
    }


def paper_table(tokens_per_gpu: int, mfu: float) -> str:
    """Predicted efficiency of GPT-2 124M (bf16 autocast, fp32 gradients) for each link and W."""
    seconds_per_token = gradient_layout("gpt2")["flops_per_token"] / (HARDWARE["peak_flops"] * mfu)
    links = [("NVLink, one node", HARDWARE["nvlink_busbw"], [2, 4, 8])]
    for name, busbw in HARDWARE["links"].items():
        links.append((name, min(busbw, HARDWARE["nvlink_busbw"]), [16, 32, 128, 512]))
    lines = [
        f"GPT-2 124M, bf16 autocast (float32 gradients), {tokens_per_gpu:,} tokens per GPU per "
        f"step, H100 SXM at {mfu:.0%} MFU:",
        "",
        "| link | busbw (GB/s) | GPUs | compute (ms) | all-reduce (ms) | not hidden (ms) "
        "| communication share | efficiency "
        "| tokens/GPU to hide all but the last bucket | tokens/GPU for 90% |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, busbw, worlds in links:
        for world in worlds:
            p = predict(tokens_per_gpu * seconds_per_token, "gpt2", busbw, world)
            hide = p["hide_s"] / seconds_per_token
            for_90 = p["for_90_s"] / seconds_per_token
            lines.append(
                f"| {name} | {busbw / 1e9:,.1f} | {world} | {1000 * p['compute_s']:.1f} | "
                f"{1000 * p['allreduce_s']:.1f} | {1000 * p['exposed_s']:.1f} | "
                f"{p['comm_share']:.0%} | {p['efficiency']:.0%} | {hide:,.0f} | {for_90:,.0f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens-per-gpu", type=int, default=16 * 1024, help="per-GPU batch in tokens")
    p.add_argument("--mfu", type=float, default=HARDWARE["mfu"], help="share of the peak FLOP/s")
    p.add_argument("--busbw", type=float, default=None, help="GB/s: print one predicted step")
    p.add_argument("--compute-ms", type=float, default=None, help="with --busbw: the bare step")
    p.add_argument("--preset", default="tiny", help="with --busbw: the model")
    p.add_argument("--world", type=int, default=2, help="with --busbw: the ranks")
    args = p.parse_args(argv)
    if args.busbw is not None:
        if args.compute_ms is None:
            p.error("--busbw needs --compute-ms, the bare step of one rank's share")
        step = predict(args.compute_ms / 1000, args.preset, args.busbw * 1e9, args.world)
        print(
            f"predicted step {1000 * step['step_s']:.1f} ms: compute {args.compute_ms:.1f} ms + "
            f"all-reduce not hidden {1000 * step['exposed_s']:.1f} ms "
            f"({args.preset}, {args.world} ranks, busbw {args.busbw:g} GB/s)"
        )
        return
    print(paper_table(args.tokens_per_gpu, args.mfu))
    layout = gradient_layout("gpt2")
    print(
        f"gradients {layout['grad_bytes'] / 1e6:.1f} MB in {layout['buckets']} buckets, the last "
        f"{layout['last_bucket_bytes'] / 1e6:.1f} MB "
        f"(tied embedding {layout['wte_bytes'] / 1e6:.1f} MB); "
        f"{layout['flops_per_token'] / 1e9:.3f} GFLOP per token; the JAX scaling book: about "
        f"{JAX_TOKENS_PER_GPU:,} tokens per GPU within a node"
    )


if __name__ == "__main__":
    main()
