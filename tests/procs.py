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

NODE = [sys.executable, "-m", "islands.node"]


class NodeProcess:
    def __init__(self, args: list[str], run_dir: Path, env: dict | None = None, name: str = "node"):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.run_dir / "events.jsonl"
        self.stderr_path = self.run_dir / f"{name}.stderr"
        self.args = ["--run-dir", str(self.run_dir), "--progress", "lines", *args]
        self._stderr = open(self.stderr_path, "ab")
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("ISLANDS_")}
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [*NODE, *self.args], stdout=subprocess.PIPE, stderr=self._stderr, stdin=subprocess.DEVNULL,
            env=full_env, start_new_session=True,
        )
        self._offset = 0
        self.events: list[dict] = []

    def poll_events(self) -> list[dict]:
        if self.log_path.exists():
            with open(self.log_path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1
            self._offset += end
            for line in chunk[:end].splitlines():
                self.events.append(json.loads(line))
        return self.events

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
