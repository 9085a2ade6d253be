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
from typing import Protocol

import torch
from islands.protocols.diloco import Contribution, RoundResult, StreamingDiLoCo
from islands.protocols.schedule import fragments_starting, next_sync_step, round_number

logger = logging.getLogger(__name__)


class Averager(Protocol):
    async def average(self, contribution: Contribution) -> RoundResult: ...

    async def consensus(
        self, fragment: int, round_: int, global_: dict, momentum: dict, stale: bool = False
    ) -> tuple[dict, dict, int] | None: ...


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
        averager: Averager,
        params: Mapping[str, torch.Tensor],
        on_sync: Callable[[dict], None],
        round_timeout_s: float,
        run_torch: Callable[..., Awaitable],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.diloco = diloco
        self.averager = averager
        self.params = params
        self.on_sync = on_sync
        self.round_timeout_s = round_timeout_s
        self._clock = clock
        self._run_torch = run_torch
        self.pending: dict[int, Pending] = {}

    @property
    def quiet(self) -> bool:
        """No round in flight: the state can be checkpointed as it is."""
        return not self.pending

    def next_sync(self, step: int) -> tuple[int, int]:
        """(fragment, step) of the next round to start after `step`."""
        return min(enumerate(self.next_syncs(step)), key=lambda x: x[1])

    def next_syncs(self, step: int) -> list[int]:
        cfg = self.diloco.cfg
        return [next_sync_step(step, p, cfg.window, cfg.fragments) for p in range(cfg.fragments)]

    async def after_step(self, step: int, tokens: int) -> None:
        cfg = self.diloco.cfg
        self.diloco.add_tokens(tokens)
        for p in fragments_starting(step, cfg.window, cfg.fragments):
            await self._start(p, step)
        for p in [p for p, pend in self.pending.items() if pend.apply_step <= step]:
            await self._finish(p, step)

    async def _start(self, fragment: int, step: int) -> None:
        if fragment in self.pending:  # cannot happen with tau < H/P; never start a second round
            logger.warning("fragment %d: round still pending at step %d, skipping", fragment, step)
            return
        round_ = round_number(step, self.diloco.cfg.window)
        c = await self._run_torch(self.diloco.contribution, fragment, round_, step, self.params)
        task = asyncio.ensure_future(self.averager.average(c))
        self.pending[fragment] = Pending(c, step + self.diloco.cfg.tau, task, self._clock())

    async def _finish(self, fragment: int, step: int) -> None:
        pend = self.pending.pop(fragment)
        c = pend.contribution
        remaining_s = max(0.0, self.round_timeout_s - (self._clock() - pend.started))
        try:
            result = await asyncio.wait_for(pend.task, timeout=remaining_s)
        except (asyncio.TimeoutError, Exception) as e:  # noqa: BLE001 - any failure falls back to solo
            logger.warning("fragment %d round %d failed: %r; applying own update", fragment, c.round, e)
            result = RoundResult(outcome="failed", delta=c.delta, group_size=1, weight=c.weight)
        await self._run_torch(self.diloco.apply, fragment, c.round, result.delta, self.params)
        self.diloco.count(fragment, result.outcome)
        consensus = None
        if result.consensus:
            consensus, extra_bytes = await self._consensus(fragment, c.round, stale=c.staleness > 0)
            result.bytes_sent += extra_bytes
            result.bytes_recv += extra_bytes
        self.on_sync(
            {
                "fragment": fragment,
                "step": c.step,
                "applied_step": step,
                "round": c.round,
                "outcome": result.outcome,
                "group_size": result.group_size,
                # a stale base counted ~0 in the group (see FragmentAveraging)
                "weight": 0.0 if c.staleness and result.outcome == "ok" else c.weight,
                "group_weight": result.weight,
                "bytes_sent": result.bytes_sent,
                "bytes_recv": result.bytes_recv,
                "seconds": round(result.seconds, 6),
                "staleness": result.staleness,
                "consensus": consensus,
            }
        )

    async def _consensus(self, fragment: int, round_: int, stale: bool) -> tuple[str, int]:
        """The group's agreed values disagreed: average them (and the outer momentum) once more."""
        d = self.diloco
        try:
            got = await asyncio.wait_for(
                self.averager.consensus(fragment, round_, d.globals[fragment], d.momentum[fragment], stale=stale),
                timeout=self.round_timeout_s,
            )
        except (asyncio.TimeoutError, Exception) as e:  # noqa: BLE001 - keep own values, retry next round
            logger.warning("fragment %d round %d: consensus round failed: %r", fragment, round_, e)
            return "failed", 0
        if got is None:
            return "failed", 0
        global_, momentum, sent = got
        await self._run_torch(d.replace, fragment, global_, momentum)
        logger.info("fragment %d round %d: agreed values re-averaged", fragment, round_)
        return "ok", sent

    async def flush(self, step: int) -> None:
        """Finish every round in flight now (bounded by the round timeout) and apply it."""
        for p in sorted(self.pending):
            await self._finish(p, step)
