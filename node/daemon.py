"""What every process of a node shares: the model at the run's initialisation, the shutdown
trigger, start-up errors, and the loop of a follower rank. The island's own training loop is
loop.py, on the island core (island.py); neither reads signals or the environment (the CLI does,
and passes the shutdown trigger in)."""

from __future__ import annotations

import asyncio
import logging

import torch
from islands.models.data import load_corpus
from islands.models.transformer import Transformer
from islands.protocols.fragments import layout_digest, split_fragments
from islands.protocols.manifest import build_manifest

from .config import Config
from .ranks import RankEnv, RankFailure, RankGroup, pick_device
from .timeouts import Timeouts
from .trainer import Trainer

logger = logging.getLogger(__name__)

VERSION = "0.1.0"


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
    """How long a collective between the island's ranks may wait (Timeouts.ranks_wait_s)."""
    return Timeouts.from_config(cfg).ranks_wait_s(cfg.diloco.fragments)


def follow(cfg: Config, env: RankEnv) -> int:
    """Rank 1.. of a multi-rank island: train in step with rank 0, which does everything else
    (ranks.py). Returns the exit status."""
    torch.set_num_threads(cfg.train.torch_threads or torch.get_num_threads())
    device = pick_device(cfg.train.device, env.local_rank)
    if cfg.task.task is not None:
        return _follow_task(cfg, env, device)
    model, layout, _ = build_model(cfg)
    model.to(device)
    corpus = load_corpus(cfg.data, cfg.train.seq_len, cfg.train.vocab_size)
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


def _follow_task(cfg: Config, env: RankEnv, device: torch.device) -> int:
    """A follower rank of a task's island: build the task on the shard rank 0 names, then train in step."""
    from .task import TaskError, TaskStepError, build_task, resolve, share_task_state

    try:
        fn = resolve(cfg.task.task)
        ranks = RankGroup(env, device, None, rank_timeout_s(cfg), sharded=cfg.train.parallel == "fsdp")
    except (TaskError, RuntimeError, ValueError) as e:
        logger.error("rank %d: %s", env.rank, e)
        return 1
    try:
        shard, _ = ranks.receive_header()
        trainer = build_task(fn, cfg.task.task, cfg, ranks, device, shard)
        share_task_state(ranks, trainer)
        while (order := ranks.next_step(trainer.evaluate)) is not None:
            ranks.guard(trainer.step, order[0])
        return 0
    except (RankFailure, TaskError, TaskStepError) as e:
        logger.error("rank %d: %s", env.rank, e)
        return 1
    finally:
        ranks.close()
