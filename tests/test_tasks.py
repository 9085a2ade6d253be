"""The Task API, `attach` and the examples: bring your own model, optimizer, step and loop."""

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from islands.node.checkpoint import Checkpoint, load, save
from islands.node.cli import main
from islands.node.config import ConfigError, build_config
from islands.node.task import TaskError, check_layout, layout, resolve
from safetensors.torch import load_file

from tests.procs import free_port

pytestmark = pytest.mark.timeout(300)

HF = importlib.util.find_spec("transformers") is not None
needs_hf = pytest.mark.skipif(not HF, reason="transformers is not installed (pip install 'compute-islands[hf]')")
HF_TASK = ["--task", "examples.hf_task:build", "--task-arg", "d_model=64", "--task-arg", "layers=4", "--task-arg", "batch_size=4"]
SCHEDULE = ["--window", "10", "--fragments", "2", "--torch-threads", "1"]


def _max_diff(a, b) -> float:
    ta, tb = load_file(a), load_file(b)
    assert ta.keys() == tb.keys()
    return max((ta[k] - tb[k]).abs().max().item() for k in ta)


# --- pure: layouts, options, checkpoints -----------------------------------------------


@needs_hf
def test_a_hugging_face_llama_is_cut_into_fragments_by_its_parameter_names():
    from transformers import AutoModelForCausalLM

    from examples.hf_task import model_config

    model = AutoModelForCausalLM.from_config(model_config("llama", 256, 64, 4, 32))
    names = [n for n, _ in model.named_parameters()]
    task = type("T", (), {"fragments": None})()
    f0, f1 = layout(task, names, 2)
    assert f0[0] == "model.embed_tokens.weight" and f1[-2:] == ["model.norm.weight", "lm_head.weight"]
    assert {n.split(".")[2] for n in f0 if ".layers." in n} == {"0", "2"}
    assert {n.split(".")[2] for n in f1 if ".layers." in n} == {"1", "3"}


def test_a_task_layout_of_its_own_is_checked():
    names = ["a", "b", "c"]
    assert check_layout([["a"], ["b", "c"]], names, 2) == [["a"], ["b", "c"]]
    for bad, message in [
        ([["a", "b", "c"]], "has 1 fragments, not --fragments 2"),
        ([["a", "b", "c"], []], "leaves fragment 1 empty"),
        ([["a", "b"], ["b", "c"]], "puts 'b' in fragments 0 and 1"),
        ([["a"], ["b"]], "misses ['c']"),
    ]:
        with pytest.raises(TaskError, match=".*" + message.replace("[", r"\[").replace("]", r"\]")):
            check_layout(bad, names, 2)


def test_task_options_from_the_command_line_toml_and_environment(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[task]\nentry = "mypkg.train:build"\n[task.args]\nlr = 0.001\nname = "big"\n')
    cfg = build_config({"config": str(toml)}, environ={})
    assert cfg.task.task == "mypkg.train:build" and cfg.task.args == {"lr": "0.001", "name": "big"}
    cfg = build_config({"task_arg": ["a=1", "b=x=y"]}, environ={"ISLANDS_TASK": "m:f"})
    assert cfg.task.task == "m:f" and cfg.task.args == {"a": "1", "b": "x=y"}
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        build_config({"task": "m:f", "task_arg": ["novalue"]}, environ={})
    with pytest.raises(ConfigError, match="balance sets the built-in loop's micro-batches"):
        build_config({"task": "m:f", "balance": True}, environ={})


def test_help_lists_the_task_options(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--task MODULE:FUNCTION" in out and "--task-arg KEY=VALUE" in out


@pytest.mark.parametrize(
    "entry, message",
    [
        ("nosuchmodule:build", "--task nosuchmodule:build: no module named 'nosuchmodule'"),
        ("tests.tasks_for_tests:missing", "module tests.tasks_for_tests has no function 'missing'"),
        ("tests.tasks_for_tests:not_callable", "has no function 'not_callable'"),
        ("no_colon", "expected MODULE:FUNCTION"),
    ],
)
def test_a_task_that_cannot_be_found_ends_with_one_line_and_exit_2(entry, message, capsys, tmp_path):
    assert main(["--task", entry, "--run-dir", str(tmp_path / "r")], environ={}) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()


def test_resolve_finds_a_module_in_the_working_folder(tmp_path, monkeypatch):
    (tmp_path / "mytask_here.py").write_text("def build(ctx):\n    return 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    assert resolve("mytask_here:build")(None) == 1


def test_a_checkpoint_keeps_the_task_state(tmp_path):
    t = {"w": torch.ones(2)}
    ckpt = Checkpoint(
        step=7, manifest={"run_id": "r"}, global_state=t, local_state=t, outer_state=t, inner_opt_state={}, fragments=[],
        totals={"shard": 3}, inner_opt="SGD", task_state={"position": 7, "rng": torch.arange(3)},
    )
    save(tmp_path, ckpt)
    back = load(tmp_path, {"run_id": "r"})
    assert back.task_state["position"] == 7 and back.task_state["rng"].tolist() == [0, 1, 2]
    ckpt.task_state = None
    save(tmp_path, ckpt)
    assert load(tmp_path, {"run_id": "r"}).task_state is None


# --- real processes --------------------------------------------------------------------


@pytest.mark.network
@pytest.mark.parametrize(
    "entry, message",
    [
        ("tests.tasks_for_tests:raises", "the build function raised RuntimeError: no GPU quota left"),
        ("tests.tasks_for_tests:not_a_task", "the build function returned dict, not islands.node.Task"),
    ],
)
def test_a_build_function_that_fails_ends_with_one_line_and_exit_2(entry, message, capsys, tmp_path):
    argv = ["--task", entry, "--run-dir", str(tmp_path / "r"), "--progress", "off", "--listen", "/ip4/127.0.0.1/tcp/0"]
    assert main(argv, environ={}) == 2
    err = capsys.readouterr().err
    assert message in err and len([line for line in err.strip().splitlines() if "islands-node" in line]) == 1, err


@pytest.mark.network
def test_a_task_trains_resumes_and_refuses_another_tasks_checkpoint(tmp_path, capsys):
    run = str(tmp_path / "r")
    base = ["--task", "tests.tasks_for_tests:build", *SCHEDULE, "--run-dir", run, "--progress", "off", "--listen", "/ip4/127.0.0.1/tcp/0"]
    assert main([*base, "--steps", "20"], environ={}) == 0
    assert main([*base, "--steps", "30"], environ={}) == 0
    events = [json.loads(line) for line in (tmp_path / "r" / "events.jsonl").read_text().splitlines()]
    steps = [e["step"] for e in events if e["event"] == "step"]
    assert steps == list(range(21, 31))  # resumed at step 20
    summary = events[-1]
    assert summary["event"] == "summary" and summary["eval_loss"] < 0.5 * events[1]["loss"]
    capsys.readouterr()
    assert main([*base, "--steps", "40", "--task-arg", "depth=6"], environ={}) == 2
    err = capsys.readouterr().err
    assert "belongs to another run or configuration" in err and "layout_digest" in err, err


@needs_hf
def test_two_islands_train_the_hugging_face_example_through_task(nodes, tmp_path):
    common = [*HF_TASK, *SCHEDULE, "--steps", "60", "--wait-islands", "2", "--run-id", "hf-task"]
    maddr = tmp_path / "a.maddr"
    a = nodes([*common, "--maddr-file", str(maddr)], tmp_path / "a", name="a")
    b = nodes([*common, "--join", a.wait_file(maddr, 90)], tmp_path / "b", name="b")
    for node in (a, b):
        assert node.wait_exit(240) == 0, node.stderr()
    # the untrained model's loss: that of the run's first step (an island still building its model
    # when the other started, a busy machine, catches up at a later step from the other's state)
    first = next(n.of("step")[0]["loss"] for n in (a, b) if n.of("step")[0]["step"] == 1)
    for node in (a, b):
        [summary] = node.of("summary")
        assert summary["eval_loss"] < first - 1.0, (first, summary)
        assert any(s["outcome"] == "ok" and s["group_size"] == 2 for s in node.of("sync"))
    assert {a.of("started")[0]["shard"], b.of("started")[0]["shard"]} == {0, 1}  # different data
    ga, gb = (tmp_path / n / "checkpoint" / "global.safetensors" for n in "ab")
    assert _max_diff(ga, gb) < 1e-4


@needs_hf
def test_a_torchrun_fsdp_island_and_a_single_process_island_train_one_model(nodes, tmp_path):
    common = [*HF_TASK, *SCHEDULE, "--steps", "40", "--wait-islands", "2", "--run-id", "hf-fsdp"]
    maddr = tmp_path / "a.maddr"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "islands.node"]
    a = nodes([*common, "--parallel", "fsdp", "--maddr-file", str(maddr)], tmp_path / "a", name="a", command=torchrun)
    b = nodes([*common, "--join", a.wait_file(maddr, 120)], tmp_path / "b", name="b")
    for node in (a, b):
        assert node.wait_exit(240) == 0, node.stderr()
    [ranks] = a.of("ranks")
    assert ranks["world"] == 2 and ranks["parallel"] == "fsdp" and ranks["rank_bytes"] < ranks["model_bytes"]
    # the island's step: 4 sequences of 128 tokens on each rank
    assert all(e["tokens"] == 2 * 4 * 128 for e in a.of("step")) and all(e["tokens"] == 4 * 128 for e in b.of("step"))
    ga, gb = (tmp_path / n / "checkpoint" / "global.safetensors" for n in "ab")
    assert _max_diff(ga, gb) < 1e-4


@needs_hf
def test_a_stopped_island_resumes_at_its_step_on_the_batch_it_would_have_read(nodes, tmp_path):
    common = [*HF_TASK, *SCHEDULE, "--steps", "30", "--run-id", "hf-resume"]
    whole = nodes(common, tmp_path / "whole", name="whole")
    assert whole.wait_exit(120) == 0, whole.stderr()
    batches = {e["step"]: e["info"]["batch"] for e in whole.of("step")}
    stopped = nodes(common, tmp_path / "s", name="s")
    stopped.wait_for(lambda e: e["event"] == "step" and e["step"] >= 12, 120, "step 12")
    stopped.proc.send_signal(signal.SIGTERM)
    assert stopped.wait_exit(60) == 0, stopped.stderr()
    k = stopped.of("stopped")[0]["step"]
    assert 12 <= k < 30 and stopped.of("stopped")[0]["reason"] == "signal SIGTERM"
    again = nodes(common, tmp_path / "s", name="again")
    assert again.wait_exit(120) == 0, again.stderr()
    assert again.of("started")[0]["resumed_step"] == k
    steps = again.of("step")
    assert steps[0]["step"] == k + 1 and steps[0]["info"]["batch"] == batches[k + 1]
    assert [e["info"]["batch"] for e in steps] == [batches[s] for s in range(k + 1, 31)]


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-rank", "torchrun-two-ranks"])
def test_two_attached_loops_train_one_model(nodes, tmp_path, ranks):
    """Example 2 on two islands; with `torchrun-two-ranks`, A is two DDP ranks of it under torchrun."""
    script = [sys.executable, "examples/attach_loop.py"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "examples/attach_loop.py"]
    common = ["--steps", "60", "--option", "wait_islands=2", "--option", "run_id=attached"]
    maddr = tmp_path / "a.maddr"
    a = nodes([*common, "--option", f"maddr_file={maddr}"], tmp_path / "a", name="a", command=script if ranks == 1 else torchrun)
    b = nodes([*common, "--shard", "1", "--option", f"join={a.wait_file(maddr, 90)}"], tmp_path / "b", name="b", command=script)
    for node in (a, b):
        assert node.wait_exit(200) == 0, node.stderr()
    for node in (a, b):
        assert [e["step"] for e in node.of("step")] == list(range(1, 61))
        assert any(s["outcome"] == "ok" and s["group_size"] == 2 for s in node.of("sync"))
        assert node.of("summary")[0]["eval_loss"] < node.of("step")[0]["loss"] - 1.0
    assert all(e["tokens"] == ranks * 16 * 64 for e in a.of("step"))  # the island's: every rank's
    if ranks == 2:
        assert a.of("ranks")[0]["param_spread"] == 0.0  # the ranks ended identical
    ga, gb = (tmp_path / n / "checkpoint" / "global.safetensors" for n in "ab")
    assert _max_diff(ga, gb) < 1e-4


@needs_hf
@pytest.mark.network
def test_the_torchrun_example_runs_a_ddp_and_an_fsdp_island(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ISLANDS_")}
    env.update(STEPS="20", PYTHON=sys.executable, PORT_A=str(free_port()), PORT_B=str(free_port()))
    proc = subprocess.Popen(
        ["bash", "examples/torchrun_hf.sh", str(tmp_path)], env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=280)
    finally:  # nothing of the two islands is left behind, whatever happened
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    for name, parallel in (("a", "ddp"), ("b", "fsdp")):
        events = [json.loads(line) for line in (tmp_path / name / "events.jsonl").read_text().splitlines()]
        [ranks] = [e for e in events if e["event"] == "ranks"]
        assert ranks["world"] == 2 and ranks["parallel"] == parallel
        assert events[-1]["event"] == "summary" and events[-1]["steps"] == 20
    assert _max_diff(*(tmp_path / n / "checkpoint" / "global.safetensors" for n in "ab")) < 1e-4
