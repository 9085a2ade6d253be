"""Quality and traffic against data parallelism, at equal tokens.

    python -m bench.parity --out bench/results/parity.json [--steps 600] [--window 100] [--compression none fp16 int8 int4+ef0.95 int2]

The same model (`tiny`), data (the standard library's sources) and total tokens, trained three ways:
- dp: one process whose batch is the sum of the islands' batches, for the swarm's steps; it
  never averages (its window is longer than the run), so it computes exactly what synchronous
  data parallelism over the two islands would;
- solo: one island with one island's batch for twice the steps, Streaming DiLoCo alone;
- swarm: two islands with Streaming DiLoCo, once per compression setting (a codec, and with
  `+efD` error feedback of decay D: `int4+ef0.95` is `--compression int4 --error-feedback 0.95`);
- oracle: the same two islands in one process with perfect communication (bench.simulate), once
  per compression setting: `ratio_swarm_to_oracle` is what the network costs.

eval_loss is on the same held-out batches for all: dp's trained model, the agreed model
(`global.safetensors`) of the DiLoCo runs (the islands' mean). Bytes per step of dp are what
a ring all-reduce of fp32 gradients sends per worker: 2 (n-1)/n * 4 bytes * parameters.
The swarm's are measured on the wire: each island sits behind a relay (`lan` profile) that
counts every byte it forwards, DHT traffic, consensus rounds and the end-of-run agreement
included; their sum over both relays, divided by islands and steps, is what one island sent per
step. The end-of-run agreement (a last round of every fragment: about the model once, more where
the replicas need re-averaging) is also reported apart: a long run amortizes it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import shutil
import statistics
from pathlib import Path

from tests.procs import Nodes

from .common import plot, table, write

SEQ_LEN = 128


def _parameters(model: str) -> int:
    from islands.models.transformer import Transformer, model_config

    return sum(p.numel() for p in Transformer(model_config(model)).parameters())


def _curve(events: list[dict], tokens_per_step: int) -> list[tuple[int, float]]:
    """(total tokens, eval_loss) at every evaluation of the (local) model."""
    return [(e["step"] * tokens_per_step, e["eval_loss"]) for e in events if e["event"] == "eval" and "global_eval_loss" not in e]


def dp(root: Path, args: argparse.Namespace) -> dict:
    nodes = Nodes(root)
    try:
        node = nodes.start("dp", [*args.common, "--steps", str(args.steps), "--batch-size", str(2 * args.batch_size),
                                  "--window", str(10 * args.steps), "--fragments", "1", "--eval-every", str(args.steps // 10),
                                  "--run-id", "bench-parity-dp"])
        nodes.finish([node], args.timeout_s)
        summary = node.of("summary")[0]
        return {"eval_loss": summary["eval_loss"], "tokens": summary["tokens"],
                "curve": _curve(node.events, 2 * args.batch_size * SEQ_LEN)}
    finally:
        nodes.stop()


def solo(root: Path, args: argparse.Namespace) -> dict:
    nodes = Nodes(root)
    try:
        steps = 2 * args.steps
        node = nodes.start("solo", [*args.common, *args.schedule, "--steps", str(steps), "--batch-size", str(args.batch_size),
                                    "--eval-every", str(steps // 10), "--run-id", "bench-parity-solo"])
        nodes.finish([node], args.timeout_s)
        summary = node.of("summary")[0]
        return {"eval_loss": summary["global_eval_loss"], "local_eval_loss": summary["eval_loss"], "tokens": summary["tokens"],
                "curve": _curve(node.events, args.batch_size * SEQ_LEN)}
    finally:
        nodes.stop()


def codec_options(setting: str) -> list[str]:
    """islands-node options of a compression setting: `int8`, or `int4+ef0.95` (with error feedback)."""
    codec, _, feedback = setting.partition("+ef")
    return ["--compression", codec, *(["--error-feedback", feedback] if feedback else [])]


def swarm(root: Path, args: argparse.Namespace, compression: str) -> dict:
    nodes = Nodes(root)
    common = [*args.common, *args.schedule, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
              "--eval-every", str(args.steps // 10), *codec_options(compression), "--wait-islands", "2",
              "--run-id", f"bench-parity-{compression.replace('+', '-')}", *args.swarm_args.split()]
    relay = ["--profile", "lan"]
    try:
        a, join = nodes.first("a", common, relay)
        b = nodes.start("b", [*common, "--join", join], relay)
        nodes.finish([a, b], args.timeout_s)
        summaries = [n.of("summary")[0] for n in (a, b)]
        syncs = [s for n in (a, b) for s in n.of("sync")]
        curves = [_curve(n.events, args.batch_size * SEQ_LEN) for n in (a, b)]
        agreed = [e.get("bytes_sent", 0) for n in (a, b) for e in n.of("agree")]
    finally:
        nodes.stop()
    wire = nodes.link_bytes(["a", "b"])
    return {
        "eval_loss": statistics.mean(s["global_eval_loss"] for s in summaries),
        "local_eval_loss": statistics.mean(s["eval_loss"] for s in summaries),
        "tokens": sum(s["tokens"] for s in summaries),
        "bytes_on_wire": wire,
        "bytes_per_step_measured": wire / 2 / args.steps,
        # the run's one-off end: the last round of every fragment (about the model once)
        "bytes_end_agreement": sum(agreed) / 2,
        "bytes_per_step_training": (wire - sum(agreed)) / 2 / args.steps,
        "bytes_per_step_counted": statistics.mean(s["bytes_sent"] for s in summaries) / args.steps,
        "syncs": len(syncs), "syncs_ok": sum(s["outcome"] == "ok" for s in syncs),
        "consensus_rounds": sum(1 for s in syncs if s.get("consensus")) // 2,
        # two islands, equal tokens at every step: the swarm's tokens at step k are 2 * batch * k
        "curve": [(2 * t, statistics.mean(v for v in vals)) for t, *vals in _zip_curves(curves)],
    }


def oracle(args: argparse.Namespace, compression: str) -> dict:
    """bench.simulate with the swarm's settings: the same run with perfect communication."""
    from .simulate import config_of, parser, simulate, split_options

    argv = [*args.common, *args.schedule, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
            *codec_options(compression), *args.swarm_args.split()]
    known, _ = parser().parse_known_args(argv)  # the swarm's network options are not the oracle's
    return simulate(config_of(split_options(known)[1]), islands=2, on_progress=lambda line: None)


def _zip_curves(curves: list[list[tuple[int, float]]]) -> list[tuple]:
    common = sorted(set.intersection(*(set(t for t, _ in c) for c in curves)))
    lookup = [dict(c) for c in curves]
    return [(t, *(d[t] for d in lookup)) for t in common]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="JSON file for the figures (a PNG is written next to it)")
    p.add_argument("--steps", type=int, default=600, help="steps of each swarm island and of dp (solo runs twice as many)")
    p.add_argument("--batch-size", type=int, default=8, help="one island's batch (dp's is twice this)")
    p.add_argument("--window", type=int, default=100)
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--compression", nargs="+", default=["none", "fp16", "int8"], metavar="CODEC[+efDECAY]",
                   help="compression settings, a swarm and an oracle each (default: none fp16 int8)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per run")
    p.add_argument("--run-dir", default="bench-runs/parity")
    p.add_argument("--swarm-args", default="", help="more islands-node options for the swarm's islands, e.g. '--outer-lr 1 --alpha 0'")
    p.add_argument("--no-solo", action="store_true", help="skip the solo run (its figures are then null)")
    args = p.parse_args()
    root = Path(args.run_dir)
    shutil.rmtree(root, ignore_errors=True)
    args.common = ["--model", args.model, "--seq-len", str(SEQ_LEN), "--checkpoint-every", str(100 * args.steps)]
    args.schedule = ["--window", str(args.window), "--fragments", str(args.fragments)]
    params = _parameters(args.model)
    # data parallel between 2 peers: an fp32 ring all-reduce sends (and receives) 2 (n - 1) / n of the gradient
    bytes_per_step_dp = 2 * 4 * params * (2 - 1) / 2
    # dp and solo are one process each and measure quality, not speed: they run side by side
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        base_run = pool.submit(dp, root / "dp", args)
        solo_run = None if args.no_solo else pool.submit(solo, root / "solo", args)
        base = base_run.result()
        alone = {"eval_loss": float("nan"), "local_eval_loss": float("nan"), "tokens": 0, "curve": []} if solo_run is None else solo_run.result()
    runs = {c: swarm(root / f"swarm-{c}", args, c) for c in args.compression}
    oracles = {c: oracle(args, c) for c in args.compression}
    rows = [["dp", f"{base['eval_loss']:.4f}", "1.000", f"{bytes_per_step_dp / 1e3:.0f}", "-", "1", "-", "-"],
            ["solo", f"{alone['eval_loss']:.4f}", f"{alone['eval_loss'] / base['eval_loss']:.3f}", "0", "-", "-", "-", "-"]]
    per_compression = {}
    for c, r in runs.items():
        ratio = r["eval_loss"] / base["eval_loss"]
        reduction = bytes_per_step_dp / r["bytes_per_step_measured"]
        per_compression[c] = {
            "swarm_eval_loss": round(r["eval_loss"], 4), "swarm_local_eval_loss": round(r["local_eval_loss"], 4),
            "ratio_swarm_to_dp": round(ratio, 4), "bytes_per_step_swarm": round(r["bytes_per_step_measured"]),
            "bytes_per_step_swarm_counted": round(r["bytes_per_step_counted"]), "wire_reduction": round(reduction, 1),
            "bytes_end_agreement": round(r["bytes_end_agreement"]), "bytes_per_step_swarm_training": round(r["bytes_per_step_training"]),
            "wire_reduction_training": round(bytes_per_step_dp / r["bytes_per_step_training"], 1),
            "syncs_ok": r["syncs_ok"], "syncs": r["syncs"], "consensus_rounds": r["consensus_rounds"], "tokens": r["tokens"],
            "oracle_eval_loss": round(oracles[c]["eval_loss"], 4), "ratio_oracle_to_dp": round(oracles[c]["eval_loss"] / base["eval_loss"], 4),
            "ratio_swarm_to_oracle": round(r["eval_loss"] / oracles[c]["eval_loss"], 4),
        }
        rows.append([f"swarm ({c})", f"{r['eval_loss']:.4f}", f"{ratio:.3f}", f"{r['bytes_per_step_measured'] / 1e3:.1f}",
                     f"{r['bytes_per_step_counted'] / 1e3:.1f}", f"{reduction:.0f}x",
                     f"{bytes_per_step_dp / r['bytes_per_step_training']:.0f}x", f"{oracles[c]['eval_loss']:.4f}"])
    print(table(rows, ["run", "eval_loss", "ratio to dp", "kB/step/island (wire)", "kB/step (counted)", "wire reduction",
                       "without the final agreement", "oracle eval_loss"]))
    best = min(per_compression, key=lambda c: per_compression[c]["bytes_per_step_swarm"])
    head = per_compression[best]
    write(args.out, {
        "dp_eval_loss": round(base["eval_loss"], 4), "swarm_eval_loss": head["swarm_eval_loss"], "solo_eval_loss": round(alone["eval_loss"], 4),
        "ratio_swarm_to_dp": head["ratio_swarm_to_dp"], "oracle_eval_loss": head["oracle_eval_loss"],
        "ratio_swarm_to_oracle": head["ratio_swarm_to_oracle"], "bytes_per_step_dp": round(bytes_per_step_dp),
        "bytes_per_step_swarm": head["bytes_per_step_swarm"], "wire_reduction": head["wire_reduction"], "compression": best,
        "per_compression": per_compression, "parameters": params, "solo_local_eval_loss": round(alone["local_eval_loss"], 4),
        "tokens": {"dp": base["tokens"], "solo": alone["tokens"], **{f"swarm_{c}": r["tokens"] for c, r in runs.items()}},
        "config": {"steps": args.steps, "batch_size": args.batch_size, "window": args.window, "fragments": args.fragments,
                   "model": args.model, "seq_len": SEQ_LEN, "islands": 2, "swarm_args": args.swarm_args},
    })
    if args.out:
        series = {"data-parallel (batch 2x)": base["curve"], "solo island (2x steps)": alone["curve"]}
        series.update({f"swarm of 2, {c}": r["curve"] for c, r in runs.items()})
        plot(Path(args.out).with_suffix(".png"), f"eval_loss at equal tokens ({args.model}, H={args.window}, P={args.fragments})", series,
             xlabel="tokens (all islands)", ylabel="eval_loss (held-out bytes)")


if __name__ == "__main__":
    main()
