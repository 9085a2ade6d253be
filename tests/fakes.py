"""In-process fakes for the island core: a swarm of records on a clock the test controls, and
rounds between islands of one event loop with scripted faults. No sockets, no processes, no
sleeping: every wait polls the board and moves the fake clock, so a scenario runs the same way
on an idle machine and a loaded one."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

import torch
from islands.node.config import Config
from islands.node.contact import ContactClock
from islands.node.island import IslandCore
from islands.node.net.base import STALE_WEIGHT
from islands.node.network import Network
from islands.node.roles import IslandRole, SatelliteRole
from islands.protocols.consensus import TOLERANCE, consensus_needed
from islands.protocols.diloco import Contribution, DiLoCoConfig, RoundResult
from islands.protocols.outer import fold_deposits
from islands.protocols.records import (
    IslandRecord,
)
from islands.protocols.validation import NormHistory, round_verdict, tensors_norm


class Clock:
    """Seconds that pass only when the test (or a poll) says so."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class Board:
    """The swarm's records as the DHT holds them: the newest record of each peer wins. In a
    partition each side sees the other side's records as they were at the cut, until they lapse."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.records: dict[str, IslandRecord] = {}
        self.side: dict[str, int] = {}
        """peer -> side of a partition; peers on different sides cannot reach each other."""
        self.at_cut: dict[str, IslandRecord] = {}

    def store(self, record: IslandRecord) -> None:
        old = self.records.get(record.peer_id)
        if old is None or record.time >= old.time:
            self.records[record.peer_id] = record

    def reaches(self, a: str, b: str) -> bool:
        return self.side.get(a, 0) == self.side.get(b, 0)

    def read(self, reader: str) -> dict[str, IslandRecord]:
        return {p: r if self.reaches(reader, p) else self.at_cut[p] for p, r in self.records.items()}

    def partition(self, *sides: set[str]) -> None:
        self.side = {p: i for i, side in enumerate(sides) for p in side}
        self.at_cut = dict(self.records)

    def heal(self) -> None:
        self.side = {}


class FakeNetwork(Network):
    """The node's Network, its decisions and waits as they are, over a Board instead of a DHT,
    on the board's clock; its waits between two looks move that clock instead of sleeping."""

    def __init__(self, board: Board, peer_id: str, cfg: Config, role: IslandRole | SatelliteRole | None = None):
        super().__init__(cfg, version="fake", role=role)
        self.board, self._peer_id = board, peer_id

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def clock(self) -> Clock:
        return self.board.clock

    def maddrs(self) -> list[str]:
        return []

    def _now(self) -> float:
        return self.board.clock()

    def _monotonic(self) -> float:
        return self.board.clock()

    async def _pause(self, seconds: float) -> None:
        self.clock.advance(seconds)
        await asyncio.sleep(0)  # the others take their turn

    def report(self) -> None:
        """Every step: this island's record is published and the others' read (no refresh period)."""
        if self._out_of_contact():
            return
        self.board.store(self.record())
        self.peers = self.board.read(self.peer_id)

    async def refresh(self) -> None:
        self.report()

    async def read_peers(self, timeout_s: float | None = None) -> None:
        if not self._out_of_contact():
            self.peers = self.board.read(self.peer_id)

    def counts(self) -> dict[str, int]:
        return {"peers": len(self.live()), "banned": 0, "forged": 0, "malformed": 0}

    async def withdraw(self) -> None:
        if self.status.state != "left":
            self.status.state = "left"
            self.board.store(self.record())


@dataclasses.dataclass
class Gathering:
    """One round of one fragment (or one consensus round) as the members arrive."""

    expected: set[str]
    given: dict[str, object] = dataclasses.field(default_factory=dict)
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    failed: bool = False


class Hub:
    """Rounds between the islands of one event loop: a round completes when every member its
    first arrival expected (the live islands it saw) has contributed, with the token-weighted
    average, as hivemind's all-reduce gives it; scripted faults change that per round."""

    def __init__(self):
        self.gatherings: dict[tuple, Gathering] = {}
        self.dead: set[str] = set()
        self.split: dict[tuple[int, int], str] = {}
        """(fragment, round) -> the member that gets `failed` while the others get `ok`."""
        self.crash: dict[tuple[int, int], str] = {}
        """(fragment, round) -> the member that dies in that round, once it has contributed."""
        self.poison: dict[tuple[int, int], str] = {}
        """(fragment, round) -> the member whose contribution arrives 1000 times too large."""
        self.states: dict[str, tuple[Callable, FakeNetwork, FakeRounds]] = {}
        self.deposits: dict[tuple[str, int], list[Contribution]] = {}
        """(island, fragment) -> satellites' contributions deposited with it, not yet folded in."""
        self.log: list[tuple] = []
        self.no_state: set[str] = set()
        """Islands whose state downloads fail (gone mid-download, say)."""

    def kill(self, peer: str) -> None:
        """The member dies: every round waiting for it fails at once for the others."""
        self.dead.add(peer)
        for g in self.gatherings.values():
            if peer in g.expected and not g.done.is_set():
                g.failed = True
                g.done.set()

    async def gather(self, key: tuple, me: str, expected: set[str], given: object) -> Gathering:
        g = self.gatherings.setdefault(key, Gathering(expected))
        g.given[me] = given
        if g.expected & self.dead:
            g.failed = True
        if g.failed or set(g.given) >= g.expected:
            g.done.set()
        await g.done.wait()
        return g


class FakeRounds:
    """The core's rounds (node/sync.Rounds) over a Hub."""

    compression = "none"

    def __init__(self, hub: Hub, network: FakeNetwork):
        self.hub, self.network = hub, network
        self.history: dict[int, NormHistory] = {}

    def prefetch(self) -> None:
        pass

    def fold_deposits(self, c: Contribution) -> Contribution:
        kept = self.hub.deposits.pop((self.network.peer_id, c.fragment), [])
        if not kept:
            return c
        delta, weight = fold_deposits(c.delta, c.weight, [(d.delta, d.weight) for d in kept])
        return dataclasses.replace(c, delta=delta, weight=weight, deposits=len(kept))

    def _deposit(self, c: Contribution) -> RoundResult:
        """A satellite's round: its contribution left with the first live island it sees."""
        islands = sorted(p for p, r in self.network.live().items() if r.role == "island" and r.state == "training")
        if not islands:
            return RoundResult(outcome="failed", delta=c.delta, group_size=1, weight=c.weight)
        self.hub.deposits.setdefault((islands[0], c.fragment), []).append(c)
        return RoundResult(outcome="ok", delta=c.delta, group_size=2, weight=c.weight, staleness=c.staleness, deposited_with=islands[0])

    def _members(self) -> set[str]:
        return {self.network.peer_id} | {p for p, r in self.network.live().items() if r.role == "island"}

    async def average(self, c: Contribution, wait_s: float | None = None) -> RoundResult:
        me = self.network.peer_id
        if self.network.role.satellite:
            return self._deposit(c)
        failed = RoundResult(outcome="failed", delta=c.delta, group_size=1, weight=c.weight)
        if self.network.expected_group() <= 1:
            return RoundResult(outcome="solo", delta=c.delta, group_size=1, weight=c.weight)
        if not all(self.network.board.reaches(me, p) for p in self._members()):
            return failed  # a member it cannot reach: the real round waits for it, then fails
        if self.hub.crash.get((c.fragment, c.round)) == me:
            self.hub.kill(me)
        sent = c
        if self.hub.poison.get((c.fragment, c.round)) == me:
            sent = dataclasses.replace(c, delta={n: t * 1000.0 for n, t in c.delta.items()})
        history = self.history.setdefault(c.fragment, NormHistory())
        reference = history.reference(tensors_norm(c.delta.values()))
        g = await self.hub.gather(("delta", c.fragment, c.round), me, self._members(), (sent, reference))
        self.hub.log.append(("delta", c.fragment, c.round, me, not g.failed))
        if g.failed or self.hub.split.get((c.fragment, c.round)) == me:
            return failed
        members = [m for m, _ in g.given.values()]
        weights = [max(m.weight, STALE_WEIGHT) for m in members]  # as the real rounds: a stale member weighs ~0, not 0
        total = sum(weights)
        delta = {n: sum(m.delta[n] * (w / total) for m, w in zip(members, weights, strict=True)) for n in c.delta}
        # every member's check of the round's result (protocols/validation.py), as the real rounds run it
        why, norm, _ = round_verdict(delta, c.delta, {p: ref for p, (_, ref) in g.given.items()})
        if why is not None:
            return RoundResult(outcome="rejected", delta=c.delta, group_size=len(members), weight=c.weight, reason=why)
        self.history[c.fragment].accept(norm)
        return RoundResult(
            outcome="ok", delta=delta, group_size=len(members), weight=total, staleness=c.staleness,
            consensus=consensus_needed((m.fingerprint for m in members if not m.staleness), TOLERANCE["none"]),
        )

    async def consensus(self, fragment, round_, global_, momentum, stale=False, apart=(0.0, 0.0), wait_s=None):
        me = self.network.peer_id
        g = await self.hub.gather(("consensus", fragment, round_), me, self._members(), (global_, momentum))
        self.hub.log.append(("consensus", fragment, round_, me, not g.failed))
        if g.failed:
            return None
        values = list(g.given.values())
        mean = lambda i: {n: sum(v[i][n] for v in values) / len(values) for n in global_}  # noqa: E731
        return mean(0), mean(1), 0

    def share_state(self, provider: Callable, priority: float) -> None:
        self.hub.states[self.network.peer_id] = (provider, self.network, self)

    async def download(self, fragment: int, timeout_s: float, values_only: bool = False, min_round: int = 0) -> tuple[dict, list] | None:
        """From the donor furthest ahead that gives it (the node's refresh sets a donor's priority to its step)."""
        me = self.network.peer_id
        donors = [
            (network.status.step, peer) for peer, (_, network, _) in self.hub.states.items()
            if peer != me and peer not in self.hub.dead and self.network.board.reaches(me, peer)
        ]
        for _, peer in sorted(donors, reverse=True):  # as records.state_donors: the furthest first
            provider, _, rounds = self.hub.states[peer]
            got = None if peer in self.hub.no_state else provider(fragment)
            if got is not None and got[0]["round"] >= min_round:
                break
        else:
            return None
        meta, tensors = got
        if values_only:
            return meta, tensors[: len(tensors) // 2]
        # as the real rounds: the donor's accepted norms come with its state
        self.history.setdefault(fragment, NormHistory()).seed(list(rounds.history.get(fragment, NormHistory()).norms))
        return meta, tensors


class Events:
    """The event log, in memory."""

    def __init__(self):
        self.records: list[dict] = []

    def emit(self, event: str, **fields) -> dict:
        record = {"event": event, **fields}
        self.records.append(record)
        return record

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.records if e["event"] == kind]


LAYOUT = [["a"], ["b"]]
TOKENS = 100
STEP_S = 0.5
"""Fake seconds one inner step takes."""


def config(window: int = 10, steps: int = 40, **net) -> Config:
    cfg = Config(diloco=DiLoCoConfig(window=window, fragments=2))
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, steps=steps), net=dataclasses.replace(cfg.net, **net),
    )


async def _run_torch(fn, *args):
    return fn(*args)


class ToyIsland:
    """An island of the in-process tier: two fragments of six values, an inner step that pulls
    them towards this island's own target, the real island core, a fake network and rounds."""

    def __init__(self, name: str, board: Board, hub: Hub, cfg: Config, target: float, contact: str | None = None):
        """`contact`: a satellite's windows (e.g. "up 10s every 30s") on the board's clock."""
        self.name = name
        self.cfg = cfg
        self.target = {n: torch.full((6,), target) + torch.arange(6.0) * 0.1 for n in ("a", "b")}
        self.params = {n: torch.zeros(6) for n in ("a", "b")}
        role = IslandRole() if contact is None else SatelliteRole(ContactClock(contact, clock=board.clock))
        self.network = FakeNetwork(board, name, cfg, role)
        self.events = Events()
        self.totals = {"bytes_sent": 0, "bytes_recv": 0, **{f"syncs_{o}": 0 for o in ("ok", "solo", "failed", "skipped_no_contact", "rejected")}}
        self.core = IslandCore(
            cfg, LAYOUT, self.params, self.network, role, self.events, self.totals, _run_torch,
            rounds=FakeRounds(hub, self.network),
        )
        self.hub = hub
        self.step = 0

    def train(self) -> None:
        with torch.no_grad():
            for n, p in self.params.items():
                p.add_(0.1 * (self.target[n] - p))

    async def join(self) -> None:
        """Start: catch up with the swarm if it is ahead, then sync on the schedule."""
        await self.network.refresh()
        self.core.begin(self.step, 0, TOKENS)
        caught_up = await self.core.catch_up(self.step, _Quiet())
        if caught_up is not None:
            self.step = caught_up
        self.core.start(self.step)
        self.network.report()

    async def run(self, until: int) -> None:
        """Train to step `until`, or until this island dies (Hub.crash): then its record stops."""
        while self.step < until:
            self.step = await self.core.before_step(self.step)
            if self.step >= until:
                return
            self.train()
            self.step += 1
            self.network.clock.advance(STEP_S)
            await self.core.after_step(self.step, TOKENS)
            await asyncio.sleep(0)  # the islands of the test take turns, step by step
            if self.name in self.hub.dead:
                for pending in self.core.sync.pending.values():
                    pending.task.cancel()
                return
            self.core.publish(self.step, TOKENS / STEP_S, STEP_S)

    async def leave(self) -> None:
        """The end of the run: flush, agree with the others, withdraw."""
        await self.core.flush(self.step, leaving=False)
        await self.core.agree(self.step, lambda: False, _Quiet())
        await self.core.withdraw()

    def syncs(self) -> list[tuple[int, int, str]]:
        """(start step, fragment, outcome) of every round, in the order they were applied."""
        return [(e["step"], e["fragment"], e["outcome"]) for e in self.events.of("sync")]


class _Quiet:
    def note(self, text: str) -> None:
        pass
