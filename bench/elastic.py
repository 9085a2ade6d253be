"""Islands coming and going, measured: join time, state download, time lost to a crash mid-round,
and the islands' round times with and without a satellite.

    python -m bench.elastic --out bench/results/elastic.json

Real `islands-node` processes on 127.0.0.1 (the test suite's launcher, tests/procs.py):
1. crash: A and B (window 20, 4 fragments, 200 steps); C joins after A passes step 60; once C has
   averaged, B is SIGKILLed one step into a round of fragment 1 after step 100.
2. satellite: 3 islands without a satellite, with a 4th training process outside the swarm (the
   CPU a satellite takes on this machine), and with a satellite `up 10s every 30s` (240 steps);
3. the same with every island behind a `lan` relay that gives connections from the satellite's
   address (it listens on 127.0.0.2) the `satellite` profile: without, then with the satellite
   on its own link.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from pathlib import Path

from tests.procs import Nodes

from .common import parse, table, write

SCHEDULE = ["--window", "20", "--fragments", "4", "--listen", "/ip4/127.0.0.1/tcp/0", "--match-wait-s", "3"]


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def crash(root: Path) -> dict:
    nodes = Nodes(root)
    try:
        common = [*SCHEDULE, "--steps", "200", "--run-id", "bench-elastic"]
        a, join = nodes.first("a", [*common, "--wait-islands", "2"])
        b = nodes.start("b", [*common, "--wait-islands", "2", "--join", join])
        a.wait_for(lambda e: e["event"] == "step" and e["step"] > 60, 120, "A past 60")
        c = nodes.start("c", [*common, "--join", join])
        # the crash alone: once C averages with the others (a join still under way when B dies makes
        # the survivors wait for both: 29 s lost in one run where C's start took until step 103)
        c.wait_for(lambda e: e["event"] == "sync" and e["outcome"] == "ok", 180, "C's first ok round")
        # mid-round: fragment 1's rounds start at steps 5 mod 20 and are applied 4 steps later
        now = max(b.steps())
        at = max(106, now + 1 + (6 - (now + 1)) % 20)
        b.wait_for(lambda e: e["event"] == "step" and e["step"] >= at, 180, "B inside a round")
        os.kill(b.proc.pid, signal.SIGKILL)
        killed_t = time.time()
        for node in (a, c):
            node.wait_exit(300)
        joined = c.of("join")[0]
        first_ok = next(s for s in c.of("sync") if s["outcome"] == "ok")
        syncs = a.of("sync")
        before = [s["seconds"] for s in syncs if s["outcome"] == "ok" and s["t"] < killed_t]
        typical = statistics.median(before)
        # rounds applied after the kill until A and C first averaged alone together
        back = next(s for s in syncs if s["t"] > killed_t and s["outcome"] == "ok" and s["group_size"] == 2)
        hit = [s for s in syncs if killed_t <= s["t"] <= back["t"]]
        return {
            "join_state_bytes": joined["bytes"],
            "join_download_seconds": joined["seconds"],
            "join_step": joined["step"],
            "join_seconds_start_to_first_ok_sync": round(first_ok["t"] - c.t_start, 3),
            "crash_rounds_hit": len(hit),
            "crash_outcomes": [s["outcome"] for s in hit],
            "crash_seconds_lost": round(sum(max(0.0, s["seconds"] - typical) for s in hit), 3),
            "crash_seconds_until_pair_ok": round(back["t"] - killed_t, 3),
            "round_seconds_typical": round(typical, 3),
        }
    finally:
        nodes.stop()


SATELLITE_SOURCE = "127.0.0.2"
"""The satellite listens (and so dials) from here; the islands' relays give it the satellite link."""


def satellite(root: Path, with_satellite: bool, link: bool = False, load: bool = False) -> dict:
    """With `link`: every island behind a `lan` relay that gives connections from the satellite's
    address the `satellite` profile (300 ms one way, 10 Mbit/s): the satellite's own link.
    With `load` (and no satellite): a fourth training process that is not in the swarm (a solo
    island of another run), to tell what a satellite costs the islands' rounds on these 2 cores
    as one more process from what it costs as a peer."""
    nodes = Nodes(root)
    try:
        common = [*SCHEDULE, "--steps", "240", "--run-id", "bench-orbit"]
        relay = ["--profile", "lan", "--from", f"{SATELLITE_SOURCE}=satellite"] if link else None
        a, join = nodes.first("a", [*common, "--wait-islands", "3"], relay)
        # the satellite (or the load) starts next, and B and C once it is up, so that it is there
        # before the islands begin: a satellite that arrives later first downloads the swarm's
        # state, which over its link took 32 s for 18.2 MB, and then has few contact windows left
        sat = None
        if load:
            nodes.start("load", ["--window", "20", "--fragments", "4", "--listen", "/ip4/127.0.0.1/tcp/0", "--steps", "240", "--run-id", "bench-elsewhere"])
        if with_satellite:
            sat_args = [*common, "--join", join, "--role", "satellite", "--contact", "up 10s every 30s"]
            if link:
                # it listens on its own address only, so that its connections leave from it (the islands'
                # relays give those the satellite link); connections to it cross its own relay, with the
                # same link (its node keeps its contact windows)
                i = sat_args.index("--listen")
                del sat_args[i : i + 2]
                sat = nodes.start("sat", sat_args, ["--profile", "satellite", "--contact", "always"], host=SATELLITE_SOURCE)
            else:
                sat = nodes.start("sat", sat_args)
        if sat is not None:  # up before B and C: A starts training only once they are
            sat.wait_for(lambda e: e["event"] == "started", 120, "the satellite's start")
        islands = [a] + [nodes.start(n, [*common, "--wait-islands", "3", "--join", join], relay) for n in "bc"]
        for node in islands + ([sat] if sat else []):
            node.wait_exit(300)
        island_syncs = [s for n in islands for s in n.of("sync")]
        out = {
            "island_round_seconds_median": _median([s["seconds"] for s in island_syncs if s["outcome"] == "ok"]),
            "island_round_seconds_p90": round(sorted(s["seconds"] for s in island_syncs)[int(0.9 * len(island_syncs))], 3),
            "island_share_ok": round(sum(s["outcome"] == "ok" for s in island_syncs) / len(island_syncs), 3),
            "island_wall_seconds": _median([n.of("summary")[0]["wall_seconds"] for n in islands]),
            "island_eval_loss": _median([n.of("summary")[0]["eval_loss"] for n in islands]),
        }
        if sat is not None:
            ss = sat.of("sync")
            out["satellite_outcomes"] = {o: sum(s["outcome"] == o for s in ss) for o in sorted({s["outcome"] for s in ss})}
            out["satellite_ok"] = [
                {"step": s["step"], "group_size": s["group_size"], "staleness": s["staleness"], "weight": s["weight"], "policy": s["policy"]}
                for s in ss if s["outcome"] == "ok"
            ]
            out["satellite_deposit_seconds_median"] = _median([s["seconds"] for s in ss if s["outcome"] == "ok"])
            out["satellite_bytes_sent_per_deposit"] = _median([s["bytes_sent"] for s in ss if s["outcome"] == "ok"])
            out["satellite_bytes_recv_per_deposit"] = _median([s["bytes_recv"] for s in ss if s["outcome"] == "ok"])
            carried = [s for s in island_syncs if s.get("deposits")]
            out["island_rounds_carrying_deposits"] = len(carried)
            out["island_round_seconds_median_carrying_deposits"] = _median([s["seconds"] for s in carried if s["outcome"] == "ok"])
            out["island_max_group_size"] = max(s["group_size"] for s in island_syncs)
        return out
    finally:
        nodes.stop()


def main() -> None:
    args, root = parse(__doc__, "bench-runs/elastic")
    figures = {
        "crash": crash(root / "crash"),
        "without_satellite": satellite(root / "plain", False),
        "without_satellite_fourth_process": satellite(root / "load", False, load=True),
        "with_satellite": satellite(root / "sat", True),
        "without_satellite_link": satellite(root / "linkplain", False, link=True),
        "with_satellite_link": satellite(root / "satlink", True, link=True),
    }
    c, w, wo = figures["crash"], figures["with_satellite"], figures["without_satellite"]
    lw, lwo = figures["with_satellite_link"], figures["without_satellite_link"]
    print(table(
        [
            ["join: start to first ok sync", f"{c['join_seconds_start_to_first_ok_sync']} s"],
            ["join: state download", f"{c['join_state_bytes'] / 1e6:.1f} MB in {c['join_download_seconds']} s"],
            ["crash mid-round: time lost by A", f"{c['crash_seconds_lost']} s over {c['crash_rounds_hit']} rounds ({', '.join(c['crash_outcomes'])})"],
            ["crash: until A and C average as a pair", f"{c['crash_seconds_until_pair_ok']} s"],
            ["island round s (median / p90), no satellite", f"{wo['island_round_seconds_median']} / {wo['island_round_seconds_p90']}"],
            ["island round s (median / p90), no satellite, a 4th process outside the swarm",
             f"{figures['without_satellite_fourth_process']['island_round_seconds_median']} / {figures['without_satellite_fourth_process']['island_round_seconds_p90']}"],
            ["island round s (median / p90), satellite", f"{w['island_round_seconds_median']} / {w['island_round_seconds_p90']}"],
            ["island ok share, no satellite / satellite", f"{wo['island_share_ok']} / {w['island_share_ok']}"],
            ["satellite syncs", str(w["satellite_outcomes"])],
            ["island rounds carrying a deposit (their median s)", f"{w['island_rounds_carrying_deposits']} ({w['island_round_seconds_median_carrying_deposits']})"],
            ["islands behind relays, no satellite: island round s (median / p90)", f"{lwo['island_round_seconds_median']} / {lwo['island_round_seconds_p90']}"],
            ["... a satellite over its own link: island round s (median / p90)", f"{lw['island_round_seconds_median']} / {lw['island_round_seconds_p90']}"],
            ["... satellite syncs", str(lw["satellite_outcomes"])],
            ["... satellite deposit s (median), bytes sent / received per deposit",
             f"{lw['satellite_deposit_seconds_median']}, {lw['satellite_bytes_sent_per_deposit']} / {lw['satellite_bytes_recv_per_deposit']}"],
        ],
        ["figure", "value"],
    ))
    write(args.out, figures)


if __name__ == "__main__":
    main()
