"""The progress bar: a tqdm bar on a terminal, plain lines every log interval in a file."""

from __future__ import annotations

import os
import sys

from tqdm import tqdm


def _terminal_columns(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError):
        return 0


class Progress:
    """Steps on a bar (a terminal), or the loss and speed as a line at every log interval (a file)."""

    def __init__(self, total: int, initial: int, enabled: bool = True, prefix: str = ""):
        self.prefix = prefix
        self.enabled = enabled
        # a bar needs a terminal that knows its width; a pseudo-terminal without a size (`script`,
        # some CI runners and IDE consoles) reports 0 columns, where tqdm would draw nothing at all
        self.on_terminal = enabled and sys.stderr.isatty() and _terminal_columns(sys.stderr) > 0
        desc = prefix.strip() or None
        self.bar = tqdm(
            total=total, initial=initial, disable=not self.on_terminal, dynamic_ncols=True, desc=desc
        )

    def step(
        self, iter_num: int, loss: float | None = None, figures: dict | None = None, lr: float | None = None
    ) -> None:
        """Advance one step; the loss and the speed (Throughput's figures) are shown when given."""
        if not self.enabled:
            return
        self.bar.update(1)
        if loss is None:
            return
        tokens_per_sec = figures["tokens_per_sec"]
        if self.on_terminal:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_sec:,.0f}", refresh=False)
        else:
            speed = f"{tokens_per_sec:,.0f} tokens/s"
            print(f"{self.prefix}iter {iter_num:>6} | loss {loss:.4f} | lr {lr:.2e} | {speed}", flush=True)

    def print(self, message: str) -> None:
        """A line that does not tear the bar."""
        if self.enabled:
            (self.bar.write if self.on_terminal else print)(f"{self.prefix}{message}")
            sys.stdout.flush()

    def close(self) -> None:
        self.bar.close()
