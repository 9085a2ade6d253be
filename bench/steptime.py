"""Step time and tokens/s of one island's inner step, per model size and inner optimizer.

    python -m bench.steptime --out bench/results/steptime.json [--sizes tiny] [--steps 60]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from islands.models.data import DataConfig, load_corpus
from islands.models.transformer import Transformer
from islands.node.config import TrainConfig
from islands.node.trainer import Trainer

from .common import table, write


def measure(size: str, inner_opt: str, steps: int, warmup: int, threads: int, batch_size: int, seq_len: int, corpus) -> dict:
    torch.set_num_threads(threads)
    cfg = TrainConfig(model=size, inner_opt=inner_opt, batch_size=batch_size, seq_len=seq_len, torch_threads=threads)
    torch.manual_seed(0)
    model = Transformer(cfg.model_config())
    trainer = Trainer(cfg, model, corpus.shard(0), corpus, data_seed=0, eval_batches=1)
    times, losses = [], []
    for t in range(1, warmup + steps + 1):
        stats = trainer.step(t)
        losses.append(stats.loss)
        if t > warmup:
            times.append(stats.seconds)
    median = statistics.median(times)
    return {
        "model": size, "inner_opt": inner_opt, "threads": threads, "batch_tokens": batch_size * seq_len,
        "params": sum(p.numel() for p in model.parameters()),
        "step_seconds_median": round(median, 5), "step_seconds_p90": round(sorted(times)[int(0.9 * len(times))], 5),
        "tokens_per_s": round(batch_size * seq_len / median, 1),
        "loss_first10": round(sum(losses[:10]) / 10, 4), "loss_last10": round(sum(losses[-10:]) / 10, 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the figures here (JSON)")
    p.add_argument("--sizes", default="tiny", help="comma-separated model sizes")
    p.add_argument("--opts", default="adamw,shampoo", help="comma-separated inner optimizers")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args()
    started = time.time()
    corpus = load_corpus(DataConfig(), args.seq_len)
    results = [
        measure(size, opt, args.steps, args.warmup, int(th), args.batch_size, args.seq_len, corpus)
        for size in args.sizes.split(",") for opt in args.opts.split(",") for th in args.threads.split(",")
    ]
    print(table(
        [[r["model"], r["inner_opt"], str(r["threads"]), f"{r['step_seconds_median'] * 1000:.1f}", f"{r['tokens_per_s']:.0f}", f"{r['loss_first10']:.3f} -> {r['loss_last10']:.3f}"] for r in results],
        ["model", "inner_opt", "threads", "step ms (median)", "tokens/s", "loss first10 -> last10"],
    ))
    write(args.out, {"results": results, "seconds": round(time.time() - started, 1)})


if __name__ == "__main__":
    main()
