"""The progress bar: a tqdm bar on a terminal, plain lines every log interval in a file."""

import os
import sys

from tqdm import tqdm


class Progress:
    """enabled=False: no bar, for a rank that does not speak (its RunLog calls nothing else)."""

    def __init__(self, total: int, initial: int, enabled: bool, prefix: str):
        self.prefix = prefix
        # no bar in a file, nor on a pseudo-terminal without a size (`script`, some CI runners):
        # plain lines
        self.tty = (
            enabled
            and sys.stderr.isatty()
            and os.get_terminal_size(sys.stderr.fileno()).columns > 0
        )
        self.bar = tqdm(
            total=total,
            initial=initial,
            disable=not self.tty,
            dynamic_ncols=True,
            desc=prefix.strip(),
        )

    def step(self, iter_num: int, loss: float, figures: dict, lr: float) -> None:
        """A log step: the bar reaches `iter_num` and shows its loss and Throughput's figures, or,
        in a file, a plain line says them."""
        self.bar.update(iter_num - self.bar.n)  # nothing where the bar is off
        tokens_per_sec = figures["tokens_per_sec"]
        if self.tty:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_sec:,.0f}", refresh=False)
        else:
            speed = f"{tokens_per_sec:,.0f} tokens/s"
            line = f"{self.prefix}iter {iter_num:>6} | loss {loss:.4f} | lr {lr:.2e} | {speed}"
            print(line, flush=True)

    def print(self, message: str) -> None:
        """A line that does not tear the bar."""
        if self.tty:
            self.bar.write(f"{self.prefix}{message}")
        else:
            print(f"{self.prefix}{message}")
        sys.stdout.flush()

    def close(self) -> None:
        self.bar.close()
