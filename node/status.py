"""`islands-node status`: the swarm as a table, read from the DHT by a client-mode peer."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Mapping

from islands.protocols.records import IslandRecord, live_records

from .progress import format_rate, format_table


def lateness(records: Mapping[str, IslandRecord], window: int, fragments: int) -> dict[str, int]:
    """Steps each island is behind the furthest one, where that exceeds one fragment's spacing."""
    if not records:
        return {}
    lead = max(r.step for r in records.values())
    spacing = max(1, window // max(1, fragments))  # Schedule.spacing, for a manifest that may be partial
    return {p: lead - r.step for p, r in records.items() if lead - r.step > spacing}


def render_table(manifest: dict | None, records: Mapping[str, IslandRecord], now: float) -> str:
    window = (manifest or {}).get("window", 0) or 1
    fragments = (manifest or {}).get("fragments", 0) or 1
    live = live_records(records, now)
    late = lateness(live, window, fragments)
    head = ["island", "role", "state", "step", "tok/s", "step s", "batch tok", "shard", "last sync per fragment", "late"]
    rows = []
    for peer, r in sorted(records.items(), key=lambda kv: (-kv[1].step, kv[0])):
        syncs = " ".join(
            f"f{p}@{s.get('step', '-')}:{s.get('outcome', '-')}" + (f"x{s['group_size']}" if s.get("group_size") else "")
            for p, s in enumerate(r.last_sync) if s
        ) or "-"
        state = r.state if peer in live or r.state == "left" else "expired"
        rows.append([
            peer[-12:], r.role, state, str(r.step), format_rate(r.tokens_per_s), f"{r.step_seconds:.3f}",
            str(r.batch_tokens), str(r.shard), syncs, f"{late[peer]} steps" if peer in late else "",
        ])
    lines = []
    if manifest:
        lines.append(
            f"run {manifest.get('run_id')}: window {manifest.get('window')}, {manifest.get('fragments')} fragments, "
            f"overlap {manifest.get('overlap')}, model {manifest.get('model', {}).get('n_layer')} layers"
        )
    lines.append(f"{len(live)} live island(s), {len(records) - len(live)} gone")
    lines.append(format_table(head, rows))
    return "\n".join(lines)


def main(argv: list[str], prog: str) -> int:
    from .cli import _Parser

    parser = _Parser(prog=f"{prog} status", description="Show the islands of a run: roles, steps, speed, last sync per fragment, who is late.")
    parser.add_argument("--join", action="append", required=True, metavar="MADDR", help="any peer of the swarm (repeatable)")
    parser.add_argument("--run-id", default="islands", help="the run to show (default: islands)")
    parser.add_argument("--json", action="store_true", help="print the manifest and records as JSON")
    parser.add_argument("--swarm-key", metavar="PATH", help="the swarm's key file, if it runs with one")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="give up after this long")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return asyncio.run(_show(args))


async def _show(args) -> int:
    from islands.node.net.dht import SwarmDHT, dht_now
    from islands.protocols.admission import SwarmKeyError, load_swarm_key

    try:
        key = load_swarm_key(args.swarm_key) if args.swarm_key else None
    except SwarmKeyError as e:
        print(f"islands-node status: error: {e}", file=sys.stderr)
        return 2
    try:
        swarm = await asyncio.wait_for(
            asyncio.to_thread(
                SwarmDHT.start, args.run_id, initial_peers=args.join, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                client_mode=True, swarm_key=key,
            ),
            timeout=args.timeout_s,
        )
    except Exception as e:  # noqa: BLE001 - any failure to reach the swarm
        print(f"islands-node status: error: cannot reach {', '.join(args.join)}: {e}", file=sys.stderr)
        return 2
    try:
        manifest = await swarm.get_manifest()
        records = await swarm.islands()
    finally:
        await asyncio.to_thread(swarm.shutdown)
    if manifest is None and not records:
        print(f"islands-node status: error: no run {args.run_id!r} found via {', '.join(args.join)}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"manifest": manifest, "islands": {p: {**r.to_value(), "peer_id": p} for p, r in records.items()}}, indent=1))
    else:
        print(render_table(manifest, records, dht_now()))
    return 0
