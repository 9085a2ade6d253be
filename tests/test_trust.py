"""A swarm that runs with a swarm key keeps strangers and poisoners out: real processes, real DHT.

Honest islands A and B run with the key and a metrics endpoint; P holds the key
but sends poisoned pseudo-gradients (tests.hostile); X has another key; an
insider writes forged and malformed records into the DHT.
"""

import asyncio
import json
import math
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from islands.node.cli import main as node_main
from islands.node.net.dht import SwarmDHT
from islands.node.net.signing import load_identity
from islands.protocols.admission import load_swarm_key
from safetensors.torch import load_file

from .procs import NODE

pytestmark = [pytest.mark.network, pytest.mark.timeout(300)]

COMMON = ["--window", "20", "--fragments", "4", "--listen", "/ip4/127.0.0.1/tcp/0", "--run-id", "guarded"]
HOSTILE = [sys.executable, "-m", "tests.hostile", "mixed"]


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def _sample(text: str, name: str) -> float:
    """The sum of a metric's samples in a Prometheus text exposition."""
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name) and not line.startswith("#")]
    assert values, f"{name} not exposed"
    return sum(values)


async def _forge(join: str, key: bytes) -> None:
    """An insider (it holds the key) writes records no honest island signed."""
    from hivemind.utils import get_dht_time

    intruder = SwarmDHT.start("guarded", initial_peers=[join], host_maddrs=["/ip4/127.0.0.1/tcp/0"], swarm_key=key)
    try:
        expire = get_dht_time() + 120
        # a record under someone else's name (a plain subkey: nobody's signature)
        assert intruder.dht.store(intruder.islands_key, {"shard": 0, "step": 10**9}, expire, subkey=b"QmSomeoneElse")
        # its own, signed, but nonsense
        assert intruder.dht.store(intruder.islands_key, {"step": "lots", "shard": -3}, expire, subkey=intruder.owner)
        # a manifest of its own that only it signed
        assert await intruder.store_manifest({"run_id": "guarded", "window": 1, "fragments": 1})
    finally:
        intruder.shutdown()


def test_a_keyed_swarm_refuses_strangers_and_bans_a_poisoner(nodes, tmp_path):
    key, wrong = tmp_path / "swarm.key", tmp_path / "other.key"
    assert node_main(["keygen", str(key)]) == 0 and node_main(["keygen", str(wrong)]) == 0
    assert key.stat().st_mode & 0o777 == 0o600

    keyed = [*COMMON, "--swarm-key", str(key), "--steps", "120", "--wait-islands", "3"]
    a = nodes([*keyed, "--metrics-port", "0", "--maddr-file", str(tmp_path / "a.maddr")], tmp_path / "a", name="a")
    join = a.wait_file(tmp_path / "a.maddr", 60)
    b = nodes([*keyed, "--join", join], tmp_path / "b", name="b")
    p = nodes([*keyed, "--join", join], tmp_path / "p", name="p", command=HOSTILE)

    # a stranger with another key gets nowhere, and is told why
    x = nodes([*COMMON, "--swarm-key", str(wrong), "--steps", "40", "--join", join], tmp_path / "x", name="x")
    assert x.wait_exit(90) == 2
    assert "--swarm-key" in x.stderr().strip().splitlines()[-1], x.stderr()
    assert not x.of("sync")
    _, x_id = load_identity(tmp_path / "x" / "identity.key")
    a.wait_for(lambda e: e["event"] == "refused", 30, "a refused event")

    port = a.wait_for(lambda e: e["event"] == "started", 60, "started")["metrics_port"]
    b.wait_for(lambda e: e["event"] == "step" and e["step"] >= 10, 120, "step 10")
    asyncio.run(_forge(join, load_swarm_key(key)))

    status = subprocess.run(
        [*NODE, "status", "--join", join, "--run-id", "guarded", "--swarm-key", str(key), "--json"],
        capture_output=True, text=True, timeout=60,
    )
    assert status.returncode == 0, status.stderr
    shown = json.loads(status.stdout)
    assert shown["manifest"]["window"] == 20  # the majority's manifest, not the insider's
    assert len(shown["islands"]) == 3 and x_id not in shown["islands"]  # the forged and the malformed records are not islands
    assert all(isinstance(r["step"], int) for r in shown["islands"].values())

    # the islands read the records every few seconds: the forged and the malformed ones get counted
    deadline = time.monotonic() + 60
    while True:
        text = _metrics(port)
        dropped = {w: _sample(text, f'islands_records_dropped{{why="{w}"}}') for w in ("forged", "malformed")}
        if all(dropped.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert all(dropped.values()), dropped
    for name in ("islands_step", "islands_loss", "islands_tokens_total", "islands_syncs_total",
                 "islands_bytes_sent_total", "islands_round_seconds", "islands_peers_seen", "islands_refused_total"):
        _sample(text, name)
    assert _sample(text, "islands_refused_total") >= 1

    for node in (a, b):
        assert node.wait_exit(240) == 0, node.stderr()
    p_id = p.wait_for(lambda e: e["event"] == "started", 5, "p started")["peer_id"]
    for node in (a, b):
        syncs = node.of("sync")
        rejected = [s for s in syncs if s["outcome"] == "rejected"]
        assert rejected and all(s["reason"] for s in rejected)
        assert [e["peer"] for e in node.of("banned")] == [p_id]
        # once P is out, the honest pair averages again
        assert any(s["outcome"] == "ok" and s["group_size"] == 2 for s in syncs[-8:]), [(s["outcome"], s["group_size"]) for s in syncs]
        summary = node.of("summary")[0]
        assert math.isfinite(summary["eval_loss"]) and summary["eval_loss"] < 5
    ga, gb = (load_file(tmp_path / n / "checkpoint" / "global.safetensors") for n in "ab")
    assert all(torch.isfinite(t).all() for t in ga.values())
    assert max((ga[k] - gb[k]).abs().max().item() for k in ga) < 1e-4
