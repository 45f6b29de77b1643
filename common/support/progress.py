"""The progress bar: a tqdm bar on a terminal, plain lines every log interval in a file."""

import os
import sys

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, initial: int, enabled: bool = True, prefix: str = ""):
        self.prefix, self.enabled = prefix, enabled
        # no bar in a file, nor on a pseudo-terminal without a size (`script`, some CI runners):
        # plain lines
        self.tty = (
            enabled
            and sys.stderr.isatty()
            and os.get_terminal_size(sys.stderr.fileno()).columns > 0
        )
        desc, off = prefix.strip() or None, not self.tty
        self.bar = tqdm(total=total, initial=initial, disable=off, dynamic_ncols=True, desc=desc)

    def step(
        self, iter_num: int, loss: float | None = None, figures: dict | None = None, lr: float = 0.0
    ):
        self.bar.update(1)  # nothing where the bar is off
        # the loss and speed (Throughput's figures) come at log steps
        if self.tty and loss is not None:
            self.bar.set_postfix(
                loss=f"{loss:.4f}", tok_s=f"{figures['tokens_per_sec']:,.0f}", refresh=False
            )
        elif self.enabled and loss is not None:
            speed = f"{figures['tokens_per_sec']:,.0f} tokens/s"
            print(
                f"{self.prefix}iter {iter_num:>6} | loss {loss:.4f} | lr {lr:.2e} | {speed}",
                flush=True,
            )

    def print(self, message: str) -> None:  # a line that does not tear the bar
        if self.enabled:
            (self.bar.write if self.tty else print)(f"{self.prefix}{message}")
            sys.stdout.flush()

    def close(self) -> None:
        self.bar.close()
