"""One island as a user runs it: real processes, real signals, real checkpoints."""

import json
import signal

import pytest
from islands.node.cli import main
from islands.protocols.schedule import fragment_offset

pytestmark = pytest.mark.timeout(240)

SMALL = ["--window", "8", "--fragments", "4", "--seq-len", "64", "--batch-size", "4"]


def _mean(xs):
    return sum(xs) / len(xs)


def test_acceptance_run_then_resume(nodes, tmp_path):
    """The issue's acceptance: 120 steps on the schedule, loss falls, then a resume to 150."""
    d = tmp_path / "D"
    node = nodes(["--steps", "120", "--window", "20", "--fragments", "4", "--log-json", str(d / "log.jsonl")], d)
    node.use_log(d / "log.jsonl")
    assert node.wait_exit(170) == 0, node.stderr()
    events = node.poll_events()
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 121))
    syncs = [e for e in events if e["event"] == "sync"]
    for p in range(4):
        got = [e["step"] for e in syncs if e["fragment"] == p]
        assert got == [t for t in range(20, 121) if t % 20 == fragment_offset(p, 20, 4)], (p, got)
    assert all(e["outcome"] == "solo" and e["applied_step"] in (e["step"] + 4, 120) for e in syncs)
    assert events[-1]["event"] == "summary" and events[-1]["steps"] == 120
    losses = [e["loss"] for e in steps]
    assert _mean(losses[-10:]) < 0.8 * _mean(losses[:10])
    assert json.loads((d / "checkpoint" / "state.json").read_text())["step"] == 120

    again = nodes(["--steps", "150", "--window", "20", "--fragments", "4", "--log-json", str(d / "log.jsonl")], d, name="again")
    again.use_log(d / "log.jsonl")
    assert again.wait_exit(120) == 0, again.stderr()
    assert again.steps()[0] == 121 and again.steps()[-1] == 150
    summary = again.of("summary")[0]
    assert summary["steps"] == 150 and summary["tokens"] == 150 * 8 * 128
    assert (d / "log.jsonl.1").exists()  # the first run's log is kept


def test_shampoo_trains(nodes, tmp_path):
    node = nodes(["--steps", "60", "--window", "20", "--fragments", "4", "--inner-opt", "shampoo"], tmp_path / "s")
    assert node.wait_exit(150) == 0, node.stderr()
    losses = [e["loss"] for e in node.of("step")]
    assert _mean(losses[-10:]) < 0.8 * _mean(losses[:10])


def test_sigterm_checkpoints_and_resume_continues(nodes, tmp_path):
    d = tmp_path / "run"
    node = nodes(["--steps", "100000", *SMALL], d)
    node.wait_for(lambda e: e["event"] == "step" and e["step"] >= 13, 90, "step 13")
    node.signal(signal.SIGTERM)
    assert node.wait_exit(60) == 0, node.stderr()
    stopped = node.of("stopped")[0]
    assert stopped["reason"] == "signal SIGTERM"
    assert node.of("summary")[0]["steps"] == stopped["step"]
    assert json.loads((d / "checkpoint" / "state.json").read_text())["step"] == stopped["step"]

    again = nodes(["--steps", str(stopped["step"] + 3), *SMALL], d, name="again")
    assert again.wait_exit(90) == 0, again.stderr()
    assert again.steps() == [stopped["step"] + 1, stopped["step"] + 2, stopped["step"] + 3]


def test_sigkill_loses_at_most_a_window(nodes, tmp_path):
    d = tmp_path / "run"
    node = nodes(["--steps", "100000", *SMALL, "--checkpoint-every", "8"], d)
    node.wait_for(lambda e: e["event"] == "step" and e["step"] >= 27, 90, "step 27")
    node.kill_tree()
    saved = json.loads((d / "checkpoint" / "state.json").read_text())["step"]
    assert 27 - 16 <= saved <= 27 + 1
    again = nodes(["--steps", str(saved + 2), *SMALL], d, name="again")
    assert again.wait_exit(90) == 0, again.stderr()
    assert again.steps() == [saved + 1, saved + 2]


# --- bad input: one line, exit status 2, nothing touched --------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--inner-opt", "sgd"], "argument --inner-opt: invalid choice: 'sgd'"),
        (["--window", "3", "--fragments", "4"], "window 3 cannot be divided into 4 fragments"),
        (["--window", "20", "--fragments", "4", "--overlap", "5"], "overlap 5 must be below window/fragments = 5"),
        (["--steps", "many"], "option steps: expected an integer, got 'many'"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    ],
)
def test_bad_options(argv, message, capsys, tmp_path):
    assert main([*argv, "--run-dir", str(tmp_path / "r")], environ={}) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()


def test_bad_data_paths(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    for data, message in ((tmp_path / "missing", "does not exist"), (tmp_path / "empty", "holds no files")):
        assert main(["--data", str(data), "--run-dir", str(tmp_path / "r"), "--steps", "2"], environ={}) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def _make_checkpoint(tmp_path, capsys) -> "object":
    run = tmp_path / "r"
    assert main(["--steps", "2", *SMALL, "--run-dir", str(run), "--progress", "off"], environ={}) == 0
    capsys.readouterr()
    return run


@pytest.mark.network
def test_truncated_checkpoint_is_refused_untouched(capsys, tmp_path):
    run = _make_checkpoint(tmp_path, capsys)
    f = run / "checkpoint" / "global.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    before = {p.name: p.read_bytes() for p in (run / "checkpoint").iterdir()}
    assert main(["--steps", "4", *SMALL, "--run-dir", str(run)], environ={}) == 2
    err = capsys.readouterr().err
    assert "global.safetensors is truncated" in err and len(err.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in (run / "checkpoint").iterdir()} == before


@pytest.mark.network
def test_foreign_checkpoint_is_refused(capsys, tmp_path):
    run = _make_checkpoint(tmp_path, capsys)
    assert main(["--steps", "4", "--window", "12", "--fragments", "4", "--seq-len", "64", "--run-dir", str(run)], environ={}) == 2
    err = capsys.readouterr().err
    assert "window: this node has 12, the checkpoint has 8" in err
    assert main(["--steps", "4", *SMALL, "--run-id", "other", "--run-dir", str(run)], environ={}) == 2
    assert "run_id: this node has 'other'" in capsys.readouterr().err


def test_help_explains_itself(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--join", "--window", "--fragments", "--overlap", "--inner-opt", "--run-dir", "--log-json", "ISLANDS_"):
        assert flag in out


def test_check_config(tmp_path, capsys):
    good = tmp_path / "good.toml"
    good.write_text("window = 20\nfragments = 4\n")
    assert main(["check-config", str(good)], environ={}) == 0
    bad = tmp_path / "bad.toml"
    bad.write_text("window = 20\nfragmnets = 4\n")
    assert main(["check-config", str(bad)], environ={}) == 2
    assert "unknown key 'fragmnets'" in capsys.readouterr().err


def _group(pgid: int) -> set[int]:
    import subprocess

    out = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


def test_sigkill_of_the_node_takes_its_daemons_down(nodes, tmp_path):
    """No ghost peer: hivemind's DHT and p2pd go when the node is killed."""
    import os
    import time

    node = nodes(["--steps", "100000", *SMALL, "--listen", "/ip4/127.0.0.1/tcp/0"], tmp_path / "k")
    node.wait_for(lambda e: e["event"] == "step" and e["step"] >= 3, 90, "step 3")
    pgid = node.proc.pid
    assert len(_group(pgid)) >= 4  # node, watchdog, DHT, p2pd
    os.kill(node.proc.pid, signal.SIGKILL)
    node.proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    while _group(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _group(pgid)


@pytest.mark.network
def test_identity_keeps_the_peer_id(capsys, tmp_path):
    key = tmp_path / "id.key"
    ids = []
    for i in range(2):
        run = tmp_path / f"r{i}"
        assert main(["--steps", "1", *SMALL, "--run-dir", str(run), "--identity", str(key), "--progress", "off", "--listen", "/ip4/127.0.0.1/tcp/0"], environ={}) == 0
        ids.append(json.loads((run / "events.jsonl").read_text().splitlines()[0])["peer_id"])
    assert ids[0] == ids[1] and len(ids[0]) > 40
    assert key.stat().st_mode & 0o077 == 0


def test_a_damaged_checkpoint_is_set_aside_by_an_island_that_joins_a_swarm(tmp_path):
    """With --join the swarm gives the island the run's state, as to any joiner: its damaged
    checkpoint (a crash or a full disk under it) goes to checkpoint.corrupt and it starts without
    one; alone it refuses to start (the operator's to decide), the checkpoint untouched."""
    import dataclasses

    from islands.node import checkpoint as ck
    from islands.node.config import Config
    from islands.node.daemon import StartupError
    from islands.node.loop import Island

    cfg = Config()
    cfg = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, run_dir=str(tmp_path)))
    fresh = Island(cfg)
    state = {n: p.detach() for n, p in fresh.model.named_parameters()}
    ck.save(tmp_path, ck.Checkpoint(
        step=7, manifest=fresh.manifest, global_state=state, local_state=state, outer_state=state, inner_opt_state={},
        fragments=[], totals={}, inner_opt="adamw",
    ))
    f = tmp_path / "checkpoint" / "outer.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(StartupError, match="outer.safetensors is truncated.*without --join"):
        Island(cfg)
    assert f.stat().st_size == 100
    joiner = Island(dataclasses.replace(cfg, net=dataclasses.replace(cfg.net, join=["/ip4/127.0.0.1/tcp/1"])))
    assert joiner.resume is None and joiner.set_aside[0] == tmp_path / "checkpoint.corrupt"
    assert "truncated" in joiner.set_aside[1] and not (tmp_path / "checkpoint").exists()
