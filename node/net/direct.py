"""Rounds over the project's own protocol (issue 17): a fragment's round is one
run of protocols/rounds.py's state machine over the direct transport (transport.py).

The members are this island and the live islands whose records publish a transport address and
have not yet applied the round (records.round_peers); no matchmaking: each member sends its part to
the others as soon as it starts the round, and a part that arrives before its receiver got there
waits in its inbox. Each part is encoded once by its owner (protocols/parts.py); the round commits
only when every member holds every part, and every member reduces the same parts in the same order,
so a committed round gives the same bits everywhere. A member that dies or stays silent is dropped
and the others retry at once without it.

A consensus round (the agreed values and momentum themselves, when the members' fingerprints
differ) is a round of the same protocol among the same members, on its own channel (the fragment
number + CONSENSUS in the frame), in fp32. The state a joiner, a rebasing member or a satellite
downloads comes over libp2p streams (state.py), like the satellites' deposits (deposit.py), both in
the parts format (streams.py): a peer that cannot be dialled can still dial. An island that cannot be dialled takes part in rounds over
libp2p streams (`--data-announce p2p`, DataPlane.reach).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence

import torch
from hivemind import DHT
from islands.node.timeouts import Timeouts
from islands.protocols import rounds as sm
from islands.protocols.consensus import TOLERANCE, consensus_needed
from islands.protocols.diloco import Contribution, RoundResult
from islands.protocols.parts import (
    PartError,
    SliceSpoiled,
    assemble,
    encode_part,
    encode_slices,
    reduce_parts,
    result_digest,
    take,
    values_codec,
)
from islands.protocols.validation import (
    check_consensus,
    consensus_bound,
    flatten,
    member_flagrant,
    member_report_bad,
    round_verdict,
    tensors_norm,
)

from .base import STALE_WEIGHT, RoundsBase
from .state import StateBox
from .transport import DataPlane

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
CONSENSUS = 0x8000
"""A consensus round of fragment p runs on channel p + CONSENSUS (the frame's fragment field)."""


class DirectRounds(RoundsBase):
    """`Rounds` (node/sync.py) over the direct transport; deposits and state downloads over libp2p."""

    def __init__(
        self, plane: DataPlane | None, namespace: str, shapes: Sequence[Sequence[tuple[str, tuple[int, ...]]]],
        compression: str, timeouts: Timeouts, members: Callable[[int, int], dict[str, tuple[str, int]]],
        others: Callable[[], int], arrival: Callable[[int], float], donors: Callable[[], list[str]],
        everyone: Callable[[], dict[str, tuple[str, int]]], follower: bool = False, swarm_key: bytes | None = None,
        on_refused: Callable[[str], None] | None = None, deposit_targets: Callable[[], list[str]] | None = None,
        refresh_peers=None, left: Callable[[int, int], set[str]] | None = None,
    ):
        """`plane`: the transport (None for a satellite: it deposits instead);
        `members(fragment, step)`: the other members of the round of `fragment` starting at `step`,
        with their addresses (records.round_peers); `others()`: how many other live islands there
        are; `arrival(step)`: seconds until the last island still short of `step` gets there;
        `donors()`: the islands to download state from, in the order to try (records.state_donors);
        `everyone()`: the other live islands' addresses (a consensus round at the end of the run);
        `left(fragment, step)`: the islands whose records now say they will not take part in that
        round (records.left_round): a round in flight stops waiting for them."""
        if plane is None and not follower:
            raise ValueError("an island's rounds need a transport")
        super().__init__(
            namespace, shapes, compression, timeouts, follower, swarm_key, on_refused,
            deposit_targets, refresh_peers,
        )
        self.plane = plane
        self.members = members
        self.others = others
        self.arrival = arrival
        self.donors = donors
        self.everyone = everyone
        self.left = left or (lambda fragment, step: set())
        self.layout_shapes = [[tuple(s) for _, s in frag] for frag in shapes]
        self.states: StateBox | None = None
        self._provider = None
        self._committed: dict[tuple[int, int], tuple[str, ...]] = {}
        """(fragment, round) -> members of the newest committed rounds (their consensus runs among them)."""

    @property
    def me(self) -> str:
        return self.plane.me.peer_id

    async def open(self, dht: DHT) -> None:
        """Deposits and state downloads (libp2p) from now on."""
        await self.open_deposits(dht)
        p2p = await dht.replicate_p2p()
        self.states = StateBox(
            p2p, self.namespace, self.shapes, self.round_key,
            refuse_peer=lambda peer: self.reputation.is_banned(peer, time.monotonic()), on_refused=self.on_refused,
        )
        self.states.provider = None if self._provider is None else self._serve
        if not self.follower:
            await self.states.open()

    async def close(self) -> None:
        await self.close_deposits()
        if self.states is not None:
            await self.states.close()
        if self.plane is not None:
            await self.plane.close()

    def share_state(self, provider, priority: float) -> None:
        """Joiners may download each fragment's state from this island (the furthest island is
        asked first: records.state_donors)."""
        self._provider = provider
        if self.states is not None:
            self.states.provider = self._serve

    def _serve(self, fragment: int) -> tuple[dict, list] | None:
        """A fragment's state for a joiner, with the norms this island accepted lately
        (NormHistory.seed); None while this island has none to give (IslandCore.unsound)."""
        got = self._provider(fragment)
        if got is None:
            return None
        meta, tensors = got
        return {**meta, "norms": list(self.history[fragment].norms)}, tensors

    async def download(self, fragment: int, timeout_s: float, values_only: bool = False, min_round: int = 0):
        if self.states is None:
            return None
        codec = values_codec(self.compression) if values_only else "none"
        got = await self.states.fetch(self.donors(), fragment, timeout_s, codec=codec, momentum=not values_only, min_round=min_round)
        if got is not None and not values_only:
            self.history[fragment].seed(got[0].get("norms"))
        return got

    # --- the rounds -----------------------------------------------------------------------------

    def attempt_s(self, step: int | None, wait_s: float | None) -> float:
        """How long an attempt waits for a silent member: the match wait, or longer for an island
        still training towards the round's step (bounded), plus a part's transfer. At most the
        attempts and one more wait (a silent member asked again: rounds.py) fit in the round's time."""
        t = self.timeouts
        behind = 0.0 if step is None else min(t.max_match_wait_s, t.match_wait_s + self.arrival(step))
        return min(max(wait_s or 0.0, t.match_wait_s, behind) + t.next_chunk_s, t.round_s / (MAX_ATTEMPTS + 1) - 1.0)

    async def _round(
        self, channel: int, round_: int, peers: dict[str, tuple[str, int]], values: torch.Tensor, weight: float, codec: str,
        meta: dict, attempt_s: float, left: Callable[[], set[str]] | None = None,
    ) -> tuple[sm.Commit | sm.Fail, list[torch.Tensor] | None, float, dict[str, dict], int, int]:
        """One round of the protocol: (outcome, the reduced values as segments to read end to end,
        their total weight, each member's meta, bytes sent, bytes received on the wire); PartError
        from a part that does not decode."""
        members = {**peers, self.me: ("", 0)}
        if sm.uses_scatter(len(members), codec):  # a reduce-scatter: each member reduces its slice
            outcome, parts = await self.plane.run_round(
                channel, round_, members, None, attempt_s=attempt_s, max_attempts=MAX_ATTEMPTS,
                cut=lambda order: encode_slices(values, weight, codec, meta, order), left=left,
            )
            combine = assemble
        else:
            part = await asyncio.to_thread(encode_part, values, weight, codec, meta)
            outcome, parts = await self.plane.run_round(channel, round_, members, part, attempt_s=attempt_s, max_attempts=MAX_ATTEMPTS, left=left)
            combine = reduce_parts
        sent, recv = self.plane.round_bytes(channel, round_)
        if not isinstance(outcome, sm.Commit):
            return outcome, None, 0.0, {}, sent, recv
        mean, total, metas = await asyncio.to_thread(combine, outcome.members, parts)
        segments = mean if isinstance(mean, list) else [mean]
        if sum(x.numel() for x in segments) != values.numel():
            raise PartError(f"the round's result has {sum(x.numel() for x in segments)} values, this island's part {values.numel()}")
        # each member's norm as this island measured it: the whole part where it came whole, else
        # its slice of this island's reduced slice, scaled to the whole (what no other reducer can forge)
        mine = outcome.members.index(self.me)
        for m in metas.values():
            norms = m.pop("slice_norms", None)
            if norms is None:
                m["measured_norm"] = m["value_norm"]
            elif segments[mine].numel():
                m["measured_norm"] = norms[mine] * math.sqrt(values.numel() / segments[mine].numel())
        return outcome, segments, total, metas, sent, recv

    def _split(self, fragment: int, segments: list[torch.Tensor], like: dict[str, torch.Tensor], at: int = 0) -> dict[str, torch.Tensor]:
        """The fragment's tensors from the round's values (segments read end to end from `at`)."""
        out = {}
        for n, shape in zip(self.names[fragment], self.layout_shapes[fragment], strict=True):
            k = math.prod(shape)
            out[n] = take(segments, at, at + k).view(shape).to(like[n].dtype)
            at += k
        return out

    def _flat(self, fragment: int, values: dict[str, torch.Tensor]) -> torch.Tensor:
        return flatten(values[n] for n in self.names[fragment])

    async def average(self, contribution: Contribution, wait_s: float | None = None) -> RoundResult:
        c = contribution
        await self.read_peers()  # the records as of just before the round
        if self.follower:
            return await self.deposit(c)
        own = RoundResult(outcome="failed", delta=c.delta, group_size=1, weight=c.weight)
        if self.others() == 0:
            return dataclasses.replace(own, outcome="solo")
        peers = self.members(c.fragment, c.step)
        if not peers:
            return own  # the others have applied this round already: catch up instead of waiting
        started = time.monotonic()
        own_norm = tensors_norm(c.delta.values())
        # `ref`: what this island's check compares the result with; every member runs every
        # member's check on the same result (validation.round_verdict), so all apply it or none
        reference = self.history[c.fragment].reference(own_norm)
        meta = {"round": c.round, "step": c.step, "fp": c.fingerprint, "stale": c.staleness, "ref": reference}
        try:
            outcome, mean, total, metas, sent, recv = await self._round(
                c.fragment, c.round, peers, self._flat(c.fragment, c.delta), max(c.weight, STALE_WEIGHT), self.compression,
                meta, self.attempt_s(c.step, wait_s), left=lambda: self.left(c.fragment, c.step),
            )
        except PartError as e:  # every member holds the same parts: every member rejects alike
            logger.warning("fragment %d round %d: %s; applying own update", c.fragment, c.round, e)
            if isinstance(e, SliceSpoiled) and e.owner != self.me:
                self._ban([e.owner], [p for p in peers if p != e.owner])
            return dataclasses.replace(own, outcome="rejected", reason=str(e), seconds=time.monotonic() - started)
        seconds = time.monotonic() - started
        if not isinstance(outcome, sm.Commit):
            logger.info("fragment %d round %d: no round: %s", c.fragment, c.round, outcome.reason)
            return dataclasses.replace(own, seconds=seconds, attempts=outcome.attempts, bytes_sent=sent, bytes_recv=recv)
        self._committed[(c.fragment, c.round)] = outcome.members
        for key in [k for k in self._committed if k[0] == c.fragment and k[1] < c.round - 2]:
            del self._committed[key]
        delta = self._split(c.fragment, mean, c.delta)
        digest = await asyncio.to_thread(result_digest, mean)
        result = RoundResult(
            outcome="ok", delta=delta, group_size=len(outcome.members), weight=total, bytes_sent=sent, bytes_recv=recv,
            seconds=seconds, staleness=c.staleness, digest=digest, members=list(outcome.members), attempts=outcome.attempts,
        )
        rounds = {m.get("round") for m in metas.values()}
        if rounds != {c.round}:
            logger.warning("fragment %d: parts of rounds %s; keeping own update", c.fragment, rounds)
            return dataclasses.replace(result, outcome="failed", delta=c.delta, weight=c.weight)
        why, norm = self._validate(c, metas, delta, own_norm)
        result.norm_ratio = round(norm / own_norm, 4) if own_norm > 0 and math.isfinite(norm) else None
        if why is not None:
            logger.warning("fragment %d round %d rejected: %s; applying own update", c.fragment, c.round, why)
            return dataclasses.replace(result, outcome="rejected", delta=c.delta, weight=c.weight, reason=why)
        # a stale member's base differs by design: it takes the swarm's afterwards (FragmentSync._rebase)
        result.consensus = consensus_needed((m.get("fp", []) for m in metas.values() if not m.get("stale")), TOLERANCE[self.compression])
        return result

    def _validate(self, c: Contribution, metas: dict[str, dict], delta: dict[str, torch.Tensor], own_norm: float) -> tuple[str | None, float]:
        """(why the round's result must not be applied or None, the result's norm): every
        member's check (validation.round_verdict), the same verdict on every member. Blames the
        members whose own part is out of bounds, else those whose check alone rejected a result
        this island's own check accepts; bans repeat offenders, and flagrant ones at once."""
        history = self.history[c.fragment]
        others = [p for p in metas if p != self.me]
        why, norm, judges = round_verdict(delta, c.delta, {p: m.get("ref") for p, m in metas.items()})
        if why is None:
            history.accept(norm)
            self.reputation.accepted(others, time.monotonic())
            return None, norm
        reference = history.reference(own_norm)
        reports = {p: {"norm": metas[p]["value_norm"], "weight": metas[p]["weight"], "measured": metas[p].get("measured_norm")} for p in others}
        suspects = [p for p in others if member_report_bad(reports[p], reference)]
        if not suspects and self.me not in judges:
            suspects = [p for p in judges if p != self.me]
        self._ban(suspects, others, [p for p in suspects if member_flagrant(reports[p], reference)])
        return why, norm

    async def consensus(
        self, fragment: int, round_: int, global_: dict[str, torch.Tensor], momentum: dict[str, torch.Tensor],
        stale: bool = False, apart: tuple[float, float] = (0.0, 0.0), wait_s: float | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int] | None:
        """Average the agreed values and outer momentum themselves (equal weights; a stale member ~0),
        in fp32, among the members of the committed round (all live islands at the end of the run).
        `apart`: how far this island's values travelled alone since they last agreed with others'
        (validation.consensus_bound). (global, momentum, bytes sent), or None."""
        if self.follower:
            return None
        everyone = self.everyone()
        members = self._committed.get((fragment, round_))
        peers = {p: a for p, a in everyone.items() if members is None or p in members}
        if not peers:
            return None
        values = torch.cat([self._flat(fragment, global_), self._flat(fragment, momentum)])
        half = values.numel() // 2
        try:
            outcome, mean, _, metas, sent, _ = await self._round(
                fragment + CONSENSUS, round_, peers, values, STALE_WEIGHT if stale else 1.0, "none", {"round": round_},
                self.attempt_s(None, wait_s),
            )
        except PartError as e:
            logger.warning("fragment %d consensus round %d: %s", fragment, round_, e)
            if isinstance(e, SliceSpoiled) and e.owner != self.me:
                self._ban([e.owner], [p for p in peers if p != e.owner])
            return None
        if not isinstance(outcome, sm.Commit):
            logger.info("fragment %d consensus round %d: no round: %s", fragment, round_, outcome.reason)
            return None
        averaged = (self._split(fragment, mean, global_), self._split(fragment, mean, momentum, half))
        agreed_norm, reference = tensors_norm(global_.values()), self.history[fragment].reference(0.0)
        for phase, got, own, path in (("global", averaged[0], global_, apart[0]), ("momentum", averaged[1], momentum, apart[1])):
            why = check_consensus(got, own, consensus_bound(agreed_norm, reference, path))
            if why is None and any(self.reputation.is_banned(p, time.monotonic()) for p in metas):
                why = "banned members"
            if why is not None:
                logger.warning("fragment %d consensus round %d (%s) rejected: %s", fragment, round_, phase, why)
                return None
        return averaged[0], averaged[1], sent
