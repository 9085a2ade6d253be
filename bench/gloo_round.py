"""The existing engine, as torchft uses it: torch.distributed gloo with a fresh group per round over a TCPStore.

    python -m bench.gloo_round --out bench/results/gloo-round.json [--rounds 5] [--megabytes 100]

Three measurements, each with 2 processes on 127.0.0.1 (3 for the kill):

- loopback: per round, a new `ProcessGroupGloo` over a `PrefixStore` of one long-lived
  `TCPStore` (torchft's quorum pattern), then one `allreduce` of an fp32 tensor; the set-up and
  the all-reduce are timed apart (the slowest rank's, median over rounds).
- set-up across a 150 ms link: the same fresh group with the TCPStore reached through the link
  emulator (`islands-node relay`, profile intercontinental): how many round trips a round's
  set-up costs before any data moves. Gloo's own pair connections dial the address each rank
  listens on, which the relay cannot stand in for (and the kernel has no netem), so the data
  transfer itself is not measured across the link.
- a member SIGKILLed mid-round (3 members, 100 MB): how long the survivors take to see it, what
  they see, and whether their input tensor is still their own (gloo reduces in place).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import multiprocessing as mp
import os
import signal
import statistics
import threading
import time

from .common import table, write

TIMEOUT_S = 30.0


def _group(store, prefix: str, rank: int, world: int):
    import torch.distributed as dist

    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world, datetime.timedelta(seconds=TIMEOUT_S))


def _store(host: str, port: int, rank: int, world: int, master: bool):
    import torch.distributed as dist

    return dist.TCPStore(host, port, world, master, timeout=datetime.timedelta(seconds=TIMEOUT_S), wait_for_workers=False)


def _peer(rank: int, world: int, port: int, store_port: int, numel: int, rounds: int, barrier, results) -> None:
    """One member: `rounds` rounds, each a fresh group then an all-reduce. The store's master listens on
    `port`; the members reach it at `store_port` (the same, or a relay in front of it)."""
    import torch

    torch.set_num_threads(1)
    master = _store("127.0.0.1", port, 0, world, True) if rank == 0 else None
    barrier.wait()
    store = _store("127.0.0.1", store_port, rank, world, False)
    x = torch.full((numel,), float(rank + 1))
    for r in range(rounds):
        barrier.wait()
        start = time.perf_counter()
        pg = _group(store, f"round{r}/", rank, world)
        ready = time.perf_counter()
        pg.allreduce([x]).wait()
        done = time.perf_counter()
        ok = bool((x[:1000] == sum(range(1, world + 1))).all())
        results.put({"rank": rank, "round": r, "setup_s": ready - start, "allreduce_s": done - ready, "ok": ok})
        x.fill_(float(rank + 1))
        del pg
    barrier.wait()
    del master


def _free_port() -> int:
    from islands.node.workers import free_port

    return free_port()


def _run_rounds(world: int, numel: int, rounds: int, through_relay: bool) -> list[dict]:
    ctx = mp.get_context("spawn")
    port = _free_port()
    store_port, relay_stop = port, None
    if through_relay:
        store_port, relay_stop = _start_relay(port)
    barrier, results = ctx.Barrier(world), ctx.Queue()
    procs = [ctx.Process(target=_peer, args=(k, world, port, store_port, numel, rounds, barrier, results)) for k in range(world)]
    for p in procs:
        p.start()
    rows = [results.get(timeout=300) for _ in range(world * rounds)]
    for p in procs:
        p.join(timeout=60)
    if relay_stop is not None:
        relay_stop()
    return rows


def _start_relay(target_port: int):
    """The link emulator (150 ms round trip, 100 Mbit/s) in front of the store, in a thread."""
    from islands.node.relay import PROFILES, Relay

    loop = asyncio.new_event_loop()
    relay = Relay(("127.0.0.1", target_port), PROFILES["intercontinental"])
    port = loop.run_until_complete(relay.start("127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(relay.close(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)

    return port, stop


def _killed_peer(rank: int, world: int, port: int, numel: int, barrier, results) -> None:
    import torch

    torch.set_num_threads(1)
    master = _store("127.0.0.1", port, 0, world, True) if rank == 0 else None
    store = _store("127.0.0.1", port, rank, world, False)
    pg = _group(store, "round0/", rank, world)
    x = torch.full((numel,), float(rank + 1))
    before = x.clone()
    results.put({"rank": rank, "pid": os.getpid(), "event": "ready"})
    barrier.wait()
    start = time.perf_counter()
    try:
        pg.allreduce([x]).wait()
        outcome, error = "ok", None
    except Exception as e:  # noqa: BLE001 - what the survivor sees is the measurement
        outcome, error = "error", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    results.put({
        "rank": rank, "event": "done", "outcome": outcome, "error": error, "seconds": time.perf_counter() - start,
        "input_changed": bool((x != before).any()), "changed_fraction": float((x != before).float().mean()),
    })
    del master


def _run_kill(numel: int, kill_after_s: float) -> list[dict]:
    ctx = mp.get_context("spawn")
    world, port = 3, _free_port()
    barrier, results = ctx.Barrier(world + 1), ctx.Queue()
    procs = [ctx.Process(target=_killed_peer, args=(k, world, port, numel, barrier, results)) for k in range(world)]
    for p in procs:
        p.start()
    pids = {}
    for _ in range(world):
        row = results.get(timeout=120)
        pids[row["rank"]] = row["pid"]
    barrier.wait()
    time.sleep(kill_after_s)
    os.kill(pids[2], signal.SIGKILL)
    killed_at = time.perf_counter()
    rows = []
    for _ in range(world - 1):
        row = results.get(timeout=TIMEOUT_S + 30)
        row["seen_after_kill_s"] = time.perf_counter() - killed_at
        rows.append(row)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--megabytes", type=float, default=100.0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--kill-after-s", type=float, default=0.03, help="SIGKILL the third member this long into the all-reduce")
    args = p.parse_args()
    numel = int(args.megabytes * 1e6 / 4)

    def summary(rows: list[dict]) -> dict:
        by_round: dict[int, list[dict]] = {}
        for row in rows:
            by_round.setdefault(row["round"], []).append(row)
        setup = [max(r["setup_s"] for r in rs) for rs in by_round.values()]
        reduce = [max(r["allreduce_s"] for r in rs) for rs in by_round.values()]
        return {"setup_s_median": statistics.median(setup), "allreduce_s_median": statistics.median(reduce),
                "round_s_median": statistics.median(s + a for s, a in zip(setup, reduce, strict=True)),
                "rounds": len(by_round), "all_ok": all(r["ok"] for r in rows)}

    loopback = summary(_run_rounds(2, numel, args.rounds, through_relay=False))
    small = summary(_run_rounds(2, 1024, args.rounds, through_relay=True))  # set-up dominated: 4 KB of data
    kill = _run_kill(numel, args.kill_after_s)
    rtt = 0.150
    print(table(
        [["loopback, fresh group + all-reduce", f"{args.megabytes:g} MB", f"{loopback['setup_s_median']:.3f}",
          f"{loopback['allreduce_s_median']:.3f}", f"{loopback['round_s_median']:.3f}"],
         ["store across 150 ms link", "4 KB", f"{small['setup_s_median']:.3f}", f"{small['allreduce_s_median']:.3f}",
          f"{small['round_s_median']:.3f} (= {small['setup_s_median'] / rtt:.1f} round trips of set-up)"]],
        ["test", "size", "set-up s", "all-reduce s", "round s"],
    ))
    for row in kill:
        print(f"killed member: rank {row['rank']} saw {row['outcome']} after {row['seen_after_kill_s']:.3f}s "
              f"({row['error']}); input changed: {row['input_changed']} ({row['changed_fraction']:.1%} of values)")
    write(args.out, {
        "megabytes": args.megabytes, "loopback": loopback, "relay_setup": small, "relay_rtt_s": rtt,
        "setup_round_trips": small["setup_s_median"] / rtt, "kill": kill,
    })


if __name__ == "__main__":
    main()
