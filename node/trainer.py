"""The island's plain training loop parts: model, inner optimizer, one step, evaluation.

Nothing here knows of fragments or peers; Streaming DiLoCo attaches from outside.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable

import torch
from islands.models.data import Corpus, Split
from islands.models.transformer import Transformer

from .config import TrainConfig

CPU = torch.device("cpu")

# the same held-out batches on every island, whatever its own batch size
EVAL_SEED, EVAL_BATCH_SIZE = 12345, 8


def make_inner_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    if cfg.inner_opt == "adamw":
        return torch.optim.AdamW(
            model.parameters(), lr=cfg.learning_rate, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
        )
    if cfg.inner_opt == "shampoo":
        # ScalableShampoo is the "Distributed Shampoo" of Anil et al.; AdaGrad grafting
        # sets the step size, so the same learning rate as AdamW trains stably here.
        from pytorch_optimizer import ScalableShampoo

        return ScalableShampoo(
            model.parameters(),
            lr=cfg.learning_rate,
            weight_decay=cfg.weight_decay,
            start_preconditioning_step=10,
            preconditioning_compute_steps=10,
            block_size=128,
            graft_type=2,  # LayerWiseGrafting.ADAGRAD
        )
    raise ValueError(f"unknown inner optimizer {cfg.inner_opt!r}")


def lr_multiplier(step: int, warmup_steps: int) -> float:
    """Linear warm-up to 1, then constant (DiLoCo's inner schedule)."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, step / warmup_steps)


@dataclasses.dataclass
class StepStats:
    loss: float | None
    aux_loss: float | None
    tokens: int
    seconds: float
    info: dict | None = None
    """A task's own figures for the step (StepResult.info)."""


class Trainer:
    def __init__(
        self, cfg: TrainConfig, model: Transformer, shard: Split, corpus: Corpus, data_seed: int, eval_batches: int,
        device: torch.device = CPU, rank: int = 0, world: int = 1,
    ):
        """`rank`/`world`: this process among the island's data-parallel ranks; each takes its own
        batches of the shard, and the step's tokens and loss are the island's (all ranks')."""
        self.cfg = cfg
        self.model = model
        self.shard = shard
        self.corpus = corpus
        self.data_seed = data_seed
        self.eval_batches = eval_batches
        self.device = device
        self.rank, self.world = rank, world
        self.optimizer = make_inner_optimizer(cfg, model)
        self.forward: torch.nn.Module = model
        """What the step calls: the model, or its DistributedDataParallel wrapper (ranks.RankGroup.wrap)."""
        self.mean: Callable[[list[float]], list[float]] = lambda values: values
        """The ranks' mean of the step's loss figures (identity for one process)."""
        self.accum = 1
        """Micro-batches of --batch-size per inner step (gradient accumulation; --balance sets it)."""

    def rebuild_optimizer(self) -> None:
        """A new inner optimizer over the model's parameters as they are now (sharded ones)."""
        self.optimizer = make_inner_optimizer(self.cfg, self.model)

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step(self, step: int) -> StepStats:
        """One inner step (`step` counts from 1): forward, backward, clip, optimizer."""
        start = time.perf_counter()
        cfg, model = self.cfg, self.model
        model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.learning_rate * lr_multiplier(step, cfg.warmup_steps)
        accum, losses, auxes, tokens = self.accum, 0.0, 0.0, 0
        for i in range(accum):
            # rank r of W takes batch keys (step*W + r)*A + i: no two ranks or micro-batches share one
            x, y = self.shard.batch(self.data_seed, (step * self.world + self.rank) * accum + i, cfg.batch_size, cfg.seq_len)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            # DDP averages the gradients over the ranks in the last micro-batch's backward only
            last = i == accum - 1
            with contextlib.nullcontext() if last or self.forward is model else self.forward.no_sync():
                with self._autocast():
                    _, loss, aux = self.forward(x, y)
                ((loss + model.cfg.aux_loss_coef * aux) / accum).backward()
            losses, auxes, tokens = losses + loss.item() / accum, auxes + aux.item() / accum, tokens + x.numel()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss_value, aux_value = self.mean([losses, auxes])
        return StepStats(loss_value, aux_value, tokens * self.world, time.perf_counter() - start)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean next-byte cross-entropy on the held-out split (fixed batches)."""
        self.model.eval()
        losses = []
        for i in range(self.eval_batches):
            x, y = self.corpus.eval.batch(seed=EVAL_SEED, key=i, batch_size=EVAL_BATCH_SIZE, seq_len=self.cfg.seq_len)
            with self._autocast():
                _, loss, _ = self.model(x.to(self.device), y.to(self.device))
            losses.append(loss.item())
        value = sum(losses) / len(losses)
        return value if math.isfinite(value) else float("nan")
