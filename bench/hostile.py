"""Two honest islands with and without a hostile peer: what the poisoner costs them.

    python -m bench.hostile --out bench/results/hostile.json

Real `islands-node` processes on 127.0.0.1 with a swarm key (tests/procs.py, tests/hostile.py):
A and B (window 20, 4 fragments, 200 steps, batch 8) alone; then with a third peer that
holds the key and sends NaN and huge pseudo-gradients (`mixed`); then with one that
contributes honestly but spoils the part it reduces (`reducer`). Reports each honest
island's eval loss, its syncs by outcome, when the peer was banned, and the distribution
of |averaged update| / |own update| in the honest run (the evidence for NORM_RATIO).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from islands.node.cli import main as node_main
from islands.protocols.validation import NORM_RATIO

from tests.procs import Nodes

from .common import parse, table, write

SCHEDULE = ["--window", "20", "--fragments", "4", "--listen", "/ip4/127.0.0.1/tcp/0", "--batch-size", "8"]


def _kind(reason: str) -> str:
    """A rejection reason without its figures and tensor names."""
    kinds = ("non-finite", "parts reduced", "norm", "shape", "dtype", "without this swarm's key", "banned")
    return "+".join(k for k in kinds if k in reason) or reason[:40]


def run(root: Path, hostile: str | None, steps: int) -> dict:
    key = root / "swarm.key"
    root.mkdir(parents=True, exist_ok=True)
    node_main(["keygen", str(key)])
    nodes = Nodes(root)
    try:
        common = [*SCHEDULE, "--steps", str(steps), "--run-id", "bench-hostile", "--swarm-key", str(key),
                  "--wait-islands", "3" if hostile else "2"]
        a, join = nodes.first("a", common)
        b = nodes.start("b", [*common, "--join", join])
        if hostile:
            nodes.start("p", [*common, "--join", join], command=[sys.executable, "-m", "tests.hostile", hostile])
        out: dict = {"hostile": hostile}
        nodes.finish([a, b], 600)
        for name, node in (("a", a), ("b", b)):
            syncs = node.of("sync")
            summary = node.of("summary")[0]
            banned = node.of("banned")
            out[name] = {
                "eval_loss": round(summary["eval_loss"], 4),
                "wall_seconds": summary["wall_seconds"],
                "outcomes": {o: sum(s["outcome"] == o for s in syncs) for o in sorted({s["outcome"] for s in syncs})},
                "banned_at_sync": next((i for i, s in enumerate(syncs) if s["t"] > banned[0]["t"]), None) if banned else None,
                "norm_ratios": [s["norm_ratio"] for s in syncs if s["outcome"] == "ok" and s.get("norm_ratio") is not None],
                "reasons": sorted({_kind(s["reason"]) for s in syncs if s.get("reason")}),
            }
        return out
    finally:
        nodes.stop()


def main() -> None:
    args, root = parse(__doc__, "bench-runs/hostile", lambda p: p.add_argument("--steps", type=int, default=200))
    runs = [run(root / (h or "honest"), h, args.steps) for h in (None, "mixed", "reducer")]
    base = statistics.mean(r[n]["eval_loss"] for r in runs[:1] for n in "ab")
    rows = []
    for r in runs:
        loss = statistics.mean(r[n]["eval_loss"] for n in "ab")
        rows.append([
            r["hostile"] or "none", f"{r['a']['eval_loss']:.4f} / {r['b']['eval_loss']:.4f}", f"{100 * (loss / base - 1):+.2f}%",
            ", ".join(f"{k} {v}" for k, v in r["a"]["outcomes"].items()), str(r["a"]["banned_at_sync"]),
            "; ".join(r["a"]["reasons"]) or "-",
        ])
    print(table(rows, ["hostile peer", "eval loss A / B", "vs none", "A's syncs", "banned after sync #", "reasons (A)"]))
    ratios = sorted(x for n in "ab" for x in runs[0][n]["norm_ratios"])
    spread = {
        "n": len(ratios), "min": ratios[0], "median": statistics.median(ratios), "max": ratios[-1],
        "p95": ratios[int(0.95 * (len(ratios) - 1))], "bound": NORM_RATIO,
    }
    print(f"|avg update| / |own update| in the honest run: {spread}")
    write(args.out, {"steps": args.steps, "runs": runs, "honest_norm_ratio": spread})


if __name__ == "__main__":
    main()
