"""Islands of several ranks next to single-process ones: throughput, agreement, balance.

    python -m bench.ranks --out bench/results/ranks.json

Real `islands-node` processes on 127.0.0.1 (tests/procs.py):
1. one island alone, `--nproc 1`, `--nproc 2` (DDP over gloo) and `--nproc 2 --parallel fsdp`,
   80 steps: step time, tokens/s;
2. memory: one island of 2 ranks, model `small` (67M parameters), DDP against FSDP, 30 steps with
   rounds at 20 and 25: the model's bytes, a rank's share, the most bytes a round gathered at once,
   and each process's peak resident memory (VmHWM);
3. a mixed swarm: A with `--nproc 2` (DDP, then FSDP), B a single process (`--window 20 --fragments 4
   --steps 100 --batch-size 4`): syncs ok, agreement of the final agreed models, A's rank spread;
4. A at batch 2 per rank with `--balance`, B at batch 64: what balance chose, and the islands' round times.

    python -m bench.ranks --stress 50 [--jobs 2] [--hog 1] --out bench/results/ranks-stress.json

runs only the sharded mixed swarm (A `--nproc 2 --parallel fsdp`, B a single process), N times, J
of them at once (`--jobs`), optionally next to K busy processes (`--hog`), and counts the runs that
failed and how:
each island's exit status, each follower rank's, and the first lines of a crash's Python stacks
from the rank's log.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from islands.node.workers import rank_log_path
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


class PeakMemory:
    """The peak resident memory (VmHWM, MB) of a process and its children, polled until stopped."""

    def __init__(self, pid: int):
        self.pid, self.peak_mb, self._stop = pid, {}, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.5):
            children = subprocess.run(["pgrep", "-P", str(self.pid)], capture_output=True, text=True).stdout.split()
            for pid in [self.pid, *map(int, children)]:
                try:  # the ranks only (the node's other children are hivemind's DHT and p2pd)
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
                    if pid != self.pid and b"RANK" not in env:
                        continue
                    with open(f"/proc/{pid}/status") as f:
                        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
                    name = f"rank{env.get(b'RANK', b'0').decode()}"
                    self.peak_mb[name] = max(self.peak_mb.get(name, 0), round(hwm / 1024))
                except (OSError, StopIteration, ValueError):
                    pass

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return self.peak_mb


def alone(root: Path, nproc: int, parallel: str = "ddp", model: str = "tiny", steps: int = 80) -> dict:
    nodes = Nodes(root)
    try:
        a = nodes.start("a", [*SCHEDULE, "--steps", str(steps), "--nproc", str(nproc), "--parallel", parallel,
                              "--model", model, "--run-id", f"alone{nproc}"])
        memory = PeakMemory(a.proc.pid)
        nodes.finish([a], 600)
        out = {"nproc": nproc, "parallel": parallel, "model": model, **_steps(a, skip=min(20, steps // 3)),
               "wall_seconds": a.of("summary")[0]["wall_seconds"], "peak_rss_mb": memory.stop()}
        for r in a.of("ranks"):
            out.update({k: r[k] for k in ("model_bytes", "rank_bytes", "fragment_bytes", "gather_peak_bytes")})
        return out
    finally:
        nodes.stop()


def mixed(root: Path, a_batch: int, b_batch: int, balance: bool, parallel: str = "ddp") -> dict:
    nodes = Nodes(root)
    try:
        common = [*SCHEDULE, "--steps", "100", "--wait-islands", "2", "--run-id", "mixed-ranks"]
        a, join = nodes.first("a", [*common, "--nproc", "2", "--parallel", parallel, "--batch-size", str(a_batch),
                                    *(["--balance"] if balance else [])])
        b = nodes.start("b", [*common, "--batch-size", str(b_batch), "--join", join])
        nodes.finish([a, b], 400)
        out: dict = {"a_batch": a_batch, "b_batch": b_batch, "balance": balance, "parallel": parallel}
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


def stress_once(root: Path, parallel: str = "fsdp") -> dict:
    """One run of the sharded mixed swarm (tests/test_ranks.py's): how each island and rank ended."""
    nodes = Nodes(root)
    started = time.monotonic()
    try:
        common = [*SCHEDULE, "--steps", "100", "--wait-islands", "2", "--run-id", f"stress-{root.name}", "--batch-size", "4"]
        a, join = nodes.first("a", [*common, "--nproc", "2", "--parallel", parallel])
        b = nodes.start("b", [*common, "--join", join])
        codes = {n.run_dir.name: n.wait_exit(400) for n in (a, b)}
        out = {"seconds": round(time.monotonic() - started, 1), "exit": codes, "ok": not any(codes.values())}
        stopped = a.of("stopped")
        out["a_stopped"] = stopped[0]["reason"][:200] if stopped else None
        rank_log = rank_log_path(root / "a", 1).read_text(errors="replace")
        crash = rank_log.find("Fatal Python error")
        out["rank1_crash"] = rank_log[crash:crash + 1500] if crash >= 0 else None
        out["rank_lines"] = [line for line in a.stderr().splitlines() if "exited with" in line]
        out["ok"] = out["ok"] and crash < 0
        return out
    except (AssertionError, RuntimeError) as e:
        return {"seconds": round(time.monotonic() - started, 1), "ok": False, "error": str(e)[-1500:]}
    finally:
        nodes.stop()


def hogs(count: int) -> list[subprocess.Popen]:
    """Busy processes that compete for the cores (a loaded machine)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def stress(args, root: Path) -> None:
    """--stress N: the sharded mixed swarm N times, `--jobs` of them at once, next to `--hog` busy processes."""
    busy = hogs(args.hog)
    runs: dict[int, dict] = {}
    lock = threading.Lock()

    def one(i: int) -> None:
        r = stress_once(root / f"run{i}")
        with lock:
            runs[i] = r
            print(f"run {i + 1} ({len(runs)}/{args.stress} done): {'ok' if r['ok'] else 'FAILED'} in {r['seconds']} s"
                  + ("" if r["ok"] else f": {r.get('a_stopped') or r.get('error', '')[:300]}"), flush=True)
            for line in r.get("rank_lines", []):
                print(f"  {line}", flush=True)
            if r.get("rank1_crash"):
                print(r["rank1_crash"][:600], flush=True)
        if r["ok"]:
            shutil.rmtree(root / f"run{i}", ignore_errors=True)  # keep the failed runs' folders only

    started = time.monotonic()
    try:
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(one, range(args.stress)))
    finally:
        for p in busy:
            p.kill()
            p.wait()
    failed = sorted(i for i, r in runs.items() if not r["ok"])
    print(table([[str(len(runs)), str(len(failed)), str(args.jobs), str(args.hog),
                  f"{statistics.median(r['seconds'] for r in runs.values()):.0f} s", f"{time.monotonic() - started:.0f} s"]],
                ["runs", "failed", "at once", "busy processes", "run (median)", "all"]))
    write(args.out, {"stress": {"runs": len(runs), "failed": len(failed), "failed_runs": failed, "jobs": args.jobs, "hog": args.hog,
                                "seconds": round(time.monotonic() - started), "details": [runs[i] for i in sorted(runs)]}})


def main() -> None:
    def extra(p) -> None:
        p.add_argument("--stress", type=int, default=0, metavar="N", help="only the sharded mixed swarm, N times in a row")
        p.add_argument("--jobs", type=int, default=1, metavar="J", help="with --stress: J swarms at once (a loaded machine)")
        p.add_argument("--hog", type=int, default=0, metavar="K", help="with --stress: K busy processes alongside")

    args, root = parse(__doc__, "bench-runs/ranks", extra)
    if args.stress:
        return stress(args, root)
    solo = [alone(root / "alone1", 1), alone(root / "alone2", 2), alone(root / "alone2-fsdp", 2, "fsdp")]
    print(table(
        [[f"{r['nproc']} {r['parallel']}", f"{r['step_seconds'] * 1000:.1f} ms", str(r["tokens_per_step"]), f"{r['tokens_per_s'] / 1000:.1f}k"] for r in solo],
        ["ranks", "step (median)", "tokens/step", "tokens/s"],
    ))
    memory = [alone(root / f"memory-{p}", 2, p, "small", 30) for p in ("ddp", "fsdp")]
    print(table(
        [[r["parallel"], f"{r['model_bytes'] / 1e6:.1f} MB", f"{r['fragment_bytes'] / 1e6:.1f} MB", f"{r['rank_bytes'] / 1e6:.1f} MB",
          "-" if r["gather_peak_bytes"] is None else f"{r['gather_peak_bytes'] / 1e6:.2f} MB",
          ", ".join(f"{k} {v} MB" for k, v in sorted(r["peak_rss_mb"].items())), f"{r['step_seconds']:.2f} s"] for r in memory],
        ["small, 2 ranks", "model", "largest fragment", "per rank", "gather peak", "peak RSS", "step"],
    ))
    swarms = [mixed(root / "mixed", 4, 4, False), mixed(root / "mixed-fsdp", 4, 4, False, "fsdp"), mixed(root / "balance", 2, 64, True)]
    rows = []
    for s in swarms:
        for name in "ab":
            r = s[name]
            rows.append([
                f"{'A (2 ranks, ' + s['parallel'] + ')' if name == 'a' else 'B (1 process)'} b{s[name + '_batch']}{' --balance' if name == 'a' and s['balance'] else ''}",
                f"{r['step_seconds'] * 1000:.0f} ms", f"{r['tokens_per_s'] / 1000:.1f}k", r["ok_group_2"], f"{r['round_seconds_median']}",
                f"{r['eval_loss']}", f"{s['global_max_diff']:.1e}",
                ", ".join(f"{b['accum_from']}->{b['accum']}@{b['step']}" for b in r.get("balance", [])) or "-",
            ])
    print(table(rows, ["island", "step", "tokens/s", "ok (group 2)", "round s", "eval loss", "global diff", "balance"]))
    write(args.out, {"alone": solo, "memory": memory, "mixed": swarms})


if __name__ == "__main__":
    main()
