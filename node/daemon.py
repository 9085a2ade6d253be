"""The island daemon: builds the parts, runs the training loop, syncs fragments, checkpoints.

`run(cfg, shutdown)` is the whole node; it reads no signals and no
environment (the CLI does, and passes the shutdown trigger in).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from islands.models.data import load_corpus
from islands.models.transformer import Transformer
from islands.protocols.diloco import OUTCOMES, StreamingDiLoCo
from islands.protocols.fragments import layout_digest, split_fragments
from islands.protocols.manifest import build_manifest
from islands.protocols.schedule import balance_accumulation
from islands.protocols.validation import BAN_S

from . import checkpoint as ckpt_io
from .config import Config
from .contact import ContactClock
from .events import EventLog, rotate
from .files import write_lines
from .metrics import Metrics
from .network import ManifestMismatch, Network, NetworkError
from .progress import Progress
from .ranks import TIMEOUT_S, RankEnv, RankFailure, RankGroup, pick_device
from .sync import FragmentSync
from .trainer import Trainer

logger = logging.getLogger(__name__)

VERSION = "0.1.0"
ROUND_TIMEOUT_S = 150.0  # above the longest match wait (x2) plus the all-reduce timeout
JOIN_TIMEOUT_S = 30.0
END_COMPARE_TIMEOUT_S = 30.0  # at the end, how long an island waits for the others' fingerprints (each look)


class StartupError(Exception):
    """Bad input found before training starts (exit status 2); nothing was written."""


class Shutdown:
    """The trigger that stops a node, with the reason it is logged under."""

    def __init__(self):
        self.event = asyncio.Event()
        self.reason = ""

    def request(self, reason: str) -> None:
        if not self.event.is_set():
            self.reason = reason
            self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()


def build_model(cfg: Config) -> tuple[Transformer, list[list[str]], dict]:
    """The model at the run's initialisation, its fragment layout, and the run manifest."""
    model_cfg = cfg.train.model_config()
    torch.manual_seed(cfg.diloco.seed)
    model = Transformer(model_cfg)
    layout = split_fragments(model.layer_groups(), cfg.diloco.fragments)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    manifest = build_manifest(cfg.net.run_id, model_cfg.to_dict(), cfg.diloco.manifest_fields(), layout_digest(layout, shapes))
    return model, layout, manifest


def rank_timeout_s(cfg: Config) -> float:
    """How long a collective may wait: the followers wait at the first one while rank 0 waits for
    islands (--wait-timeout-s) and downloads the swarm's state."""
    return max(TIMEOUT_S, cfg.net.wait_timeout_s + cfg.diloco.fragments * JOIN_TIMEOUT_S + 60.0)


def follow(cfg: Config, env: RankEnv) -> int:
    """Rank 1.. of a multi-rank island: train in step with rank 0, which does everything else
    (ranks.py). Returns the exit status."""
    torch.set_num_threads(cfg.train.torch_threads or torch.get_num_threads())
    device = pick_device(cfg.train.device, env.local_rank)
    model, layout, _ = build_model(cfg)
    model.to(device)
    corpus = load_corpus(cfg.data, cfg.train.seq_len)
    try:
        ranks = RankGroup(env, device, layout, rank_timeout_s(cfg), sharded=cfg.train.parallel == "fsdp")
    except (RuntimeError, ValueError) as e:
        logger.error("rank %d: could not meet rank 0: %s", env.rank, e)
        return 1
    try:
        shard, data_seed = ranks.receive_header()
        trainer = Trainer(
            cfg.train, model, corpus.shard(shard), corpus, data_seed=data_seed, eval_batches=cfg.data.eval_batches,
            device=device, rank=env.rank, world=env.world,
        )
        ranks.attach(trainer)
        while (order := ranks.next_step(trainer.evaluate)) is not None:
            step, trainer.accum = order
            ranks.guard(trainer.step, step)
        return 0
    except RankFailure as e:
        logger.error("rank %d: %s", env.rank, e)
        return 1
    finally:
        ranks.close()


def _new_totals() -> dict:
    return {
        "tokens": 0,
        "compute_seconds": 0.0,
        "wall_seconds": 0.0,
        "bytes_sent": 0,
        "bytes_recv": 0,
        "final_loss": None,
        **{f"syncs_{o}": 0 for o in OUTCOMES},
    }


class Island:
    def __init__(self, cfg: Config, ranks: RankEnv | None = None, rank_logs: Sequence[Path] = ()):
        """`ranks`: this node is rank 0 of an island of several data-parallel ranks (ranks.py);
        `rank_logs`: the other ranks' logs, where this node started them (--nproc)."""
        self.cfg = cfg
        self.rank_logs = list(rank_logs)
        self.run_dir = Path(cfg.output.run_dir)
        # all torch work runs in one thread (see run); fix the thread count before any of it
        self.threads = cfg.train.torch_threads or torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            self.device = pick_device(cfg.train.device, ranks.local_rank if ranks else 0)
        except ValueError as e:
            raise StartupError(str(e)) from None
        self.model, self.layout, self.manifest = build_model(cfg)
        self.model.to(self.device)
        self.ranks = None
        if ranks is None and cfg.train.parallel == "fsdp":
            raise StartupError("--parallel fsdp shards the model over the island's ranks: give --nproc N (N >= 2) or run under torchrun")
        if ranks is not None:
            try:
                self.ranks = RankGroup(ranks, self.device, self.layout, rank_timeout_s(cfg), sharded=cfg.train.parallel == "fsdp")
            except (RuntimeError, ValueError) as e:  # the ranks did not meet (torch's store errors are RuntimeErrors)
                raise StartupError(f"the island's {ranks.world} ranks could not meet: {e}") from None
        try:
            self.resume = ckpt_io.load(self.run_dir, self.manifest)
        except ckpt_io.CheckpointError as e:
            raise StartupError(str(e)) from None
        if self.resume is not None and self.resume.inner_opt != cfg.train.inner_opt:
            raise StartupError(
                f"checkpoint {ckpt_io.checkpoint_dir(self.run_dir)} was trained with --inner-opt "
                f"{self.resume.inner_opt}, not {cfg.train.inner_opt}; use the same or another --run-dir"
            )
        shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
        self.shapes = [[(n, shapes[n]) for n in names] for names in self.layout]  # per fragment, for the averagers
        try:  # before the network starts: bad data is a start-up error like any other
            self.corpus = load_corpus(cfg.data, cfg.train.seq_len)
        except ValueError as e:
            raise StartupError(str(e)) from None

    async def run(
        self, shutdown: Shutdown, announce: Callable[[str], None] = print, ready: Callable[[], None] = lambda: None
    ) -> int:
        """Join or start the swarm, train to --steps (or until shutdown), leave cleanly.

        `ready` is called once the network is up (hivemind resets SIGINT as it starts,
        so that is when the caller should install its signal handlers).
        """
        # a satellite's contact windows count from the node's start
        contact = ContactClock(self.cfg.net.contact) if self.cfg.net.role == "satellite" else None
        network = Network(self.cfg, self.manifest, self.shapes, VERSION, contact)
        try:
            try:
                await network.start()
            except (ManifestMismatch, NetworkError) as e:
                raise StartupError(str(e)) from None
            ready()
            maddrs = network.maddrs()
            if self.cfg.output.maddr_file:
                write_lines(self.cfg.output.maddr_file, maddrs)
            join_with = next((m for m in maddrs if "/ip4/127.0.0.1/" not in m), maddrs[0] if maddrs else "")
            announce(f"islands-node {network.peer_id} listening; join with: islands-node --join {join_with}")
            return await self._train(shutdown, network)
        finally:
            await network.close()
            if self.ranks is not None:
                self.ranks.close()

    async def _train(self, shutdown: Shutdown, network: Network) -> int:
        cfg = self.cfg
        wall_mark = time.monotonic()
        # torch keeps a thread pool per calling thread: one thread for all of it avoids contention
        torch_thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="torch", initializer=torch.set_num_threads, initargs=(self.threads,)
        )
        loop = asyncio.get_running_loop()

        def in_torch_thread(fn, *args):
            return loop.run_in_executor(torch_thread, fn, *args)

        corpus = self.corpus
        params = dict(self.model.named_parameters())
        satellite = network.contact is not None
        diloco = StreamingDiLoCo(cfg.diloco, self.layout, params, satellite=satellite)
        totals = _new_totals()
        start_step = 0
        if self.resume is not None:
            totals.update(self.resume.totals)
            start_step = self.resume.step

        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        log_path = cfg.output.event_log_path
        rotate(log_path)
        events = EventLog(log_path)
        progress = Progress(cfg.output.progress, f"{cfg.net.role} {network.peer_id[-8:]}", cfg.train.steps)
        metrics = None
        if cfg.net.metrics_port is not None:
            try:
                metrics = Metrics(cfg.net.metrics_host, cfg.net.metrics_port, {"run_id": cfg.net.run_id, "role": cfg.net.role, "peer_id": network.peer_id})
            except OSError as e:
                raise StartupError(f"metrics_port {cfg.net.metrics_port}: cannot listen on {cfg.net.metrics_host}: {e.strerror}") from None
            progress.note(f"metrics at http://{cfg.net.metrics_host}:{metrics.port}/metrics")

        def on_refused(what: str) -> None:
            events.emit("refused", what=what)
            if metrics is not None:
                metrics.refused.inc()

        def on_banned(peer: str) -> None:
            events.emit("banned", peer=peer, seconds=BAN_S)
            progress.note(f"banned peer {peer} for {BAN_S:.0f}s: its rounds were rejected repeatedly")

        network.on_refused, network.on_banned = on_refused, on_banned

        if cfg.net.wait_islands > 1 and not start_step:
            seen = await network.wait_for_islands(
                cfg.net.wait_islands, cfg.net.wait_timeout_s, shutdown.is_set,
                _Changed(lambda n: progress.note(f"waiting for islands: {n} of {cfg.net.wait_islands} here")),
            )
            if seen < cfg.net.wait_islands:
                progress.note(f"only {seen} of {cfg.net.wait_islands} islands after {cfg.net.wait_timeout_s:g}s; training anyway")
        shard_index = cfg.data.shard if cfg.data.shard >= 0 else totals.get("shard", -1)
        if shard_index < 0:
            shard_index = network.choose_shard()
        totals["shard"] = shard_index
        network.status.shard = shard_index
        network.status.step = start_step
        network.status.state = "training"
        world = self.ranks.world if self.ranks else 1
        data_seed = cfg.diloco.seed * 7919 + shard_index
        trainer = Trainer(
            cfg.train, self.model, corpus.shard(shard_index), corpus, data_seed=data_seed, eval_batches=cfg.data.eval_batches,
            device=self.device, world=world,
        )
        network.status.batch_tokens = cfg.train.batch_size * cfg.train.seq_len * world
        if self.resume is not None:
            r = self.resume
            try:
                self.model.load_state_dict(r.local_state)
                if r.inner_opt_state:  # a sharded island checkpoints none: its inner optimizer starts afresh
                    trainer.optimizer.load_state_dict(r.inner_opt_state)
                diloco.load(r.global_state, r.outer_state, r.fragments)
            except (RuntimeError, KeyError, ValueError) as e:
                raise StartupError(f"checkpoint {ckpt_io.checkpoint_dir(self.run_dir)} does not fit this model: {e}") from None
            self.resume = None
        await network.refresh()

        events.emit(
            "started", peer_id=network.peer_id, maddrs=network.maddrs(), run_id=cfg.net.run_id, role=cfg.net.role,
            config=cfg.flat(), manifest=self.manifest, resumed_step=start_step, shard=shard_index, version=VERSION,
            metrics_port=None if metrics is None else metrics.port,
        )
        if start_step:
            progress.note(f"resumed from {ckpt_io.checkpoint_dir(self.run_dir)} at step {start_step}")
        caught_up = await self._catch_up(network, diloco, in_torch_thread, start_step, events, progress)
        if caught_up is not None:
            start_step = caught_up
        if self.ranks is not None:
            ranks = self.ranks

            def bring_ranks() -> None:  # every rank starts from this one's model and inner optimizer
                ranks.header(shard_index, data_seed)
                ranks.attach(trainer)

            try:
                await in_torch_thread(bring_ranks)
            except RankFailure as e:
                raise StartupError(str(e)) from None
            diloco.on_local_change = ranks.mark
            params = ranks.view(params)
            whole, local = ranks.model_bytes()
            progress.note(
                f"{ranks.world} ranks: {cfg.train.parallel} on {self.device} ({'nccl' if self.device.type == 'cuda' else 'gloo'}); "
                f"model {whole / 1e6:.1f} MB, {local / 1e6:.1f} MB of it on this rank"
            )

        def inner_step(step: int):
            if self.ranks is None:
                return trainer.step(step)
            self.ranks.before_step(step, trainer.accum)
            return self.ranks.guard(trainer.step, step)  # DDP's gradient all-reduce runs inside

        def state_for_joiners(fragment: int) -> tuple[dict, list]:
            round_, tensors = diloco.fragment_state(fragment)
            meta = {"peer_id": network.peer_id, "step": network.status.step, "round": round_, "run_id": cfg.net.run_id}
            return meta, tensors

        if not satellite:  # a satellite's agreed values are stale by design: joiners take an island's
            network.averaging.share_state(state_for_joiners, priority=float(start_step))

        refreshes: set[asyncio.Future] = set()

        def on_sync(record: dict) -> None:
            totals[f"syncs_{record['outcome']}"] += 1
            totals["bytes_sent"] += record["bytes_sent"]
            totals["bytes_recv"] += record["bytes_recv"]
            network.status.last_sync[record["fragment"]] = {
                "step": record["step"], "outcome": record["outcome"], "group_size": record["group_size"],
            }
            events.emit("sync", **record)
            if metrics is not None:
                metrics.on_sync(record)
            # tell the swarm at once: an island that fell behind reads this to skip the round
            refreshes.add(asyncio.ensure_future(network.refresh()))
            refreshes.difference_update({t for t in refreshes if t.done()})

        can_round = (lambda: network.contact.can_round(network.round_budget_s)) if satellite else None
        sync = FragmentSync(diloco, network.averaging, params, on_sync, ROUND_TIMEOUT_S, run_torch=in_torch_thread, can_round=can_round)
        was_in_contact = None
        schedule = cfg.diloco.schedule
        checkpoint_every = cfg.output.checkpoint_every or schedule.window
        last_checkpoint = start_step
        recent_losses: deque[float] = deque(maxlen=10)
        recent_rate: deque[tuple[float, int]] = deque(maxlen=20)
        recent_seconds: deque[float] = deque(maxlen=10)  # per micro-batch
        step = start_step

        sharded = self.ranks is not None and self.ranks.sharded
        failed = False

        def local_state() -> dict[str, torch.Tensor]:
            """The island's own parameters (sharded: gathered; after a rank failed, the last full copy)."""
            if sharded and failed:
                return dict(self.ranks.mirror)
            return {n: params[n].detach().cpu() for n in params}

        def save() -> Path:
            nonlocal wall_mark
            now = time.monotonic()
            totals["wall_seconds"] += now - wall_mark
            wall_mark = now
            if recent_losses:
                totals["final_loss"] = sum(recent_losses) / len(recent_losses)
            return ckpt_io.save(
                self.run_dir,
                ckpt_io.Checkpoint(
                    step=step,
                    manifest=self.manifest,
                    global_state=diloco.global_state(),
                    local_state=local_state(),
                    outer_state=diloco.momentum_state(),
                    inner_opt_state={} if sharded else trainer.optimizer.state_dict(),
                    fragments=diloco.counters_state(),
                    totals=totals,
                    inner_opt=cfg.train.inner_opt,
                ),
            )

        reason = "completed"
        path = None
        eval_loss = global_eval_loss = None
        try:
            try:  # a failed collective: the step's, or a sharded island's gathers and evaluations
                while step < cfg.train.steps:
                    if shutdown.is_set():
                        reason = shutdown.reason or "shutdown"
                        break
                    if satellite:
                        in_contact = network.contact.in_contact()
                        if in_contact != was_in_contact:
                            was_in_contact = in_contact
                            events.emit("contact", step=step, in_contact=in_contact, remaining_s=round(network.contact.remaining_s(), 3))
                            if in_contact:  # publish its record and read the islands' at once
                                refreshes.add(asyncio.ensure_future(network.refresh()))
                        if in_contact and sync.quiet:
                            step = self._align(step, network, events)
                            if step >= cfg.train.steps:
                                break
                    stats = await in_torch_thread(inner_step, step + 1)
                    step += 1
                    totals["tokens"] += stats.tokens
                    totals["compute_seconds"] += stats.seconds
                    recent_losses.append(stats.loss)
                    recent_rate.append((time.monotonic(), stats.tokens))
                    events.emit("step", step=step, loss=stats.loss, aux_loss=stats.aux_loss, tokens=stats.tokens, step_seconds=round(stats.seconds, 6))
                    await sync.after_step(step, stats.tokens)
                    recent_seconds.append(stats.seconds / trainer.accum)
                    if cfg.train.balance and schedule.ends_window(step):
                        self._balance(trainer, step, statistics.median(recent_seconds), network.peer_step_seconds(), events, progress)
                        network.status.batch_tokens = cfg.train.batch_size * cfg.train.seq_len * world * trainer.accum
                    if cfg.train.eval_every and step % cfg.train.eval_every == 0:
                        events.emit("eval", step=step, eval_loss=await in_torch_thread(trainer.evaluate))
                    if sync.quiet and step - last_checkpoint >= checkpoint_every:
                        await in_torch_thread(save)
                        last_checkpoint = step
                    frag, at = schedule.next_round(step)
                    rate = _rate(recent_rate)
                    progress.update(step, stats.loss, rate, f"f{frag}@{at}")
                    network.status.step, network.status.tokens_per_s = step, rate
                    network.status.step_seconds = stats.seconds
                    network.status.next_sync = schedule.next_starts(step)
                    network.report()
                    if metrics is not None:
                        metrics.on_step(step, stats.loss, stats.tokens, rate)
                        metrics.on_network(**network.counts())
            except RankFailure as e:
                reason, failed = f"rank failed: {e}", True
                progress.note(f"stopping: {e}; {self._rank_logs_hint()}")
            if shutdown.is_set() and reason == "completed" and step < cfg.train.steps:
                reason = shutdown.reason or "shutdown"
            # leaving on a signal: rounds in flight get a bounded time, then the swarm is told at once
            try:
                await sync.flush(step, budget_s=cfg.net.leave_timeout_s if shutdown.is_set() else None)
            except RankFailure as e:  # a sharded island gathers the fragments it applies
                reason, failed = f"rank failed: {e}", True
            if step >= cfg.train.steps and not failed and not satellite and network.expected_group() > 1:
                # the islands end together: they wait for one another to finish, then run one last
                # round of every fragment, healed where needed
                ready = await network.wait_for_end(step, cfg.net.end_wait_s, shutdown.is_set, _Changed(
                    lambda behind: progress.note(f"waiting up to {cfg.net.end_wait_s:g} s for {behind} island(s) to finish, to agree the model")
                ))

                async def compare(look: int, fingerprints: list[list[float]]) -> list[list[list[float]]]:
                    return await network.compare_final(look, fingerprints, ready, END_COMPARE_TIMEOUT_S)

                last_rounds, verdicts, agree_bytes = await sync.agree(step, compare)
                totals["bytes_sent"] += agree_bytes
                totals["bytes_recv"] += agree_bytes
                events.emit("agree", step=step, last_rounds=last_rounds, fragments=verdicts, bytes_sent=agree_bytes)
            await network.withdraw()
            try:
                path = await in_torch_thread(save)
                if not (sharded and failed):  # a sharded evaluation needs every rank
                    eval_loss = await in_torch_thread(trainer.evaluate)
                    global_eval_loss = await in_torch_thread(self._evaluate_global, trainer, diloco, params)
            except RankFailure as e:
                reason, failed = f"rank failed: {e}", True
                path = await in_torch_thread(save)  # the last full copy, then
            events.emit("eval", step=step, eval_loss=eval_loss, global_eval_loss=global_eval_loss)
            if self.ranks is not None and not failed:
                # the others take what changed since the last step (all ranks end alike), then leave
                spread = await in_torch_thread(self.ranks.stop)
                whole, local = self.ranks.model_bytes()
                events.emit(
                    "ranks", step=step, world=self.ranks.world, device=str(self.device), param_spread=spread,
                    parallel=cfg.train.parallel, model_bytes=whole, rank_bytes=local, fragment_bytes=self.ranks.fragment_bytes(),
                    gather_peak_bytes=self.ranks.gather_peak_bytes if sharded else None,
                )
        finally:
            progress.close()
            torch_thread.shutdown(wait=False)
            if metrics is not None:
                metrics.close()
        events.emit("stopped", reason=reason, step=step)
        summary = events.emit(
            "summary",
            steps=step,
            final_loss=totals["final_loss"],
            eval_loss=eval_loss,
            global_eval_loss=global_eval_loss,
            tokens=totals["tokens"],
            compute_seconds=round(totals["compute_seconds"], 3),
            wall_seconds=round(totals["wall_seconds"], 3),
            bytes_sent=totals["bytes_sent"],
            bytes_recv=totals["bytes_recv"],
            **{f"syncs_{o}": totals[f"syncs_{o}"] for o in OUTCOMES},
            checkpoint=str(path),
        )
        events.close()
        progress.note(
            f"{reason} at step {step}: loss {_fmt(summary['final_loss'])}, eval_loss {_fmt(eval_loss)}, "
            f"{totals['tokens']} tokens, syncs ok/solo/failed {totals['syncs_ok']}/{totals['syncs_solo']}/{totals['syncs_failed']}; checkpoint {path}"
        )
        return 1 if failed else 0

    async def _catch_up(self, network: Network, diloco: StreamingDiLoCo, in_torch_thread, step: int, events: EventLog, progress: Progress) -> int | None:
        """If the swarm is ahead of this island (it joined late, or restarted), take its state and its step.

        Downloads every fragment's agreed values, outer momentum and round number
        from the most advanced island that answers, starts the local model from
        them, and continues at that island's step; None if there was nothing to catch up.
        """
        cfg = self.cfg
        ahead = network.ahead()
        if ahead is None or ahead[1] <= step + cfg.diloco.schedule.spacing:
            return None
        progress.note(f"the swarm is at step {ahead[1]}, this island at {step}: downloading its state")
        started = time.monotonic()
        got = []
        for p in range(cfg.diloco.fragments):
            item = await network.averaging.download(p, timeout_s=JOIN_TIMEOUT_S)
            if item is None:
                break
            meta, tensors = item
            try:
                g, m = diloco.state_from_tensors(p, tensors)
            except ValueError as e:
                logger.warning("state from %s does not fit: %s", meta.get("peer_id"), e)
                break
            got.append((p, meta, g, m))
        if len(got) < cfg.diloco.fragments:
            # no usable state: take the swarm's step anyway; this island's first round of each
            # fragment is then stale (it counts ~0) and it rebases on an island's fragment after it
            progress.note("could not download the swarm's state; joining at its step with a stale base")
            events.emit("join", step=ahead[1], state_from=None, seconds=round(time.monotonic() - started, 3), bytes=0)
            return ahead[1]
        params = dict(self.model.named_parameters())

        def take() -> None:
            for p, meta, g, m in got:
                diloco.replace(p, g, m, round_=int(meta["round"]))
                with torch.no_grad():
                    for n, t in g.items():
                        params[n].copy_(t)

        await in_torch_thread(take)
        new_step = min(int(meta["step"]) for _, meta, _, _ in got)
        sources = [str(meta.get("peer_id")) for _, meta, _, _ in got]
        size = sum(t.numel() * t.element_size() for _, _, g, m in got for t in (*g.values(), *m.values()))
        seconds = time.monotonic() - started
        # state_from: the island that gave fragment 0; sources: who gave each fragment
        events.emit("join", step=new_step, state_from=sources[0], sources=sources, seconds=round(seconds, 3), bytes=size)
        progress.note(f"took the swarm's state at step {new_step} from {', '.join(sorted({s[-8:] for s in sources}))}: {size / 1e6:.1f} MB in {seconds:.1f}s")
        return new_step

    def _rank_logs_hint(self) -> str:
        """Where to read why a rank failed (a crash leaves its Python stacks in its log)."""
        if self.rank_logs:
            return f"the other ranks' logs (a crashed rank's Python stacks are there): {', '.join(map(str, self.rank_logs))}"
        return "see the other ranks' stderr (under torchrun: its --log-dir); a crashed rank's Python stacks are there"

    def _balance(self, trainer: Trainer, step: int, micro_s: float, peers: list[float], events: EventLog, progress: Progress) -> None:
        """--balance: as many micro-batches a step as make it take about the other islands' median step."""
        accum = balance_accumulation(micro_s, peers, trainer.accum)
        if accum == trainer.accum:
            return
        swarm_s = round(statistics.median(peers), 6)
        events.emit("balance", step=step, accum_from=trainer.accum, accum=accum, micro_seconds=round(micro_s, 6), swarm_step_seconds=swarm_s)
        progress.note(f"balance: {trainer.accum} -> {accum} micro-batches a step ({micro_s:.3f}s each; the others' median step {swarm_s:.3f}s)")
        trainer.accum = accum

    def _align(self, step: int, network: Network, events: EventLog) -> int:
        """A satellite in contact moves its step counter to the islands' (it trains at its own
        pace, and rounds are matched by round number): the step it should be at now."""
        target = network.swarm_step()
        s = self.cfg.diloco.schedule
        # a little behind: its rounds start late but within the overlap; ahead by less than half
        # a window: its round numbers are the islands' still. Otherwise move.
        if target is None or -s.overlap <= step - target <= s.window // 2:
            return step
        target = min(target, self.cfg.train.steps)
        events.emit("align", step=step, to_step=target)
        return target

    def _evaluate_global(self, trainer: Trainer, diloco: StreamingDiLoCo, params: Mapping[str, torch.Tensor]) -> float:
        """eval_loss of the agreed model: the fragments' global values in place of the local ones
        (`params`: the model's parameters, as Streaming DiLoCo writes them)."""
        local = {n: params[n].detach().clone() for n in params}

        def put(values: Mapping[str, torch.Tensor]) -> None:
            with torch.no_grad():
                for n, t in values.items():
                    params[n].copy_(t)
            for f in range(len(self.layout)):
                diloco.on_local_change(f)

        put(diloco.global_state())
        try:
            return trainer.evaluate()
        finally:
            put(local)


class _Changed:
    """Call `fn(value)` only when the value differs from the last one."""

    def __init__(self, fn):
        self.fn, self.last = fn, object()

    def __call__(self, value) -> None:
        if value != self.last:
            self.last = value
            self.fn(value)


def _rate(recent: deque[tuple[float, int]]) -> float:
    if len(recent) < 2:
        return 0.0
    span = recent[-1][0] - recent[0][0]
    return sum(n for _, n in list(recent)[1:]) / span if span > 0 else 0.0


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.4f}"
