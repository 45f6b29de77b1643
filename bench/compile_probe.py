"""Does a compiled `x * 2` run on the device? The GPU check's first question, in seconds.

torch.compile needs more than torch: on a GPU, Triton builds its helpers with a C compiler and
Python's headers (gcc, Python.h) the first time it runs. A machine without them fails only when
something is compiled, so the check asks with the smallest program there is before it spends
minutes compiling GPT-2.

    python3 -m bench.compile_probe --device cuda --out probe.json

Prints one line, `compile probe: passed on cuda in 8.1 s` or `compile probe: FAILED on cuda: ...`
(the error's first lines; its traceback above it), writes the same as JSON to --out, and exits 1
when the probe fails."""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch


def probe(device: str) -> str | None:
    """None when a compiled `x * 2` gives the right numbers on `device`, else what went wrong."""
    double = torch.compile(lambda x: x * 2)
    x = torch.arange(8.0, device=device)
    y = double(x)
    if not torch.equal(y.cpu(), torch.arange(8.0) * 2):
        return f"wrong result: {y.cpu().tolist()}"
    return None


def first_lines(err: BaseException, count: int = 3) -> str:
    """An exception in one line: its type and first non-empty lines (compile errors are long)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {' | '.join(lines[:count])}"[:400]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=None, help="the result as JSON")
    args = p.parse_args()
    start = time.perf_counter()
    try:
        error = probe(args.device)
    except Exception as err:  # any failure is the answer, not a crash of the check
        traceback.print_exc()
        error = first_lines(err)
    seconds = round(time.perf_counter() - start, 1)
    result = {
        "device": args.device,
        "torch": torch.__version__,
        "passed": error is None,
        "seconds": seconds,
        "error": error,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if error is None:
        print(f"compile probe: passed on {args.device} in {seconds} s", flush=True)
        return
    print(f"compile probe: FAILED on {args.device}: {error}", flush=True)
    raise SystemExit(1)


if __name__ == "__main__":
    main()
