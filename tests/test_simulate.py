"""The oracle (bench.simulate: Streaming DiLoCo in one process, perfect communication) against a
real 2-island swarm with the same seed: the network must add nothing to the model's quality."""

import pytest

from bench.simulate import config_of, simulate

pytestmark = [pytest.mark.network, pytest.mark.timeout(300)]

RUN = {"steps": 60, "window": 20, "fragments": 4, "seq_len": 64, "batch_size": 4, "seed": 5, "compression": "int2"}


def _argv(run: dict) -> list[str]:
    return [a for k, v in run.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def test_a_two_island_swarm_ends_where_the_oracle_does(nodes, tmp_path):
    common = [*_argv(RUN), "--wait-islands", "2", "--run-id", "oracle", "--listen", "/ip4/127.0.0.1/tcp/0", "--data-listen", "127.0.0.1:0"]
    maddr = tmp_path / "a.maddr"
    a = nodes([*common, "--maddr-file", str(maddr)], tmp_path / "a", name="a")
    b = nodes([*common, "--join", a.wait_file(maddr, 60)], tmp_path / "b", name="b")
    for node in (a, b):
        assert node.wait_exit(240) == 0, node.stderr()
    oracle = simulate(config_of(RUN), islands=2, on_progress=lambda line: None)  # after: the swarm has the cores to itself
    syncs = [s for node in (a, b) for s in node.of("sync")]
    assert syncs and all(s["outcome"] == "ok" and s["group_size"] == 2 for s in syncs), [(s["outcome"], s["group_size"]) for s in syncs]
    swarm = [node.of("summary")[0]["global_eval_loss"] for node in (a, b)]
    assert swarm[0] == swarm[1]  # one agreed model
    # within the 0.5 %; here they were bitwise equal (int8 and int2): the same steps, parts and reductions
    assert abs(swarm[0] / oracle["eval_loss"] - 1) < 0.005, (swarm, oracle["eval_loss"])
    assert oracle["rounds"] == len(syncs) // 2


def test_bench_parity_gives_the_oracle_the_swarms_settings(monkeypatch):
    import argparse

    import bench.simulate
    from bench import parity

    monkeypatch.setattr(bench.simulate, "simulate", lambda cfg, islands, on_progress: (cfg, islands))
    args = argparse.Namespace(
        common=["--model", "tiny", "--seq-len", "128", "--checkpoint-every", "6000"], schedule=["--window", "50", "--fragments", "4"],
        steps=600, batch_size=8, swarm_args="--outer-lr 1 --match-wait-s 3",
    )
    cfg, islands = parity.oracle(args, "int4+ef0.95")  # the swarm's network options are not the oracle's
    assert islands == 2 and cfg.train.steps == 600 and cfg.train.batch_size == 8 and cfg.diloco.window == 50
    assert (cfg.diloco.compression, cfg.diloco.feedback, cfg.diloco.outer_lr) == ("int4", 0.95, 1.0)
