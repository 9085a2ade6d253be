"""The island's training loop, on top of the island core (island.py): the built-in model (byte or
token data, the inner optimizer, --balance) or a task (task.py: the user's model, optimizer and
step), with evaluation, checkpoints, progress and metrics. `attach` (attached.py) drives the same
loop's join, per-step and leave parts from the user's own loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from islands.models.data import load_corpus
from islands.protocols.fragments import layout_digest
from islands.protocols.manifest import build_manifest
from islands.protocols.schedule import balance_accumulation

from . import checkpoint as ckpt_io
from . import task as task_api
from .config import Config
from .daemon import VERSION, Shutdown, StartupError, build_model, rank_timeout_s
from .files import write_lines
from .island import IslandCore, wait_for_islands
from .network import ManifestMismatch, Network, NetworkError
from .outputs import Finish, Outputs, new_totals, rate
from .progress import Progress
from .ranks import RankEnv, RankFailure, RankGroup, pick_device
from .roles import IslandRole, SatelliteRole, make_role
from .task import TaskStepError, TaskTrainer, build_task, share_task_state
from .trainer import StepStats, Trainer

logger = logging.getLogger(__name__)

ATTACHED = "attach"
"""The task entry of an island driven by the user's own loop (attach.py)."""


def _data_seed(cfg: Config, shard: int) -> int:
    """The seed of an island's batches: the run's, and its shard."""
    return cfg.diloco.seed * 7919 + shard


def _shapes(model: torch.nn.Module, layout: Sequence[Sequence[str]]) -> list[list[tuple[str, tuple[int, ...]]]]:
    """(name, shape) of every parameter, per fragment (what the rounds exchange)."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return [[(n, shapes[n]) for n in names] for names in layout]


@dataclasses.dataclass
class LoopState:
    """Where the built-in training loop stands."""

    step: int
    totals: dict
    last_checkpoint: int = 0
    reason: str = "completed"
    failed: bool = False
    """A rank failed: the island stops, saving what it has."""
    wall_mark: float = dataclasses.field(default_factory=time.monotonic)
    losses: deque = dataclasses.field(default_factory=lambda: deque(maxlen=10))
    rates: deque = dataclasses.field(default_factory=lambda: deque(maxlen=20))
    """(time, tokens) of the recent steps."""
    micro_seconds: deque = dataclasses.field(default_factory=lambda: deque(maxlen=10))
    """Seconds per micro-batch of the recent steps."""


class Island:
    """The training loop of an island (the built-in model or a task) on top of the island core."""

    def __init__(self, cfg: Config, ranks: RankEnv | None = None, rank_logs: Sequence[Path] = (), task: task_api.Task | None = None):
        """`ranks`: this node is rank 0 of an island of several data-parallel ranks (ranks.py);
        `rank_logs`: the other ranks' logs, where this node started them (--nproc); `task`: a task
        built already (`attach`), instead of --task's or the built-in model."""
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
        self.entry = cfg.task.task if task is None else ATTACHED
        """--task: the task's build function is called once the island knows its data shard (run)."""
        self.trainer: TaskTrainer | None = None
        self.shard = -1
        self.resume: ckpt_io.Checkpoint | None = None
        self.set_aside: tuple[Path, str] | None = None
        """A damaged checkpoint moved aside at start (where, why), for the event log once it is open."""
        self.resumed_task_state: dict | None = None
        if task is not None:
            self.task_fn = lambda ctx: task
            self.model, self.layout, self.manifest, self.shapes = None, None, None, []
        elif self.entry is not None:
            try:
                self.task_fn = task_api.resolve(self.entry)
            except task_api.TaskError as e:
                raise StartupError(str(e)) from None
            self.model, self.layout, self.manifest, self.shapes = None, None, None, []
        else:
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
        self.sharded = self.ranks is not None and self.ranks.sharded
        if self.entry is not None:
            return
        self._load_checkpoint()
        if self.resume is not None and self.resume.inner_opt != cfg.train.inner_opt:
            raise StartupError(
                f"checkpoint {ckpt_io.checkpoint_dir(self.run_dir)} was trained with --inner-opt "
                f"{self.resume.inner_opt}, not {cfg.train.inner_opt}; use the same or another --run-dir"
            )
        self.shapes = _shapes(self.model, self.layout)
        try:  # before the network starts: bad data is a start-up error like any other
            self.corpus = load_corpus(cfg.data, cfg.train.seq_len, cfg.train.vocab_size)
        except ValueError as e:
            raise StartupError(str(e)) from None

    def _load_checkpoint(self) -> None:
        """The run dir's checkpoint to resume from. One that is damaged (truncated, corrupt: a
        crash or a full disk under it) is set aside when the island joins a swarm, which gives it
        the run's state as to any joiner; alone, it is the operator's to decide (StartupError)."""
        try:
            self.resume = ckpt_io.load(self.run_dir, self.manifest)
        except ckpt_io.ForeignCheckpoint as e:
            raise StartupError(str(e)) from None
        except ckpt_io.CheckpointError as e:
            if not self.cfg.net.join:
                raise StartupError(f"{e}; without --join no swarm can give this island the run's state: "
                                   "move the checkpoint aside to start over") from None
            self.set_aside = (ckpt_io.set_aside(self.run_dir), str(e))
            logger.warning("%s: set aside as %s; this island takes the swarm's state", e, self.set_aside[0])

    def _report_set_aside(self, out: Outputs) -> None:
        if self.set_aside is not None:
            where, why = self.set_aside
            out.events.emit("checkpoint_set_aside", moved_to=str(where), reason=why)
            out.progress.note(f"{why}: set aside as {where}; taking the swarm's state instead")
            self.set_aside = None

    async def run(
        self, shutdown: Shutdown, announce: Callable[[str], None] = print, ready: Callable[[], None] = lambda: None
    ) -> int:
        """Join or start the swarm, train to --steps (or until shutdown), leave cleanly.

        `ready` is called once the network is up (hivemind resets SIGINT as it starts,
        so that is when the caller should install its signal handlers).
        """
        role = make_role(self.cfg)
        network = Network(self.cfg, VERSION, role)
        try:
            try:
                await network.open()
                if self.entry is None:
                    await network.start(self.manifest, self.shapes)
            except (ManifestMismatch, NetworkError) as e:
                raise StartupError(str(e)) from None
            if self.entry is None:
                ready()
            announce(self.listening(network))
            return await self._train(shutdown, network, role, ready)
        finally:
            await network.close()
            if self.ranks is not None:
                self.ranks.close()

    def listening(self, network: Network) -> str:
        """Write --maddr-file; the line that tells where others join."""
        maddrs = network.maddrs()
        if self.cfg.output.maddr_file:
            write_lines(self.cfg.output.maddr_file, maddrs)
        join_with = next((m for m in maddrs if "/ip4/127.0.0.1/" not in m), maddrs[0] if maddrs else "")
        return f"islands-node {network.peer_id} listening; join with: islands-node --join {join_with}"

    async def _train(self, shutdown: Shutdown, network: Network, role: IslandRole | SatelliteRole, ready: Callable[[], None]) -> int:
        # torch keeps a thread pool per calling thread: one thread for all of it avoids contention
        torch_thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="torch", initializer=torch.set_num_threads, initargs=(self.threads,)
        )
        loop = asyncio.get_running_loop()

        def run_torch(fn, *args):
            return loop.run_in_executor(torch_thread, fn, *args)

        out = Outputs.open(self.cfg, self.run_dir, network)
        self._report_set_aside(out)
        try:
            if self.entry is not None:
                await self._build_task(shutdown, network, out, run_torch)
                ready()
            core, trainer, state = await self._join(shutdown, network, role, out, run_torch)
            await self._loop(core, trainer, state, shutdown, out, run_torch)
            finish = await self._leave(core, trainer, state, shutdown, out, run_torch)
        finally:
            out.close()
            torch_thread.shutdown(wait=False)
        out.summarize(state.reason, state.step, state.totals, finish)
        return 1 if state.failed else 0

    async def _join(
        self, shutdown: Shutdown, network: Network, role: IslandRole | SatelliteRole, out: Outputs, run_torch,
    ) -> tuple[IslandCore, Trainer, LoopState]:
        """Start or resume, wait for the islands, catch up with the swarm, bring the ranks along."""
        cfg = self.cfg
        state = LoopState(step=0, totals=new_totals())
        if self.resume is not None:
            state.totals.update(self.resume.totals)
            state.step = self.resume.step
        if self.trainer is None:  # the built-in model: its shard is chosen now
            if cfg.net.wait_islands > 1 and not state.step:
                await wait_for_islands(network, cfg.net.wait_islands, shutdown.is_set, out.progress)
            shard = cfg.data.shard if cfg.data.shard >= 0 else state.totals.get("shard", -1)
            if shard < 0:
                shard = network.choose_shard()
            world = self.ranks.world if self.ranks else 1
            data_seed = _data_seed(cfg, shard)
            trainer = Trainer(
                cfg.train, self.model, self.corpus.shard(shard), self.corpus, data_seed=data_seed, eval_batches=cfg.data.eval_batches,
                device=self.device, world=world,
            )
        else:  # a task: built on its shard already
            shard, data_seed, trainer = self.shard, _data_seed(cfg, self.shard), self.trainer
        state.totals["shard"] = shard
        params = dict(self.model.named_parameters())
        if self.trainer is not None and self.ranks is not None:
            params = self.ranks.view(params)  # a task's model is wrapped already: its rounds see the ranks' view
        core = IslandCore(cfg, self.layout, params, network, role, out.events, state.totals, run_torch, out.metrics)
        if self.trainer is not None and self.ranks is not None:
            core.use_params(params, self.ranks.mark)
        core.begin(state.step, shard, self._batch_tokens(trainer))
        self._resume(core, trainer)
        await network.refresh()
        if cfg.net.wait_islands > 1 and not state.step and not role.satellite:
            await wait_for_islands(network, cfg.net.wait_islands, shutdown.is_set, out.progress, ready=True)
        out.events.emit(
            "started", peer_id=network.peer_id, maddrs=network.maddrs(), run_id=cfg.net.run_id, role=cfg.net.role,
            config=cfg.flat(), manifest=self.manifest, resumed_step=state.step, shard=shard, version=VERSION,
            metrics_port=None if out.metrics is None else out.metrics.port,
        )
        if state.step:
            out.progress.note(f"resumed from {ckpt_io.checkpoint_dir(self.run_dir)} at step {state.step}")
        caught_up = await core.catch_up(state.step, out.progress)
        if caught_up is not None:
            state.step = caught_up
        if self.ranks is not None:
            await self._bring_ranks(core, trainer, shard, data_seed, out.progress, run_torch)
        core.start(state.step)
        state.last_checkpoint = state.step
        return core, trainer, state

    def _batch_tokens(self, trainer: Trainer | TaskTrainer) -> int:
        """Tokens of one step of the island (a task's: those of its last step, 0 before the first)."""
        if self.trainer is not None:
            return self.trainer.last_tokens
        world = self.ranks.world if self.ranks else 1
        return self.cfg.train.batch_size * self.cfg.train.seq_len * world * trainer.accum

    def _resume(self, core: IslandCore, trainer: Trainer | TaskTrainer) -> None:
        """Load the checkpoint found at start-up, if any, into the model, optimizer, task and core."""
        r = self.resume
        if r is None:
            return
        try:
            if self.trainer is None:
                self.model.load_state_dict(r.local_state)
            else:  # through the core's view: a task's model may be wrapped (and sharded) already
                with torch.no_grad():
                    for n, t in r.local_state.items():
                        core.params[n].copy_(t)
                self.trainer.load_state_dict(r.task_state)
                self.resumed_task_state = r.task_state
            if r.inner_opt_state:  # a sharded island checkpoints none: its inner optimizer starts afresh
                trainer.optimizer.load_state_dict(r.inner_opt_state)
            core.diloco.load(r.global_state, r.outer_state, r.fragments, r.residual_state)
        except (RuntimeError, KeyError, ValueError, TypeError) as e:
            raise StartupError(f"checkpoint {ckpt_io.checkpoint_dir(self.run_dir)} does not fit this model: {e}") from None
        self.resume = None

    async def _build_task(self, shutdown: Shutdown, network: Network, out: Outputs, run_torch) -> None:
        """--task: choose the island's data shard, build the task on every rank (rank 0 tells the others
        the shard), then check its checkpoint and join the run with the task's manifest."""
        cfg = self.cfg
        resumed_shard = ckpt_io.peek_shard(self.run_dir)
        if cfg.net.wait_islands > 1 and resumed_shard is None:
            await wait_for_islands(network, cfg.net.wait_islands, shutdown.is_set, out.progress)
        shard = cfg.data.shard if cfg.data.shard >= 0 else resumed_shard if resumed_shard is not None else network.choose_shard()
        self.shard = shard
        ranks = self.ranks

        def build() -> TaskTrainer:
            if ranks is not None:
                ranks.header(shard, _data_seed(cfg, shard))
            return build_task(self.task_fn, self.entry, cfg, ranks, self.device, shard)

        out.progress.note(f"building task {self.entry} on data shard {shard}")
        try:
            self.trainer = await run_torch(build)
        except task_api.TaskError as e:
            raise StartupError(str(e)) from None
        except RankFailure as e:
            raise StartupError(f"the island's ranks could not build the task: {e}") from None
        self.model, self.layout = self.trainer.model, self.trainer.layout
        self.shapes = _shapes(self.model, self.layout)
        shapes = {n: s for names in self.shapes for n, s in names}
        self.manifest = build_manifest(
            cfg.net.run_id, task_api.manifest_model(self.entry, self.model), cfg.diloco.manifest_fields(), layout_digest(self.layout, shapes),
        )
        self._load_checkpoint()
        self._report_set_aside(out)
        try:
            await network.start(self.manifest, self.shapes)
        except (ManifestMismatch, NetworkError) as e:
            raise StartupError(str(e)) from None

    async def _bring_ranks(self, core: IslandCore, trainer: Trainer | TaskTrainer, shard: int, data_seed: int, progress: Progress, run_torch) -> None:
        """Every rank starts from this one's model and inner optimizer (a task's: and its state); the
        rounds then work on the ranks' view of the model."""
        ranks = self.ranks

        def bring() -> None:
            ranks.header(shard, data_seed)
            ranks.attach(trainer)

        def bring_task() -> None:  # wrapped already (TaskContext.parallelize); what rank 0 loaded goes out at the first step
            share_task_state(ranks, self.trainer, self.resumed_task_state)
            for f in range(len(self.layout)):
                ranks.mark(f)

        try:
            await run_torch(bring if self.trainer is None else bring_task)
        except RankFailure as e:
            raise StartupError(str(e)) from None
        if self.trainer is None:
            core.use_params(ranks.view(core.params), ranks.mark)
        whole, local = ranks.model_bytes()
        progress.note(
            f"{ranks.world} ranks: {self.cfg.train.parallel} on {self.device} ({'nccl' if self.device.type == 'cuda' else 'gloo'}); "
            f"model {whole / 1e6:.1f} MB, {local / 1e6:.1f} MB of it on this rank"
        )

    async def _loop(self, core: IslandCore, trainer: Trainer, state: LoopState, shutdown: Shutdown, out: Outputs, run_torch) -> None:
        """Train to --steps, or until shutdown or a rank fails."""
        steps = self.cfg.train.steps
        try:  # a failed collective: the step's, or a sharded island's gathers and evaluations
            while state.step < steps:
                if shutdown.is_set():
                    state.reason = shutdown.reason or "shutdown"
                    break
                state.step = await core.before_step(state.step)
                if state.step >= steps:
                    break
                await self._one_step(core, trainer, state, out, run_torch)
        except RankFailure as e:
            state.reason, state.failed = f"rank failed: {e}", True
            out.progress.note(f"stopping: {e}; {self._rank_logs_hint()}")
        except TaskStepError as e:
            state.reason, state.failed = f"task failed: {e}", True
            out.progress.note(f"stopping: {e} (the last checkpoint is of step {state.last_checkpoint})")
            logger.error("%s", e, exc_info=e.__cause__)
        if shutdown.is_set() and state.reason == "completed" and state.step < steps:
            state.reason = shutdown.reason or "shutdown"

    async def _one_step(self, core: IslandCore, trainer: Trainer, state: LoopState, out: Outputs, run_torch) -> None:
        stats = await run_torch(self._inner_step, trainer, state.step + 1)
        await self._after_inner(core, trainer, state, out, run_torch, stats)

    async def _after_inner(self, core: IslandCore, trainer: Trainer | TaskTrainer, state: LoopState, out: Outputs, run_torch, stats: StepStats) -> None:
        """An inner step was taken (by this loop, or by the user's own under `attach`): log it, start
        and apply the rounds it calls for, evaluate, checkpoint, report."""
        cfg = self.cfg
        state.step = step = state.step + 1
        state.totals["tokens"] += stats.tokens
        state.totals["compute_seconds"] += stats.seconds
        if stats.loss is not None:  # an attached island may not be told its loss
            state.losses.append(stats.loss)
        state.rates.append((time.monotonic(), stats.tokens))
        extra = {"aux_loss": stats.aux_loss} if stats.aux_loss is not None else {}
        if stats.info is not None:
            extra["info"] = stats.info
        out.events.emit("step", step=step, loss=stats.loss, **extra, tokens=stats.tokens, step_seconds=round(stats.seconds, 6))
        if self.trainer is not None:
            core.set_batch_tokens(stats.tokens)
        await core.after_step(step, stats.tokens)
        state.micro_seconds.append(stats.seconds / trainer.accum)
        if cfg.train.balance and core.schedule.ends_window(step):
            self._balance(trainer, step, statistics.median(state.micro_seconds), core.network.peer_step_seconds(), out)
            core.set_batch_tokens(self._batch_tokens(trainer))
        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and trainer.evaluate is not None:
            out.events.emit("eval", step=step, eval_loss=await run_torch(trainer.evaluate))
        if core.sync.quiet and step - state.last_checkpoint >= (cfg.output.checkpoint_every or core.schedule.window):
            await self._checkpoint(core, trainer, state, out, run_torch)
            state.last_checkpoint = step
        frag, at = core.schedule.next_round(step)
        tokens_per_s = rate(state.rates)
        out.progress.update(step, stats.loss, tokens_per_s, f"f{frag}@{at}")
        core.publish(step, tokens_per_s, stats.seconds)
        if out.metrics is not None:
            out.metrics.on_step(step, float("nan") if stats.loss is None else stats.loss, stats.tokens, tokens_per_s)

    def _inner_step(self, trainer: Trainer, step: int):
        if self.ranks is None:
            return trainer.step(step)
        self.ranks.before_step(step, trainer.accum)
        return self.ranks.guard(trainer.step, step)  # DDP's gradient all-reduce runs inside

    async def _leave(self, core: IslandCore, trainer: Trainer, state: LoopState, shutdown: Shutdown, out: Outputs, run_torch) -> Finish:
        """Finish the rounds in flight (bounded when leaving on a signal), agree the model with the
        other islands at the end of the run, withdraw, checkpoint, evaluate, release the ranks."""
        finish = Finish()
        try:
            await core.flush(state.step, leaving=shutdown.is_set())
        except RankFailure as e:  # a sharded island gathers the fragments it applies
            state.reason, state.failed = f"rank failed: {e}", True
        if state.step >= self.cfg.train.steps and not state.failed:
            await core.agree(state.step, shutdown.is_set, out.progress)
        await core.withdraw()
        try:
            finish.checkpoint = await self._checkpoint(core, trainer, state, out, run_torch)
            if finish.checkpoint is None:
                state.reason, state.failed = f"{state.reason}; the last checkpoint could not be written", True
            if not (self.sharded and state.failed) and trainer.evaluate is not None:  # a sharded evaluation needs every rank
                finish.eval_loss = await run_torch(trainer.evaluate)
                finish.global_eval_loss = await run_torch(self._evaluate_global, trainer, core)
        except RankFailure as e:
            state.reason, state.failed = f"rank failed: {e}", True
            finish.checkpoint = await run_torch(self._save, core, trainer, state)  # the last full copy, then
        out.events.emit("eval", step=state.step, eval_loss=finish.eval_loss, global_eval_loss=finish.global_eval_loss)
        if self.ranks is not None and not state.failed:
            # the others take what changed since the last step (all ranks end alike), then leave
            spread = await run_torch(self.ranks.stop)
            whole, local = self.ranks.model_bytes()
            out.events.emit(
                "ranks", step=state.step, world=self.ranks.world, device=str(self.device), param_spread=spread,
                parallel=self.cfg.train.parallel, model_bytes=whole, rank_bytes=local, fragment_bytes=self.ranks.fragment_bytes(),
                gather_peak_bytes=self.ranks.gather_peak_bytes if self.sharded else None,
            )
        return finish

    async def _checkpoint(self, core: IslandCore, trainer: Trainer | TaskTrainer, state: LoopState, out: Outputs, run_torch) -> Path | None:
        """Checkpoint, or, when the disk will not take it (full, gone read-only), say so and go on:
        the previous checkpoint stays as it was (`checkpoint_failed` event); None then."""
        try:
            return await run_torch(self._save, core, trainer, state)
        except OSError as e:
            out.events.emit("checkpoint_failed", step=state.step, reason=str(e))
            out.progress.note(f"checkpoint at step {state.step} failed, the previous one is kept: {e}")
            return None

    def _save(self, core: IslandCore, trainer: Trainer | TaskTrainer, state: LoopState) -> Path:
        """Checkpoint the island at `state.step` (the torch thread)."""
        now = time.monotonic()
        state.totals["wall_seconds"] += now - state.wall_mark
        state.wall_mark = now
        if state.losses:
            state.totals["final_loss"] = sum(state.losses) / len(state.losses)
        d = core.diloco
        return ckpt_io.save(
            self.run_dir,
            ckpt_io.Checkpoint(
                step=state.step,
                manifest=self.manifest,
                global_state=d.global_state(),
                local_state=self._local_state(core.params, state.failed),
                outer_state=d.momentum_state(),
                inner_opt_state={} if self.sharded else trainer.optimizer.state_dict(),
                fragments=d.counters_state(),
                totals=state.totals,
                inner_opt=self.cfg.train.inner_opt if self.trainer is None else type(trainer.optimizer).__name__,
                task_state=None if self.trainer is None else self.trainer.state_dict(),
                residual_state=d.residual_state(),
            ),
        )

    def _local_state(self, params: Mapping[str, torch.Tensor], failed: bool) -> dict[str, torch.Tensor]:
        """The island's own parameters (sharded: gathered; after a rank failed, the last full copy)."""
        if self.sharded and failed:
            return dict(self.ranks.mirror)
        return {n: params[n].detach().cpu() for n in params}

    def _rank_logs_hint(self) -> str:
        """Where to read why a rank failed (a crash leaves its Python stacks in its log)."""
        if self.rank_logs:
            return f"the other ranks' logs (a crashed rank's Python stacks are there): {', '.join(map(str, self.rank_logs))}"
        return "see the other ranks' stderr (under torchrun: its --log-dir); a crashed rank's Python stacks are there"

    def _balance(self, trainer: Trainer, step: int, micro_s: float, peers: list[float], out: Outputs) -> None:
        """--balance: as many micro-batches a step as make it take about the other islands' median step."""
        accum = balance_accumulation(micro_s, peers, trainer.accum)
        if accum == trainer.accum:
            return
        swarm_s = round(statistics.median(peers), 6)
        out.events.emit("balance", step=step, accum_from=trainer.accum, accum=accum, micro_seconds=round(micro_s, 6), swarm_step_seconds=swarm_s)
        out.progress.note(f"balance: {trainer.accum} -> {accum} micro-batches a step ({micro_s:.3f}s each; the others' median step {swarm_s:.3f}s)")
        trainer.accum = accum

    def _evaluate_global(self, trainer: Trainer, core: IslandCore) -> float:
        """eval_loss of the agreed model: the fragments' global values in place of the local ones."""
        params, diloco = core.params, core.diloco
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
