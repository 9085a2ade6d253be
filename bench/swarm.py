"""A local swarm, measured: wall time, bytes per island per step, sync outcomes, round time per fragment.

    python -m bench.swarm --islands 3 --out bench/results/swarm.json [-- node options]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
from pathlib import Path

from islands.node.events import EventTail
from islands.node.swarm import SwarmConfig, run_swarm

from .common import table, write


def summarize(folder: Path) -> dict:
    ev = EventTail.read(folder / "events.jsonl")
    syncs = [e for e in ev if e["event"] == "sync"]
    summary = next(e for e in reversed(ev) if e["event"] == "summary")
    started = next(e for e in ev if e["event"] == "started")
    by_frag: dict[int, list[float]] = {}
    for s in syncs:
        if s["outcome"] == "ok":
            by_frag.setdefault(s["fragment"], []).append(s["seconds"])
    n = max(1, len(syncs))
    return {
        "island": folder.name, "batch_size": started["config"]["batch_size"], "steps": summary["steps"],
        "eval_loss": summary["eval_loss"], "wall_seconds": summary["wall_seconds"],
        "bytes_sent": summary["bytes_sent"], "bytes_sent_per_step": summary["bytes_sent"] / max(1, summary["steps"]),
        "syncs": len(syncs), "share_ok": sum(s["outcome"] == "ok" for s in syncs) / n,
        "share_solo": sum(s["outcome"] == "solo" for s in syncs) / n,
        "share_failed": sum(s["outcome"] == "failed" for s in syncs) / n,
        "share_group_full": sum(s["group_size"] == started["config"]["wait_islands"] for s in syncs) / n,
        "consensus_rounds": sum(1 for s in syncs if s.get("consensus")),
        "round_seconds_median_per_fragment": {str(p): round(statistics.median(v), 3) for p, v in sorted(by_frag.items())},
    }


def main() -> None:
    argv = sys.argv[1:]
    node_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, node_args = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out")
    p.add_argument("--islands", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--run-dir", default="bench-runs/swarm")
    args = p.parse_args(argv)
    cfg = SwarmConfig(islands=args.islands, steps=args.steps, window=args.window, fragments=args.fragments, run_dir=args.run_dir, node_args=tuple(node_args))
    buf = io.StringIO()
    rc = run_swarm(cfg, out=buf)
    print(buf.getvalue())
    root = sorted(Path(args.run_dir).iterdir())[-1]
    wall = float(buf.getvalue().split("swarm finished in ")[1].split("s")[0])
    islands = [summarize(f) for f in sorted(root.glob("island-*")) if f.is_dir()]
    print(table(
        [[r["island"], str(r["batch_size"]), f"{r['eval_loss']:.4f}", f"{r['bytes_sent_per_step'] / 1e3:.1f}kB",
          f"{r['share_ok']:.0%}/{r['share_solo']:.0%}/{r['share_failed']:.0%}", f"{r['share_group_full']:.0%}",
          " ".join(f"f{k}:{v}s" for k, v in r["round_seconds_median_per_fragment"].items())] for r in islands],
        ["island", "batch", "eval_loss", "sent/step", "ok/solo/failed", "full group", "round s (median) per fragment"],
    ))
    write(args.out, {"islands": islands, "wall_seconds": wall, "exit": rc, "node_args": node_args, "config": {"islands": args.islands, "steps": args.steps, "window": args.window, "fragments": args.fragments}})
    sys.exit(rc)


if __name__ == "__main__":
    main()
