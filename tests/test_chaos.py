"""The chaos soak's smoke run (bench/chaos.py): three islands and a satellite behind relays, a
fixed-seed schedule of faults for a minute; what an operator checks after a soak must hold."""

import pytest

from bench.chaos import Soak

pytestmark = [pytest.mark.network, pytest.mark.timeout(480)]


def test_a_minute_of_mixed_faults_leaves_no_hang_no_ghost_no_corrupt_checkpoint_and_one_model(tmp_path):
    soak = Soak(tmp_path / "soak", seed=3, minutes=1.0, steps=240, rate=8.0)
    figures = soak.run(8.0)
    assert figures["faults_total"] >= 2, figures["fault_log"]
    assert figures["hangs"] == 0, figures["hang_details"]
    assert figures["unexpected_exits"] == []
    assert figures["ghosts"] == 0
    assert figures["corrupt_checkpoints"] == 0, figures["corrupt_details"]
    assert len(figures["islands_at_end"]) >= 2, figures["islands_at_end"]
    assert figures["max_param_diff"] <= 1e-4
