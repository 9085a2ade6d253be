"""Fragment sync attached to the training loop: start rounds on schedule, apply them tau steps later.

The loop stays plain: after each inner step it awaits `after_step(step)`. A
round runs on the event loop while the next steps train in their thread; its
contribution is a snapshot taken between steps, and its result is applied
between steps, so the model is never touched by two parties at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Protocol

import torch
from islands.protocols.consensus import TOLERANCE, fragments_to_heal
from islands.protocols.diloco import Contribution, RoundResult, StreamingDiLoCo
from islands.protocols.policy import after_failed_rebase, after_round

if TYPE_CHECKING:
    from .timeouts import Timeouts

logger = logging.getLogger(__name__)

PREFETCH_STEPS = 3
"""A round's averager starts reading the island records this many steps before the round starts."""
END_LOOKS = 3
"""How many times at most the islands compare their agreed values at the end of a run (FragmentSync.agree)."""


class Rounds(Protocol):
    """Averaging one contribution with the islands of its round, and the state transfers around
    it: the seam between the island core and a transport (node/net/direct.py; in tests,
    tests/fakes.py)."""

    def prefetch(self) -> None: ...

    compression: str

    async def average(self, contribution: Contribution, wait_s: float | None = None) -> RoundResult: ...

    async def download(
        self, fragment: int, timeout_s: float, values_only: bool = False, min_round: int = 0,
    ) -> tuple[dict, list] | None: ...

    def fold_deposits(self, contribution: Contribution) -> Contribution: ...

    async def consensus(
        self, fragment: int, round_: int, global_: dict, momentum: dict, stale: bool = False,
        apart: tuple[float, float] = (0.0, 0.0), wait_s: float | None = None,
    ) -> tuple[dict, dict, int] | None: ...

    def share_state(self, provider: Callable[[int], tuple[dict, list]], priority: float) -> None: ...


async def download_state(
    rounds: Rounds, diloco: StreamingDiLoCo, fragment: int, timeout_s: float, values_only: bool = False, min_round: int = 0,
) -> tuple[dict, dict, dict | None] | str:
    """(metadata, agreed values, momentum) of a fragment from the island of highest priority that
    answers, checked against this island's layout, or why none came; `values_only` (a satellite
    after its deposit): the values, compressed, and no momentum (None); `min_round`: a donor whose
    fragment is at an earlier round is passed over for the next."""
    item = await rounds.download(fragment, timeout_s=timeout_s, values_only=values_only, min_round=min_round)
    if item is None:
        return "no state came"
    meta, tensors = item
    try:
        if values_only:  # the values checked as both halves of a state
            g, m = diloco.state_from_tensors(fragment, [*tensors, *tensors])[0], None
        else:
            g, m = diloco.state_from_tensors(fragment, tensors)
        int(meta["round"]), int(meta["step"])
    except (ValueError, KeyError, TypeError) as e:
        return f"the state from {meta.get('peer_id')} does not fit: {e}"
    return meta, g, m


def state_bytes(*parts: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the tensors of some state dicts (a downloaded fragment's values and momentum)."""
    return sum(t.numel() * t.element_size() for part in parts for t in part.values())


@dataclasses.dataclass
class Pending:
    contribution: Contribution
    apply_step: int
    task: asyncio.Task
    started: float


class FragmentSync:
    def __init__(
        self,
        diloco: StreamingDiLoCo,
        averager: Rounds,
        params: Mapping[str, torch.Tensor],
        on_sync: Callable[[dict], None],
        timeouts: Timeouts,
        run_torch: Callable[..., Awaitable],
        clock: Callable[[], float] = time.monotonic,
        can_round: Callable[[], bool] | None = None,
    ):
        """`can_round` (satellites): whether the contact window allows a round now; a round that
        cannot start is logged `skipped_no_contact` and the satellite keeps accumulating; one that
        can deposits the fragment most overdue (`_most_overdue`)."""
        self.diloco = diloco
        self.averager = averager
        self.params = params
        self.on_sync = on_sync
        self.timeouts = timeouts
        self.round_timeout_s = timeouts.round_s
        self._clock = clock
        self._run_torch = run_torch
        self.can_round = can_round
        self.schedule = diloco.cfg.schedule
        self.pending: dict[int, Pending] = {}

    @property
    def quiet(self) -> bool:
        """No round in flight: the state can be checkpointed as it is."""
        return not self.pending

    async def after_step(self, step: int, tokens: int) -> None:
        self.diloco.add_tokens(tokens)
        if self.schedule.starting(step + PREFETCH_STEPS):
            self.averager.prefetch()
        for p in self.schedule.starting(step):
            await self._start(p, step)
        for p in [p for p, pend in self.pending.items() if pend.apply_step <= step]:
            await self._finish(p, step)

    async def _start(self, fragment: int, step: int) -> None:
        if fragment in self.pending:  # cannot happen with tau < H/P; never start a second round
            logger.warning("fragment %d: round still pending at step %d, skipping", fragment, step)
            return
        round_ = self.schedule.round_of(step)
        if self.can_round is not None:
            if not self.can_round():
                self._skipped_no_contact(fragment, round_, step)
                return
            fragment = self._most_overdue(fragment)
        c = await self._run_torch(self.diloco.contribution, fragment, round_, step, self.params)
        if not self.diloco.satellite:  # what satellites deposited with this island counts in its round
            c = await self._run_torch(self.averager.fold_deposits, c)
        task = asyncio.ensure_future(self.averager.average(c))
        self.pending[fragment] = Pending(c, self.schedule.applied_at(step), task, self._clock())

    def _most_overdue(self, fragment: int) -> int:
        """A satellite in contact at `fragment`'s turn deposits the fragment with the most tokens
        not yet deposited (`fragment` itself on a tie). Its contact windows and the fragments'
        turns keep a period of their own, and at the slot's fragment alone one fragment could fall
        outside every window for good (the chaos soak: one fragment undeposited for 385 steps,
        its tokens lost at the end of the run)."""
        counters = self.diloco.counters
        free = [p for p in range(len(counters)) if p not in self.pending]
        return max(free, key=lambda p: (counters[p].tokens_since_sync, p == fragment), default=fragment)

    def _skipped_no_contact(self, fragment: int, round_: int, step: int) -> None:
        d = self.diloco
        d.count(fragment, "skipped_no_contact")
        self.on_sync(
            {
                "fragment": fragment, "step": step, "applied_step": step, "round": round_,
                "outcome": "skipped_no_contact", "policy": "accumulate", "group_size": 0,
                "weight": 0.0, "tokens": 0, "group_weight": 0.0, "bytes_sent": 0, "bytes_recv": 0, "seconds": 0.0,
                "staleness": max(0, round_ - d.counters[fragment].round - 1), "consensus": None, "reason": None, "norm_ratio": None,
                "deposits": 0, "digest": None, "members": None, "attempts": None,
            }
        )

    async def _finish(self, fragment: int, step: int, deadline: float | None = None) -> None:
        """Wait for the round (bounded by the round timeout, and by `deadline` when leaving) and apply it."""
        pend = self.pending.pop(fragment)
        c = pend.contribution
        remaining_s = max(0.0, self.round_timeout_s - (self._clock() - pend.started))
        if deadline is not None:
            remaining_s = min(remaining_s, max(0.0, deadline - self._clock()))
        try:
            result = await asyncio.wait_for(pend.task, timeout=remaining_s)
        except Exception as e:  # noqa: BLE001 - any failure falls back to solo
            logger.warning("fragment %d round %d failed: %r", fragment, c.round, e)
            result = RoundResult(outcome="failed", delta=c.delta, group_size=1, weight=c.weight)
        plan = after_round(result.outcome, result.deposited_with is not None, result.consensus, c.staleness, self.diloco.satellite)
        if plan.action == "rebase" and not await self._rebase(fragment, c.round, result.delta):
            plan = after_failed_rebase(self.diloco.satellite)
        consensus = None
        if plan.action == "take_swarm":
            result.bytes_recv += await self._take_swarm(fragment, c)
        elif plan.action == "accumulate":
            self.diloco.keep_accumulating(c)
        elif plan.action == "apply":
            round_ = c.round if plan.advance_round else None
            await self._run_torch(self.diloco.apply, fragment, round_, result.delta, self.params, plan.mix_local, plan.alone)
            if plan.settle:
                self.diloco.settled(fragment)
            if plan.heal and deadline is None:  # leaving: the others heal without this island
                consensus, extra_bytes = await self._consensus(fragment, c.round, stale=c.staleness > 0)
                result.bytes_sent += extra_bytes
                result.bytes_recv += extra_bytes
            if not plan.mix_local:
                await self._run_torch(self.diloco.mix_local, fragment, self.params)
        self.diloco.count(fragment, result.outcome)
        self.on_sync(
            {
                "fragment": fragment,
                "step": c.step,
                "applied_step": step,
                "round": c.round,
                "outcome": result.outcome,
                "policy": plan.policy,
                "group_size": result.group_size,
                "weight": c.weight,
                "tokens": c.tokens,
                "group_weight": result.weight,
                "bytes_sent": result.bytes_sent,
                "bytes_recv": result.bytes_recv + c.deposit_bytes,
                "seconds": round(result.seconds, 6),
                "staleness": result.staleness,
                "consensus": consensus,
                "reason": result.reason,
                "norm_ratio": result.norm_ratio,
                "deposits": c.deposits,
                "digest": result.digest,
                "members": result.members,
                "attempts": result.attempts,
            }
        )

    async def _download(self, fragment: int, values_only: bool = False, min_round: int = 0) -> tuple[dict, dict | None, int, int] | str:
        """The fragment's (agreed values, momentum, round, bytes on the wire) from the island of
        highest priority that answers, or why none came (`values_only`, `min_round`: see download_state)."""
        got = await download_state(self.averager, self.diloco, fragment, self.timeouts.download_s, values_only, min_round)
        if isinstance(got, str):
            return got
        meta, g, m = got
        return g, m, int(meta["round"]), int(meta.get("wire_bytes", state_bytes(g, m or {})))

    async def _take_swarm(self, fragment: int, c: Contribution) -> int:
        """After a deposit: the fragment's agreed values (compressed: download_state) and round from
        an island, then mix; the bytes downloaded. The satellite keeps its momentum (it never takes
        an outer step). If none came, the satellite's own values at the deposit become
        its base, so that its next delta holds only what it trained since (the deposit counted the rest)."""
        d = self.diloco
        got = await self._download(fragment, values_only=True)
        if isinstance(got, str):
            logger.warning("fragment %d: no swarm state after a deposit (%s); own values are the base", fragment, got)
            own = {n: d.globals[fragment][n] - c.delta[n] for n in c.delta}
            await self._run_torch(d.replace, fragment, own, d.momentum[fragment])
            return 0
        g, m, donor_round, nbytes = got

        def take() -> None:
            d.replace(fragment, g, d.momentum[fragment], round_=donor_round)
            d.mix_local(fragment, self.params)

        await self._run_torch(take)
        return nbytes

    async def _rebase(self, fragment: int, round_: int, avg_delta: dict) -> bool:
        """Download the fragment's agreed values, momentum and round from an island and bring them
        to round `round_` (applying the averaged delta if the donor has not yet); False if none came."""
        d = self.diloco
        # an island as stale as this one (another joiner, say) has nothing to rebase on: the next
        got = await self._download(fragment, min_round=round_ - 1)
        if isinstance(got, str):
            logger.warning("fragment %d round %d: no state to rebase on (%s)", fragment, round_, got)
            return False
        g, m, donor_round, _ = got
        if donor_round < round_ - 1:
            logger.warning("fragment %d: donor at round %d, behind round %d", fragment, donor_round, round_)
            return False

        def take() -> None:
            d.replace(fragment, g, m, round_=donor_round)
            if donor_round == round_ - 1:  # the donor has not applied this round yet: do it here
                d.apply(fragment, round_, avg_delta, self.params, mix_local=False)
            d.mix_local(fragment, self.params)

        await self._run_torch(take)
        return True

    async def _consensus(self, fragment: int, round_: int, stale: bool, wait_s: float | None = None) -> tuple[str, int]:
        """The group's agreed values disagreed: average them (and the outer momentum) once more."""
        d = self.diloco
        try:
            got = await asyncio.wait_for(
                self.averager.consensus(
                    fragment, round_, d.globals[fragment], d.momentum[fragment], stale=stale,
                    apart=(d.counters[fragment].apart, d.counters[fragment].apart_momentum), wait_s=wait_s,
                ),
                timeout=self.round_timeout_s,
            )
        except Exception as e:  # noqa: BLE001 - keep own values, retry next round
            logger.warning("fragment %d round %d: consensus round failed: %r", fragment, round_, e)
            return "failed", 0
        if got is None:
            return "failed", 0
        global_, momentum, sent = got
        await self._run_torch(d.replace, fragment, global_, momentum)
        logger.info("fragment %d round %d: agreed values re-averaged", fragment, round_)
        return "ok", sent

    async def agree(
        self, step: int, compare: Callable[[int, list[list[float]]], Awaitable[list[list[list[float]]]]],
    ) -> tuple[list[str], list[str], int]:
        """At the end of a run: one last round of every fragment, with the progress since its last
        round (up to a window of it, which the agreed model would otherwise lack), keyed by the
        fragment's next round number, which no training round of this run uses; its result is
        applied without an outer step (StreamingDiLoCo.apply_last). Its number comes from the
        schedule (Schedule.last_round), not from this island's own count: an island whose fragment is
        a round behind (it took the swarm's state while that fragment's round was in flight) meets the
        others in the same round, stale, instead of in one of its own. The islands have waited for one
        another to finish (Network.wait_for_end), so these rounds wait long for every live island
        (Timeouts.last_round_match_s) and start as soon as all are in.

        Then the islands compare their agreed values: `compare(n, fingerprints)` publishes this
        island's fingerprint of each fragment (n-th look) and returns the other finished islands'.
        A round can split (hivemind: one side `ok`, the other `failed`) and a member that thinks it
        went well cannot tell, so which fragments to heal is decided from everyone's fingerprints,
        alike on every island: those that differ have their agreed values and momentum averaged
        once more (a consensus round), and the islands look again, END_LOOKS times at most.
        Returns each fragment's last-round outcome and verdict (`ok`: the islands' agreed values
        are the same; `failed`: they still differ), and the bytes sent (as many received)."""
        d = self.diloco
        wait_s = self.timeouts.last_round_match_s
        contributions = []
        for p in range(d.cfg.fragments):
            # it starts after the last step (a round that started at `step` is over): the others'
            # records of their last rounds must not make it look already applied (FragmentAveraging.average)
            c = await self._run_torch(d.contribution, p, self.schedule.last_round(p, step) + 1, step + 1, self.params)
            contributions.append(await self._run_torch(self.averager.fold_deposits, c))
        results = await asyncio.gather(
            *(asyncio.wait_for(self.averager.average(c, wait_s=wait_s), timeout=self.round_timeout_s) for c in contributions),
            return_exceptions=True,
        )
        outcomes, sent = [], 0
        for p, (c, result) in enumerate(zip(contributions, results, strict=True)):
            if isinstance(result, BaseException):
                logger.warning("fragment %d: last round failed: %r", p, result)
                result = RoundResult(outcome="failed", delta=c.delta, group_size=1, weight=c.weight)
            await self._run_torch(d.apply_last, p, c.round, result.delta, result.outcome != "ok")
            outcomes.append(result.outcome)
            sent += result.bytes_sent
        verdicts = ["ok"] * d.cfg.fragments
        tol = TOLERANCE[self.averager.compression]
        for look in range(1, END_LOOKS + 1):
            mine = [await self._run_torch(d.agreed_fingerprint, p) for p in range(d.cfg.fragments)]
            heal = fragments_to_heal(mine, await compare(look, mine), tol)
            for p in range(d.cfg.fragments):
                verdicts[p] = "failed" if p in heal else "ok"
            if not heal or look == END_LOOKS:
                break
            logger.info("the islands' agreed values differ in fragments %s: averaging them once more", heal)
            for p in heal:
                _, nbytes = await self._consensus(p, contributions[p].round + look, stale=False, wait_s=wait_s)
                sent += nbytes
        for p, verdict in enumerate(verdicts):
            if verdict == "ok":
                d.settled(p)
        return outcomes, verdicts, sent

    async def flush(self, step: int, budget_s: float | None = None) -> None:
        """Finish every round in flight now and apply it; with `budget_s` (leaving), rounds not
        done within that many seconds in all are abandoned (`failed`, own update applied)."""
        deadline = None if budget_s is None else self._clock() + budget_s
        for p in sorted(self.pending):
            await self._finish(p, step, deadline)
