"""What every implementation of the island's rounds shares (node/sync.py's `Rounds`): the state of
update validation (norm history per fragment, the peers' reputation, bans to report), the
satellites' deposits (deposit.py: folded into an island's contribution, or sent by a satellite),
and reading the island records just before a round.

Its subclass: `DirectRounds` (direct.py, the project's own protocol); in tests, tests/fakes.py has
its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from hivemind import DHT
from islands.node.timeouts import Timeouts
from islands.protocols.admission import derive
from islands.protocols.diloco import Contribution, RoundResult
from islands.protocols.outer import fold_deposits
from islands.protocols.validation import NormHistory, Reputation, check_deposit

from .deposit import DepositBox

logger = logging.getLogger(__name__)

STALE_WEIGHT = 1e-6
"""A member whose base is stale takes part in a round with this weight: its delta counts ~0, and
the weights stay positive (a part's weight may be 0, but a round of zero total weight has no mean)."""


class RoundsBase:
    def __init__(
        self, namespace: str, shapes: Sequence[Sequence[tuple[str, tuple[int, ...]]]], compression: str,
        timeouts: Timeouts | None = None, follower: bool = False, swarm_key: bytes | None = None,
        on_refused: Callable[[str], None] | None = None, deposit_targets: Callable[[], list[str]] | None = None,
        refresh_peers: Callable[[], Awaitable[None]] | None = None,
    ):
        """`follower` (satellites): never a member of a round; `average` deposits the contribution with
        one of `deposit_targets()` (islands, in the order to try) instead (deposit.py).
        `namespace`: the run's DHT prefix (admission.namespace); `swarm_key`: deposits and state
        downloads admit only peers that show a tag made with it; `on_refused(what)` hears of every
        refusal; `refresh_peers()`: reads the island records (bounded)."""
        self.namespace = namespace
        self.shapes = shapes
        self.names = [[n for n, _ in frag] for frag in shapes]
        self.compression = compression
        self.timeouts = timeouts or Timeouts()
        self.follower = follower
        self.round_key = None if swarm_key is None else derive(swarm_key, "rounds")
        self.on_refused = on_refused or (lambda what: None)
        self.deposit_targets = deposit_targets or (lambda: [])
        self.deposits: DepositBox | None = None
        self.reputation = Reputation()
        self.history = [NormHistory() for _ in shapes]
        """Per fragment, the norms of the averaged pseudo-gradients accepted lately (validation.py)."""
        self.banned_events: list[str] = []
        """Peers banned since the caller last looked (it logs them)."""
        self.refresh_peers = refresh_peers
        self._records_read: asyncio.Future | None = None
        self._records_read_started = float("-inf")

    # --- deposits ----------------------------------------------------------------------------------

    async def open_deposits(self, dht: DHT) -> None:
        """Islands take satellites' deposits from now on; a satellite can send them."""
        p2p = await dht.replicate_p2p()
        self.deposits = DepositBox(
            p2p, self.namespace, self.shapes, self.compression, self.round_key,
            refuse_peer=lambda peer: self.reputation.is_banned(peer, time.monotonic()), on_refused=self.on_refused, receive_s=self.timeouts.allreduce_s,
        )
        if not self.follower:
            await self.deposits.open()

    async def close_deposits(self) -> None:
        if self.deposits is not None:
            await self.deposits.close()

    def fold_deposits(self, c: Contribution) -> Contribution:
        """The contribution with the satellites' deposits for its fragment folded in (outer.fold_deposits);
        a deposit whose check fails (validation.check_deposit) is dropped and logged."""
        if self.deposits is None:
            return c
        kept = []
        for d in self.deposits.take(c.fragment):
            why = check_deposit(d.delta, c.delta, self.history[c.fragment], d.staleness)
            if why is not None:
                self.on_refused(f"deposit from {d.peer}: {why}")
                logger.warning("fragment %d: dropped the deposit of %s: %s", c.fragment, d.peer, why)
                continue
            kept.append(d)
        if not kept:
            return c
        delta, weight = fold_deposits(c.delta, c.weight, [(d.delta, d.weight) for d in kept])
        return dataclasses.replace(c, delta=delta, weight=weight, deposits=len(kept), deposit_bytes=sum(d.nbytes for d in kept))

    async def deposit(self, c: Contribution) -> RoundResult:
        """A satellite's round: its contribution deposited with the first island that takes it."""
        started = time.monotonic()
        for island in self.deposit_targets()[:2] if self.deposits is not None else []:
            try:
                sent = await self.deposits.send(
                    island, c.fragment, c.round, c.delta, c.weight, c.staleness, timeout_s=self.timeouts.allreduce_s,
                )
            except Exception as e:  # noqa: BLE001 - refused, gone, timed out: try the next
                logger.info("fragment %d: deposit with %s failed: %r", c.fragment, island, e)
                continue
            return RoundResult(
                outcome="ok", delta=c.delta, group_size=2, weight=c.weight, bytes_sent=sent,
                seconds=time.monotonic() - started, staleness=c.staleness, deposited_with=island,
            )
        return RoundResult(outcome="failed", delta=c.delta, group_size=1, weight=c.weight, seconds=time.monotonic() - started)

    # --- the records just before a round -----------------------------------------------------------

    def prefetch(self) -> None:
        """Start reading the island records for a round about to start: over a long link the read
        takes a few round trips, which the round then does not wait for (see `read_peers`)."""
        if self.refresh_peers is None:
            return
        if self._records_read is None or self._records_read.done() or not self._records_read_fresh():
            self._start_records_read()

    async def read_peers(self) -> None:
        """The records as of at most Timeouts.records_fresh_s ago (a prefetched read, or a new one)."""
        if self.refresh_peers is None:
            return
        if self._records_read is None or not self._records_read_fresh():
            self._start_records_read()
        await asyncio.shield(self._records_read)  # bounded inside refresh_peers

    def _records_read_fresh(self) -> bool:
        return time.monotonic() - self._records_read_started <= self.timeouts.records_fresh_s

    def _start_records_read(self) -> None:
        self._records_read_started = time.monotonic()
        self._records_read = asyncio.ensure_future(self.refresh_peers())

    def _ban(self, suspects: list[str], others: list[str], flagrant: list[str] = ()) -> None:
        """A rejected round: blame `suspects` (else the others not trusted lately), ban `flagrant`
        ones at once (validation.member_flagrant); log new bans."""
        now = time.monotonic()
        for peer in self.reputation.blame(suspects, others, now, flagrant):
            why = "its part was far out of bounds" if peer in flagrant else "its rounds were rejected repeatedly"
            logger.warning("banning peer %s for %.0f s: %s", peer, self.reputation.banned_until[peer] - now, why)
            self.banned_events.append(peer)
