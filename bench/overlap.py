"""Compute utilization over a long, thin link: streaming (fragments, overlapped) against blocking DiLoCo.

    python -m bench.overlap --out bench/results/overlap.json [--rate-mbit 20] [--window 100] [--steps 400]

Two islands, each behind a relay with the `intercontinental` profile (75 ms one
way) and a rate cap per direction, low enough that averaging the whole model at
once takes a visible share of a window. Run twice on the same data:
- streaming: `--fragments 4 --overlap TAU` (one fragment at a time, applied TAU steps after its start);
- blocking: `--fragments 1 --overlap 0` (the whole model at once, training waits for it);
side by side.

Utilization is the time spent in forward, backward and optimizer steps over the
wall time, from the end of step H (the first round) to the end of the last
step, as the event log shows it (`step_seconds` and `t`). Checkpoints are
switched off so that only the synchronisation competes with compute.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from tests.procs import Nodes

from .common import plot, table, write

PROFILE = "intercontinental"


def utilization(events: list[dict], since_step: int) -> dict:
    steps = [e for e in events if e["event"] == "step"]
    first = next(e for e in steps if e["step"] == since_step)
    after = [e for e in steps if e["step"] > since_step]
    wall = after[-1]["t"] - first["t"]
    compute = sum(e["step_seconds"] for e in after)
    syncs = [e for e in events if e["event"] == "sync"]
    return {
        "utilization": round(compute / wall, 4), "wall_seconds": round(wall, 3), "compute_seconds": round(compute, 3),
        "step_seconds_median": round(sorted(e["step_seconds"] for e in after)[len(after) // 2], 4),
        "syncs": len(syncs), "syncs_ok": sum(s["outcome"] == "ok" for s in syncs),
        "round_seconds": [s["seconds"] for s in syncs],
        # how long the loop stood still waiting for rounds to finish: wall time not spent in steps
        "idle_seconds": round(wall - compute, 3),
    }


def run(root: Path, name: str, schedule: list[str], args: argparse.Namespace) -> dict:
    nodes = Nodes(root / name)
    relay = ["--profile", PROFILE, "--rate-mbit", str(args.rate_mbit)]
    common = [*schedule, "--steps", str(args.steps), "--run-id", f"bench-overlap-{name}", "--wait-islands", "2",
              "--checkpoint-every", str(10 * args.steps), "--batch-size", str(args.batch_size)]
    try:
        a, join = nodes.first("a", common, relay)
        b = nodes.start("b", [*common, "--join", join], relay)
        nodes.finish([a, b], args.timeout_s)
        per_island = [utilization(n.poll_events(), args.window) for n in (a, b)]
    finally:
        nodes.stop()
    return {
        "utilization": round(min(u["utilization"] for u in per_island), 4),
        "islands": per_island,
        "link_bytes": nodes.link_bytes(["a", "b"]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="JSON file for the figures (a PNG is written next to it)")
    p.add_argument("--rate-mbit", type=float, default=20.0, help="rate cap per direction of each island's link")
    p.add_argument("--window", type=int, default=100)
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--overlap", type=int, default=20, help="streaming's TAU (below window/fragments)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--timeout-s", type=float, default=240.0, help="per run")
    p.add_argument("--run-dir", default="bench-runs/overlap")
    args = p.parse_args()
    root = Path(args.run_dir)
    shutil.rmtree(root, ignore_errors=True)
    window = ["--window", str(args.window)]
    runs = {
        "streaming": run(root, "streaming", [*window, "--fragments", str(args.fragments), "--overlap", str(args.overlap)], args),
        "blocking": run(root, "blocking", [*window, "--fragments", "1", "--overlap", "0"], args),
    }
    rows = []
    for name, r in runs.items():
        u = r["islands"][0]
        rounds = sorted(s for i in r["islands"] for s in i["round_seconds"])
        rows.append([name, f"{r['utilization']:.3f}", f"{u['wall_seconds']:.1f}", f"{u['idle_seconds']:.1f}", f"{u['step_seconds_median'] * 1e3:.0f} ms",
                     f"{rounds[len(rounds) // 2]:.2f}" if rounds else "-", f"{u['syncs_ok']}/{u['syncs']}", f"{r['link_bytes'] / 1e6:.1f}"])
    print(table(rows, ["run", "utilization", "wall s (island a)", "idle s", "step", "round s (median)", "ok/syncs", "MB over the links"]))
    wan = {"profile": PROFILE, "one_way_delay_ms": 75, "rate_mbit_per_direction": args.rate_mbit}
    write(args.out, {
        "utilization_streaming": runs["streaming"]["utilization"], "utilization_blocking": runs["blocking"]["utilization"],
        "wan_profile": wan, "runs": runs,
        "config": {"window": args.window, "fragments": args.fragments, "overlap": args.overlap, "steps": args.steps,
                   "batch_size": args.batch_size},
    })
    if args.out:
        plot(Path(args.out).with_suffix(".png"), f"Compute utilization, 2 islands, {PROFILE} link at {args.rate_mbit:g} Mbit/s",
             {name: [(0, r["utilization"])] for name, r in runs.items()},
             xlabel="", ylabel="compute time / wall time", bars=True, hline=(0.95, "target 0.95"))


if __name__ == "__main__":
    main()
