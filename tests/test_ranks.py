"""Heterogeneous islands: a 2-rank data-parallel island (gloo) next to a single-process one."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp
from islands.models.transformer import Transformer, model_config
from islands.node.ranks import RankEnv, RankGroup, fragment_mask, mask_fragments
from islands.node.workers import Worker, exit_description, free_port, rank_log_path, stop_workers
from islands.protocols.fragments import split_fragments
from safetensors.torch import load_file

pytestmark = pytest.mark.timeout(300)

SCHEDULE = ["--window", "20", "--fragments", "4", "--listen", "/ip4/127.0.0.1/tcp/0"]


def test_rank_environment_and_fragment_masks():
    assert RankEnv.from_environ({}) is None and RankEnv.from_environ({"WORLD_SIZE": "1"}) is None
    assert RankEnv.from_environ({"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "0"}) == RankEnv(2, 4, 0)
    with pytest.raises(ValueError):
        RankEnv.from_environ({"WORLD_SIZE": "2", "RANK": "5"})
    assert mask_fragments(fragment_mask({0, 3}), 4) == [0, 3] and mask_fragments(0, 4) == []


def test_a_rank_that_ended_badly_is_reported_with_its_log(tmp_path, caplog):
    assert exit_description(1) == "status 1" and exit_description(-signal.SIGSEGV) == "signal SIGSEGV"
    log = rank_log_path(tmp_path, 1)
    log.write_text("--- rank 1 of 2\nFatal Python error: Segmentation fault\n  File \"x.py\", line 3 in f\nExtension modules: a, b\n")
    crashed = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"])
    with caplog.at_level("WARNING"):
        stop_workers([Worker(1, crashed, log)], timeout_s=30)
    text = caplog.text
    assert f"rank 1 exited with signal SIGSEGV; its log is {log} (the Python stacks" in text
    assert 'File "x.py", line 3 in f' in text and "Extension modules" not in text


@pytest.mark.network
def test_the_rank_protocol_refuses_a_second_thread(monkeypatch):
    """A read of a sharded fragment from another thread would interleave its collectives with the
    driving thread's: the protocol raises instead (a group of one rank, in this process)."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    group = RankGroup(RankEnv(0, 1, 0), torch.device("cpu"), [["w"]], timeout_s=30)
    try:
        assert group._ints([7, 8]) == [7, 8]
        errors = []

        def elsewhere() -> None:
            try:
                group.pull(0)
            except RuntimeError as e:
                errors.append(str(e))

        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join(30)
        assert errors and "must run in one thread" in errors[0]
        assert group._ints([1]) == [1]  # the driving thread goes on
    finally:
        group.close()


def _sharded_rank(rank: int, port: int, out: str) -> None:
    """One of two ranks of a sharded island: rank 0 reads a fragment through its full copy, writes
    it, and the ranks' shards must then hold exactly that; the follower serves rank 0's orders.
    Then rank 0 changes the head (a root parameter) between two evaluations: the second must see it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.manual_seed(0)
    model = Transformer(model_config("tiny"))
    layout = split_fragments(model.layer_groups(), 4)
    group = RankGroup(RankEnv(rank, 2, rank), torch.device("cpu"), layout, timeout_s=60, sharded=True)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))

    @torch.no_grad()
    def loss() -> float:
        return float(model(x, x)[1])

    try:
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        group.wrap(model)
        if rank == 0:
            group.before_step(1)
        else:
            assert group.next_step() == (1, 1)
        with torch.no_grad():  # what the inner step does: every rank's shard moves
            for p in group.params.values():
                p.to_local().add_(1.0 + rank)
        names = layout[2]
        read = losses = full = None
        if rank == 0:
            view = group.view({})
            read = {n: view[n].clone() for n in names}  # gathers fragment 2
            with torch.no_grad():
                for n in names:
                    view[n].copy_(read[n] * 0.5)
            group.mark(2)
            losses = [group.evaluate(loss)]  # sends the changed fragment first
            with torch.no_grad():
                view["head.weight"].mul_(3.0)
            group.mark(layout.index(next(f for f in layout if "head.weight" in f)))
            losses.append(group.evaluate(loss))
            full = {n: view[n].clone() for n in view}
            group.stop()
        else:
            assert group.next_step(evaluate=loss) is None
        torch.save({"before": before, "read": read, "local": {n: group.params[n].to_local().clone() for n in names},
                    "peak": group.gather_peak_bytes, "bytes": group.model_bytes(), "losses": losses, "full": full},
                   f"{out}/rank{rank}.pt")
    finally:
        group.close()


@pytest.mark.network
def test_a_sharded_island_gathers_and_scatters_a_fragment_exactly(tmp_path):
    mp.start_processes(_sharded_rank, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    # an evaluation sees what rank 0 wrote before it, the root's parameters too (FSDP2 keeps them
    # unsharded after a forward without backward): the same loss as the unsharded model's
    plain = Transformer(model_config("tiny"))
    plain.load_state_dict(r0["full"])
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected_loss = float(plain(x, x)[1])
    assert r0["losses"][1] != r0["losses"][0]
    assert abs(r0["losses"][1] - expected_loss) < 1e-5, (r0["losses"], expected_loss)
    for n, read in r0["read"].items():
        shards = [r["local"][n] for r in (r0, r1)]
        # what rank 0 read: every rank's moved shard, put together
        expected = r0["before"][n] + torch.cat([torch.ones_like(shards[0]), 2 * torch.ones_like(shards[1])])
        assert torch.equal(read, expected), n
        # what the ranks hold after rank 0 wrote half of it: exactly their halves of that
        assert torch.equal(torch.cat(shards), expected * 0.5), n
    whole, local = r0["bytes"]
    assert local == whole // 2 and 0 < r0["peak"] <= max(t.numel() * 4 for t in r0["read"].values())


def test_a_sharded_island_needs_several_ranks(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "islands.node", "--parallel", "fsdp", "--steps", "5", "--run-dir", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2 and "--parallel fsdp shards the model over the island's ranks" in out.stderr


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


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_two_rank_island_and_a_single_process_island_train_one_model(nodes, tmp_path, parallel):
    common = [*SCHEDULE, "--steps", "100", "--wait-islands", "2", "--run-id", "mixed-ranks", "--batch-size", "4"]
    maddr = tmp_path / "a.maddr"
    a = nodes([*common, "--nproc", "2", "--parallel", parallel, "--maddr-file", str(maddr)], tmp_path / "a", name="a")
    b = nodes([*common, "--join", a.wait_file(maddr, 90)], tmp_path / "b", name="b")
    for node in (a, b):
        assert node.wait_exit(240) == 0, node.stderr()
    [ranks] = a.of("ranks")
    assert ranks["world"] == 2 and ranks["parallel"] == parallel
    if parallel == "ddp":
        assert ranks["param_spread"] == 0.0 and ranks["rank_bytes"] == ranks["model_bytes"]  # the ranks stayed identical
    else:  # each rank holds half; a round gathered at most one tensor of a fragment at a time
        assert ranks["rank_bytes"] == ranks["model_bytes"] // 2
        assert 0 < ranks["gather_peak_bytes"] <= ranks["fragment_bytes"] < ranks["model_bytes"]
    for node, world in ((a, 2), (b, 1)):
        syncs = node.of("sync")
        ok = [s for s in syncs if s["outcome"] == "ok" and s["group_size"] == 2]
        assert len(ok) >= 0.8 * len(syncs), [(s["outcome"], s["group_size"]) for s in syncs]
        # the island's global batch: 4 sequences of 128 bytes on each rank
        assert all(e["tokens"] == 4 * 128 * world for e in node.of("step"))
        assert syncs[-1]["weight"] == 20 * 4 * 128 * world
    ga, gb = (tmp_path / n / "checkpoint" / "global.safetensors" for n in "ab")
    assert _max_diff(ga, gb) < 1e-4


@pytest.mark.parametrize(("parallel", "sig"), [("ddp", signal.SIGKILL), ("fsdp", signal.SIGSEGV)], ids=["ddp-sigkill", "fsdp-sigsegv"])
def test_a_killed_rank_takes_its_island_down_and_the_other_goes_on(nodes, tmp_path, parallel, sig):
    common = [*SCHEDULE, "--steps", "100", "--wait-islands", "2", "--run-id", "rank-crash", "--batch-size", "4", "--match-wait-s", "3"]
    maddr = tmp_path / "a.maddr"
    a = nodes([*common, "--nproc", "2", "--parallel", parallel, "--maddr-file", str(maddr)], tmp_path / "a", name="a")
    b = nodes([*common, "--join", a.wait_file(maddr, 90)], tmp_path / "b", name="b")
    a.wait_for(lambda e: e["event"] == "step" and e["step"] >= 25, 120, "A at step 25")
    worker = _rank_pids(a.proc.pid)[1]
    os.kill(worker, sig)
    assert a.wait_exit(60) == 1, a.stderr()
    stopped = a.of("stopped")[0]
    assert stopped["reason"].startswith("rank failed") and stopped["step"] < 100
    # the rank's log tells its story, and rank 0 says where it is
    log = tmp_path / "a" / "rank1.log"
    assert f"rank 1 exited with signal {sig.name}; its log is {log}" in a.stderr_path.read_text()
    if sig == signal.SIGSEGV:  # a crash leaves the Python stack of the rank's thread
        text = log.read_text()
        assert "Fatal Python error: Segmentation fault" in text and 'File "' in text and "in follow" in text, text[-3000:]
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
