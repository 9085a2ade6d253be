"""Averaging speed: the project's own round protocol (the islands' data path) against
torch.distributed gloo.

    python -m bench.allreduce --out bench/results/allreduce.json [--peers 2 3 4] [--sizes-mb 1 10 100]

For each peer count, that many processes on 127.0.0.1 average one fp32 tensor of each size a few
times: through the data plane's rounds (node/net/transport.py, the path a fragment's round takes,
without its records and validation) and through gloo's `all_reduce` on the same tensors (the
result divided by the peer count). Every round starts at a barrier; its time is the slowest
peer's, and the figure is the median over rounds. The first round of each size is checked against
the exact mean. (hivemind's averager, which carried the rounds before, took ~20x gloo's time for
100 MB between 2 peers: bench/README.md.)
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time
from pathlib import Path

from .common import plot, table, write

RUN_ID = "bench-allreduce"


def _tensor(rank: int, numel: int):
    import torch

    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))


def _numel(megabytes: float) -> int:
    return int(megabytes * 1e6 / 4)


def _row(backend: str, peers: int, mb: float, round_: int, outcome: str, group: int, seconds: float, error: float | None) -> dict:
    return {"backend": backend, "peers": peers, "megabytes": mb, "round": round_, "outcome": outcome, "group": group,
            "seconds": seconds, "error": error}


def _gloo_peer(rank: int, peers: int, sizes_mb: list[float], rounds: int, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=peers)
    try:
        for mb in sizes_mb:
            x = _tensor(rank, _numel(mb))
            for r in range(rounds):
                y = x.clone()
                dist.barrier()
                started = time.perf_counter()
                dist.all_reduce(y)
                y /= peers
                results.put(_row("gloo", peers, mb, r, "ok", peers, time.perf_counter() - started, None))
    finally:
        dist.destroy_process_group()


DIRECT = ("direct", "direct-keyed", "direct-int8", "direct-gather", "direct-scatter")


def _direct_peer(
    rank: int, peers: int, sizes_mb: list[float], rounds: int, addresses, barrier, results, swarm_key: bytes | None, codec: str, name: str,
    scatter: bool | None = None,
) -> None:
    """The project's own round protocol (node/net/transport.py: direct TCP, a pool of connections,
    AES-GCM): each member's part (in `codec`) sent once to every other member and reduced in a fixed
    order (an all-gather), or cut in slices that one member each reduces (a reduce-scatter);
    `scatter` None: as the node chooses (rounds.uses_scatter)."""
    import torch
    from islands.node.net.transport import DataPlane, Identity
    from islands.protocols.parts import assemble, encode_part, encode_slices, reduce_parts
    from islands.protocols.rounds import uses_scatter

    if scatter is None:
        scatter = uses_scatter(peers, codec)

    torch.set_num_threads(1)

    async def run() -> None:
        me = Identity.generate()
        plane = DataPlane(me, swarm_key)
        port = await plane.start()
        for box in addresses:  # one mailbox per peer: each gets every address once
            box.put((me.peer_id, port))
        members = {}
        while len(members) < peers:
            peer, p = await asyncio.to_thread(addresses[rank].get, True, 60)
            members[peer] = ("127.0.0.1", p)
        await asyncio.to_thread(barrier.wait, 120)
        try:
            for f, mb in enumerate(sizes_mb):
                x = _tensor(rank, _numel(mb))
                for r in range(rounds):
                    await asyncio.to_thread(barrier.wait, 120)
                    started = time.perf_counter()
                    if scatter:
                        def cut(order, x=x):
                            return encode_slices(x, 1.0, codec, {}, order)

                        outcome, parts = await plane.run_round(f, f * 1000 + r, members, None, attempt_s=60.0, cut=cut)
                        combine = assemble
                    else:
                        outcome, parts = await plane.run_round(f, f * 1000 + r, members, encode_part(x, 1.0, codec), attempt_s=60.0)
                        combine = reduce_parts
                    mean, _, _ = (await asyncio.to_thread(combine, sorted(parts), parts)) if parts else (None, 0, {})
                    seconds = time.perf_counter() - started  # a reduce-scatter's slices are read in place, not joined
                    if isinstance(mean, list):
                        mean = torch.cat(mean)
                    error = None
                    if f == 0 and r == 0 and mean is not None:
                        exact = sum(_tensor(k, x.numel()) for k in range(peers)) / peers
                        error = float((mean - exact).abs().max())
                    ok = type(outcome).__name__ == "Commit"
                    results.put(_row(name, peers, mb, r, "ok" if ok else "failed", len(parts), seconds, error))
            await asyncio.to_thread(barrier.wait, 120)  # nobody leaves while another still reduces
        finally:
            await plane.close()

    asyncio.run(run())


def _run(backend: str, peers: int, sizes_mb: list[float], rounds: int, timeout_s: float) -> list[dict]:
    ctx = mp.get_context("fork")  # the parent has not started torch or threads
    results = ctx.Queue()
    if backend in DIRECT:
        addresses, barrier = [ctx.Queue() for _ in range(peers)], ctx.Barrier(peers)
        key = b"bench-swarm-key-0123456789abcdef" if backend in ("direct-keyed", "direct-int8") else None
        codec = "int8" if backend == "direct-int8" else "none"
        scatter = {"direct-gather": False, "direct-scatter": True}.get(backend)
        procs = [
            ctx.Process(target=_direct_peer, args=(k, peers, sizes_mb, rounds, addresses, barrier, results, key, codec, backend, scatter))
            for k in range(peers)
        ]
    else:
        from tests.procs import free_port

        port = free_port()
        procs = [ctx.Process(target=_gloo_peer, args=(k, peers, sizes_mb, rounds, port, results)) for k in range(peers)]
    for p in procs:
        p.start()
    expected = peers * rounds * len(sizes_mb)
    rows: list[dict] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(rows) < expected and time.monotonic() < deadline:
            try:
                rows.append(results.get(timeout=1.0))
            except Exception:  # noqa: BLE001 - queue.Empty: check the peers are alive
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"{backend} peer failed: exit codes {[p.exitcode for p in procs]}") from None
        if len(rows) < expected:
            raise RuntimeError(f"{backend} with {peers} peers: {len(rows)} of {expected} results within {timeout_s}s")
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per (backend, peers, size): the median over rounds of the slowest peer's time (a round
    that did not average over every peer counts as infinitely slow)."""
    out = []
    for key in sorted({(r["backend"], r["peers"], r["megabytes"]) for r in rows}):
        mine = [r for r in rows if (r["backend"], r["peers"], r["megabytes"]) == key]
        per_round: dict[int, list[float]] = {}
        for r in mine:
            full = r["outcome"] == "ok" and r["group"] == r["peers"]
            per_round.setdefault(r["round"], []).append(r["seconds"] if full else float("inf"))
        slowest = [max(v) for v in per_round.values()]
        errors = [r["error"] for r in mine if r["error"] is not None]
        out.append({
            "backend": key[0], "peers": key[1], "megabytes": key[2], "rounds": len(slowest),
            "seconds_median": round(statistics.median(slowest), 4),
            "rounds_complete": sum(s != float("inf") for s in slowest),
            "max_error": max(errors) if errors else None,
        })
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="JSON file for the figures (a PNG is written next to it)")
    p.add_argument("--peers", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 10.0, 100.0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--backends", nargs="+", default=["gloo", "direct", "direct-keyed"],
                   help="gloo; direct (the project's own round protocol), "
                        "direct-keyed (the same with a swarm key), direct-int8 (keyed, each part in blockwise int8: --compression int8); "
                        "direct chooses an all-gather or a reduce-scatter as the node does: direct-gather and direct-scatter force one")
    args = p.parse_args()
    rows: list[dict] = []
    for peers in args.peers:
        for backend in args.backends:
            started = time.monotonic()
            rows += _run(backend, peers, args.sizes_mb, args.rounds, timeout_s=300)
            print(f"{backend}, {peers} peers: {time.monotonic() - started:.1f}s", flush=True)
    results = summarize(rows)
    by = {(r["backend"], r["peers"], r["megabytes"]): r for r in results}
    lines = []
    for peers in args.peers:
        for mb in args.sizes_mb:
            g = by.get(("gloo", peers, mb))
            d, k = by.get(("direct", peers, mb)), by.get(("direct-keyed", peers, mb))
            q = by.get(("direct-int8", peers, mb))
            ag, rs = by.get(("direct-gather", peers, mb)), by.get(("direct-scatter", peers, mb))
            line = {"peers": peers, "megabytes": mb, "gloo_seconds": g and g["seconds_median"],
                    "direct_seconds": d and d["seconds_median"], "direct_keyed_seconds": k and k["seconds_median"],
                    "direct_ratio": d and g and round(d["seconds_median"] / g["seconds_median"], 2),
                    "direct_max_error": d and d["max_error"], "direct_int8_seconds": q and q["seconds_median"],
                    "direct_int8_max_error": q and q["max_error"],
                    "direct_gather_seconds": ag and ag["seconds_median"], "direct_scatter_seconds": rs and rs["seconds_median"],
                    "direct_scatter_max_error": rs and rs["max_error"]}
            lines.append(line)
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    print(table([[str(x["peers"]), f"{x['megabytes']:g}", fmt(x["direct_seconds"], ".3f"),
                  fmt(x["direct_keyed_seconds"], ".3f"), fmt(x["direct_int8_seconds"], ".3f"), fmt(x["direct_gather_seconds"], ".3f"),
                  fmt(x["direct_scatter_seconds"], ".3f"), fmt(x["gloo_seconds"], ".3f"),
                  fmt(x["direct_ratio"], ".2f")] for x in lines],
                ["peers", "MB", "direct s", "direct, swarm key s", "direct, int8 s", "all-gather s", "reduce-scatter s",
                 "gloo s", "direct/gloo"]))
    head = next((x for x in lines if x["megabytes"] == max(args.sizes_mb) and x["peers"] == min(args.peers)), lines[-1])
    figures = {
        # DESIGN.md's names: `hivemind_seconds` is "our averaging path's, whatever it is": the own protocol's
        "hivemind_seconds": head["direct_seconds"], "direct_seconds": head["direct_seconds"], "gloo_seconds": head["gloo_seconds"],
        "ratio": head["direct_ratio"],
        "megabytes": head["megabytes"], "peers": head["peers"],
        "rows": lines, "rounds": args.rounds,
    }
    write(args.out, figures)
    if args.out:
        series = {}
        for r in results:
            series.setdefault(f"{r['backend']}, {r['peers']} peers", []).append(
                (r["megabytes"], r["seconds_median"]))
        plot(Path(args.out).with_suffix(".png"), "Averaging time vs size (127.0.0.1, median of rounds)", series,
             xlabel="megabytes (fp32)", ylabel="seconds", log=True)


if __name__ == "__main__":
    main()
