"""Fragment averaging across islands: one hivemind averager per fragment, matched by round.

Each fragment p has its own `DecentralizedAverager` under the prefix
`<run>:frag<p>`. Before each round the island sets the averager's group key
to the round number, so islands meet in the same round of the same fragment
whatever their wall clocks say, and sets the target group size to the
number of live islands, so a round starts as soon as everyone is there. The
round is token-weighted (hivemind's `weight`); every network wait has a
bound, and a round that finds nobody or fails comes back as "failed" with
the island's own update.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence

import torch
from hivemind import DHT
from hivemind.compression import (
    CompressionBase,
)
from hivemind.utils import get_dht_time
from islands.node.net.codecs import compression_codec, consensus_compression, install_codec_fixes
from islands.node.timeouts import Timeouts
from islands.protocols.admission import admission_tag, untagged_members
from islands.protocols.compression import BLOCK
from islands.protocols.consensus import TOLERANCE, consensus_needed
from islands.protocols.diloco import Contribution, RoundResult
from islands.protocols.validation import (
    check_consensus,
    check_update,
    consensus_bound,
    flatten,
    member_report_bad,
    spoiled_spans,
    tensors_norm,
)

from .averager import IslandAverager, round_group_bits
from .base import STALE_WEIGHT, RoundsBase

logger = logging.getLogger(__name__)

BYTES_PER_VALUE = {"none": 4, "fp16": 2, "int8": 1 + 4 / BLOCK}


PART_SIZE_BYTES = 2**21
"""A fragment crosses the wire in parts of this size. hivemind's default, 512 KiB, averaged 100 MB
between two peers in 1.59 s here, 2 MiB in 1.23 s (bench.allreduce); a part must stay well below the
daemon's 4 MiB message limit."""


def allreduce_wire_bytes(num_values: int, group_size: int, compression: str) -> int:
    """Bytes one peer sends (and receives) in a butterfly all-reduce of equal shares:
    (n-1)/n of its vector out to the reducers, then (n-1)/n of the result back to the others."""
    if group_size <= 1:
        return 0
    return int(2 * num_values * BYTES_PER_VALUE[compression] * (group_size - 1) / group_size)


class FragmentAveraging(RoundsBase):
    """The averaging side of Streaming DiLoCo: `average(contribution)` for any fragment."""

    def __init__(
        self,
        dht: DHT,
        namespace: str,
        shapes: Sequence[Sequence[tuple[str, tuple[int, ...]]]],
        compression: str,
        expected_group: Callable[[], int],
        timeouts: Timeouts | None = None,
        peer_progress: Callable[[int], list[tuple[int, int]]] | None = None,
        arrival: Callable[[int], float] | None = None,
        refresh_peers: Callable[[], Awaitable[None]] | None = None,
        overlap: int = 0,
        follower: bool = False,
        part_size_bytes: int = PART_SIZE_BYTES,
        swarm_key: bytes | None = None,
        on_refused: Callable[[str], None] | None = None,
        deposit_targets: Callable[[], list[str]] | None = None,
    ):
        """`follower` (satellites): never a member of a round; `average` deposits the contribution with
        one of `deposit_targets()` (islands, in the order to try) instead (deposit.py).

        `namespace`: the run's DHT prefix (admission.namespace); `swarm_key`: rounds admit only members
        that show a tag made with it; `on_refused(what)` hears of every join this island refuses."""
        install_codec_fixes()
        super().__init__(
            namespace, shapes, compression, compression_codec(compression), timeouts, follower, swarm_key, on_refused,
            deposit_targets, refresh_peers,
        )
        timeouts = self.timeouts
        self.peer_id = dht.peer_id.to_base58()
        self.peer_progress = peer_progress or (lambda fragment: [])
        self.arrival = arrival or (lambda step: 0.0)
        """Seconds until the last live island still short of a step gets there (records.arrival_s)."""
        self.overlap = overlap
        self.wait_s = self._base_wait_s = timeouts.match_wait_s * (2 if follower else 1)
        """The current match wait: doubled after a round that found nobody (up to max_match_wait_s),
        so that an island that fell behind is waited for until it catches up; reset by a good round."""
        self.expected_group = expected_group
        """How many members a round should wait for: live islands and satellites in contact."""
        self.num_values = [sum(int(torch.Size(s).numel()) for _, s in frag) for frag in shapes]
        self.averagers = [
            IslandAverager(
                [torch.zeros(s, dtype=torch.float32) for _, s in frag],
                dht,
                start=False,
                prefix=f"{namespace}:frag{p}",
                min_group_size=2,
                min_matchmaking_time=min(2.0, timeouts.match_wait_s),
                request_timeout=timeouts.request_s,
                allreduce_timeout=timeouts.allreduce_s,
                next_chunk_timeout=timeouts.next_chunk_s,
                sender_timeout=timeouts.next_chunk_s / 2,
                reducer_timeout=timeouts.next_chunk_s,
                compression=compression_codec(compression),
                allow_state_sharing=False,
                client_mode=follower,
                declare_state_period=5,
                shutdown_timeout=2,
                part_size_bytes=part_size_bytes,
            )
            for p, frag in enumerate(shapes)
        ]
        for averager in self.averagers:  # before their processes fork: they keep these
            averager.round_key = self.round_key
            averager.on_refused = on_refused or (lambda what: None)
            averager.run_in_background(await_ready=True)

    async def average(self, contribution: Contribution, wait_s: float | None = None) -> RoundResult:
        """One round of the contribution's fragment; `wait_s`: match for at least that long."""
        c = contribution
        # read the records just before the round: an island that left or went ahead is then counted right
        await self.read_peers()
        if self.follower:
            return await self.deposit(c)
        expected = self.expected_group()
        if expected <= 1:
            return RoundResult(outcome="solo", delta=c.delta, group_size=1, weight=c.weight)
        if any(step > c.step + self.overlap or last >= c.step for step, last in self.peer_progress(c.fragment)):
            # another island has already applied this round (its record says so): nobody will
            # come; skip it at once to catch up instead of waiting
            self.wait_s = self._base_wait_s
            return RoundResult(outcome="failed", delta=c.delta, group_size=1, weight=c.weight)
        started = time.monotonic()
        # a delta taken against a base the swarm no longer has counts ~0 (a satellite's: less), see
        # outer.contribution_weight; hivemind needs a positive weight
        weight = max(c.weight, STALE_WEIGHT)
        own_norm = tensors_norm(c.delta.values())
        # an island still training towards this round's step is waited for until it should be here
        # (bounded): else the others, pairing up after the usual wait, leave it behind for good
        wait_s = max(wait_s or 0.0, self.wait_s, min(self.timeouts.max_match_wait_s, self._base_wait_s + self.arrival(c.step)))
        gathered, delta = await self._allreduce(
            c.fragment, round_group_bits(c.round, "delta"), expected, c.delta, weight=weight,
            gather={"round": c.round, "step": c.step, "weight": weight, "fp": c.fingerprint, "stale": c.staleness, "norm": own_norm},
            compression=self.codec, wait_s=wait_s,
        )
        seconds = time.monotonic() - started
        if gathered is None:
            # the others are there (by their records) but not in this round: one of us is behind
            if not self.follower:  # a satellite that missed a round just keeps accumulating
                self.wait_s = min(self.timeouts.max_match_wait_s, 2 * self.wait_s)
            return RoundResult(outcome="failed", delta=c.delta, group_size=1, weight=c.weight, seconds=seconds)
        self.wait_s = self._base_wait_s
        rounds = {m.get("round") for m in gathered.values()}
        if rounds != {c.round}:
            logger.warning("fragment %d: group mixed rounds %s; keeping own update", c.fragment, rounds)
            return RoundResult(outcome="failed", delta=c.delta, group_size=1, weight=c.weight, seconds=seconds)
        wire = allreduce_wire_bytes(self.num_values[c.fragment], len(gathered), self.compression)
        why, norm = self._validate(c, gathered, delta, own_norm)
        norm_ratio = round(norm / own_norm, 4) if own_norm > 0 and math.isfinite(norm) else None
        if why is not None:
            logger.warning("fragment %d round %d rejected: %s; applying own update", c.fragment, c.round, why)
            return RoundResult(
                outcome="rejected", delta=c.delta, group_size=len(gathered), weight=c.weight,
                bytes_sent=wire, bytes_recv=wire, seconds=seconds, staleness=c.staleness, reason=why,
                norm_ratio=norm_ratio,
            )
        return RoundResult(
            outcome="ok", delta=delta, group_size=len(gathered),
            weight=sum(float(m.get("weight", 0.0)) for m in gathered.values()),
            bytes_sent=wire, bytes_recv=wire, seconds=seconds, staleness=c.staleness, norm_ratio=norm_ratio,
            # a stale member's base differs by design: it takes the swarm's afterwards (FragmentSync._rebase)
            consensus=consensus_needed(
                (m.get("fp", []) for m in gathered.values() if not m.get("stale")), TOLERANCE[self.compression]
            ),
        )

    def _validate(
        self, c: Contribution, gathered: dict, delta: dict[str, torch.Tensor], own_norm: float
    ) -> tuple[str | None, float]:
        """(why a round's result must not be applied (validation.py) or None, the result's norm);
        blames and bans peers."""
        now = time.monotonic()
        norm = math.nan
        others = [p for p in gathered if p != self.peer_id]
        history = self.history[c.fragment]
        reference = history.reference(own_norm)
        unadmitted = [] if self.round_key is None else [
            p for p in untagged_members(self.round_key, self._group_key(c.fragment, round_group_bits(c.round, "delta")), gathered)
            if p != self.peer_id
        ]
        banned = [p for p in others if self.reputation.is_banned(p, now)]
        if unadmitted:
            why = f"members without this swarm's key: {', '.join(unadmitted)}"
            suspects = unadmitted
        elif banned:
            why, suspects = f"banned members: {', '.join(banned)}", banned
        else:
            why, norm = check_update(delta, c.delta, history)
            names = self.names[c.fragment]
            spans = {p: m.get("span", []) for p, m in gathered.items() if m.get("span")}
            spoiled = spoiled_spans(flatten(delta[n] for n in names), flatten(c.delta[n] for n in names), spans, reference)
            if spoiled:
                part = f"the parts reduced by {', '.join(spoiled)} are out of bounds"
                why = part if why is None else f"{why}; {part}"
            if why is None:
                history.accept(norm)
                self.reputation.accepted(others, now)
                return None, norm
            # a bad part that this island reduced itself, or every part bad: a bad contribution, blamed
            # on members whose own reports show it (else on members not trusted lately); only some
            # parts bad: their reducers
            contribution = self.peer_id in spoiled or set(spoiled) >= set(spans)
            suspects = (
                [p for p in others if member_report_bad(gathered[p], reference)] if contribution or not spoiled
                else [p for p in spoiled if p != self.peer_id]
            )
        self._ban(suspects, others)
        return why, norm

    def _group_key(self, fragment: int, group_bits: str) -> str:
        return f"{self.averagers[fragment].prefix}.0b{group_bits}"

    async def consensus(
        self, fragment: int, round_: int, global_: dict[str, torch.Tensor], momentum: dict[str, torch.Tensor],
        stale: bool = False, apart: tuple[float, float] = (0.0, 0.0), wait_s: float | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int] | None:
        """Average the agreed values and outer momentum themselves (equal weights; a stale member ~0).

        `apart`: how far this island's agreed values and momentum travelled alone since they last
        agreed with others' (see validation.consensus_bound).

        hivemind sends each member's values to the reducers through the codec, then avg - own back:
        the codec is never below fp16 here (consensus_compression).

        Run by every member of a group whose fingerprints disagreed; returns
        (global, momentum, bytes sent) or None if the group did not re-form."""
        expected = self.expected_group()
        codec = consensus_compression(self.compression)
        sent = 0
        out = []
        agreed_norm, reference = tensors_norm(global_.values()), self.history[fragment].reference(0.0)
        for phase, values, path in (("global", global_, apart[0]), ("momentum", momentum, apart[1])):
            bound = consensus_bound(agreed_norm, reference, path)
            gathered, averaged = await self._allreduce(
                fragment, round_group_bits(round_, phase), expected, values, weight=STALE_WEIGHT if stale else 1.0,
                gather={"round": round_, "phase": phase}, compression=compression_codec(codec), wait_s=wait_s,
            )
            if gathered is None or {m.get("round") for m in gathered.values()} != {round_}:
                return None
            sent += allreduce_wire_bytes(self.num_values[fragment], len(gathered), codec)
            why = check_consensus(averaged, values, bound)
            if why is None and self.round_key is not None:
                unadmitted = [p for p in untagged_members(self.round_key, self._group_key(fragment, round_group_bits(round_, phase)), gathered) if p != self.peer_id]
                why = f"members without this swarm's key: {', '.join(unadmitted)}" if unadmitted else None
            if why is None and any(self.reputation.is_banned(p, time.monotonic()) for p in gathered):
                why = "banned members"
            if why is not None:
                logger.warning("fragment %d consensus round %d (%s) rejected: %s", fragment, round_, phase, why)
                return None
            out.append(averaged)
        return out[0], out[1], sent

    async def _allreduce(
        self, fragment: int, group_bits: str, expected: int, values: dict[str, torch.Tensor], *,
        weight: float, gather: dict, compression: CompressionBase, wait_s: float | None = None,
    ) -> tuple[dict | None, dict[str, torch.Tensor]]:
        """One bounded all-reduce of `values` on this fragment's averager, matchmaking for `wait_s`
        (the current match wait by default): (gathered metadata or None, result)."""
        averager, names = self.averagers[fragment], self.names[fragment]
        if self.round_key is not None:
            gather = {**gather, "auth": admission_tag(self.round_key, self.peer_id, self._group_key(fragment, group_bits))}
        await asyncio.to_thread(self._load, averager, names, values)
        banned = frozenset(self.reputation.banned(time.monotonic()))
        await asyncio.to_thread(averager.set_round, group_bits, expected, compression, banned)
        wait_s = self.wait_s if wait_s is None else wait_s
        control = await asyncio.to_thread(
            averager.step, gather=gather, weight=max(weight, 1e-6), scheduled_time=get_dht_time() + wait_s,
            timeout=wait_s + 2 * self.timeouts.request_s, wait=False,
        )
        try:
            gathered = await asyncio.wait_for(asyncio.wrap_future(control), timeout=2 * wait_s + self.timeouts.allreduce_s)
        except asyncio.CancelledError:
            control.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - no group, a peer gone, a timeout: all mean "no result"
            control.cancel()
            logger.info("fragment %d: round %s found no result: %r", fragment, group_bits, e)
            return None, values
        if not gathered or not all(isinstance(m, dict) for m in gathered.values()):
            return None, values
        gathered = {p.to_base58() if hasattr(p, "to_base58") else str(p): m for p, m in gathered.items()}
        return gathered, await asyncio.to_thread(self._read, averager, names)

    @staticmethod
    def _load(averager: IslandAverager, names: list[str], delta: dict[str, torch.Tensor]) -> None:
        with averager.get_tensors() as tensors:
            for t, n in zip(tensors, names, strict=True):
                t.copy_(delta[n])

    @staticmethod
    def _read(averager: IslandAverager, names: list[str]) -> dict[str, torch.Tensor]:
        with averager.get_tensors() as tensors:
            return {n: t.detach().clone() for t, n in zip(tensors, names, strict=True)}

    def share_state(self, provider: Callable[[int], tuple[dict, list[torch.Tensor]]], priority: float) -> None:
        """Let joiners download each fragment's state from this island; higher priority is asked first."""
        for p, averager in enumerate(self.averagers):
            averager.state_provider = (lambda p=p: provider(p))
            averager.state_sharing_priority = priority
            averager.allow_state_sharing = True

    async def download(self, fragment: int, timeout_s: float) -> tuple[dict, list[torch.Tensor]] | None:
        """One fragment's (metadata, tensors) from the island of highest priority that answers, or None."""
        averager = self.averagers[fragment]
        try:
            got = await asyncio.wait_for(asyncio.to_thread(averager.load_state_from_peers, True, timeout_s), timeout=timeout_s + 5)
        except Exception as e:  # noqa: BLE001 - no donor, a donor gone: no state
            logger.info("fragment %d: state download failed: %r", fragment, e)
            return None
        if not got or not isinstance(got[0], dict):
            return None
        return got[0], list(got[1])

    def shutdown(self) -> None:
        for averager in self.averagers:
            try:
                averager.shutdown()
            except Exception as e:  # noqa: BLE001 - shutting down is best effort
                logger.debug("averager shutdown: %r", e)

