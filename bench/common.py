"""Shared bits of the benchmarks: the machine they ran on, and writing the figures."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

from islands.node.progress import format_table


def machine() -> dict:
    import torch

    return {
        "date": time.strftime("%Y-%m-%d"),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }


def write(out: str | None, figures: dict) -> None:
    payload = {"machine": machine(), **figures}
    text = json.dumps(payload, indent=1)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
        print(f"wrote {out}")


def table(rows: list[list[str]], head: list[str]) -> str:
    return format_table(head, rows)
