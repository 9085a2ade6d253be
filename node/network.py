"""The node's link to the swarm: DHT, manifest check, island record, live peers, averaging.

All of it is started before training and torn down in `close()`, whatever happened.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path

from islands.node.net.authorizer import RefusalLog
from islands.node.net.dht import SwarmDHT, dht_now
from islands.node.net.direct import DirectRounds
from islands.node.net.signing import IdentityError, load_identity
from islands.node.net.transport import DataPlane, Identity
from islands.protocols.admission import SwarmKeyError, key_file_exposed, load_swarm_key
from islands.protocols.manifest import describe_differences, manifest_differences
from islands.protocols.records import (
    P2P_ADDRESS,
    REFRESH_S,
    IslandRecord,
    arrival_s,
    choose_shard,
    data_address,
    deposit_candidates,
    expected_group,
    final_fingerprints,
    finished,
    furthest,
    left_round,
    live_records,
    other_islands,
    parse_address,
    peer_progress,
    redial_targets,
    remember,
    round_peers,
    state_donors,
    swarm_step,
    transport_addresses,
    typical_step,
)

from .config import Config
from .contact import ContactClock
from .roles import IslandRole, SatelliteRole
from .timeouts import Timeouts

logger = logging.getLogger(__name__)

ROUNDS = "direct"
"""What carries the rounds, in the run's manifest: the own protocol. Nodes of older versions that
ran rounds over hivemind's averager (`"hivemind"`) cannot join a run of this one, nor it theirs."""


class ManifestMismatch(Exception):
    pass


class NetworkError(Exception):
    """The node cannot listen or reach the swarm it was told to join."""


@dataclasses.dataclass
class Status:
    """What this island tells the swarm about itself; updated by the daemon as it trains."""

    step: int = 0
    tokens_per_s: float = 0.0
    step_seconds: float = 0.0
    next_sync: list[int] = dataclasses.field(default_factory=list)
    last_sync: list[dict] = dataclasses.field(default_factory=list)
    state: str = "starting"
    shard: int = -1
    batch_tokens: int = 0
    """Tokens of one inner step of the whole island (0: one rank's --batch-size x --seq-len)."""
    final: dict | None = None
    """At the end of a run: what IslandRecord.final says."""
    since: int = -1
    """The step this process began training after (IslandRecord.since)."""


class Network:
    def __init__(self, cfg: Config, version: str, role: IslandRole | SatelliteRole | None = None):
        """`role`: an island (the default) or a satellite, which out of its contact windows neither
        publishes nor reads records, and deposits its rounds instead of joining them."""
        self.cfg = cfg
        self.role = role or IslandRole()
        self.contact: ContactClock | None = self.role.contact
        self.manifest: dict | None = None
        """The run manifest, once `start` has it (a task's needs the task built, after `open`)."""
        self.shapes: list[list[tuple[str, tuple[int, ...]]]] = []
        self.version = version
        self.timeouts = Timeouts.from_config(cfg)
        self.status = Status(next_sync=[0] * cfg.diloco.fragments, last_sync=[{} for _ in range(cfg.diloco.fragments)])
        self.dht: SwarmDHT | None = None
        self.rounds: DirectRounds | None = None
        """What the island's rounds go through (node/sync.py's `Rounds`): the own protocol."""
        self.plane: DataPlane | None = None
        self.data_address: str | None = None
        self.peers: dict[str, IslandRecord] = {}
        self.known: dict[str, IslandRecord] = {}
        """The newest record ever read of each peer: where to dial it again if the DHT loses it."""
        self._task: asyncio.Task | None = None
        self._maddrs: list[str] = []
        self._swarm_key: bytes | None = None
        self.refusals = RefusalLog()
        self.on_refused: Callable[[str], None] = lambda what: logger.warning("refused: %s", what)
        """Hears of every refusal (a peer without the swarm key, a banned peer), in this process."""
        self.on_banned: Callable[[str], None] = lambda peer: None

    def _now(self) -> float:
        """The swarm's clock, that of the records (DHT time)."""
        return dht_now()

    def _monotonic(self) -> float:
        """This node's clock, for its own deadlines."""
        return time.monotonic()

    async def _pause(self, seconds: float) -> None:
        """Between two looks at the records while waiting for the others."""
        await asyncio.sleep(seconds)

    @property
    def identity_path(self) -> Path:
        """The node's key: --identity, or RUN_DIR/identity.key (its peer id then survives restarts)."""
        return Path(self.cfg.net.identity or Path(self.cfg.output.run_dir) / "identity.key")

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id

    def maddrs(self) -> list[str]:
        """As read once at start: asking the DHT process again blocks, with no bound, while it is busy."""
        return list(self._maddrs)

    async def open(self) -> None:
        """Start the DHT: the node listens and can read the swarm's records (`start` joins the run)."""
        net = self.cfg.net
        swarm_key = None
        if net.swarm_key:
            try:
                swarm_key = load_swarm_key(net.swarm_key)
            except SwarmKeyError as e:
                raise NetworkError(str(e)) from None
            if key_file_exposed(net.swarm_key):
                logger.warning("swarm key file %s is readable by group or others: chmod 600 it", net.swarm_key)
        try:
            self.dht = await asyncio.to_thread(
                SwarmDHT.start, net.run_id, initial_peers=net.join, host_maddrs=net.listen,
                announce_maddrs=net.announce, identity_path=self.identity_path,
                # a satellite serves no DHT requests: in the islands' routing tables, its link would
                # slow every lookup of theirs (bench.elastic, bench/README.md)
                client_mode=self.role.satellite,
                swarm_key=swarm_key, on_refused=self.refusals,
            )
        except IdentityError as e:
            raise NetworkError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - hivemind raises many kinds; all mean "cannot start"
            joined = f" via {', '.join(net.join)}" if net.join else ""
            hint = ""
            if net.join and "bootstrap failed" in str(e):
                hint = (" (no peer accepted this node's --swarm-key: is it the swarm's?)" if swarm_key
                        else " (if the swarm runs with --swarm-key, give this node the same)")
            raise NetworkError(f"cannot start the DHT{joined}: {e}{hint}") from None
        self._maddrs = await asyncio.wait_for(asyncio.to_thread(self.dht.visible_maddrs), timeout=self.timeouts.start_s)
        _ = self.dht.peer_id  # cached by hivemind after the first call
        self._swarm_key = swarm_key

    async def start(self, manifest: dict, shapes: list[list[tuple[str, tuple[int, ...]]]]) -> None:
        """Join the run: check (or write) its manifest, open the rounds of the fragments of these
        shapes, publish this island's record and keep it fresh. Opens the DHT first if need be."""
        if self.dht is None:
            await self.open()
        self.manifest, self.shapes = {**manifest, "rounds": ROUNDS}, shapes
        await self._check_manifest()
        await self._open_direct(self._swarm_key)
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_loop())

    async def _open_direct(self, swarm_key: bytes | None) -> None:
        """The own round protocol: an island listens for rounds (its record publishes where); deposits
        and state downloads over libp2p."""
        net, plane = self.cfg.net, None
        if not self.role.satellite:
            key, peer_id = load_identity(self.identity_path)
            plane = self.plane = DataPlane(Identity(key._private_key, peer_id), swarm_key, on_refused=self.refusals)
            await plane.reach(await self.dht.dht.replicate_p2p(), f"{self.dht.namespace}::rounds")
            if net.data_announce == P2P_ADDRESS:
                self.data_address = P2P_ADDRESS
                logger.info("rounds: over libp2p streams only (--data-announce p2p)")
            else:
                host, port = parse_address(net.data_listen)
                port = await plane.start(host, port)
                self.data_address = net.data_announce or data_address(host, port, [*net.announce, *self.maddrs()])
                logger.info("rounds: direct transport on %s:%d, announced as %s", host, port, self.data_address)
        self.rounds = DirectRounds(
            plane, self.dht.namespace, self.shapes, self.cfg.diloco.compression, self.timeouts,
            members=lambda fragment, step: round_peers(self.peer_id, self.live(), fragment, step, self.cfg.diloco.tau),
            left=lambda fragment, step: {p for p, r in self.live().items() if left_round(r, fragment, step, self.cfg.diloco.tau)},
            others=lambda: self.expected_group() - 1, arrival=self.arrival_s,
            donors=lambda: state_donors(self.peer_id, self.live()),
            everyone=lambda: transport_addresses(self.peer_id, self.live()),
            follower=self.role.satellite, swarm_key=swarm_key, on_refused=self.refusals,
            deposit_targets=self.deposit_targets, refresh_peers=self.read_peers,
        )
        await self.rounds.open(self.dht.dht)

    async def _check_manifest(self) -> None:
        theirs = await self.dht.get_manifest()
        if theirs is None:
            if self.cfg.net.join:
                logger.info("no manifest for run %s yet: this island writes it", self.cfg.net.run_id)
            await self.dht.store_manifest(self.manifest)
            return
        diffs = manifest_differences(self.manifest, theirs)
        if diffs:
            raise ManifestMismatch(
                f"this node does not match run {self.cfg.net.run_id!r}: "
                + describe_differences(diffs, mine="this node", theirs="the run")
            )

    def record(self) -> IslandRecord:
        s, net = self.status, self.cfg.net
        return IslandRecord(
            peer_id=self.peer_id, role=net.role, step=s.step,
            batch_tokens=s.batch_tokens or self.cfg.train.batch_size * self.cfg.train.seq_len,
            tokens_per_s=round(s.tokens_per_s, 3), step_seconds=round(s.step_seconds, 6),
            next_sync=list(s.next_sync), last_sync=list(s.last_sync), contact=net.contact,
            version=self.version, time=self._now(), state=s.state, maddrs=self.maddrs(), shard=s.shard,
            contact_until=self._contact_until(), final=s.final, data=self.data_address, since=s.since,
        )

    def _contact_until(self) -> float | None:
        if self.contact is None or not self.contact.in_contact():
            return None
        return self._now() + min(self.contact.remaining_s(), 1e9)

    @property
    def round_budget_s(self) -> float:
        """The contact a satellite needs left to start a round: deposit, then take the swarm's values."""
        return self.cfg.net.match_wait_s + 1.0

    def report(self) -> None:
        """Pass on the refusals and bans seen since the last call (from the DHT's process too)."""
        for what in self.refusals.drain():
            self.on_refused(what)
        if self.rounds is not None:
            banned, self.rounds.banned_events = self.rounds.banned_events, []
            for peer in banned:
                self.on_banned(peer)

    def counts(self) -> dict[str, int]:
        """Peers seen (live records, this island's included), peers banned, records dropped since start."""
        banned = 0 if self.rounds is None else len(self.rounds.reputation.banned(self._monotonic()))
        return {
            "peers": len(self.live()), "banned": banned,
            "forged": self.dht.forged_records if self.dht else 0, "malformed": self.dht.malformed_records if self.dht else 0,
        }

    async def refresh(self) -> None:
        """Publish this island's record (and the manifest), then read everyone's."""
        self.report()
        if self._out_of_contact() and self.status.state != "left":
            return  # a satellite out of contact reaches nobody
        try:
            await self.dht.store_island(self.record())
            if self.status.state != "left" and self.manifest is not None:
                await self.dht.store_manifest(self.manifest)
            self._read(await self.dht.islands())
        except Exception as e:  # noqa: BLE001 - the DHT may be briefly unreachable
            logger.warning("DHT refresh failed: %r", e)
        await self.redial()

    def _read(self, peers: dict[str, IslandRecord]) -> None:
        self.peers = peers
        self.known = remember(self.known, peers)

    async def redial(self) -> None:
        """Dial again the known peers the DHT has lost (after a partition, it would not by itself)."""
        targets = redial_targets(self.known, self._now(), self.peer_id, self.cfg.net.join)
        if self.rounds is not None:
            now = self._monotonic()
            targets = {p: m for p, m in targets.items() if not self.rounds.reputation.is_banned(p, now)}
        try:
            back = await self.dht.redial(targets)
        except Exception as e:  # noqa: BLE001 - next refresh tries again
            logger.info("re-dialling lost peers failed: %r", e)
            return
        for peer in back:
            logger.info("peer %s is reachable again: back in the DHT", peer)

    async def read_peers(self, timeout_s: float | None = None) -> None:
        """Read everyone's records (without publishing this island's), bounded tightly: it runs
        before every round, and a slow read must not make this island late for the round."""
        if self._out_of_contact():
            return
        try:
            self._read(await asyncio.wait_for(self.dht.islands(), timeout=timeout_s or self.timeouts.records_read_s))
        except Exception as e:  # noqa: BLE001 - keep the last view
            logger.info("reading the island records failed: %r", e)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            await self.refresh()

    def _out_of_contact(self) -> bool:
        return self.role.satellite and not self.contact.in_contact()

    def live(self) -> dict[str, IslandRecord]:
        """Fresh records, without the peers this island banned (it does not wait for them)."""
        live = live_records(self.peers, self._now())
        if self.rounds is not None:
            now = self._monotonic()
            live = {p: r for p, r in live.items() if not self.rounds.reputation.is_banned(p, now)}
        return live

    def _other_islands(self, training: bool = True) -> dict[str, IslandRecord]:
        """The live islands (satellites excluded) other than this node; by default only those training."""
        return other_islands(self.peer_id, self.live(), training)

    def peer_progress(self, fragment: int) -> list[tuple[int, int]]:
        """(step, start step of the last round applied to `fragment`) of the other live, training islands."""
        return peer_progress(self._other_islands().values(), fragment)

    def arrival_s(self, step: int) -> float:
        """How long until the last live, training island still short of `step` gets there (records.arrival_s)."""
        return arrival_s(step, self._other_islands().values(), self._now())

    def expected_group(self) -> int:
        """Members a round waits for: this node and the live islands (never a satellite)."""
        return expected_group(self.peer_id, self.live())

    def deposit_targets(self) -> list[str]:
        """The islands a satellite may deposit with (records.deposit_candidates), in the order to try:
        the live ones at random, so that satellites spread over the islands; else the most recent."""
        live = self.live()
        islands = deposit_candidates(self.peer_id, live, self.known, self._now())
        if any(p in live for p in islands):
            random.shuffle(islands)
        return islands

    def swarm_step(self) -> int | None:
        """The furthest live island's step now, extrapolated from its record by its recent pace."""
        return swarm_step(self._other_islands().values(), self._now())

    def peer_step_seconds(self) -> list[float]:
        """The other live, training islands' step times (compute only) from their records."""
        return [r.step_seconds for r in self._other_islands().values() if r.step_seconds > 0]

    def live_islands(self) -> int:
        """Islands (satellites excluded) that would take part in a round now, this one included."""
        return 1 + len(self._other_islands(training=False))

    def ready_islands(self) -> int:
        """Islands that have opened their rounds (their record names a transport address), this one included."""
        return 1 + sum(1 for r in self._other_islands(training=False).values() if r.data)

    async def wait_for_islands(
        self, count: int, timeout_s: float, shutdown: Callable[[], bool], on_wait: Callable[[int], None], ready: bool = False,
    ) -> int:
        """Wait (bounded) until `count` islands are present (`ready`: and have opened their rounds),
        or until another island has trained a step (the run is under way: this island joins it, as
        one restarted without its checkpoint does); the number seen."""
        counted = self.ready_islands if ready else self.live_islands
        deadline = self._monotonic() + timeout_s
        seen = counted()
        while seen < count and not self.under_way() and self._monotonic() < deadline and not shutdown():
            on_wait(seen)
            await self._pause(0.5)
            await self.refresh()
            seen = counted()
        return seen

    async def wait_for_end(self, step: int, timeout_s: float, shutdown: Callable[[], bool], on_wait: Callable[[int], None]) -> set[str]:
        """At the end of the run: publish this island's last step, then wait (bounded) until every
        other live, training island has reached `step` too, so that the last rounds (FragmentSync.agree)
        find them all. The peer ids of the other islands that have."""
        await self.refresh()
        deadline = self._monotonic() + timeout_s
        while True:
            ready, behind = finished(self._other_islands(), step)
            if not behind or self._monotonic() >= deadline or shutdown():
                return ready
            on_wait(behind)
            await self._pause(0.5)
            await self.read_peers(timeout_s=self.timeouts.end_read_s)

    async def compare_final(self, check: int, fps: list[list[float]], peers: set[str], timeout_s: float) -> list[list[list[float]]]:
        """Publish this island's fingerprints of its agreed fragments after its `check`-th look at the
        end of the run, and read the others' (`peers`, those that finished with it) until each has
        published its own for that look, has left, or `timeout_s` has passed: their fingerprints."""
        self.status.final = {"check": check, "fp": fps}
        await self.refresh()
        deadline = self._monotonic() + timeout_s
        while True:
            posted, waiting = final_fingerprints(self.peers, peers, self.live(), check)
            if not waiting or self._monotonic() >= deadline:
                return posted
            await self._pause(0.3)
            await self.read_peers(timeout_s=self.timeouts.end_read_s)

    def under_way(self) -> bool:
        """Whether another island has trained past step 0 (by its record)."""
        ahead = self.ahead()
        return ahead is not None and ahead[1] > 0

    def typical_step(self) -> int | None:
        """Where most other training islands are (records.typical_step), if there are any."""
        return typical_step(self._other_islands().values())

    def ahead(self) -> tuple[str, int] | None:
        """(peer, step) of the furthest training island (not satellite) other than this one, if any."""
        return furthest(self._other_islands())

    def choose_shard(self) -> int:
        return choose_shard(self.peer_id, {**self.live(), self.peer_id: self.record()}, self.cfg.data.num_shards)

    async def withdraw(self) -> None:
        """Mark this island's record as left (once), so that nobody waits for it any more."""
        if self.dht is None or self.status.state == "left":
            return
        self.status.state = "left"
        try:
            await asyncio.wait_for(self.dht.store_island(self.record()), timeout=self.timeouts.withdraw_s)
        except Exception as e:  # noqa: BLE001 - best effort on the way out
            logger.info("could not withdraw the island record: %r", e)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        await self.withdraw()
        if self.rounds is not None:
            await self.rounds.close()
        if self.dht is not None:
            await asyncio.to_thread(self.dht.shutdown)

