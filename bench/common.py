"""Shared bits of the benchmarks: the machine they ran on, and writing the figures."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
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


def parse(doc: str, run_dir: str, extra=lambda p: None) -> tuple[argparse.Namespace, Path]:
    """The options of a process benchmark (--out, --run-dir, and `extra(parser)`'s), and its run dir, emptied."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the figures here (JSON)")
    p.add_argument("--run-dir", default=run_dir, help=f"where the nodes run (default {run_dir}; emptied first)")
    extra(p)
    args = p.parse_args()
    root = Path(args.run_dir)
    shutil.rmtree(root, ignore_errors=True)
    return args, root


def write(out: str | None, figures: dict) -> None:
    payload = {"machine": machine(), **figures}
    text = json.dumps(payload, indent=1)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
        print(f"wrote {out}")


def table(rows: list[list[str]], head: list[str]) -> str:
    return format_table(head, rows)


def plot(
    path: Path, title: str, series: dict[str, list[tuple[float, float]]], *, xlabel: str, ylabel: str,
    log: bool = False, bars: bool = False, hline: tuple[float, str] | None = None,
) -> None:
    """A PNG of named (x, y) series as lines, or of one bar per series (its first y) with `bars`.

    matplotlib comes with the `bench` extra (scripts/setup.sh installs it); without it, no PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed (pip install -e '.[bench]'): no {path}")
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if bars:
        names = list(series)
        values = [series[n][0][1] for n in names]
        ax.bar(names, values, color=[f"C{i}" for i in range(len(names))])
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.3g}", ha="center", va="bottom")
    else:
        for name, points in series.items():
            xs, ys = zip(*sorted(points), strict=True) if points else ((), ())
            ax.plot(xs, ys, marker="o" if len(points) < 20 else None, label=name)
        ax.legend()
    if hline is not None:
        ax.axhline(hline[0], color="grey", linestyle="--", linewidth=1)
        ax.text(ax.get_xlim()[0], hline[0], f" {hline[1]}", va="bottom", color="grey")
    if log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
