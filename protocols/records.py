"""The island records every island publishes under `<run>:islands`, and how they are read.

Pure: values in, values out. A record that is malformed is dropped and
counted, never trusted and never a crash.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

RECORD_TTL_S = 20.0
"""An island record expires this long after it was written; islands refresh it well inside."""
REFRESH_S = 4.0
LIVE_S = 3 * REFRESH_S
"""An island whose record has not been refreshed for this long is no longer waited for."""
FORGET_S = 600.0
"""A peer whose last record is older than this is no longer re-dialled (see `redial_targets`)."""


@dataclasses.dataclass(frozen=True)
class IslandRecord:
    peer_id: str
    role: str
    step: int
    batch_tokens: int
    tokens_per_s: float
    step_seconds: float
    next_sync: list[int]
    last_sync: list[dict]
    contact: str | None
    version: str
    time: float
    state: str
    """"starting", "training", or "left" (withdrawn on a clean exit)."""
    maddrs: list[str]
    shard: int = -1
    contact_until: float | None = None
    """A satellite in contact: the DHT time its contact window ends (None for islands, or out of contact)."""
    final: dict | None = None
    """At the end of a run (FragmentSync.agree): {"check": n, "fp": one fingerprint per fragment of
    its agreed values} after its n-th look, so that every island decides alike which fragments to heal."""
    data: str | None = None
    """"HOST:PORT" of the island's round transport (node/net/transport.py), or
    P2P_ADDRESS for one reached over libp2p streams."""
    since: int = -1
    """The step this island's process began training after (resumed, or joined at): it starts no
    round at or before it (-1: not said)."""

    def to_value(self) -> dict:
        value = dataclasses.asdict(self)
        value.pop("peer_id")
        return value


def parse_island_record(peer_id: str, value: Any) -> IslandRecord | None:
    """The record, or None if it is malformed."""
    if not isinstance(value, Mapping) or not isinstance(peer_id, str):
        return None
    try:
        record = IslandRecord(
            peer_id=peer_id,
            role=str(value["role"]),
            step=int(value["step"]),
            batch_tokens=int(value["batch_tokens"]),
            tokens_per_s=float(value["tokens_per_s"]),
            step_seconds=float(value.get("step_seconds", 0.0)),
            next_sync=[int(x) for x in value["next_sync"]],
            last_sync=[dict(x) for x in value.get("last_sync", [])],
            contact=None if value.get("contact") is None else str(value["contact"]),
            version=str(value["version"]),
            time=float(value["time"]),
            state=str(value.get("state", "training")),
            maddrs=[str(m) for m in value.get("maddrs", [])],
            shard=int(value.get("shard", -1)),
            contact_until=None if value.get("contact_until") is None else float(value["contact_until"]),
            final=_parse_final(value.get("final")),
            data=None if value.get("data") is None else str(value["data"]),
            since=int(value.get("since", -1)),
        )
    except (KeyError, TypeError, ValueError):
        return None
    if record.role not in ("island", "satellite") or record.step < 0 or record.state not in ("starting", "training", "left"):
        return None
    return record


def _parse_final(value: Any) -> dict | None:
    """The `final` field (IslandRecord.final), or None; ValueError if malformed."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not isinstance(value.get("fp"), Sequence):
        raise ValueError("final: not a mapping with fp")
    return {"check": int(value["check"]), "fp": [[float(x) for x in fp] for fp in value["fp"]]}


def live_records(records: Mapping[str, IslandRecord], now: float, ttl_s: float = LIVE_S) -> dict[str, IslandRecord]:
    """Records that are fresh (refreshed within ttl_s) and not withdrawn."""
    return {p: r for p, r in records.items() if r.state != "left" and now - r.time <= ttl_s}


def remember(known: Mapping[str, IslandRecord], records: Mapping[str, IslandRecord]) -> dict[str, IslandRecord]:
    """The newest record seen of every peer, across reads: the DHT forgets a record once it
    expires, and after a partition the last one seen is all that tells where a peer was."""
    out = dict(known)
    for peer, record in records.items():
        if peer not in out or record.time >= out[peer].time:
            out[peer] = record
    return out


def redial_targets(
    known: Mapping[str, IslandRecord], now: float, me: str, join: Sequence[str] = (), forget_s: float = FORGET_S
) -> dict[str, list[str]]:
    """Peer id -> addresses of the peers to dial again if the DHT has lost them: those seen in
    the last `forget_s` that did not withdraw, and the --join peers (`/.../p2p/<id>` addresses).
    Never a satellite: its DHT is a client (it serves no one), so nobody dials it."""
    out: dict[str, list[str]] = {}
    for maddr in join:
        address, sep, peer = maddr.rpartition("/p2p/")
        if sep and peer and peer != me:
            out.setdefault(peer, []).append(address)
    for peer, r in known.items():
        if peer == me or r.role == "satellite":
            continue
        if r.state == "left":
            out.pop(peer, None)
        elif now - r.time <= forget_s and r.maddrs:
            out[peer] = [m.rpartition("/p2p/")[0] or m for m in r.maddrs]
    return out


def arrival_s(step: int, records: Iterable[IslandRecord], now: float) -> float:
    """Seconds until the last of the islands still short of `step` gets there, each extrapolated
    from its record (its step at the record's time, at its recent wall pace, stalls included); 0
    when none is behind. A crashed island's record stops, so its estimate falls behind `now` and
    it adds nothing: a round waits this long only for an island that is still training."""
    out = 0.0
    for r in records:
        if r.step >= step:
            continue
        pace = r.batch_tokens / r.tokens_per_s if r.tokens_per_s > 0 and r.batch_tokens > 0 else r.step_seconds
        if pace > 0:
            out = max(out, r.time + (step - r.step) * pace - now)
    return out


def deposit_candidates(
    me: str, live: Mapping[str, IslandRecord], known: Mapping[str, IslandRecord], now: float, forget_s: float = FORGET_S
) -> list[str]:
    """The islands a satellite may deposit with: the live training ones, or if it sees none (a
    satellite's view is old by design: over its link a records read before a round often does not
    finish in time), the training islands it saw in the last `forget_s`, most recent first."""
    fresh = sorted(p for p, r in live.items() if p != me and r.role == "island" and r.state == "training")
    if fresh:
        return fresh
    seen = [(r.time, p) for p, r in known.items() if p != me and r.role == "island" and r.state == "training" and now - r.time <= forget_s]
    return [p for _, p in sorted(seen, reverse=True)]


def expected_group(me: str, records: Mapping[str, IslandRecord]) -> int:
    """How many members a round of this island should wait for: itself and the other live
    islands. Never a satellite: satellites deposit their progress with an island instead of
    joining rounds (deposit.py), so islands never wait for one."""
    return 1 + sum(1 for p, r in records.items() if p != me and r.role == "island")


def choose_shard(me: str, records: Mapping[str, IslandRecord], num_shards: int) -> int:
    """A data shard no training island holds; islands starting together split the free ones by peer id."""
    claimed = {r.shard for p, r in records.items() if p != me and r.state == "training" and r.shard >= 0}
    free = [s for s in range(num_shards) if s not in claimed] or list(range(num_shards))
    starting = sorted({p for p, r in records.items() if r.state == "starting"} | {me})
    return free[starting.index(me) % len(free)]


def other_islands(me: str, live: Mapping[str, IslandRecord], training: bool = True) -> dict[str, IslandRecord]:
    """The live islands (satellites excluded) other than `me`; by default only those training."""
    return {p: r for p, r in live.items() if p != me and r.role == "island" and (r.state == "training" or not training)}


def peer_progress(islands: Iterable[IslandRecord], fragment: int) -> list[tuple[int, int]]:
    """(step, start step of the last round applied to `fragment`) of each island."""
    out = []
    for r in islands:
        last = r.last_sync[fragment] if fragment < len(r.last_sync) else {}
        out.append((r.step, int(last.get("step", -1)) if isinstance(last, dict) else -1))
    return out


def swarm_step(islands: Iterable[IslandRecord], now: float) -> int | None:
    """The furthest island's step at `now`, each extrapolated from its record by its recent wall
    pace (stalls included); None without islands."""
    best = None
    for r in islands:
        steps_per_s = r.tokens_per_s / r.batch_tokens if r.batch_tokens > 0 else 0.0
        guess = r.step + int(max(0.0, now - r.time) * steps_per_s)
        best = guess if best is None else max(best, guess)
    return best


def typical_step(islands: Iterable[IslandRecord]) -> int | None:
    """The lower median of the islands' steps (None without islands): where most of them are, not
    where one runs ahead (a poisoner never waits for a round, so it is often the furthest)."""
    steps = sorted(r.step for r in islands)
    return steps[(len(steps) - 1) // 2] if steps else None


def furthest(islands: Mapping[str, IslandRecord]) -> tuple[str, int] | None:
    """(peer, step) of the island furthest ahead by its record (ties: the larger peer id)."""
    if not islands:
        return None
    step, peer = max((r.step, p) for p, r in islands.items())
    return peer, step


def finished(others: Mapping[str, IslandRecord], step: int) -> tuple[set[str], int]:
    """At the end of a run: (the islands that have reached `step`, how many are still behind it)."""
    return {p for p, r in others.items() if r.step >= step}, sum(1 for r in others.values() if r.step < step)


def final_fingerprints(
    records: Mapping[str, IslandRecord], peers: Iterable[str], live: Mapping[str, IslandRecord], check: int
) -> tuple[list[list[list[float]]], list[str]]:
    """At the end of a run, after this island's `check`-th look: (the fingerprints that `peers`
    published for that look or a later one, the peers still live that have not yet). A withdrawn
    island's record still shows its last fingerprints."""
    posted = {p: r.final for p, r in records.items() if p in peers and r.final is not None and r.final["check"] >= check}
    return [f["fp"] for f in posted.values()], [p for p in peers if p in live and p not in posted]


P2P_ADDRESS = "p2p"
"""The `data` of an island that cannot be dialled: its rounds' connections are libp2p streams to its
peer id."""


def parse_address(text: str) -> tuple[str, int]:
    """("host", port) of "HOST:PORT" (an IPv6 host in brackets); ValueError if it is not one."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def data_address(host: str, port: int, maddrs: Sequence[str]) -> str:
    """"HOST:PORT" that other islands dial for this island's rounds, listening on `host`:`port`: the
    host itself, or for a wildcard one, the first IPv4 address of `maddrs` (announced ones first)
    that is not a loopback one, else the first loopback one."""
    if host not in ("0.0.0.0", "", "::"):
        return f"{host}:{port}"
    ips = [m.split("/")[2] for m in maddrs if m.startswith("/ip4/") and m.split("/")[2] != "0.0.0.0"]
    public = [ip for ip in ips if not ip.startswith("127.")]
    return f"{(public or ips or ['127.0.0.1'])[0]}:{port}"


def transport_addresses(me: str, live: Mapping[str, IslandRecord]) -> dict[str, tuple[str, int]]:
    """The round transport's address of each other live, training island that publishes one
    ((P2P_ADDRESS, 0) for one reached over libp2p streams)."""
    out = {}
    for p, r in other_islands(me, live).items():
        if r.data == P2P_ADDRESS:
            out[p] = (P2P_ADDRESS, 0)
            continue
        try:
            host, port = parse_address(r.data or "")
        except ValueError:
            continue
        if port > 0:
            out[p] = (host, port)
    return out


def round_peers(
    me: str, live: Mapping[str, IslandRecord], fragment: int, step: int, overlap: int,
) -> dict[str, tuple[str, int]]:
    """The other members of this island's round of `fragment` that starts at `step`, with their
    round transport's address: the live, training islands (never a satellite) that publish one and
    have not yet applied that round (by their records: past `step + overlap`, or `step` already
    their fragment's last round) nor began training after its start (`since`: a restarted or
    joining island never starts a round it began past). One still training towards `step` is a
    member: its part comes when it gets there. A round in flight asks again (node/net/direct.py):
    a member that left these since its start is not waited for."""
    return {p: address for p, address in transport_addresses(me, live).items() if not left_round(live[p], fragment, step, overlap)}


def left_round(record: IslandRecord, fragment: int, step: int, overlap: int) -> bool:
    """A member's (fresh) record says it will not take part in the round of `fragment` that started
    at `step`: it began training past the start (restarted or joined: `since`), went past the
    round's overlap, applied a round of that start or later (alone), or left. A record that is
    missing or stale says nothing: the round waits for its deadline then (a DHT that is slow to
    answer must not drop members whose parts still come)."""
    ((now, last),) = peer_progress([record], fragment)
    return record.since >= step or now > step + overlap or last >= step or record.state == "left"


def agreed_fragments(record: IslandRecord) -> int:
    """How many fragments this island's last round committed with others (`ok`): their values are
    the swarm's, not its own (an island whose last round it applied alone — a poisoner whose
    rounds the others rejected, an island cut off — holds values nobody else has)."""
    return sum(1 for s in record.last_sync if isinstance(s, dict) and s.get("outcome") == "ok")


def state_donors(me: str, live: Mapping[str, IslandRecord]) -> list[str]:
    """The islands to download a fragment's state from, in the order to try: the live, training
    ones, those whose last rounds agreed with the swarm's first (`agreed_fragments`), then the
    furthest (ties: by peer id). The chaos soak found a satellite that took the state of a peer
    the islands had banned for poisoning (the furthest by step) and trained from it for minutes."""
    return [p for *_, p in sorted((-agreed_fragments(r), -r.step, p) for p, r in other_islands(me, live).items())]
