"""`attach`: the island for a user who keeps their own training loop.

    island = attach(model, optimizer, join=[...], window=50, fragments=4, steps=10_000, run_dir="run")
    with island:
        for step in range(island.start_step + 1, island.steps + 1):
            ...forward, backward, optimizer.step(), zero_grad...
            island.step(tokens=batch_tokens, loss=loss.item())

The island's network, rounds and checkpoints run on an event loop in a background thread; every
touch of the model (a round's snapshot, an applied result, a checkpoint) runs in the caller's
thread, inside `step()` (or `close()`), never while the user's own step runs. `step()` blocks only
for what the schedule says happens at that step (applying a round's result; a checkpoint).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .config import ConfigError, build_config
from .daemon import Shutdown, StartupError
from .ranks import RankEnv
from .task import StepResult, Task
from .trainer import StepStats

START_TIMEOUT_S = 600.0
"""The most `attach` waits for the island to start (join, catch up): a bound, not a pace."""


class IslandError(RuntimeError):
    """The island could not start, or failed while training; the message says why."""


def attach(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, state_dict: Callable[[], dict] | None = None,
    load_state_dict: Callable[[dict], None] | None = None, evaluate: Callable[[], float] | None = None,
    layout: Callable[[int], list[list[str]]] | None = None, **options: Any,
) -> AttachedIsland:
    """Make this process an island of the swarm around the user's own model and inner optimizer.

    `options` are the run's options by their names (`join`, `run_id`, `window`, `fragments`,
    `steps`, `run_dir`, `swarm_key`, ...: `islands-node --help`); `ISLANDS_*` environment variables
    fill in the rest. A checkpoint in `run_dir` is resumed: the model, the optimizer and
    `load_state_dict(state)` get its values, and `start_step` says where the loop continues.
    Raises IslandError when the island cannot start (a bad option, a foreign checkpoint, no swarm)."""
    return AttachedIsland(model, optimizer, state_dict, load_state_dict, evaluate, layout, options)


class AttachedIsland:
    def __init__(self, model, optimizer, state_dict, load_state_dict, evaluate, layout, options: dict[str, Any]):
        try:
            cfg = build_config({k: v for k, v in options.items()}, environ=dict(os.environ))
        except ConfigError as e:
            raise IslandError(str(e)) from None
        except KeyError as e:
            raise IslandError(f"attach: unknown option {e.args[0]!r} (islands-node --help lists them)") from None
        if cfg.task.task is not None:
            raise IslandError("attach drives the caller's own model: leave out task")
        env = RankEnv.from_environ(os.environ)
        if env is not None and cfg.train.parallel != "ddp":
            raise IslandError("attach under torchrun works with DistributedDataParallel (parallel ddp); for FSDP, use --task")
        self.steps = cfg.train.steps
        """The run's last step (the `steps` option)."""
        task = Task(
            model=model, optimizer=optimizer, train_step=_not_called, evaluate=evaluate, state_dict=state_dict,
            load_state_dict=load_state_dict, fragments=layout,
        )
        self._closed = False
        self._follower: _Follower | None = None
        if env is not None and env.rank > 0:  # under torchrun: rank 0 is the island, this rank follows it
            try:
                self._follower = _Follower(cfg, env, task)
            except Exception as e:  # noqa: BLE001 - rank 0 failed, or the task does not fit
                raise IslandError(f"rank {env.rank}: {e}") from None
            self._start_step = self._follower.start_step
            atexit.register(self.close)
            return
        self._jobs: queue.Queue = queue.Queue()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="islands-attach", daemon=True)
        self._thread.start()
        self._last = time.perf_counter()
        from .loop import Island  # the network and the core load here, not at `import islands.node`

        try:
            self._island = Island(cfg, env, task=task)
        except StartupError as e:
            self._stop_loop()
            raise IslandError(str(e)) from None
        self._shutdown: Shutdown | None = None
        self._run = self._call(self._start(), timeout_s=START_TIMEOUT_S, starting=True)
        self._tell_ranks()
        atexit.register(self.close)

    # --- the caller's side ---------------------------------------------------------------

    @property
    def start_step(self) -> int:
        """The last step taken before this process (a resume, or the swarm's step when joining late):
        the caller's loop goes on with step `start_step + 1`."""
        return self._start_step

    @property
    def step_count(self) -> int:
        """Inner steps taken so far (the swarm's count)."""
        return self._follower.step if self._follower else self._run.state.step

    @property
    def done(self) -> bool:
        """The run reached its last step (`steps`)."""
        return self.step_count >= self.steps

    def step(self, tokens: int, loss: float | None = None, info: dict | None = None) -> None:
        """One inner step was taken on `tokens` tokens (this rank's; with this `loss`): start or apply
        the rounds the schedule says, checkpoint when it is time. Blocks only for what happens at this
        step. Under torchrun every rank calls it: the others take what rank 0 changed."""
        if self._closed:
            raise IslandError("step() after close()")
        ranks = self._follower.ranks if self._follower is not None else self._island.ranks
        if ranks is not None:  # the island's tokens: every rank's
            tokens = round(ranks.all_mean([float(tokens)])[0] * ranks.world)
        if self._follower is not None:
            self._follower.next()
            return
        now = time.perf_counter()
        stats = StepStats(None if loss is None else float(loss), None, int(tokens), now - self._last, info=info)
        r = self._run
        r.trainer.last_tokens = stats.tokens
        self._call(r.island._after_inner(r.core, r.trainer, r.state, r.out, self._run_torch, stats))
        self._tell_ranks()
        self._last = time.perf_counter()

    def _tell_ranks(self) -> None:
        """Rank 0 under torchrun: the other ranks take the fragments this island changed (a resume,
        a round's result) before the next step; they wait for it in their own step()."""
        ranks = self._island.ranks
        if ranks is not None:
            ranks.before_step(self._run.state.step + 1)

    def close(self) -> None:
        """Finish the rounds in flight, agree the model with the other islands (when the run reached
        `steps`), checkpoint, log the summary and leave the swarm. Called again, it does nothing."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self._follower is not None:
            self._follower.close()
            return
        try:
            self._call(self._finish(), timeout_s=None)
        finally:
            self._stop_loop()
            if self._island.ranks is not None:
                self._island.ranks.close()

    def __enter__(self) -> AttachedIsland:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the event loop's side -----------------------------------------------------------

    def _run_torch(self, fn, *args) -> asyncio.Future:
        """What the core runs on the model: queued for the caller's thread (inside step() or close())."""
        future = self._loop.create_future()
        self._jobs.put((fn, args, future))
        return future

    def _call(self, coro, timeout_s: float | None = None, starting: bool = False):
        """Run `coro` on the event loop, doing its torch work in this thread meanwhile."""
        done = asyncio.run_coroutine_threadsafe(coro, self._loop)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                fn, args, future = self._jobs.get(timeout=0.01 if not done.done() else 0)
            except queue.Empty:
                if done.done():
                    break
                if deadline is not None and time.monotonic() > deadline:
                    done.cancel()
                    raise IslandError(f"the island did not start within {timeout_s:g}s") from None
                continue
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                self._loop.call_soon_threadsafe(_settle, future, None, e)
            else:
                self._loop.call_soon_threadsafe(_settle, future, result, None)
        try:
            return done.result()
        except StartupError as e:
            if starting:
                self._stop_loop()
            raise IslandError(str(e)) from None

    async def _start(self) -> _Run:
        from .daemon import VERSION
        from .network import ManifestMismatch, Network, NetworkError
        from .outputs import Outputs
        from .roles import make_role

        island = self._island
        self._shutdown = Shutdown()
        role = make_role(island.cfg)
        network = Network(island.cfg, VERSION, role)
        out = None
        try:
            try:
                await network.open()
            except (ManifestMismatch, NetworkError) as e:
                raise StartupError(str(e)) from None
            out = Outputs.open(island.cfg, island.run_dir, network)
            out.progress.note(island.listening(network))
            await island._build_task(self._shutdown, network, out, self._run_torch)
            core, trainer, state = await island._join(self._shutdown, network, role, out, self._run_torch)
        except BaseException:
            if out is not None:
                out.close()
            await network.close()
            raise
        self._start_step = state.step
        return _Run(island, network, out, core, trainer, state)

    async def _finish(self) -> None:
        r = self._run
        try:
            finish = await r.island._leave(r.core, r.trainer, r.state, self._shutdown, r.out, self._run_torch)
            reason = "completed" if r.state.step >= self.steps else "closed"
            r.out.summarize(r.state.reason if r.state.failed else reason, r.state.step, r.state.totals, finish)
        finally:
            r.out.close()
            await r.network.close()

    def _stop_loop(self) -> None:
        """Cancel what still runs on the event loop (the network's own tasks), then end its thread."""
        try:
            asyncio.run_coroutine_threadsafe(_cancel_the_rest(), self._loop).result(timeout=10)
        except Exception:  # noqa: BLE001 - leaving anyway
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()


class _Follower:
    """Rank 1.. of an attached island under torchrun: no network; before each of its steps it takes
    the fragments rank 0 changed (ranks.py's protocol); the user's DDP averages the gradients."""

    def __init__(self, cfg, env: RankEnv, task: Task):
        from .daemon import rank_timeout_s
        from .loop import ATTACHED
        from .ranks import RankGroup, pick_device
        from .task import build_task, share_task_state

        device = pick_device(cfg.train.device, env.local_rank)
        self.ranks = RankGroup(env, device, None, rank_timeout_s(cfg))
        shard, _ = self.ranks.receive_header()
        trainer = build_task(lambda ctx: task, ATTACHED, cfg, self.ranks, device, shard)
        share_task_state(self.ranks, trainer)
        self.step = -1
        self.next()
        self.start_step = self.step

    def next(self) -> None:
        """Serve rank 0 up to its next step (taking the fragments it changed)."""
        order = self.ranks.next_step()
        if order is None:
            raise IslandError("rank 0 of this island has stopped")
        self.step = order[0] - 1

    def close(self) -> None:
        """Serve rank 0 until it stops this rank (at its own close)."""
        try:
            while self.ranks.next_step() is not None:
                pass
        finally:
            self.ranks.close()


class _Run:
    def __init__(self, island, network, out, core, trainer, state):
        self.island, self.network, self.out, self.core, self.trainer, self.state = island, network, out, core, trainer, state


async def _cancel_the_rest() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _settle(future: asyncio.Future, result, error) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _not_called(step: int) -> StepResult:
    raise AssertionError("an attached island's steps are the caller's")
