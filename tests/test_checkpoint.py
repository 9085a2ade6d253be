"""Checkpoints: atomic swap, recovery after a crash mid-swap, refusal of truncated or foreign ones."""

import json

import pytest
import torch
from islands.node import checkpoint as ck


def _ckpt(step=5, manifest=None):
    t = {"a": torch.arange(4.0), "b": torch.ones(2, 2)}
    return ck.Checkpoint(
        step=step,
        manifest=manifest or {"run_id": "r", "window": 20},
        global_state=t,
        local_state={k: v + 1 for k, v in t.items()},
        outer_state={k: v * 0 for k, v in t.items()},
        inner_opt_state={"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        fragments=[{"round": 1, "tokens_since_sync": 10, "syncs": {"solo": 1}}],
        totals={"tokens": 10},
        inner_opt="adamw",
    )


def test_round_trip(tmp_path):
    ck.save(tmp_path, _ckpt())
    got = ck.load(tmp_path, {"run_id": "r", "window": 20})
    assert got.step == 5 and torch.equal(got.local_state["a"], torch.arange(4.0) + 1)
    assert got.inner_opt_state["param_groups"][0]["lr"] == 0.1
    assert (tmp_path / "checkpoint" / "global.safetensors").stat().st_mode & 0o077 == 0


def test_no_checkpoint_is_none(tmp_path):
    assert ck.load(tmp_path, {}) is None


def test_second_save_replaces_first(tmp_path):
    ck.save(tmp_path, _ckpt(step=5))
    ck.save(tmp_path, _ckpt(step=9))
    assert ck.load(tmp_path, {"run_id": "r", "window": 20}).step == 9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]


@pytest.mark.parametrize("leftover", ["checkpoint.new", "checkpoint.old"])
def test_crash_between_renames_recovers(tmp_path, leftover):
    ck.save(tmp_path, _ckpt(step=7))
    (tmp_path / "checkpoint").rename(tmp_path / leftover)
    assert ck.load(tmp_path, {"run_id": "r", "window": 20}).step == 7


def test_truncated_checkpoint_is_refused_and_left_untouched(tmp_path):
    ck.save(tmp_path, _ckpt())
    f = tmp_path / "checkpoint" / "local.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ck.CheckpointError, match="local.safetensors is truncated"):
        ck.load(tmp_path, {"run_id": "r", "window": 20})
    assert f.read_bytes() == data[: len(data) // 2]


def test_corrupt_state_json(tmp_path):
    ck.save(tmp_path, _ckpt())
    (tmp_path / "checkpoint" / "state.json").write_text('{"format": 1, "st')
    with pytest.raises(ck.CheckpointError, match="state.json is truncated or corrupt"):
        ck.load(tmp_path, {})


def test_altered_bytes_fail_the_checksum(tmp_path):
    ck.save(tmp_path, _ckpt())
    f = tmp_path / "checkpoint" / "global.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointError, match="checksum"):
        ck.load(tmp_path, {"run_id": "r", "window": 20})


def test_foreign_checkpoint_names_the_field(tmp_path):
    ck.save(tmp_path, _ckpt())
    before = (tmp_path / "checkpoint" / "state.json").read_text()
    with pytest.raises(ck.CheckpointError, match="window: this node has 40, the checkpoint has 20"):
        ck.load(tmp_path, {"run_id": "r", "window": 40})
    assert (tmp_path / "checkpoint" / "state.json").read_text() == before
    assert json.loads(before)["step"] == 5


def test_optimizer_state_refuses_foreign_pickles(tmp_path):
    import argparse
    import io

    buf = io.BytesIO()
    torch.save({"x": argparse.Namespace(a=1)}, buf)
    with pytest.raises(ck.CheckpointError, match="not optimizer state"):
        ck._load_optimizer_state(buf.getvalue())


def test_a_save_the_disk_does_not_take_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """A full disk (ENOSPC) in the middle of writing the new checkpoint: the error reaches the
    caller (the node says so and goes on), the previous checkpoint loads as it was, and no
    half-written `checkpoint.new` is left to fill the disk further."""
    import errno

    ck.save(tmp_path, _ckpt(step=5))
    real, calls = ck._fsync_write, []

    def full(path, data, mode=0o600):
        calls.append(path.name)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data, mode)

    monkeypatch.setattr(ck, "_fsync_write", full)
    with pytest.raises(OSError, match="No space"):
        ck.save(tmp_path, _ckpt(step=9))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
    assert ck.load(tmp_path, {"run_id": "r", "window": 20}).step == 5


def test_a_damaged_checkpoint_set_aside_leaves_the_run_dir_without_one(tmp_path):
    ck.save(tmp_path, _ckpt(step=5))
    ck.save(tmp_path / "older", _ckpt(step=1))
    (tmp_path / "older" / "checkpoint").rename(tmp_path / "checkpoint.corrupt")
    f = tmp_path / "checkpoint" / "global.safetensors"
    f.write_bytes(f.read_bytes()[:10])
    with pytest.raises(ck.CheckpointError) as e:
        ck.load(tmp_path, {"run_id": "r", "window": 20})
    assert not isinstance(e.value, ck.ForeignCheckpoint)
    assert ck.set_aside(tmp_path) == tmp_path / "checkpoint.corrupt"
    assert ck.load(tmp_path, {"run_id": "r", "window": 20}) is None
    assert (tmp_path / "checkpoint.corrupt" / "global.safetensors").stat().st_size == 10  # the newer one, for a look
    ck.save(tmp_path, _ckpt(step=5))
    with pytest.raises(ck.ForeignCheckpoint):
        ck.load(tmp_path, {"run_id": "r", "window": 40})


def test_the_event_log_drops_what_a_full_disk_does_not_take_and_says_so_when_it_has_room(tmp_path):
    import errno

    from islands.node.events import EventLog, EventTail

    log = EventLog(tmp_path / "events.jsonl", clock=iter(range(1, 10)).__next__)
    log.emit("step", step=1)
    real = log._file

    class Full:
        """Takes the first bytes of a line, then nothing."""

        def __init__(self):
            self.room = 7

        def write(self, data):
            if not self.room:
                raise OSError(errno.ENOSPC, "No space left on device")
            n, self.room = min(self.room, len(data)), 0
            return real.write(data[:n])

    log._file = Full()
    log.emit("step", step=2)
    log.emit("step", step=3)
    log._file = real
    log.emit("step", step=4)
    log.close()
    assert log.dropped == 2
    lines = (tmp_path / "events.jsonl").read_bytes().splitlines()
    assert lines[1] == b'{"t":2,'  # the line the disk cut short ends on its own
    events = EventTail.read(tmp_path / "events.jsonl")
    assert [(e["event"], e.get("step"), e.get("dropped"), e.get("since")) for e in events] == [
        ("step", 1, None, None), ("log_gap", None, 2, 2), ("step", 4, None, None),
    ]
