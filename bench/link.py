"""A round over a long fat link: the own protocol's pool of connections against one connection.

    python -m bench.link --out bench/results/link.json [--pools 1 4] [--megabytes 100] [--rounds 4]

Two islands (the data plane of node/net/transport.py, each in its own process, as bench.allreduce's
`direct` peers; a swarm key) average one fp32 tensor, each behind an `islands-node relay` with
75 ms one way (150 ms round trip), a rate cap per direction shared by every connection of the link
(a site's uplink), and a TCP window per connection (`--window-kb`: at most that many bytes in flight
on a connection until their acknowledgement is back, one round trip later; so one connection moves
at most window / round trip, as a real one does). The same run does it with each pool size.

Figures, per pool size: the median round time over the rounds after the first (the pool is dialled
in the first one), the goodput (a part's bytes over the round time: each island receives one part)
and its share of the cap.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import time

from .common import parse, table, write

KEY = b"bench-swarm-key-0123456789abcdef"


def _peer(rank: int, pool: int, megabytes: float, rounds: int, ports, members_box, barrier, results) -> None:
    import torch
    from islands.node.net.transport import DataPlane, Identity
    from islands.protocols.parts import encode_part, reduce_parts

    torch.set_num_threads(1)

    async def run() -> None:
        plane = DataPlane(Identity.generate(), KEY, pool=pool)
        ports.put((rank, plane.me.peer_id, await plane.start()))
        members = await asyncio.to_thread(members_box.get, True, 60)
        x = torch.randn(int(megabytes * 1e6 / 4), generator=torch.Generator().manual_seed(rank))
        try:
            for r in range(rounds):
                await asyncio.to_thread(barrier.wait, 120)
                started = time.perf_counter()
                outcome, parts = await plane.run_round(0, r, members, encode_part(x, 1.0), attempt_s=120.0)
                if parts:
                    reduce_parts(sorted(parts), parts)
                results.put({"pool": pool, "rank": rank, "round": r, "ok": type(outcome).__name__ == "Commit",
                             "seconds": time.perf_counter() - started, "received": sum(len(v) for p, v in parts.items() if p != plane.me.peer_id)})
            await asyncio.to_thread(barrier.wait, 120)
        finally:
            await plane.close()

    asyncio.run(run())


def _run(root, pool: int, megabytes: float, rounds: int, relay: list[str]) -> list[dict]:
    from tests.procs import RelayProcess

    ctx = mp.get_context("spawn")
    ports, results, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(2)
    boxes = [ctx.Queue(), ctx.Queue()]
    procs = [ctx.Process(target=_peer, args=(k, pool, megabytes, rounds, ports, boxes[k], barrier, results)) for k in range(2)]
    relays = []
    for p in procs:
        p.start()
    try:
        members = {}
        for _ in procs:
            rank, peer, port = ports.get(timeout=60)
            link = RelayProcess(port, root / f"pool{pool}-{rank}", relay)
            relays.append(link)
            members[peer] = ("127.0.0.1", link.port)
        for box in boxes:
            box.put(members)
        rows = [results.get(timeout=300) for _ in range(2 * rounds)]
        for p in procs:
            p.join(60)
        return rows
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for link in relays:
            link.stop()


def main() -> None:
    def extra(p):
        p.add_argument("--pools", type=int, nargs="+", default=[1, 4], help="connections per peer and direction to compare")
        p.add_argument("--megabytes", type=float, default=100.0)
        p.add_argument("--rounds", type=int, default=4, help="rounds per pool size (the first dials the pool)")
        p.add_argument("--rate-mbit", type=float, default=400.0, help="the link's cap per direction, shared by its connections")
        p.add_argument("--window-kb", type=int, default=4096, help="a connection's TCP window (bytes in flight)")
        p.add_argument("--delay-ms", type=float, default=75.0, help="one-way delay")

    args, root = parse(__doc__, "/tmp/islands-bench-link", extra)
    relay = ["--delay-ms", str(args.delay_ms), "--rate-mbit", str(args.rate_mbit), "--window-kb", str(args.window_kb)]
    lines = []
    for pool in args.pools:
        started = time.monotonic()
        rows = _run(root, pool, args.megabytes, args.rounds, relay)
        by_round = {}
        for r in rows:
            by_round.setdefault(r["round"], []).append(r)
        assert all(r["ok"] for r in rows), rows
        slowest = {k: max(x["seconds"] for x in v) for k, v in by_round.items()}
        warm = statistics.median(v for k, v in slowest.items() if k > 0)
        received = rows[0]["received"]
        mbit = received * 8 / warm / 1e6
        lines.append({"pool": pool, "first_round_seconds": round(slowest[0], 3), "round_seconds_median": round(warm, 3),
                      "goodput_mbit": round(mbit, 1), "share_of_cap": round(mbit / args.rate_mbit, 3)})
        print(f"pool {pool}: {time.monotonic() - started:.1f}s", flush=True)
    print(table([[str(x["pool"]), f"{x['first_round_seconds']:.2f}", f"{x['round_seconds_median']:.2f}", f"{x['goodput_mbit']:.0f}",
                  f"{x['share_of_cap']:.2f}"] for x in lines],
                ["connections", "first round s", "round s (median)", "goodput Mbit/s", "share of cap"]))
    write(args.out, {"megabytes": args.megabytes, "rate_mbit": args.rate_mbit, "window_kb": args.window_kb,
                     "round_trip_ms": 2 * args.delay_ms, "rounds": args.rounds, "rows": lines})


if __name__ == "__main__":
    main()
