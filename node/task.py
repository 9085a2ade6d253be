"""Tasks: a model, optimizer and inner step of the user's own, trained by the island (`--task MODULE:FUNCTION`).

`FUNCTION(ctx: TaskContext) -> Task` is called on every rank of the island, once the island knows
its data shard. The node then drives the task's `train_step` exactly as it drives the built-in
model: it owns the step counter, the rounds, the checkpoints and the ranks' protocol (ranks.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from islands.protocols.fragments import groups_by_name, split_fragments

ENTRY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class TaskError(Exception):
    """A task that cannot be loaded or built; the message says why (exit status 2)."""


@dataclasses.dataclass
class StepResult:
    """What one inner step of a task did: this rank's mean loss and the tokens it trained on.
    `info` (optional, JSON-friendly) is logged with the step event."""

    loss: float
    tokens: int
    info: dict | None = None


@dataclasses.dataclass
class Task:
    """What a task's build function returns (DESIGN.md, "Tasks")."""

    model: torch.nn.Module
    """The module whose `named_parameters()` are the run's parameters (a DDP wrapper is unwrapped)."""
    optimizer: torch.optim.Optimizer
    train_step: Callable[[int], StepResult]
    """One inner step: forward, backward, optimizer step, zero the gradients. `step` counts from 1."""
    evaluate: Callable[[], float] | None = None
    """Held-out loss (the same data on every island), or None."""
    state_dict: Callable[[], dict] | None = None
    """The task's own state to checkpoint (data position, schedulers, RNG): tensors, numbers, strings, containers."""
    load_state_dict: Callable[[dict], None] | None = None
    fragments: Callable[[int], list[list[str]]] | None = None
    """The fragment layout for P fragments (parameter names); default: by the names' layer index."""


@dataclasses.dataclass
class TaskContext:
    """What a task's build function is told about where it runs."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    shard: int
    """This island's data shard, 0..num_shards-1 (islands hold different ones)."""
    num_shards: int
    seed: int
    """The run's seed (every island's is the same): initialise the model from it."""
    run_dir: Path
    args: dict[str, str]
    parallel: str = "none"
    """How the island's ranks share the model: none (one rank), ddp or fsdp."""
    _wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = dataclasses.field(default=None, repr=False)

    def parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        """The island's parallelism applied to `model` (already on `device`): DDP, FSDP2 (each module
        of a layer list sharded, then the root), or `model` itself on a one-rank island. Every rank
        starts from rank 0's values. Call it before building the optimizer."""
        return model if self._wrap is None else self._wrap(model)

    def arg(self, key: str, default: Any = None, type: Callable[[str], Any] = str) -> Any:
        """`--task-arg KEY=VALUE` as `type`, or `default` when not given."""
        if key not in self.args:
            return default
        try:
            return type(self.args[key])
        except ValueError as e:
            raise TaskError(f"--task-arg {key}={self.args[key]}: {e}") from None


def resolve(entry: str) -> Callable[[TaskContext], Task]:
    """The build function `MODULE:FUNCTION` names; TaskError if it cannot be imported or is missing."""
    if not ENTRY.match(entry):
        raise TaskError(f"--task {entry!r}: expected MODULE:FUNCTION, like mypkg.train:build")
    module_name, _, name = entry.partition(":")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # as `python -m` does: a task module in the working folder is found
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.startswith(e.name):
            raise TaskError(f"--task {entry}: no module named {module_name!r} (is it on PYTHONPATH?)") from None
        raise TaskError(f"--task {entry}: importing {module_name} failed: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's module raised while importing
        raise TaskError(f"--task {entry}: importing {module_name} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise TaskError(f"--task {entry}: module {module_name} has no function {name!r}")
    return fn


def build(fn: Callable[[TaskContext], Task], entry: str, ctx: TaskContext) -> Task:
    """Call the build function and check what it returned; TaskError if it raised or returned no Task."""
    try:
        task = fn(ctx)
    except TaskError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's code: say where and what
        raise TaskError(f"--task {entry}: the build function raised {type(e).__name__}: {e}") from None
    if not isinstance(task, Task):
        raise TaskError(f"--task {entry}: the build function returned {type(task).__name__}, not islands.node.Task")
    if not isinstance(task.model, torch.nn.Module) or not isinstance(task.optimizer, torch.optim.Optimizer):
        raise TaskError(f"--task {entry}: Task.model must be a torch.nn.Module and Task.optimizer a torch.optim.Optimizer")
    if not callable(task.train_step):
        raise TaskError(f"--task {entry}: Task.train_step must be callable (step) -> StepResult")
    if (task.state_dict is None) != (task.load_state_dict is None):
        raise TaskError(f"--task {entry}: give both Task.state_dict and Task.load_state_dict, or neither")
    return task


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under a DistributedDataParallel wrapper (its parameter names are the run's)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def layout(task: Task, names: list[str], num_fragments: int) -> list[list[str]]:
    """The task's fragment layout for P fragments, checked: every parameter in exactly one non-empty
    fragment. Default: strided by the layer index in the names (fragments.groups_by_name)."""
    try:
        if task.fragments is None:
            return split_fragments(groups_by_name(names), num_fragments)
        fragments = [list(f) for f in task.fragments(num_fragments)]
    except ValueError as e:
        raise TaskError(f"the task's fragment layout: {e}") from None
    return check_layout(fragments, names, num_fragments)


def check_layout(fragments: list[list[str]], names: list[str], num_fragments: int) -> list[list[str]]:
    if len(fragments) != num_fragments:
        raise TaskError(f"the task's fragment layout has {len(fragments)} fragments, not --fragments {num_fragments}")
    seen: dict[str, int] = {}
    for f, part in enumerate(fragments):
        if not part:
            raise TaskError(f"the task's fragment layout leaves fragment {f} empty")
        for n in part:
            if n in seen:
                raise TaskError(f"the task's fragment layout puts {n!r} in fragments {seen[n]} and {f}")
            seen[n] = f
    unknown = [n for n in seen if n not in set(names)]
    missing = [n for n in names if n not in seen]
    if unknown or missing:
        raise TaskError(f"the task's fragment layout names {unknown[:3]} that the model lacks and misses {missing[:3]}")
    return fragments


def manifest_model(entry: str, model: torch.nn.Module) -> dict:
    """The manifest's `model` part for a task: its entry point and size (the layout digest holds the
    parameters' names and shapes)."""
    return {"task": entry, "parameters": sum(p.numel() for p in model.parameters())}


def parse_args(pairs: list[str]) -> dict[str, str]:
    """`KEY=VALUE` strings as a dict; ValueError names a malformed one."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"task_arg {pair!r}: expected KEY=VALUE")
        out[key.strip()] = value
    return out


def plain_state(state: Mapping[str, Any], entry: str) -> dict:
    if not isinstance(state, Mapping):
        raise TaskError(f"--task {entry}: Task.state_dict() returned {type(state).__name__}, not a dict")
    return dict(state)


def build_task(fn: Callable[[TaskContext], Task], entry: str, cfg, ranks, device: torch.device, shard: int) -> TaskTrainer:
    """Build the task on this rank (`ranks`: the island's RankGroup, or None), wrapped for the island's
    ranks, with its fragment layout checked: what the loop (or a follower rank) drives."""
    wrapped: list[torch.nn.Module] = []

    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        if wrapped:
            raise TaskError(f"--task {entry}: ctx.parallelize was called twice (one model per task)")
        wrapped.append(model)
        return ranks.wrap(model)

    ctx = TaskContext(
        rank=ranks.rank if ranks else 0, world=ranks.world if ranks else 1, local_rank=ranks.env.local_rank if ranks else 0,
        device=device, shard=shard, num_shards=cfg.data.num_shards, seed=cfg.diloco.seed, run_dir=Path(cfg.output.run_dir),
        args=cfg.task.args, parallel=cfg.train.parallel if ranks else "none", _wrap=wrap if ranks else None,
    )
    task = build(fn, entry, ctx)
    own_ddp = task.model is not unwrap(task.model)
    task.model = unwrap(task.model)
    if ranks is not None:
        if ranks.sharded and not wrapped:
            raise TaskError(f"--task {entry}: --parallel fsdp shards the model over the island's ranks: build it with model = ctx.parallelize(model)")
        if not wrapped and not own_ddp:
            raise TaskError(
                f"--task {entry}: on an island of {ranks.world} ranks the task must wrap its model: model = ctx.parallelize(model) "
                "(or return a DistributedDataParallel of its own), before building its optimizer"
            )
        if not wrapped:  # its own DDP: every rank started from rank 0's values as DDP was built
            ranks.params = dict(task.model.named_parameters())
    names = [n for n, _ in task.model.named_parameters()]
    trainer = TaskTrainer(task, entry, ranks.world if ranks else 1, ranks.all_mean if ranks else None)
    trainer.layout = layout(task, names, cfg.diloco.fragments)
    if ranks is not None:
        ranks.set_layout(trainer.layout)
        if ranks.sharded and ranks.rank == 0 and task.evaluate is not None:
            trainer.evaluate = lambda: ranks.evaluate(task.evaluate)  # a sharded forward needs every rank
    return trainer


def share_task_state(ranks, trainer: TaskTrainer, resumed: dict | None = None) -> None:
    """Every rank of a task's island, after rank 0 resumed: rank 0's inner optimizer state (unless
    sharded: each rank's own then starts afresh) and the task's checkpointed state (`resumed`, rank 0's;
    the others load it too, and derive their own data position from it and their rank)."""
    if not ranks.sharded:
        ranks.share_optimizer(trainer.optimizer)
    state = ranks.share_object(resumed if ranks.rank == 0 else None)
    if ranks.rank and state is not None:
        trainer.load_state_dict(state)


class TaskStepError(Exception):
    """The task's own step raised (not a collective between the ranks): the island stops."""


class TaskTrainer:
    """A task driven like the built-in trainer (trainer.Trainer): the loop, the ranks' protocol and
    the checkpoints see the same surface."""

    def __init__(self, task: Task, entry: str, world: int = 1, mean: Callable[[list[float]], list[float]] | None = None):
        """`mean`: the ranks' mean of a few numbers (ranks.RankGroup.all_mean) on a multi-rank island."""
        self.task = task
        self.entry = entry
        self.model = task.model
        self.optimizer = task.optimizer
        self.world = world
        self.mean = mean or (lambda values: values)
        self.accum = 1
        self.evaluate: Callable[[], float] | None = task.evaluate
        self.layout: list[list[str]] = []
        self.last_tokens = 0
        """The island's tokens in the last step (all ranks)."""

    def step(self, step: int):
        from .trainer import StepStats

        start = time.perf_counter()
        try:
            result = self.task.train_step(step)
            if not isinstance(result, StepResult):
                raise TypeError(f"train_step returned {type(result).__name__}, not StepResult")
            loss, tokens = float(result.loss), int(result.tokens)
        except RuntimeError as e:
            if _transport_error(e):
                raise  # a rank is gone: ranks.RankGroup.guard makes it a RankFailure
            raise TaskStepError(f"--task {self.entry}: step {step} raised {type(e).__name__}: {e}") from e
        except Exception as e:  # noqa: BLE001 - the user's code
            raise TaskStepError(f"--task {self.entry}: step {step} raised {type(e).__name__}: {e}") from e
        loss, tokens_mean = self.mean([loss, float(tokens)])
        self.last_tokens = int(round(tokens_mean * self.world))
        return StepStats(loss, None, self.last_tokens, time.perf_counter() - start, info=result.info)

    def state_dict(self) -> dict | None:
        if self.task.state_dict is None:
            return None
        return plain_state(self.task.state_dict(), self.entry)

    def load_state_dict(self, state: dict | None) -> None:
        if state is not None and self.task.load_state_dict is not None:
            self.task.load_state_dict(state)


def _transport_error(e: RuntimeError) -> bool:
    import torch.distributed as dist

    return isinstance(e, dist.DistBackendError) or any(w in str(e).lower() for w in ("gloo", "nccl", "connection reset"))
