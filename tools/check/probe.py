"""Run a training script as `python SCRIPT ARGS` would, and write down what each optimizer step did.

    python -m tools.check.probe FACTS_DIR SCRIPT [ARGS...]   (or torchrun ... -m tools.check.probe)

For every optimizer step of every rank: the training windows read, the learning rate, the gradient
norm, whether it was clipped, the zero_grad calls, on which micro-steps DDP (or FSDP) reduced the
gradients, and checksums of the parameters before and after; another optimizer's steps (chapter
08's outer SGD) apart; the GPU index each rank would ask for; at the end, every rank's parameters.
FSDP's shards are gathered whole. It only watches, but for what the checker asks by environment:
CHECK_REPLICAS=N (DataParallel on a CPU splits each batch in N), CHECK_KILL=RANK:STEP (that rank
kills itself after that step, once) and CHECK_HANG_AFTER=S (a rank that waits S seconds in a
collective writes where, to FACTS_DIR/rank<R>.hang.json). Each rank writes FACTS_DIR/rank<R>.json
and rank<R>.pt, even when the script fails.
"""

from __future__ import annotations

import ast
import json
import os
import runpy
import signal
import sys
import threading
import time
import weakref
from pathlib import Path

import torch
import torch.optim.optimizer as optim_hooks
from torch.distributed.tensor import DTensor

from tools.check.mistakes import code_statements, header_end, quoted


class Recorder:
    def __init__(self):
        self.steps: list[dict] = []
        self.windows: list[int] = []  # training windows read since the last optimizer step
        self.train_windows = 0  # the training split's windows (the sampler permutes this many)
        self.zero_grads = 0  # zero_grad calls since the last optimizer step
        self.clip_norm: float | None = None  # the norm clip_grad_norm_ measured before clipping
        self.syncs: list[bool] = []  # per DDP forward since the last step: will backward average?
        self.sharded = False  # the parameters are FSDP's shards (DTensors)
        self.whole: torch.Tensor | None = None  # under FSDP: the whole parameters after the step
        # FSDP: the module whose gradient-sync switch was set last, and the switch
        self.fsdp_root: torch.nn.Module | None = None
        self.fsdp_sync = True
        # torch.distributed.checkpoint's optimizer step with zero gradients, made to create AdamW's
        # state before loading into it: not a training step
        self.ignoring = False
        self.replicated = 0  # forwards split over stand-in replicas
        self.fsdp_forwards = False  # a module sharded by fully_shard ran its forward
        # the GPU index the script's device statement gives this rank: {"line", "code", "index"}
        # or {"line", "code", "error"}; None: the script has no such statement
        self.device: dict | None = None
        self.params: list[torch.Tensor] = []  # the training optimizer's
        self.training: weakref.ref | None = None  # the training optimizer (trains)
        self.outer_steps: list[dict] = []  # every other optimizer's steps

    def trains(self, optimizer) -> bool:
        """The optimizer of the training steps: the first that steps. Another (chapter 08's outer
        optimizer, which moves the global parameters at a sync) has its steps recorded apart."""
        if self.training is None:
            self.training = weakref.ref(optimizer)
        return self.training() is optimizer

    def pre_step(self, optimizer, args, kwargs):
        if self.ignoring:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not self.trains(optimizer):
            # an outer step: after how many training steps it came
            self.outer_steps.append({"after": len(self.steps)})
            self.zero_grads = 0  # the next training step counts its own
            return
        self.params = params
        self.sharded = any(isinstance(p, DTensor) for p in params)
        grads = [whole(p.grad).detach().double().norm() for p in params if p.grad is not None]
        norm = torch.stack(grads).norm().item() if grads else 0.0
        self.steps.append(
            {
                # the parameters the step starts from: after a resume, the checkpoint's
                "checksum_before": checksum(params),
                "windows": self.windows,
                "zero_grads": self.zero_grads,
                "grad_norm": self.clip_norm if self.clip_norm is not None else norm,
                "clipped": self.clip_norm is not None,
                "lr": optimizer.param_groups[0]["lr"],
                "syncs": self.syncs,
            }
        )
        self.windows, self.zero_grads, self.clip_norm, self.syncs = [], 0, None, []

    def post_step(self, optimizer, args, kwargs):
        if self.ignoring:
            return
        if not self.trains(optimizer):
            return
        if self.sharded:
            # kept: after the script the process group may be gone, and with it the other shards
            self.whole = flat_whole(self.params).cpu()
        self.steps[-1]["checksum"] = checksum(self.params)

    def save(self, folder: Path, rank: int, status: int | None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        facts = {
            "rank": rank,
            "status": status,
            "steps": self.steps,
            "outer_steps": self.outer_steps,
            "replicated": self.replicated,
            "sharded": self.sharded,
            "fsdp_forwards": self.fsdp_forwards,
            "device": self.device,
            "train_windows": self.train_windows,
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
            # torchrun's restarts of this rank's process before this one (--max-restarts)
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        }
        (folder / f"rank{rank}.json").write_text(json.dumps(facts))
        if self.whole is not None:
            torch.save(self.whole, folder / f"rank{rank}.pt")
        elif self.params:
            flat = torch.cat([p.detach().double().reshape(-1).cpu() for p in self.params])
            torch.save(flat, folder / f"rank{rank}.pt")


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor whole: FSDP's shard (a DTensor) gathered from every rank, which all call this."""
    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    return tensor


def flat_whole(params: list[torch.Tensor]) -> torch.Tensor:
    """Every parameter whole, in float64, as one vector."""
    return torch.cat([whole(p).detach().double().reshape(-1) for p in params])


def checksum(params: list[torch.Tensor]) -> list[float]:
    flat = flat_whole(params)
    return [flat.sum().item(), flat.square().sum().item()]


def watch(recorder: Recorder) -> None:
    """Hooks on what every training script calls: the data set, zero_grad, clipping, the optimizer,
    DDP's and FSDP's forward, the device."""
    from common.data import TokenWindows

    read = TokenWindows.__getitem__

    def reading(self, i):
        if self.path.name == "train.bin":
            recorder.windows.append(int(i))
            recorder.train_windows = len(self)
        return read(self, i)

    TokenWindows.__getitem__ = reading

    for owner in (torch.optim.Optimizer, torch.nn.Module):
        zero = owner.zero_grad

        def zeroing(self, *args, _zero=zero, **kwargs):
            recorder.zero_grads += 1
            return _zero(self, *args, **kwargs)

        owner.zero_grad = zeroing

    clip = torch.nn.utils.clip_grad_norm_

    def clipping(*args, **kwargs):
        norm = clip(*args, **kwargs)
        recorder.clip_norm = float(whole(norm))
        return norm

    torch.nn.utils.clip_grad_norm_ = clipping
    watch_sync(recorder)
    ignore_dcp_optimizer_init(recorder)
    optim_hooks.register_optimizer_step_pre_hook(recorder.pre_step)
    optim_hooks.register_optimizer_step_post_hook(recorder.post_step)


def watch_sync(recorder: Recorder) -> None:
    """On which micro-steps the gradients are reduced: DDP's require_backward_grad_sync at each
    forward, FSDP's gradient-sync switch at each forward of the module it was set on."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    ddp_forward = DistributedDataParallel.forward

    def ddp_forwarding(self, *args, **kwargs):
        if torch.is_grad_enabled():
            recorder.syncs.append(bool(self.require_backward_grad_sync))
        return ddp_forward(self, *args, **kwargs)

    DistributedDataParallel.forward = ddp_forwarding

    # FSDP: the gradient-sync switch, recorded at each forward of the module it was set on
    switch = FSDPModule.set_requires_gradient_sync

    def switching(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        recorder.fsdp_root = self
        recorder.fsdp_sync = bool(requires_gradient_sync)
        return switch(self, requires_gradient_sync, recurse=recurse)

    FSDPModule.set_requires_gradient_sync = switching

    def fsdp_forwarding(module, args):
        if isinstance(module, FSDPModule):
            recorder.fsdp_forwards = True
        if module is recorder.fsdp_root and torch.is_grad_enabled():
            recorder.syncs.append(recorder.fsdp_sync)

    torch.nn.modules.module.register_module_forward_pre_hook(fsdp_forwarding)


def ignore_dcp_optimizer_init(recorder: Recorder) -> None:
    """torch.distributed.checkpoint's optimizer step with zero gradients, which creates AdamW's
    state before a load, is not a training step. The function is private: a torch without it
    fails here, rather than have the probe count a step that is not the script's."""
    from torch.distributed.checkpoint import state_dict

    original = state_dict._init_optim_state

    def initializing(optim) -> None:
        zero_grads = recorder.zero_grads
        recorder.ignoring = True
        try:
            original(optim)
        finally:
            recorder.ignoring = False
            recorder.zero_grads = zero_grads

    state_dict._init_optim_state = initializing


def gpu_index(call: ast.Call) -> ast.expr | None:
    """The GPU index a call chooses, as code: N of torch.device("cuda", N), of
    torch.device(f"cuda:{N}") or "cuda:N", of torch.cuda.set_device(N); None: it chooses none."""
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    if name == "set_device" and call.args:
        return call.args[0]
    if name != "device" or not call.args:
        return None
    first = call.args[0]
    index = call.args[1] if len(call.args) > 1 else None
    index = next((k.value for k in call.keywords if k.arg == "index"), index)
    if isinstance(first, ast.Constant) and first.value == "cuda":
        return index
    if isinstance(first, ast.Constant) and str(first.value).startswith("cuda:"):
        number = str(first.value).removeprefix("cuda:")
        return ast.Constant(int(number)) if number.isdigit() else None
    if isinstance(first, ast.JoinedStr) and len(first.values) == 2:
        prefix, value = first.values
        if isinstance(prefix, ast.Constant) and prefix.value == "cuda:":
            return value.value
    return None


def evaluable(expr: ast.expr) -> bool:
    """Names, attributes, subscripts, arithmetic, and calls to int, get and getenv only."""
    allowed = {"int", "get", "getenv"}
    for node in ast.walk(expr):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name not in allowed:
                return False
        elif isinstance(node, (ast.Lambda, ast.NamedExpr, ast.Await, ast.Yield, ast.comprehension)):
            return False
    return True


def read_devices(recorder: Recorder, script: str) -> None:
    """Evaluate each device statement's GPU index (gpu_index) with the script's variables, at each
    line of it or of a statement around it that runs, until the first optimizer step."""
    source = Path(script).read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    chosen = []  # (the lines whose run evaluates it, the statement's line, its code, the index)
    for node in code_statements(source):
        if hasattr(node, "body"):
            continue  # a compound statement: its body's statements are looked at themselves
        for call in (c for c in ast.walk(node) if isinstance(c, ast.Call)):
            index = gpu_index(call)
            if index is None:
                continue
            around = [
                a
                for a in ast.walk(tree)
                if isinstance(a, ast.stmt)
                and not isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and a.lineno <= node.lineno <= (a.end_lineno or 0)
            ]
            # the statement's own lines and the header lines of the statements it sits in
            at = {n for a in around for n in range(a.lineno, header_end(a) + 1)}
            chosen.append((at, node.lineno, quoted(node, lines), index))
    if not chosen:
        return
    paths = {script, str(Path(script).resolve())}  # the script's frames: their code's file

    def evaluate(frame) -> None:
        for at, line, code, index in chosen:
            if frame.f_lineno not in at:
                continue
            said = {"line": line, "code": code}
            if not evaluable(index):
                said["error"] = f"`{ast.unparse(index)}` calls a function: not evaluated"
            else:
                try:
                    value = eval(ast.unparse(index), frame.f_globals, frame.f_locals)
                except Exception as err:  # a name not yet assigned there, ...
                    said["error"] = f"`{ast.unparse(index)}`: {type(err).__name__}: {err}"
                else:
                    if isinstance(value, torch.device) and value.type == "cuda":
                        value = value.index
                    if not isinstance(value, int) or isinstance(value, bool):
                        continue  # set_device(device) before the GPU branch: not an index yet
                    said["index"] = value
            if recorder.device is None or "index" in said:  # the first why, the last index
                recorder.device = said

    def local(frame, event, arg):
        if recorder.steps:
            return None  # this frame traced no more
        if event == "line":
            evaluate(frame)
        return local

    def calls(frame, event, arg):
        if recorder.steps:  # training began: every device was chosen before it
            sys.settrace(None)
            return None
        return local if frame.f_code.co_filename in paths else None

    sys.settrace(calls)


def where_waiting(script: str, frame) -> dict | None:
    """The script's innermost line and the collective below it, if the main thread waits in one."""
    collective, line = None, None
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if collective is None and "/torch/distributed/" in name:
            collective = frame.f_code.co_name
        if collective is None and "/torch/autograd/" in name:
            collective = "backward (DDP's or FSDP's gradient reduction)"
        # DDP's forward syncs with the other ranks too (its bucket order, after the first step)
        if collective is None and name.endswith("/torch/nn/parallel/distributed.py"):
            collective = f"DDP's {frame.f_code.co_name}"
        if line is None and os.path.abspath(name) == script:
            line = frame.f_lineno
        frame = frame.f_back
    if collective is None or line is None:
        return None
    return {"line": line, "collective": collective}


def watch_for_hangs(script: str, folder: Path, after: float) -> threading.Event:
    """A thread that writes FACTS_DIR/rank<R>.hang.json while the main thread has waited in one
    collective, at one line of the script, for `after` seconds; removed when it moves on."""
    main_id = threading.main_thread().ident
    path = folder / f"rank{int(os.environ.get('RANK', 0))}.hang.json"

    done = threading.Event()

    def loop():
        since, last = time.monotonic(), None
        while not done.wait(0.5):
            frame = sys._current_frames().get(main_id)
            here = where_waiting(script, frame) if frame is not None else None
            # Let go of the main thread's frame now: held through the wait, it could be the last
            # reference to the script's locals when main() returns, and the model (DDP's reducer,
            # the process group) would then be freed on this thread, which deadlocks with gloo's.
            frame = None
            if here != last:
                since, last = time.monotonic(), here
                path.unlink(missing_ok=True)
            elif here is not None and time.monotonic() - since >= after and not path.exists():
                folder.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(here | {"waited_s": round(after), "pid": os.getpid()}))

    threading.Thread(target=loop, daemon=True).start()
    return done


def stand_in_replicas(recorder: Recorder, replicas: int) -> None:
    """nn.DataParallel without GPUs splits the batch in `replicas` as scatter() would, runs the
    shared model on each piece (through the script's parallel_apply, if it has its own) and gathers
    as gather() does: the outputs concatenated, the 0-dim losses as a vector of one per replica."""
    from torch import nn

    def forward(self, *inputs, **kwargs):
        if self.device_ids:
            return real_forward(self, *inputs, **kwargs)
        recorder.replicated += 1
        rows = inputs[0].shape[0]
        pieces = [
            tuple(t.tensor_split(replicas)[i] for t in inputs) for i in range(min(replicas, rows))
        ]
        outputs = self.parallel_apply([self.module] * len(pieces), pieces, [kwargs] * len(pieces))
        logits = None  # the model returns none when it computes the loss in chunks
        if outputs[0][0] is not None:
            logits = torch.cat([out[0] for out in outputs])
        losses = torch.stack([out[1].reshape(()) for out in outputs])
        return logits, losses

    def parallel_apply(self, modules, inputs, kwargs):
        if self.device_ids:
            return real_parallel_apply(self, modules, inputs, kwargs)
        return [m(*i, **k) for m, i, k in zip(modules, inputs, kwargs)]

    real_forward = nn.DataParallel.forward
    real_parallel_apply = nn.DataParallel.parallel_apply
    nn.DataParallel.forward = forward
    nn.DataParallel.parallel_apply = parallel_apply


def kill_after(recorder: Recorder, rank: int, step: int) -> None:
    """SIGKILL this process after optimizer step `step`, in the first attempt only."""
    if int(os.environ.get("RANK", 0)) != rank:
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
        return

    def killing(optimizer, args, kwargs):
        if len(recorder.steps) == step:
            os.kill(os.getpid(), signal.SIGKILL)

    optim_hooks.register_optimizer_step_post_hook(killing)


def main() -> None:
    folder, script, *args = sys.argv[1:]
    # `python SCRIPT` puts the script's folder first on the path, where `-m` put the course's root
    # (which PYTHONPATH keeps): the script finds its neighbours as it would
    sys.path[0] = str(Path(script).resolve().parent)
    sys.argv = [script, *args]
    recorder = Recorder()
    watch(recorder)
    if os.environ.get("CHECK_REPLICAS"):
        stand_in_replicas(recorder, int(os.environ["CHECK_REPLICAS"]))
    if os.environ.get("CHECK_KILL"):
        rank, step = os.environ["CHECK_KILL"].split(":")
        kill_after(recorder, int(rank), int(step))
    read_devices(recorder, script)
    watching = None
    if os.environ.get("CHECK_HANG_AFTER"):
        hang_after = float(os.environ["CHECK_HANG_AFTER"])
        watching = watch_for_hangs(os.path.abspath(script), Path(folder), hang_after)
    status: int | None = 1
    try:
        runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        raise
    finally:
        if watching is not None:
            watching.set()  # the thread ends before the interpreter does
        recorder.save(Path(folder), int(os.environ.get("RANK", 0)), status)


if __name__ == "__main__":
    main()
