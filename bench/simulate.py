"""The oracle: M islands of Streaming DiLoCo in one process, with perfect communication.

    python -m bench.simulate --islands 2 --steps 600 --window 100 --compression int8 --out FILE.json

Every island is the node's own model, inner optimizer and data (node/trainer.py, its own data
shard as the swarm deals them), and every decision is `protocols/`'s: the schedule (which
fragment starts a round at which step, applied tau steps later), the token weights, each
island's part encoded once with the run's codec and the parts reduced in a fixed order in fp32
(protocols/parts.py, as a 2-island round of the own protocol does), the outer Nesterov step,
the mixing, and the end-of-run last round of every fragment (StreamingDiLoCo.apply_last). What
it leaves out is the network: no round fails, none waits, no island drifts from the schedule.
So a swarm that works gives what this gives (tests/test_simulate.py asserts it), and a
setting can be explored here in a fraction of the swarm's time.

It takes the islands-node options of the model, training, data and DiLoCo (--help lists them);
`--islands` says how many, and `--batch-sizes` gives each its own batch. It also trains the
data-parallel baseline of bench.parity (one model, the islands' batches together, as many steps,
never averaged) for `ratio_to_dp`, unless given its figure (`--dp-eval-loss`) or `--no-dp`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import torch
from islands.models.data import load_corpus
from islands.node.config import ConfigError, add_arguments, build_config
from islands.node.daemon import build_model
from islands.node.loop import _data_seed
from islands.node.net.base import STALE_WEIGHT
from islands.node.trainer import Trainer
from islands.protocols.diloco import Contribution, StreamingDiLoCo
from islands.protocols.parts import encode_part, reduce_parts
from islands.protocols.validation import flatten, unflatten

from .common import table, write

SECTIONS = ("train", "data", "diloco")
"""The islands-node options the oracle takes (the others are the network's and the outputs')."""


@dataclasses.dataclass
class Replica:
    """One island: its model, trainer and Streaming DiLoCo state."""

    trainer: Trainer
    diloco: StreamingDiLoCo
    params: dict[str, torch.Tensor]


def average(contributions: Sequence[Contribution], names: Sequence[str], codec: str) -> tuple[dict[str, torch.Tensor], int]:
    """(the round's mean delta, bytes each island sent): every island's part encoded once with the
    codec, reduced in island order in fp32 (parts.reduce_parts); an all-gather sends each part to
    every other island. A contribution of no tokens weighs ~0, as in the node's rounds. One island
    alone applies its own delta as it is (a `solo` round)."""
    if len(contributions) == 1:
        return contributions[0].delta, 0
    parts = {
        str(i): encode_part(flatten(c.delta[n] for n in names), max(c.weight, STALE_WEIGHT), codec)
        for i, c in enumerate(contributions)
    }
    mean, _, _ = reduce_parts([str(i) for i in range(len(contributions))], parts)
    sent = len(parts["0"]) * (len(contributions) - 1)
    return unflatten(mean.clone(), names, contributions[0].delta), sent


def simulate(cfg, islands: int, batch_sizes: Sequence[int] | None = None, on_progress: Callable[[str], None] = print) -> dict:
    """Train `islands` replicas for cfg.train.steps steps; the figures (see main)."""
    started = time.monotonic()
    torch.set_num_threads(cfg.train.torch_threads or torch.get_num_threads())
    corpus = load_corpus(cfg.data, cfg.train.seq_len, cfg.train.vocab_size)
    batch_sizes = list(batch_sizes or [cfg.train.batch_size] * islands)
    if len(batch_sizes) != islands:
        raise ValueError(f"--batch-sizes gives {len(batch_sizes)} batches for {islands} islands")
    replicas = []
    for i, batch in enumerate(batch_sizes):
        model, layout, _ = build_model(cfg)  # the run's seed: every island starts from the same values
        train = dataclasses.replace(cfg.train, batch_size=batch)
        trainer = Trainer(train, model, corpus.shard(i), corpus, data_seed=_data_seed(cfg, i), eval_batches=cfg.data.eval_batches)
        params = dict(model.named_parameters())
        replicas.append(Replica(trainer, StreamingDiLoCo(cfg.diloco, layout, params), params))
    judge, _, _ = build_model(cfg)  # evaluates the agreed values
    judge_trainer = Trainer(cfg.train, judge, corpus.shard(0), corpus, data_seed=0, eval_batches=cfg.data.eval_batches)
    layout = replicas[0].diloco.layout
    schedule = cfg.diloco.schedule
    codec = cfg.diloco.compression
    pending: dict[int, tuple[int, int, dict[str, torch.Tensor]]] = {}
    """fragment -> (apply step, round, mean delta)."""
    sent = 0
    rounds = 0
    curve: list[tuple[int, float]] = []
    tokens = 0

    def agreed_eval() -> float:
        d = replicas[0].diloco
        with torch.no_grad():
            for n, p in judge.named_parameters():
                p.copy_(d.global_state()[n])
        return judge_trainer.evaluate()

    def apply(fragment: int, round_: int, mean: dict[str, torch.Tensor]) -> None:
        for r in replicas:
            r.diloco.apply(fragment, round_, mean, r.params, alone=islands == 1)

    steps = cfg.train.steps
    with concurrent.futures.ThreadPoolExecutor(islands) as pool:  # torch lets go of the GIL: islands train side by side
        for step in range(1, steps + 1):
            stats = list(pool.map(Trainer.step, [r.trainer for r in replicas], [step] * islands))
            for r, s in zip(replicas, stats, strict=True):
                r.diloco.add_tokens(s.tokens)
                tokens += s.tokens
            for p in schedule.starting(step):
                round_ = schedule.round_of(step)
                cs = [r.diloco.contribution(p, round_, step, r.params) for r in replicas]
                mean, nbytes = average(cs, layout[p], codec)
                sent += nbytes
                rounds += 1
                pending[p] = (schedule.applied_at(step), round_, mean)
            for p in [p for p, (at, _, _) in pending.items() if at <= step]:
                _, round_, mean = pending.pop(p)
                apply(p, round_, mean)
            if cfg.train.eval_every and step % cfg.train.eval_every == 0:
                curve.append((step, agreed_eval()))
            if step % max(1, steps // 10) == 0:
                loss = sum(s.loss for s in stats) / len(stats)
                on_progress(f"step {step}/{steps}  loss {loss:.4f}  {time.monotonic() - started:.0f} s")
    for p in sorted(pending):  # the node's flush: rounds in flight are applied at the last step
        _, round_, mean = pending.pop(p)
        apply(p, round_, mean)
    end_sent = 0
    for p in range(cfg.diloco.fragments):  # the end-of-run agreement: a last round of every fragment
        round_ = replicas[0].diloco.counters[p].round + 1
        cs = [r.diloco.contribution(p, round_, steps + 1, r.params) for r in replicas]
        mean, nbytes = average(cs, layout[p], codec)
        end_sent += nbytes
        for r in replicas:
            r.diloco.apply_last(p, round_, mean, alone=islands == 1)
    apart = max(
        float((a - b).abs().max())
        for r in replicas[1:]
        for a, b in zip(replicas[0].diloco.global_state().values(), r.diloco.global_state().values(), strict=True)
    ) if islands > 1 else 0.0
    local = [r.trainer.evaluate() for r in replicas]
    return {
        "eval_loss": agreed_eval(),
        "local_eval_loss": sum(local) / len(local),
        "local_eval_losses": local,
        "tokens": tokens,
        "rounds": rounds,
        "bytes_per_step": (sent + end_sent) / steps,
        "bytes_per_step_training": sent / steps,
        "bytes_end_agreement": end_sent,
        "agreed_apart": apart,
        "curve": curve,
        "seconds": time.monotonic() - started,
    }


def data_parallel(cfg, batch: int) -> float:
    """eval_loss of synchronous data parallelism at the same tokens: one model with the islands'
    batches together for the same steps (bench.parity's dp: shard 0, never averaged)."""
    torch.set_num_threads(cfg.train.torch_threads or torch.get_num_threads())
    corpus = load_corpus(cfg.data, cfg.train.seq_len, cfg.train.vocab_size)
    model, _, _ = build_model(cfg)
    trainer = Trainer(dataclasses.replace(cfg.train, batch_size=batch), model, corpus.shard(0), corpus,
                      data_seed=_data_seed(cfg, 0), eval_batches=cfg.data.eval_batches)
    for step in range(1, cfg.train.steps + 1):
        trainer.step(step)
    return trainer.evaluate()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.simulate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--islands", type=int, default=2, help="islands (replicas) trained side by side (default 2)")
    p.add_argument("--batch-sizes", type=int, nargs="+", metavar="B", help="each island's batch (default: --batch-size for all)")
    p.add_argument("--out", help="write the figures here (JSON)")
    p.add_argument("--dp-eval-loss", type=float, metavar="LOSS", help="the data-parallel baseline's eval_loss, known already (not trained again)")
    p.add_argument("--no-dp", action="store_true", help="no data-parallel baseline (ratio_to_dp is then null)")
    add_arguments(p, sections=SECTIONS)
    return p


def config_of(values: dict):
    """The run's config from islands-node option values (ConfigError on bad input), as islands-node builds it."""
    return build_config(values, environ={})


def split_options(args: argparse.Namespace) -> tuple[dict, dict]:
    """(the oracle's own options, the islands-node options given) of parsed arguments."""
    values = dict(vars(args))
    own = {k: values.pop(k) for k in ("islands", "batch_sizes", "out", "dp_eval_loss", "no_dp")}
    return own, values


def main(argv: Sequence[str] | None = None) -> None:
    p = parser()
    own, values = split_options(p.parse_args(argv))
    islands, batch_sizes, out, dp = own["islands"], own["batch_sizes"], own["out"], own["dp_eval_loss"]
    if islands < 1:
        p.error(f"--islands must be >= 1, got {islands}")
    try:
        cfg = config_of(values)
    except ConfigError as e:
        p.error(str(e))
    batches = batch_sizes or [cfg.train.batch_size] * islands
    if len(batches) != islands:
        p.error(f"--batch-sizes gives {len(batches)} batches for {islands} islands")
    figures = simulate(cfg, islands, batches)
    if dp is None and not own["no_dp"]:
        dp = data_parallel(cfg, sum(batches))
    figures["dp_eval_loss"] = dp
    figures["ratio_to_dp"] = None if dp is None else figures["eval_loss"] / dp
    d = cfg.diloco
    print(table(
        [[str(islands), f"{figures['eval_loss']:.4f}", f"{figures['local_eval_loss']:.4f}", "-" if dp is None else f"{dp:.4f}",
          "-" if dp is None else f"{figures['ratio_to_dp']:.4f}", f"{figures['bytes_per_step'] / 1e3:.1f}", f"{figures['seconds']:.0f}"]],
        ["islands", "eval_loss (agreed)", "eval_loss (local, mean)", "dp eval_loss", "ratio to dp", "kB/step/island", "seconds"],
    ))
    config = {"islands": islands, "batch_sizes": batches, "steps": cfg.train.steps,
              "model": cfg.train.model, "seq_len": cfg.train.seq_len, "inner_opt": cfg.train.inner_opt, **d.manifest_fields(),
              "compression": d.compression, "error_feedback": d.feedback}
    write(out, {**{k: (round(v, 4) if isinstance(v, float) and math.isfinite(v) else v) for k, v in figures.items()}, "config": config})


if __name__ == "__main__":
    main()
