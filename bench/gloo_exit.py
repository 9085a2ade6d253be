"""Why a follower rank ends with os._exit: gloo's worker thread against interpreter finalization.

    python -m bench.gloo_exit --runs 40 --jobs 2 --out bench/results/gloo-exit.json

Two processes form a gloo group of 2 (torch.distributed, no FSDP, no hivemind), exchange 200
small broadcasts as the rank protocol's control messages do (a fresh tensor each, dropped once the
call returns), and exit, `--runs` times for each way of exiting, `--jobs` pairs at once:

- `finalize`: a normal interpreter exit, without destroying the group first;
- `destroy`: `destroy_process_group()`, then a normal exit (what a follower rank did);
- `os_exit`: `destroy_process_group()`, then `os._exit` (what a follower rank does now).

It counts the runs in which a process did not exit 0 (an abort is status 134 here) and what it
printed. It also counts, over 3000 broadcasts, how often gloo still held the tensor when the call
returned (`Tensor._use_count() > 1`): then the worker thread drops the last reference, and freeing
the tensor's Python object takes the GIL.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import os
import subprocess
import sys

from islands.node.workers import free_port

from .common import parse, table, write

MODES = ("finalize", "destroy", "os_exit")


def child(rank: int, port: int, mode: str, count: int) -> int:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    held = 0
    for i in range(count):
        t = torch.tensor([i, 1, 2, 3], dtype=torch.int64)
        dist.broadcast(t, src=0)
        held += t._use_count() > 1
        del t
    print(f"held {held} of {count}", flush=True)
    if mode != "finalize":
        dist.destroy_process_group()
    if mode == "os_exit":
        sys.stdout.flush()
        os._exit(0)
    return 0


def pair(mode: str, count: int = 200) -> dict:
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, "-m", "bench.gloo_exit", "--child", str(r), str(port), mode, str(count)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    out = [p.communicate(timeout=300) for p in procs]
    codes = [p.returncode for p in procs]
    held = [int(o.split()[1]) for o, _ in out if o.startswith("held")]
    return {"codes": codes, "held": held, "count": count, "stderr": [e.strip()[:300] for _, e in out if e.strip()]}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        rank, port, mode, count = sys.argv[2:6]
        sys.exit(child(int(rank), int(port), mode, int(count)))

    def extra(p) -> None:
        p.add_argument("--runs", type=int, default=40, help="pairs of processes for each way of exiting")
        p.add_argument("--jobs", type=int, default=2, help="pairs at once")

    args, _ = parse(__doc__, "bench-runs/gloo-exit", extra)
    held = pair("os_exit", 3000)
    results = {}
    for mode in MODES:
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            runs = list(pool.map(pair, [mode] * args.runs))
        bad = [r for r in runs if any(r["codes"])]
        results[mode] = {"runs": len(runs), "bad": len(bad), "codes": [r["codes"] for r in bad], "stderr": [r["stderr"] for r in bad][:5]}
        print(f"{mode}: {len(bad)} of {len(runs)} runs ended badly {[r['codes'] for r in bad]}", flush=True)
    print(table([[m, f"{r['bad']} of {r['runs']}", ", ".join(sorted({s.splitlines()[0] for b in r["stderr"] for s in b})) or "-"]
                 for m, r in results.items()], ["exit", "runs that ended badly", "what they printed"]))
    print(f"gloo still held the tensor when the broadcast returned: {held['held']} of {held['count']} (rank 0, rank 1)")
    write(args.out, {"held_after_return": held["held"], "broadcasts": held["count"], "exits": results})


if __name__ == "__main__":
    main()
