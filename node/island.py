"""The island core: one seam between the swarm and a training loop.

It joins (waits for islands, catches up, serves its state to joiners), is told of every inner
step (`after_step`), and leaves (flushes its rounds, agrees the model with the others, withdraws
its record). It owns the Streaming DiLoCo state, the fragment sync and the island's role; it
knows no model class, no optimizer and no data: it sees a mapping of parameter tensors and a
fragment layout, and runs every touch of them through `run_torch` (the loop's torch thread).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import torch
from islands.protocols.diloco import StreamingDiLoCo
from islands.protocols.policy import holds_swarm_base

from .config import Config
from .events import EventLog
from .metrics import Metrics
from .network import Network
from .progress import Progress
from .roles import IslandRole, SatelliteRole
from .sync import FragmentSync, Rounds, download_state, state_bytes

logger = logging.getLogger(__name__)


class _Log:
    """Progress notes of a catch-up in the middle of a run, to the log."""

    def note(self, text: str) -> None:
        logger.info("%s", text)


class IslandCore:
    def __init__(
        self, cfg: Config, layout: Sequence[Sequence[str]], params: Mapping[str, torch.Tensor], network: Network,
        role: IslandRole | SatelliteRole, events: EventLog, totals: dict, run_torch: Callable[..., Awaitable],
        metrics: Metrics | None = None, rounds: Rounds | None = None,
    ):
        """`params`: the model's parameters by name, at the run's initialisation (the agreed values
        start from them); `totals`: the run's counters, which the core adds its rounds to;
        `rounds`: what averages a contribution with the other islands (default: the network's
        rounds, node/net/direct.py)."""
        self.cfg = cfg
        self.params = params
        self.network = network
        self.rounds = network.rounds if rounds is None else rounds
        self.role = role
        self.events = events
        self.totals = totals
        self.metrics = metrics
        self.run_torch = run_torch
        self.schedule = cfg.diloco.schedule
        self.timeouts = network.timeouts
        self.diloco = StreamingDiLoCo(cfg.diloco, layout, params, satellite=role.satellite)
        self.sync: FragmentSync | None = None
        self.unsound: set[int] = set()
        """Fragments whose agreed values are not the swarm's: it joined without the swarm's state
        (`catch_up`); none is given to a joiner until a round brings it (policy.holds_swarm_base)."""
        self._refreshes: set[asyncio.Future] = set()

    # --- joining -------------------------------------------------------------------------

    async def catch_up(self, step: int, progress: Progress, without_state: bool = True) -> int | None:
        """If the swarm is ahead of this island (it joined late, or restarted), take its state and its step.

        Downloads every fragment's agreed values, outer momentum and round number from the most
        advanced island that answers, starts the local values from them, and continues at that
        island's step; None if there was nothing to catch up. If no state came, it takes the swarm's
        step anyway (`without_state`), or stays where it is."""
        ahead = self.network.ahead()
        if ahead is None or ahead[1] <= step + self.schedule.spacing:
            return None
        progress.note(f"the swarm is at step {ahead[1]}, this island at {step}: downloading its state")
        started = time.monotonic()
        got = await self._download_all()
        if len(got) < self.schedule.fragments and not without_state:
            progress.note("could not download the swarm's state; going on from this island's own")
            return None
        if len(got) < self.schedule.fragments:
            # no usable state: take the swarm's step anyway; this island's first round of each
            # fragment is then stale (it counts ~0) and it rebases on an island's fragment after it
            progress.note("could not download the swarm's state; joining at its step with a stale base")
            self.unsound = set(range(self.schedule.fragments))
            self.events.emit("join", step=ahead[1], state_from=None, seconds=round(time.monotonic() - started, 3), bytes=0)
            return ahead[1]

        def take() -> None:
            for p, meta, g, m in got:
                self.diloco.replace(p, g, m, round_=int(meta["round"]))
                with torch.no_grad():
                    for n, t in g.items():
                        self.params[n].copy_(t)

        new_step = min(int(meta["step"]) for _, meta, _, _ in got)
        if new_step < step:
            # a donor behind this island's own state (its checkpoint): keep that instead
            progress.note(f"the swarm's state came at step {new_step}, behind this island's {step}: kept its own")
            return None
        await self.run_torch(take)
        sources = [str(meta.get("peer_id")) for _, meta, _, _ in got]
        size = sum(state_bytes(g, m) for _, _, g, m in got)
        seconds = time.monotonic() - started
        # state_from: the island that gave fragment 0; sources: who gave each fragment
        self.events.emit("join", step=new_step, state_from=sources[0], sources=sources, seconds=round(seconds, 3), bytes=size)
        progress.note(f"took the swarm's state at step {new_step} from {', '.join(sorted({s[-8:] for s in sources}))}: {size / 1e6:.1f} MB in {seconds:.1f}s")
        return new_step

    async def rejoin(self, step: int) -> int:
        """The step to train from: this one, or, when this island is more than a window behind most
        of the other islands (it was frozen, or starved of CPU, for a while), the swarm's, with its
        state, as a restarted island takes them (`catch_up`). Otherwise every round it started would
        find the others past it, and it would train alone through them, its tokens in no round (the
        chaos soak: an island back from SIGSTOP spent a minute so). Between rounds only."""
        typical = self.network.typical_step()
        if typical is None or typical <= step + self.schedule.window:
            return step
        logger.info("step %d: most islands are at step %d or beyond: taking the swarm's state", step, typical)
        new = await self.catch_up(step, _Log(), without_state=False)
        if new is None:
            return step
        for p in range(self.schedule.fragments):
            self.diloco.on_local_change(p)  # a multi-rank island's ranks take the new values
        self.network.status.step = self.network.status.since = new  # no round at or before it
        return new

    async def _download_all(self) -> list[tuple[int, dict, dict, dict]]:
        """(fragment, meta, agreed values, momentum) of each fragment in order, up to the first
        that did not come or did not fit."""
        got = []
        for p in range(self.schedule.fragments):
            item = await download_state(self.rounds, self.diloco, p, self.timeouts.join_s)
            if isinstance(item, str):
                logger.warning("fragment %d: %s", p, item)
                break
            got.append((p, *item))
        return got

    def begin(self, step: int, shard: int, batch_tokens: int) -> None:
        """From now on this island's record says it is training, from `step`, on data shard `shard`."""
        status = self.network.status
        status.step, status.shard, status.state, status.since = step, shard, "training", step
        self.set_batch_tokens(batch_tokens)

    def set_batch_tokens(self, batch_tokens: int) -> None:
        """Tokens of one inner step of the whole island (its ranks and micro-batches included)."""
        self.network.status.batch_tokens = batch_tokens

    def use_params(self, params: Mapping[str, torch.Tensor], on_local_change: Callable[[int], None]) -> None:
        """From now on the rounds read and write `params` (a multi-rank island's view of its
        model), and tell `on_local_change(fragment)` when they changed a fragment's local values."""
        self.params = params
        self.diloco.on_local_change = on_local_change

    def start(self, start_step: int) -> None:
        """Serve this island's state to joiners and begin syncing fragments on the schedule."""
        # what a joiner's download says, before the first step; and no round at or before it
        self.network.status.step = self.network.status.since = start_step
        if self.role.serves_state:
            self.rounds.share_state(self._state_for_joiners, priority=float(start_step))
        # a round its role does not allow now (a satellite short of contact) is `skipped_no_contact`
        self.sync = FragmentSync(
            self.diloco, self.rounds, self.params, self._on_sync, self.timeouts, run_torch=self.run_torch,
            can_round=lambda: self.role.may_round(self.network.round_budget_s),
        )

    def _state_for_joiners(self, fragment: int) -> tuple[dict, list] | None:
        """(metadata, tensors) of a fragment for a joiner, or None: not the swarm's values (`unsound`)."""
        if fragment in self.unsound:
            return None
        round_, tensors = self.diloco.fragment_state(fragment)
        meta = {"peer_id": self.network.peer_id, "step": self.network.status.step, "round": round_, "run_id": self.cfg.net.run_id}
        return meta, tensors

    # --- every step ------------------------------------------------------------------------

    async def before_step(self, step: int) -> int:
        """The step the loop trains from next (a satellite in contact may move to the islands')."""
        return await self.role.before_step(self, step)

    async def after_step(self, step: int, tokens: int) -> None:
        """Step `step` trained on `tokens` tokens: start and apply the rounds the schedule says."""
        await self.sync.after_step(step, tokens)

    def publish(self, step: int, tokens_per_s: float, step_seconds: float) -> None:
        """Tell the swarm where this island stands (its record is published by the network's loop)."""
        status = self.network.status
        status.step, status.tokens_per_s, status.step_seconds = step, tokens_per_s, step_seconds
        status.next_sync = self.schedule.next_starts(step)
        self.network.report()
        if self.metrics is not None:
            self.metrics.on_network(**self.network.counts())

    def _on_sync(self, record: dict) -> None:
        totals = self.totals
        totals[f"syncs_{record['outcome']}"] += 1
        totals["bytes_sent"] += record["bytes_sent"]
        totals["bytes_recv"] += record["bytes_recv"]
        self.network.status.last_sync[record["fragment"]] = {
            "step": record["step"], "outcome": record["outcome"], "group_size": record["group_size"],
        }
        self.events.emit("sync", **record)
        if record["fragment"] in self.unsound and holds_swarm_base(record["outcome"], record["policy"], record["staleness"], record["consensus"]):
            self.unsound.discard(record["fragment"])
        if self.metrics is not None:
            self.metrics.on_sync(record)
        # tell the swarm at once: an island that fell behind reads this to skip the round
        self.refresh_soon()

    def refresh_soon(self) -> None:
        """Publish this island's record and read the others' now, without waiting for it."""
        self._refreshes.add(asyncio.ensure_future(self.network.refresh()))
        self._refreshes.difference_update({t for t in self._refreshes if t.done()})

    def align(self, step: int) -> int:
        """A satellite in contact moves its step counter to the islands' (it trains at its own
        pace, and rounds are matched by round number): the step it should be at now."""
        target = self.network.swarm_step()
        s = self.schedule
        # a little behind: its rounds start late but within the overlap; ahead by less than half
        # a window: its round numbers are the islands' still. Otherwise move.
        if target is None or -s.overlap <= step - target <= s.window // 2:
            return step
        target = min(target, self.cfg.train.steps)
        self.events.emit("align", step=step, to_step=target)
        return target

    # --- leaving ---------------------------------------------------------------------------

    async def flush(self, step: int, leaving: bool) -> None:
        """Finish the rounds in flight and apply them; `leaving` on a signal: within --leave-timeout-s."""
        await self.sync.flush(step, budget_s=self.timeouts.leave_timeout_s if leaving else None)

    async def agree(self, step: int, shutdown: Callable[[], bool], progress: Progress) -> None:
        """At the end of the run, with the others: wait for them to finish, then one last round of
        every fragment, healed where the islands' agreed values still differ (FragmentSync.agree)."""
        if not self.role.agrees_at_end or self.network.expected_group() <= 1:
            return
        wait_s = self.timeouts.end_wait_s
        ready = await self.network.wait_for_end(step, wait_s, shutdown, Changed(
            lambda behind: progress.note(f"waiting up to {wait_s:g} s for {behind} island(s) to finish, to agree the model")
        ))

        async def compare(look: int, fingerprints: list[list[float]]) -> list[list[list[float]]]:
            return await self.network.compare_final(look, fingerprints, ready, self.timeouts.end_compare_s)

        last_rounds, verdicts, agree_bytes = await self.sync.agree(step, compare)
        self.totals["bytes_sent"] += agree_bytes
        self.totals["bytes_recv"] += agree_bytes
        self.events.emit("agree", step=step, last_rounds=last_rounds, fragments=verdicts, bytes_sent=agree_bytes)

    async def withdraw(self) -> None:
        """Tell the swarm this island left: the others stop waiting for it at once. A refresh still
        in flight is cancelled first: it would publish the record of an island still training."""
        for task in self._refreshes:
            task.cancel()
        await asyncio.gather(*self._refreshes, return_exceptions=True)
        self._refreshes.clear()
        await self.network.withdraw()


async def wait_for_islands(network: Network, want: int, shutdown: Callable[[], bool], progress: Progress, ready: bool = False) -> None:
    """--wait-islands: wait (bounded) until that many islands are in the swarm; `ready`: until that
    many have opened their rounds (built their model, joined the run), so that none trains alone
    while another still builds a slow task."""
    timeout_s = network.timeouts.wait_timeout_s
    what = "ready" if ready else "here"
    seen = await network.wait_for_islands(
        want, timeout_s, shutdown, Changed(lambda n: progress.note(f"waiting for islands: {n} of {want} {what}")), ready=ready,
    )
    if seen < want and network.under_way():
        progress.note(f"{seen} of {want} islands {what}, but the run is under way: joining it")
    elif seen < want:
        progress.note(f"only {seen} of {want} islands {what} after {timeout_s:g}s; training anyway")


class Changed:
    """Call `fn(value)` only when the value differs from the last one."""

    def __init__(self, fn):
        self.fn, self.last = fn, object()

    def __call__(self, value) -> None:
        if value != self.last:
            self.last = value
            self.fn(value)
