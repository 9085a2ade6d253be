"""What a site installs: the systemd unit and the example config are valid as shipped."""

import shutil
import subprocess
from pathlib import Path

import pytest
from islands.node.cli import main

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def test_the_example_config_checks_clean():
    assert main(["check-config", str(DEPLOY / "node.example.toml")], environ={}) == 0


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("[diloco]\nwindow = -5\n", "window"),
        ("[net]\nmetrics_port = 70000\n", "metrics_port"),
        ("[net]\nswarm_key = '/nonexistent/key'\n", "swarm_key"),
        ("[diloco]\ncompression = 'zip'\n", "compression"),
        ("[train\nsteps = 1\n", "line"),
    ],
)
def test_a_broken_config_exits_2_naming_the_field(tmp_path, capsys, text, field):
    path = tmp_path / "node.toml"
    path.write_text(text)
    assert main(["check-config", str(path)], environ={}) == 2
    assert field in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_unit_verifies(tmp_path):
    """`systemd-analyze verify`, with ExecStart pointed at this install (it checks the binary exists);
    verify exits 0 on unknown keys too, so any output fails."""
    exe = shutil.which("islands-node") or str(Path(__file__).resolve().parent.parent / ".venv/bin/islands-node")
    unit = (DEPLOY / "islands-node.service").read_text()
    assert "/etc/islands/node.toml" in unit and "StateDirectory=islands" in unit and "User=islands" in unit
    copy = tmp_path / "islands-node.service"
    copy.write_text(unit.replace("/opt/islands/venv/bin/islands-node", exe))
    out = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr
