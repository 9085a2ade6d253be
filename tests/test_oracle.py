"""The refactor oracle: a fixed-seed solo run gives the recorded `step`, `sync` and final events,
losses bitwise. A change to the trunk that is meant to keep behaviour must keep this log;
one that changes it on purpose records a new one with `ISLANDS_RECORD_ORACLE=1 pytest tests/test_oracle.py`
and says why in its commit."""

import json
import os
from pathlib import Path

import pytest
from islands.node.cli import main

pytestmark = [pytest.mark.network, pytest.mark.timeout(120)]

RECORD = Path(__file__).parent / "data" / "oracle_solo.json"
ARGV = ["--steps", "40", "--window", "10", "--fragments", "2", "--seq-len", "64", "--batch-size", "4",
        "--torch-threads", "1", "--seed", "3", "--progress", "off"]
# what varies with the machine's speed, not with the computation
TIMING = {"t", "step_seconds", "seconds", "compute_seconds", "wall_seconds", "checkpoint"}


def _observed(log: Path) -> dict:
    events = [json.loads(line) for line in log.read_text().splitlines()]

    def strip(e: dict) -> dict:
        return {k: v for k, v in e.items() if k not in TIMING}

    out = {"argv": ARGV}
    for kind in ("step", "sync", "eval", "summary"):
        got = [strip(e) for e in events if e["event"] == kind]
        # rounds finish in their own time: their order in the log among the steps is not the computation's
        out[kind] = sorted(got, key=lambda e: (e.get("step", 0), e.get("fragment", 0)))
    return out


def test_a_fixed_seed_solo_run_gives_the_recorded_events(tmp_path):
    log = tmp_path / "events.jsonl"
    assert main([*ARGV, "--run-dir", str(tmp_path / "run"), "--log-json", str(log)], environ={}) == 0
    observed = _observed(log)
    if os.environ.get("ISLANDS_RECORD_ORACLE"):
        RECORD.write_text(json.dumps(observed, indent=1) + "\n")
    recorded = json.loads(RECORD.read_text())
    assert observed["argv"] == recorded["argv"], "the oracle's options changed: record it again"
    for kind in ("step", "sync", "eval", "summary"):
        # floats from JSON compare exactly: the losses must be the same bits
        assert observed[kind] == recorded[kind], kind
