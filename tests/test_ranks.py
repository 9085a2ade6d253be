"""Heterogeneous islands: a 2-rank data-parallel island (gloo) next to a single-process one."""

import os
import signal
import subprocess
import time

import pytest
from islands.node.ranks import RankEnv, fragment_mask, mask_fragments
from safetensors.torch import load_file

pytestmark = pytest.mark.timeout(300)

SCHEDULE = ["--window", "20", "--fragments", "4", "--listen", "/ip4/127.0.0.1/tcp/0"]


def test_rank_environment_and_fragment_masks():
    assert RankEnv.from_environ({}) is None and RankEnv.from_environ({"WORLD_SIZE": "1"}) is None
    assert RankEnv.from_environ({"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "0"}) == RankEnv(2, 4, 0)
    with pytest.raises(ValueError):
        RankEnv.from_environ({"WORLD_SIZE": "2", "RANK": "5"})
    assert mask_fragments(fragment_mask({0, 3}), 4) == [0, 3] and mask_fragments(0, 4) == []


def _rank_pids(node_pid: int) -> dict[int, int]:
    """{rank: pid} of the follower ranks a node launched (its children with RANK set)."""
    out = subprocess.run(["pgrep", "-P", str(node_pid)], capture_output=True, text=True).stdout.split()
    ranks = {}
    for pid in map(int, out):
        try:
            env = dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)
        except OSError:
            continue
        if "RANK" in env:
            ranks[int(env["RANK"])] = pid
    return ranks


def _group(pgid: int) -> set[int]:
    out = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


def _max_diff(a, b) -> float:
    ta, tb = load_file(a), load_file(b)
    return max((ta[k] - tb[k]).abs().max().item() for k in ta)


def test_a_two_rank_island_and_a_single_process_island_train_one_model(nodes, tmp_path):
    common = [*SCHEDULE, "--steps", "100", "--wait-islands", "2", "--run-id", "mixed-ranks", "--batch-size", "4"]
    maddr = tmp_path / "a.maddr"
    a = nodes([*common, "--nproc", "2", "--maddr-file", str(maddr)], tmp_path / "a", name="a")
    b = nodes([*common, "--join", a.wait_file(maddr, 90)], tmp_path / "b", name="b")
    for node in (a, b):
        assert node.wait_exit(240) == 0, node.stderr()
    [ranks] = a.of("ranks")
    assert ranks["world"] == 2 and ranks["param_spread"] == 0.0  # the ranks stayed identical
    for node, world in ((a, 2), (b, 1)):
        syncs = node.of("sync")
        ok = [s for s in syncs if s["outcome"] == "ok" and s["group_size"] == 2]
        assert len(ok) >= 0.8 * len(syncs), [(s["outcome"], s["group_size"]) for s in syncs]
        # the island's global batch: 4 sequences of 128 bytes on each rank
        assert all(e["tokens"] == 4 * 128 * world for e in node.of("step"))
        assert syncs[-1]["weight"] == 20 * 4 * 128 * world
    ga, gb = (tmp_path / n / "checkpoint" / "global.safetensors" for n in "ab")
    assert _max_diff(ga, gb) < 1e-4


def test_a_killed_rank_takes_its_island_down_and_the_other_goes_on(nodes, tmp_path):
    common = [*SCHEDULE, "--steps", "100", "--wait-islands", "2", "--run-id", "rank-crash", "--batch-size", "4", "--match-wait-s", "3"]
    maddr = tmp_path / "a.maddr"
    a = nodes([*common, "--nproc", "2", "--maddr-file", str(maddr)], tmp_path / "a", name="a")
    b = nodes([*common, "--join", a.wait_file(maddr, 90)], tmp_path / "b", name="b")
    a.wait_for(lambda e: e["event"] == "step" and e["step"] >= 25, 120, "A at step 25")
    worker = _rank_pids(a.proc.pid)[1]
    os.kill(worker, signal.SIGKILL)
    assert a.wait_exit(60) == 1, a.stderr()
    stopped = a.of("stopped")[0]
    assert stopped["reason"].startswith("rank failed") and stopped["step"] < 100
    assert (tmp_path / "a" / "checkpoint" / "state.json").exists()
    deadline = time.monotonic() + 15
    while _group(a.proc.pid) and time.monotonic() < deadline:  # nothing of A's left: no p2pd, no rank
        time.sleep(0.2)
    assert not _group(a.proc.pid)
    assert b.wait_exit(200) == 0, b.stderr()
    assert b.of("summary")[0]["steps"] == 100


def test_balance_gives_a_fast_island_more_micro_batches(nodes, tmp_path):
    """A (batch 4, --balance) next to B (batch 32): A's steps are much shorter, so it accumulates."""
    common = [*SCHEDULE, "--steps", "80", "--wait-islands", "2", "--run-id", "balance"]
    maddr = tmp_path / "a.maddr"
    a = nodes([*common, "--batch-size", "4", "--balance", "--maddr-file", str(maddr)], tmp_path / "a", name="a")
    b = nodes([*common, "--batch-size", "32", "--join", a.wait_file(maddr, 90)], tmp_path / "b", name="b")
    for node in (a, b):
        assert node.wait_exit(240) == 0, node.stderr()
    balance = a.of("balance")
    assert balance and balance[0]["accum_from"] == 1 and balance[0]["accum"] >= 2, balance
    assert balance[0]["step"] % 20 == 0 and balance[0]["swarm_step_seconds"] > balance[0]["micro_seconds"]
    after = [e for e in a.of("step") if e["step"] > balance[0]["step"]]
    assert after and after[0]["tokens"] == balance[0]["accum"] * 4 * 128  # the island's contribution weighs them
    assert not b.of("balance")
