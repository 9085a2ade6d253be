"""Islands of several ranks next to single-process ones: throughput, agreement, balance.

    python -m bench.ranks --out bench/results/ranks.json

Real `islands-node` processes on 127.0.0.1 (tests/procs.py):
1. one island alone, `--nproc 1` and `--nproc 2` (DDP over gloo), 80 steps: step time, tokens/s;
2. a mixed swarm: A with `--nproc 2`, B a single process (`--window 20 --fragments 4
   --steps 100 --batch-size 4`): syncs ok, agreement of the final agreed models, A's rank spread;
3. A at batch 2 per rank with `--balance`, B at batch 64: what balance chose, and the islands' round times.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from safetensors.torch import load_file

from tests.procs import Nodes

from .common import parse, table, write

SCHEDULE = ["--window", "20", "--fragments", "4", "--listen", "/ip4/127.0.0.1/tcp/0"]


def _steps(node, skip: int = 20) -> dict:
    steps = node.of("step")[skip:]
    step_s = statistics.median(e["step_seconds"] for e in steps)
    return {"step_seconds": round(step_s, 4), "tokens_per_step": steps[-1]["tokens"], "tokens_per_s": round(steps[-1]["tokens"] / step_s)}


def _diff(a: Path, b: Path) -> float:
    ta, tb = load_file(a), load_file(b)
    return max((ta[k] - tb[k]).abs().max().item() for k in ta)


def alone(root: Path, nproc: int) -> dict:
    nodes = Nodes(root)
    try:
        a = nodes.start("a", [*SCHEDULE, "--steps", "80", "--nproc", str(nproc), "--run-id", f"alone{nproc}"])
        nodes.finish([a], 300)
        return {"nproc": nproc, **_steps(a), "wall_seconds": a.of("summary")[0]["wall_seconds"]}
    finally:
        nodes.stop()


def mixed(root: Path, a_batch: int, b_batch: int, balance: bool) -> dict:
    nodes = Nodes(root)
    try:
        common = [*SCHEDULE, "--steps", "100", "--wait-islands", "2", "--run-id", "mixed-ranks"]
        a, join = nodes.first("a", [*common, "--nproc", "2", "--batch-size", str(a_batch), *(["--balance"] if balance else [])])
        b = nodes.start("b", [*common, "--batch-size", str(b_batch), "--join", join])
        nodes.finish([a, b], 400)
        out: dict = {"a_batch": a_batch, "b_batch": b_batch, "balance": balance}
        for name, node in (("a", a), ("b", b)):
            syncs = node.of("sync")
            out[name] = {
                **_steps(node),
                "ok_group_2": f"{sum(s['outcome'] == 'ok' and s['group_size'] == 2 for s in syncs)}/{len(syncs)}",
                "round_seconds_median": round(statistics.median(s["seconds"] for s in syncs), 3),
                "eval_loss": round(node.of("summary")[0]["eval_loss"], 4),
                "wall_seconds": node.of("summary")[0]["wall_seconds"],
            }
        out["a"]["param_spread"] = a.of("ranks")[0]["param_spread"]
        out["a"]["balance"] = [{k: e[k] for k in ("step", "accum_from", "accum", "micro_seconds", "swarm_step_seconds")} for e in a.of("balance")]
        out["global_max_diff"] = _diff(*(root / n / "checkpoint" / "global.safetensors" for n in "ab"))
        return out
    finally:
        nodes.stop()


def main() -> None:
    args, root = parse(__doc__, "bench-runs/ranks")
    solo = [alone(root / f"alone{n}", n) for n in (1, 2)]
    print(table(
        [[str(r["nproc"]), f"{r['step_seconds'] * 1000:.1f} ms", str(r["tokens_per_step"]), f"{r['tokens_per_s'] / 1000:.1f}k"] for r in solo],
        ["ranks", "step (median)", "tokens/step", "tokens/s"],
    ))
    swarms = [mixed(root / "mixed", 4, 4, False), mixed(root / "balance", 2, 64, True)]
    rows = []
    for s in swarms:
        for name in "ab":
            r = s[name]
            rows.append([
                f"{'A (2 ranks)' if name == 'a' else 'B (1 process)'} b{s[name + '_batch']}{' --balance' if name == 'a' and s['balance'] else ''}",
                f"{r['step_seconds'] * 1000:.0f} ms", f"{r['tokens_per_s'] / 1000:.1f}k", r["ok_group_2"], f"{r['round_seconds_median']}",
                f"{r['eval_loss']}", f"{s['global_max_diff']:.1e}",
                ", ".join(f"{b['accum_from']}->{b['accum']}@{b['step']}" for b in r.get("balance", [])) or "-",
            ])
    print(table(rows, ["island", "step", "tokens/s", "ok (group 2)", "round s", "eval loss", "global diff", "balance"]))
    write(args.out, {"alone": solo, "mixed": swarms})


if __name__ == "__main__":
    main()
