"""Real `islands-node` processes for tests: start, wait on events with deadlines, always tear down."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from islands.node.events import EventTail
from islands.node.workers import free_port  # noqa: F401 - the tests' and benchmarks' too

NODE = [sys.executable, "-m", "islands.node"]


class NodeProcess:
    def __init__(self, args: list[str], run_dir: Path, env: dict | None = None, name: str = "node", command: list[str] = NODE):
        """`command`: what runs the node (tests.hostile for a poisoning peer); islands-node by default."""
        self.command = command
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.run_dir / "events.jsonl"
        self.stderr_path = self.run_dir / f"{name}.stderr"
        self.args = ["--run-dir", str(self.run_dir), "--progress", "lines", *args]
        self._stderr = open(self.stderr_path, "ab")
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("ISLANDS_")}
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [*command, *self.args], stdout=subprocess.PIPE, stderr=self._stderr, stdin=subprocess.DEVNULL,
            env=full_env, start_new_session=True,
        )
        self.tail = EventTail(self.log_path)

    @property
    def events(self) -> list[dict]:
        return self.tail.events

    def poll_events(self) -> list[dict]:
        return self.tail.poll()

    def use_log(self, path: Path) -> None:
        self.log_path = Path(path)
        self.tail = EventTail(self.log_path)

    def wait_for(self, predicate: Callable[[dict], bool], timeout_s: float, what: str = "event") -> dict:
        deadline = time.monotonic() + timeout_s
        seen = 0
        while time.monotonic() < deadline:
            events = self.poll_events()
            for e in events[seen:]:
                if predicate(e):
                    return e
            seen = len(events)
            if self.proc.poll() is not None:
                self.poll_events()
                for e in self.events[seen:]:
                    if predicate(e):
                        return e
                raise AssertionError(f"node exited ({self.proc.returncode}) before {what}:\n{self.stderr()}")
            time.sleep(0.05)
        raise AssertionError(f"no {what} within {timeout_s}s:\n{self.stderr()}")

    def wait_file(self, path: Path, timeout_s: float) -> str:
        """The first line of a file the node writes (its --maddr-file), once it exists."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if Path(path).exists():
                return Path(path).read_text().split()[0]
            if self.proc.poll() is not None:
                raise AssertionError(f"node exited ({self.proc.returncode}) before writing {path}:\n{self.stderr()}")
            time.sleep(0.05)
        raise AssertionError(f"no {path} within {timeout_s}s:\n{self.stderr()}")

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node still running after {timeout_s}s:\n{self.stderr()}") from None

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill_tree(self) -> None:
        """SIGKILL the node's whole process group (its daemons included)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill_tree()
        if self.proc.stdout:
            self.proc.stdout.close()
        self._stderr.close()

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def steps(self) -> list[int]:
        return [e["step"] for e in self.poll_events() if e["event"] == "step"]

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.poll_events() if e["event"] == kind]


def split_rounds(nodes: list[NodeProcess]) -> list[str]:
    """Rounds of the own protocol that split among these nodes: for each round a node committed
    (`sync` ok, with its members), every member that is one of these nodes and logged that round
    must have logged it ok with the same members and digest (DESIGN: all or nothing). A restarted
    node's events are its new peer id's from its `started` on."""
    logged: dict[tuple[str, int, int], dict] = {}
    for path in sorted({n.log_path for n in nodes if n.command == NODE}):  # a hostile peer's word does not count
        if not path.exists():
            continue
        peer = None
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue  # a line cut short by a kill
            if e.get("event") == "started":
                peer = e.get("peer_id")
            elif e.get("event") == "sync" and peer is not None and e.get("round") is not None:
                logged[(peer, e["fragment"], e["round"])] = e
    splits = []
    for (peer, fragment, round_), e in sorted(logged.items()):
        if e.get("outcome") != "ok" or not e.get("members"):
            continue
        for member in e["members"]:
            other = logged.get((member, fragment, round_))
            if other is not None and (other.get("outcome"), other.get("digest"), other.get("members")) != ("ok", e["digest"], e["members"]):
                splits.append(f"fragment {fragment} round {round_}: {peer} ok {e['digest']} with {len(e['members'])} members, "
                              f"{member} {other.get('outcome')} {other.get('digest')}")
    return splits


class RelayProcess:
    """`islands-node relay` in front of a node: its port, and SIGSTOP/SIGCONT for a partition."""

    def __init__(self, to_port: int, run_dir: Path, extra: list[str] | None = None, to_host: str = "127.0.0.1"):
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        port_file = run_dir / "relay.port"
        self._stderr = open(run_dir / "relay.stderr", "ab")
        self.proc = subprocess.Popen(
            [*NODE, "relay", "--to", f"{to_host}:{to_port}", "--port-file", str(port_file), *(extra or [])],
            stdout=subprocess.DEVNULL, stderr=self._stderr, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"relay did not start ({self.proc.poll()})")
            time.sleep(0.05)
        self.port = int(port_file.read_text())

    @property
    def maddr(self) -> str:
        return f"/ip4/127.0.0.1/tcp/{self.port}"

    def cut(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def heal(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM (the relay writes its final --stats-file), SIGKILL if it does not go."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait(timeout=10)
        self._stderr.close()


class Nodes:
    """Named node processes (and the relays in front of them) under one folder, stopped together:
    the launcher of the benchmarks, which run outside pytest's fixtures."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.started: list[NodeProcess] = []
        self.relays: list[RelayProcess] = []
        self.links: dict[str, list[RelayProcess]] = {}
        """name -> the relays in front of that node (its DHT's and its rounds')."""

    def start(
        self, name: str, args: list[str], relay: list[str] | None = None, command: list[str] = NODE, host: str = "127.0.0.1",
        relay_root: Path | None = None,
    ) -> NodeProcess:
        """With `relay` (the relay's options), the node listens on a fresh port of `host` behind a relay and
        announces it, and its rounds' transport (`--data-listen`) behind a second one with the same
        options; the relays' files go to `relay_root / name` (default: the node's folder);
        `command`: what runs it (tests.hostile for a hostile peer)."""
        if relay is not None:
            port, data_port = free_port(), free_port()
            where = (relay_root or self.root) / name
            link = RelayProcess(port, where, [*relay, "--stats-file", str(where / "relay.json")], to_host=host)
            data = RelayProcess(data_port, where / "data-relay", [*relay, "--stats-file", str(where / "relay-data.json")], to_host=host)
            self.relays += [link, data]
            self.links[name] = [link, data]
            args = [*args, "--listen", f"/ip4/{host}/tcp/{port}", "--announce", link.maddr,
                    "--data-listen", f"{host}:{data_port}", "--data-announce", f"127.0.0.1:{data.port}"]
        node = NodeProcess(args, self.root / name, name=name, command=command)
        node.t_start = time.time()
        self.started.append(node)
        return node

    def first(self, name: str, args: list[str], relay: list[str] | None = None) -> tuple[NodeProcess, str]:
        """The node that starts the swarm, and the address the others join."""
        maddr = self.root / f"{name}.maddr"
        node = self.start(name, [*args, "--maddr-file", str(maddr)], relay)
        return node, node.wait_file(maddr, 60)

    def finish(self, nodes: list[NodeProcess], timeout_s: float) -> None:
        """Wait for these nodes to exit; RuntimeError (with its stderr) for one that exits non-zero."""
        for node in nodes:
            code = node.wait_exit(timeout_s)
            if code != 0:
                raise RuntimeError(f"{node.run_dir.name}: exited {code}:\n{node.stderr()}")

    def link_bytes(self, names: list[str]) -> int:
        """Bytes the relays in front of these nodes forwarded, both ways (read once they stopped)."""
        files = [self.root / n / f for n in names for f in ("relay.json", "relay-data.json")]
        stats = [json.loads(f.read_text()) for f in files if f.exists()]
        return sum(r["to_node"] + r["from_node"] for r in stats)

    def stop(self) -> None:
        for node in self.started:
            node.stop()
        for link in self.relays:
            link.stop()
