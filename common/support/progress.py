"""The progress bar: a tqdm bar on a terminal, plain lines every log interval in a file."""

from __future__ import annotations

import os
import sys

from tqdm import tqdm


class Progress:
    """Steps on a bar (a terminal), or the loss and speed as a line at every log interval (a file)."""

    def __init__(self, total: int, initial: int, enabled: bool = True, prefix: str = ""):
        self.prefix, self.enabled = prefix, enabled
        try:  # a pseudo-terminal without a size (`script`, some CI runners) reports 0 columns
            columns = os.get_terminal_size(sys.stderr.fileno()).columns
        except (OSError, ValueError):
            columns = 0
        self.on_terminal = enabled and sys.stderr.isatty() and columns > 0
        desc = prefix.strip() or None
        self.bar = tqdm(
            total=total, initial=initial, disable=not self.on_terminal, dynamic_ncols=True, desc=desc
        )

    def step(
        self, iter_num: int, loss: float | None = None, figures: dict | None = None, lr: float = 0.0
    ) -> None:
        """Advance one step; the loss and the speed (Throughput's figures) are shown when given."""
        if not self.enabled:
            return
        self.bar.update(1)
        if loss is None:
            return
        if self.on_terminal:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{figures['tokens_per_sec']:,.0f}", refresh=False)
        else:
            speed = f"{figures['tokens_per_sec']:,.0f} tokens/s"
            print(f"{self.prefix}iter {iter_num:>6} | loss {loss:.4f} | lr {lr:.2e} | {speed}", flush=True)

    def print(self, message: str) -> None:
        """A line that does not tear the bar."""
        if self.enabled:
            (self.bar.write if self.on_terminal else print)(f"{self.prefix}{message}")
            sys.stdout.flush()

    def close(self) -> None:
        self.bar.close()
