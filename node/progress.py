"""Progress on long runs: a live line on a terminal, plain log lines elsewhere."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def format_table(head: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns, two spaces apart, a header line first."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(head)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in [head, *rows])


def format_rate(tokens_per_s: float) -> str:
    if tokens_per_s >= 1e6:
        return f"{tokens_per_s / 1e6:.2f}M"
    if tokens_per_s >= 1e3:
        return f"{tokens_per_s / 1e3:.1f}k"
    return f"{tokens_per_s:.0f}"


class Progress:
    """mode: bar (rewrite one line), lines (a line every few steps), off."""

    def __init__(self, mode: str, label: str, total_steps: int, stream: TextIO | None = None, clock=time.monotonic):
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "lines"
        self.mode, self.label, self.total = mode, label, total_steps
        self._clock = clock
        self._last_draw = -1e9
        self._every = max(1, total_steps // 20)
        self._drawn = False

    def update(self, step: int, loss: float | None, tokens_per_s: float, next_sync: str) -> None:
        shown = "n/a" if loss is None else f"{loss:.3f}"
        text = f"[{self.label} - step {step}/{self.total}] loss {shown}  {format_rate(tokens_per_s)} tok/s  next sync {next_sync}"
        if self.mode == "bar":
            now = self._clock()
            if now - self._last_draw >= 0.1 or step == self.total:
                self._last_draw = now
                self.stream.write("\r\x1b[2K" + text)
                self.stream.flush()
                self._drawn = True
        elif self.mode == "lines" and (step % self._every == 0 or step == self.total):
            self.stream.write(text + "\n")
            self.stream.flush()

    def note(self, message: str) -> None:
        """A message that stays on screen (above the live line)."""
        if self.mode == "off":
            return
        prefix = "\r\x1b[2K" if self._drawn else ""
        self.stream.write(f"{prefix}[{self.label}] {message}\n")
        self.stream.flush()
        self._drawn = False

    def close(self) -> None:
        if self.mode == "bar" and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
