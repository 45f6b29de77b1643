"""A plain model of one data-parallel training step on W devices, predicted and compared
with measurements.

    python -m bench.scaling_model                      # the on-paper tables for GPT-2 124M on H100s

One optimizer step of DDP on W devices, each with B tokens of the global batch:

    compute    t_c = the device's forward + backward + optimizer step on its B tokens; measured with
               bench/bare_step.py on the CPU, or B x FLOPs per token / (peak FLOP/s x MFU) on paper
    backward   t_b = 2/3 t_c: backward is two of the three matrix multiplications of every layer
    all-reduce t_ar(n bytes) = 2(W-1)/W x n / busbw     (the time of a ring all-reduce)
               with busbw as 05_multinode/preflight.py measures it: nccl-tests' normalised figure,
               algbw x 2(W-1)/W. It equals what each link carries only for a ring; NCCL's tree and
               NVLink SHARP algorithms move fewer bytes, so busbw can exceed a link's speed.
    overlap    DDP sends gradients in buckets of 25 MiB while backward runs. The bucket that holds
               the tied embedding (wte, which is also lm_head) is final only when backward
               reaches the very first layer, so its all-reduce cannot overlap; the other buckets
               can hide behind what remains of backward, at most t_b:
    exposed    t_x = t_ar(last bucket) + max(0, t_ar(other buckets) - t_b)
    step       t = t_c + t_x;  communication share t_x / t;  scaling efficiency t_c / t

What the model leaves out. DDP's first bucket: with find_unused_parameters=False, torch puts every
parameter in one bucket when DDP is built, then, after the first iteration, rebuilds the buckets in
the order the gradients became ready, the first capped at 1 MiB (bucket_cap_mb's small first
bucket) and the rest at 25 MiB. The model fills every bucket to 25 MiB. The small first bucket
starts the first all-reduce earlier and adds one call: a small change to the overlap, ignored here.

Against the JAX scaling book's ~2,200 tokens per GPU within an H100 node: that derivation also
lets only backward hide the communication. The real differences are elsewhere: this model sends
float32 gradients (the book bf16), counts the ring's 2(W-1)/W, lets only the gradient bytes outside
the tied embedding's bucket overlap, and counts lm_head's and attention's FLOPs. They roughly
cancel, so the near match of the two figures is largely a coincidence.

bench/benchmark.py runs this with its own measured inputs and prints the prediction beside the
measured 2-rank figures (`against_benchmark`); bench/link_rates.py predicts chapter 05's step
across two machines from the busbw measured between them at each rate of their link (`link_step`,
also `--busbw GB/s --compute-ms MS` here); this command prints the tables for hardware we do not
have. The bandwidths and FLOP/s are from the sources named in HARDWARE and in bench/README.md.
"""

from __future__ import annotations

import argparse
import functools
import sys

# DistributedDataParallel(bucket_cap_mb=25), its default (its first bucket, 1 MiB, is ignored)
BUCKET_CAP_BYTES = 25 * 2**20
# backward's share of a step's compute: it does twice the matrix multiplications of forward
BACKWARD_SHARE = 2 / 3
# float32 gradients: autocast computes in bf16 but keeps weights and grads in fp32
GRAD_BYTES_PER_PARAM = 4

# Links, as all-reduce bus bandwidth per GPU in bytes/s. Sources (bench/README.md cites them too):
#   NVLink: H100 SXM data sheet, NVLink 900 GB/s per GPU in both directions (450 GB/s each way);
#           nccl-tests all_reduce_perf on 8 x H100 SXM reaches 460-480 GB/s busbw (NVLink SHARP).
#   InfiniBand: DGX H100 User Guide, 8 single-port ConnectX-7 at 400 Gb/s = 50 GB/s per GPU;
#               a ring across nodes then carries 8 x 50 = 400 GB/s per node, the busbw ceiling.
#   400 Gb/s per node (one NIC for 8 GPUs): 50 GB/s; Ethernet, 100 Gb/s per node: 12.5 GB/s.
# Line rates are ceilings: measured busbw is lower, so these predictions are optimistic.
HARDWARE = {
    "peak_flops": 989e12,  # H100 SXM, dense bf16 (data sheet: 1,979 TFLOP/s with sparsity)
    "mfu": 0.40,  # an assumption: what a well-tuned GPT-2 124M run reaches on one H100
    "gpus_per_node": 8,
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
    return 2 * (world - 1) / world * nbytes / busbw if world > 1 else 0.0


@functools.cache
def gradient_layout(preset: str) -> dict:
    """Gradient bytes of the course GPT, and the bytes of DDP's last bucket (the tied embedding's).

    DDP fills buckets in the order gradients become ready, the reverse of the layers: the last
    block first, ..., the first block, the position embedding, and last the tied wte matrix (it is
    registered first, so it comes last in reverse). A bucket closes once it holds 25 MiB or more.
    Torch caps the first bucket at 1 MiB when it rebuilds them after the first iteration; this
    layout does not (see the module's text): it only moves a little of the overlap.
    """
    import torch

    from common.model import GPT, model_config

    with torch.device("meta"):  # shapes only, no memory
        model = GPT(model_config(preset, dropout=0.0))
    sizes = [p.numel() * GRAD_BYTES_PER_PARAM for p in reversed(list(model.parameters()))]
    buckets, current = [], 0
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


def predict(
    compute_s: float, grad_bytes: float, last_bucket_bytes: float, busbw: float, world: int
) -> dict:
    """The model above, for one step: every time in seconds."""
    backward = BACKWARD_SHARE * compute_s
    last = ring_allreduce_seconds(last_bucket_bytes, world, busbw)
    others = ring_allreduce_seconds(grad_bytes - last_bucket_bytes, world, busbw)
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
    }


def link_step(compute_s: float, preset: str, busbw: float, world: int) -> dict:
    """Chapter 05's step on `world` ranks across machines, the course GPT of `preset` with its
    float32 gradients in DDP's buckets: the model above, with the busbw measured between the
    machines (bytes/s). The link between the machines is the ring's slowest hop, so its busbw is
    the one that counts."""
    layout = gradient_layout(preset)
    return predict(compute_s, layout["grad_bytes"], layout["last_bucket_bytes"], busbw, world)


# ---- against the benchmark's measurements (bench/benchmark.py) -----------------------------------


def against_benchmark(report: dict, busbw_gbs: float, preflight: str) -> dict | None:
    """Predict 04 DDP with 2 ranks from the run's measured inputs, and set the prediction beside
    the measurement."""
    rows = {r["setup"]: r for r in report["setups"]}
    two, one = rows.get("04x2", {}), rows.get("04x1", {})
    bare = {
        b["batch_size"]: min((r["step_ms"] for r in b["runs"] if r), default=None)
        for b in report["bare"]
    }
    g = report["settings"]["global_batch"]
    if two.get("status") != "ok" or bare.get(g // 2) is None:
        return None
    layout = gradient_layout(report["settings"]["preset"])
    p = predict(
        bare[g // 2] / 1000, layout["grad_bytes"], layout["last_bucket_bytes"], busbw_gbs * 1e9, 2
    )
    predicted = {
        "step_ms": 1000 * p["step_s"],
        "comm_ms": 1000 * p["exposed_s"],
        "comm_share": p["comm_share"],
        # the same global batch on one device takes the bare step of the whole batch
        "efficiency": bare[g] / (2 * 1000 * p["step_s"]) if bare.get(g) else None,
    }
    measured = {  # the benchmark times the step, not the communication inside it
        "step_ms": two["step_ms"],
        "comm_ms": None,
        "comm_share": None,
        "efficiency": report["scaling"].get("04x2", {}).get("efficiency")
        if one.get("status") == "ok"
        else None,
    }
    return {
        "inputs": {
            "bare_step_ms": bare[g // 2],
            "bare_step_ms_whole_batch": bare.get(g),
            "busbw_gbs": busbw_gbs,
            "busbw_from": preflight,
            "backward_share": BACKWARD_SHARE,
            **layout,
        },
        "predicted": predicted,
        "measured": measured,
        "ratio": {
            k: predicted[k] / measured[k] if predicted[k] and measured[k] else None
            for k in predicted
        },
    }


def markdown_lines(prediction: dict | None) -> list[str]:
    """The benchmark table's companion: predicted against measured, 04 DDP with 2 ranks."""
    if not prediction:
        return []
    i, pr, me, ra = (
        prediction["inputs"],
        prediction["predicted"],
        prediction["measured"],
        prediction["ratio"],
    )

    def fmt(value, kind):
        if value is None:
            return "n/a"
        return f"{100 * value:.1f}%" if kind == "share" else f"{value:,.1f}"

    lines = [
        "",
        "Predicted against measured, 04 DDP with 2 ranks (bench/scaling_model.py):",
        "",
        "| 2 ranks | measured | predicted | predicted / measured |",
        "|---|---:|---:|---:|",
    ]
    for key, label, kind in [
        ("step_ms", "step (ms)", "ms"),
        ("comm_ms", "communication not hidden (ms)", "ms"),
        ("comm_share", "communication share", "share"),
        ("efficiency", "scaling efficiency", "share"),
    ]:
        lines.append(
            f"| {label} | {fmt(me[key], kind)} | {fmt(pr[key], kind)} | "
            f"{'n/a' if ra[key] is None else f'{ra[key]:.2f}'} |"
        )
    lines += [
        "",
        "Inputs, all measured in this run: bare step of one rank's share "
        f"{i['bare_step_ms']:.1f} ms (bench/bare_step.py), backward {i['backward_share']:.2f} "
        f"of it; {i['grad_bytes'] / 1e6:.1f} MB of float32 gradients, "
        f"{i['last_bucket_bytes'] / 1e6:.1f} MB of them in the last bucket with the tied "
        f"embedding; busbw {i['busbw_gbs']:.3f} GB/s ({i['busbw_from']}).",
    ]
    return lines


# ---- on paper: GPT-2 124M on H100s ---------------------------------------------------------------


def paper_rows(tokens_per_gpu: int, hw: dict = HARDWARE) -> list[dict]:
    """Predicted efficiency of GPT-2 124M (bf16 autocast, fp32 gradients) for each link and W."""
    layout = gradient_layout("gpt2")
    seconds_per_token = layout["flops_per_token"] / (hw["peak_flops"] * hw["mfu"])
    links = [("NVLink, one node", hw["nvlink_busbw"], [2, 4, 8])]
    links += [
        (name, min(bw, hw["nvlink_busbw"]), [8 * n for n in (2, 4, 16, 64)])
        for name, bw in hw["links"].items()
    ]
    rows = []
    for name, busbw, worlds in links:
        for world in worlds:
            p = predict(
                tokens_per_gpu * seconds_per_token,
                layout["grad_bytes"],
                layout["last_bucket_bytes"],
                busbw,
                world,
            )
            rows.append(
                {
                    "link": name,
                    "busbw": busbw,
                    "world": world,
                    **p,
                    **hiding_batch(busbw, world, seconds_per_token, layout),
                }
            )
    return rows


def hiding_batch(busbw: float, world: int, seconds_per_token: float, layout: dict) -> dict:
    """The tokens per GPU from which backward hides every bucket but the last, and those for
    90% efficiency."""
    last = ring_allreduce_seconds(layout["last_bucket_bytes"], world, busbw)
    others = ring_allreduce_seconds(
        layout["grad_bytes"] - layout["last_bucket_bytes"], world, busbw
    )
    hide = others / (BACKWARD_SHARE * seconds_per_token)
    # from `hide` on only the last bucket is exposed: efficiency 0.9 needs t_c >= 9 x its all-reduce
    return {"tokens_to_hide": hide, "tokens_for_90": max(hide, 9 * last / seconds_per_token)}


def paper_markdown(tokens_per_gpu: int, hw: dict = HARDWARE) -> str:
    rows = paper_rows(tokens_per_gpu, hw)
    lines = [
        "GPT-2 124M, bf16 autocast (float32 gradients), "
        f"{tokens_per_gpu:,} tokens per GPU per step, "
        f"H100 SXM at {hw['mfu']:.0%} MFU:",
        "",
        "| link | busbw (GB/s) | GPUs | compute (ms) | all-reduce (ms) | not hidden (ms) "
        "| communication share | efficiency "
        "| tokens/GPU to hide all but the last bucket | tokens/GPU for 90% |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['link']} | {r['busbw'] / 1e9:,.1f} | {r['world']} | "
            f"{1000 * r['compute_s']:.1f} | {1000 * r['allreduce_s']:.1f} | "
            f"{1000 * r['exposed_s']:.1f} | {r['comm_share']:.0%} | "
            f"{r['efficiency']:.0%} | "
            f"{r['tokens_to_hide']:,.0f} | {r['tokens_for_90']:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--tokens-per-gpu",
        type=int,
        default=16 * 1024,
        help="per-GPU batch in tokens (default: 16 x 1024)",
    )
    p.add_argument(
        "--mfu",
        type=float,
        default=HARDWARE["mfu"],
        help="the GPU's share of its peak FLOP/s (default: 0.4)",
    )
    p.add_argument(
        "--busbw",
        type=float,
        default=None,
        help="GB/s measured between machines: print chapter 05's predicted step (with "
        "--compute-ms, --preset, --world) instead of the tables",
    )
    p.add_argument("--compute-ms", type=float, default=None, help="the bare step of a rank's share")
    p.add_argument("--preset", default="tiny", help="with --busbw: the model")
    p.add_argument("--world", type=int, default=2, help="with --busbw: the ranks")
    args = p.parse_args(argv)
    if args.busbw is not None:
        if args.compute_ms is None:
            p.error("--busbw needs --compute-ms, the bare step of one rank's share")
        step = link_step(args.compute_ms / 1000, args.preset, args.busbw * 1e9, args.world)
        print(
            f"predicted step {1000 * step['step_s']:.1f} ms: compute {args.compute_ms:.1f} ms + "
            f"all-reduce not hidden {1000 * step['exposed_s']:.1f} ms "
            f"({args.preset}, {args.world} ranks, busbw {args.busbw:g} GB/s)"
        )
        return 0
    hw = HARDWARE | {"mfu": args.mfu}
    print(paper_markdown(args.tokens_per_gpu, hw))
    layout = gradient_layout("gpt2")
    print(
        f"gradients {layout['grad_bytes'] / 1e6:.1f} MB in {layout['buckets']} buckets, the last "
        f"{layout['last_bucket_bytes'] / 1e6:.1f} MB "
        f"(tied embedding {layout['wte_bytes'] / 1e6:.1f} MB); "
        f"{layout['flops_per_token'] / 1e9:.3f} GFLOP per token; the JAX scaling book: about "
        f"{JAX_TOKENS_PER_GPU:,} tokens per GPU within a node"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
