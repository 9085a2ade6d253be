"""Rounds over the project's own protocol (`--rounds direct`, issue 17): a fragment's round is one
run of protocols/rounds.py's state machine over the direct transport (transport.py).

The members are this island and the live islands whose records publish a transport address and
have not yet applied the round (records.round_peers); no matchmaking: each member sends its part to
the others as soon as it starts the round, and a part that arrives before its receiver got there
waits in its inbox. Each part is encoded once by its owner (protocols/parts.py); the round commits
only when every member holds every part, and every member reduces the same parts in the same order,
so a committed round gives the same bits everywhere. A member that dies or stays silent is dropped
and the others retry at once without it.

Still on hivemind (`state`, the FragmentAveraging this wraps): satellites' deposits, the state
download for joiners and rebases, and consensus rounds; this step moves only the training rounds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence

import torch
from islands.node.timeouts import Timeouts
from islands.protocols import rounds as sm
from islands.protocols.consensus import TOLERANCE, consensus_needed
from islands.protocols.diloco import Contribution, RoundResult
from islands.protocols.parts import PartError, encode_part, reduce_parts
from islands.protocols.validation import check_update, member_report_bad, tensors_norm

from .averaging import STALE_WEIGHT, FragmentAveraging
from .transport import DataPlane

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 3


class DirectRounds:
    """`Rounds` (node/sync.py) whose training rounds run over the direct transport."""

    def __init__(
        self, plane: DataPlane, state: FragmentAveraging, shapes: Sequence[Sequence[tuple[str, tuple[int, ...]]]],
        compression: str, timeouts: Timeouts, members: Callable[[int, int], dict[str, tuple[str, int]]],
        others: Callable[[], int], arrival: Callable[[int], float],
    ):
        """`members(fragment, step)`: the other members of the round of `fragment` starting at `step`,
        with their addresses (records.round_peers); `others()`: how many other live islands there
        are; `arrival(step)`: seconds until the last island still short of `step` gets there."""
        self.plane = plane
        self.state = state
        self.compression = compression
        self.timeouts = timeouts
        self.members = members
        self.others = others
        self.arrival = arrival
        self.names = [[n for n, _ in frag] for frag in shapes]
        self.shapes = [[tuple(s) for _, s in frag] for frag in shapes]

    # --- still hivemind's -----------------------------------------------------------------------

    def prefetch(self) -> None:
        self.state.prefetch()

    def fold_deposits(self, c: Contribution) -> Contribution:
        return self.state.fold_deposits(c)

    async def consensus(self, fragment, round_, global_, momentum, stale=False, apart=(0.0, 0.0), wait_s=None):
        return await self.state.consensus(fragment, round_, global_, momentum, stale=stale, apart=apart, wait_s=wait_s)

    def share_state(self, provider, priority: float) -> None:
        self.state.share_state(provider, priority)

    async def download(self, fragment: int, timeout_s: float):
        return await self.state.download(fragment, timeout_s)

    # --- the rounds -----------------------------------------------------------------------------

    def attempt_s(self, step: int, wait_s: float | None) -> float:
        """How long an attempt waits for a silent member: the match wait, or longer for an island
        still training towards the round's step (bounded), plus a part's transfer."""
        t = self.timeouts
        wait = max(wait_s or 0.0, t.match_wait_s, min(t.max_match_wait_s, t.match_wait_s + self.arrival(step)))
        return min(wait + t.next_chunk_s, t.round_s / MAX_ATTEMPTS - 1.0)

    async def average(self, contribution: Contribution, wait_s: float | None = None) -> RoundResult:
        c = contribution
        await self.state.read_peers()  # the records as of just before the round
        if self.state.follower:
            return await self.state.deposit(c)
        own = RoundResult(outcome="failed", delta=c.delta, group_size=1, weight=c.weight)
        if self.others() == 0:
            return dataclasses.replace(own, outcome="solo")
        peers = self.members(c.fragment, c.step)
        if not peers:
            return own  # the others have applied this round already: catch up instead of waiting
        started = time.monotonic()
        names = self.names[c.fragment]
        own_norm = tensors_norm(c.delta.values())
        meta = {"round": c.round, "step": c.step, "fp": c.fingerprint, "stale": c.staleness}
        flat = torch.cat([c.delta[n].detach().reshape(-1).to("cpu", torch.float32) for n in names])
        part = await asyncio.to_thread(encode_part, flat, max(c.weight, STALE_WEIGHT), self.compression, meta)
        members = {**peers, self.plane.me.peer_id: ("", 0)}
        outcome, parts = await self.plane.run_round(
            c.fragment, c.round, members, part, attempt_s=self.attempt_s(c.step, wait_s), max_attempts=MAX_ATTEMPTS,
        )
        seconds = time.monotonic() - started
        if not isinstance(outcome, sm.Commit):
            logger.info("fragment %d round %d: no round: %s", c.fragment, c.round, outcome.reason)
            return dataclasses.replace(own, seconds=seconds, attempts=outcome.attempts)
        committed = {"digest": outcome.parts, "members": list(outcome.members), "attempts": outcome.attempts}
        sent = len(part) * (len(outcome.members) - 1)
        recv = sum(len(parts[p]) for p in outcome.members if p != self.plane.me.peer_id)
        try:
            mean, total, metas = await asyncio.to_thread(reduce_parts, outcome.members, parts)
        except PartError as e:  # every member holds the same parts: every member rejects alike
            logger.warning("fragment %d round %d: %s; applying own update", c.fragment, c.round, e)
            return dataclasses.replace(own, outcome="rejected", group_size=len(outcome.members), reason=str(e), seconds=seconds, **committed)
        delta, at = {}, 0
        for n, shape in zip(names, self.shapes[c.fragment], strict=True):
            k = math.prod(shape)
            delta[n] = mean[at : at + k].view(shape).to(c.delta[n].dtype)
            at += k
        rounds = {m.get("round") for m in metas.values()}
        result = RoundResult(
            outcome="ok", delta=delta, group_size=len(outcome.members), weight=total, bytes_sent=sent, bytes_recv=recv,
            seconds=seconds, staleness=c.staleness, **committed,
        )
        if rounds != {c.round}:
            logger.warning("fragment %d: parts of rounds %s; keeping own update", c.fragment, rounds)
            return dataclasses.replace(own, seconds=seconds, **committed)
        why, norm = self._validate(c, metas, delta, own_norm)
        result.norm_ratio = round(norm / own_norm, 4) if own_norm > 0 and math.isfinite(norm) else None
        if why is not None:
            logger.warning("fragment %d round %d rejected: %s; applying own update", c.fragment, c.round, why)
            return dataclasses.replace(result, outcome="rejected", delta=c.delta, weight=c.weight, reason=why)
        # a stale member's base differs by design: it takes the swarm's afterwards (FragmentSync._rebase)
        result.consensus = consensus_needed((m.get("fp", []) for m in metas.values() if not m.get("stale")), TOLERANCE[self.compression])
        return result

    def _validate(self, c: Contribution, metas: dict[str, dict], delta: dict[str, torch.Tensor], own_norm: float) -> tuple[str | None, float]:
        """(why the round's result must not be applied (validation.py) or None, the result's norm);
        blames the members whose own part is out of bounds, and bans repeat offenders."""
        now = time.monotonic()
        me, reputation, history = self.plane.me.peer_id, self.state.reputation, self.state.history[c.fragment]
        others = [p for p in metas if p != me]
        reference = history.reference(own_norm)
        why, norm = check_update(delta, c.delta, history)
        if why is None:
            history.accept(norm)
            reputation.accepted(others, now)
            return None, norm
        suspects = [p for p in others if member_report_bad({"norm": metas[p]["value_norm"], "weight": metas[p]["weight"]}, reference)]
        for peer in reputation.blame(suspects, others, now):
            logger.warning("banning peer %s for %.0f s: its rounds were rejected repeatedly", peer, reputation.banned_until[peer] - now)
            self.state.banned_events.append(peer)
        return why, norm
