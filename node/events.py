"""The JSON-lines event log (`--log-json`): one object a line, each with `t` and `event`."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def _clean(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def rotate(path: Path) -> Path | None:
    """Move a non-empty log aside as PATH.1, PATH.2, ... so that this run's log starts fresh."""
    if not path.exists() or path.stat().st_size == 0:
        return None
    n = 1
    while path.with_name(f"{path.name}.{n}").exists():
        n += 1
    target = path.with_name(f"{path.name}.{n}")
    path.rename(target)
    return target


class EventLog:
    """Appends events, each line in one unbuffered write, so a crash loses at most the line being
    written. A line the disk does not take (full) is dropped, counted, and said once per outage:
    the node goes on, and when there is room again the log resumes with a `log_gap` event (how
    many events were dropped, from when) before the next one."""

    def __init__(self, path: str | os.PathLike | None, clock=time.time):
        self._clock = clock
        self._file = None
        self.dropped = 0
        """Events dropped in all, over every outage."""
        self._gap: tuple[float, int] | None = None
        """(time of the first dropped event, events dropped) of the outage under way."""
        self._cut = False
        """The last write put part of a line in the file."""
        if path is not None:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "ab", buffering=0)

    def emit(self, event: str, **fields: Any) -> dict:
        record = {"t": round(self._clock(), 6), "event": event, **_clean(fields)}
        if self._file is not None:
            line = self._line(record)
            if self._gap is not None:
                since, n = self._gap
                line = self._line({"t": record["t"], "event": "log_gap", "dropped": n, "since": since}) + line
            if self._cut:
                # the line the outage cut short ends here, so that the next one parses
                line = b"\n" + line
            try:
                written = self._file.write(line)
            except OSError as e:
                written, error = 0, e
            else:
                error = None if written == len(line) else OSError("the line was written in part")
            if error is None:
                self._gap, self._cut = None, False
            else:
                self.dropped += 1
                self._cut = self._cut or written > 0
                if self._gap is None:
                    logger.warning("the event log cannot be written (%s): events are dropped until it can", error)
                    self._gap = (record["t"], 1)
                else:
                    self._gap = (self._gap[0], self._gap[1] + 1)
        return record

    @staticmethod
    def _line(record: dict) -> bytes:
        return (json.dumps(record, separators=(",", ":")) + "\n").encode()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class EventTail:
    """Follows a growing event log, returning complete new events on each poll.

    When the log is rotated (a resumed node moves the old one aside), it starts
    over on the new file: `events` are then the new run's."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._offset = 0
        self._inode: int | None = None
        self.events: list[dict] = []

    def poll(self) -> list[dict]:
        """Every event so far (new ones appended)."""
        try:
            with open(self.path, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                if inode != self._inode:
                    self._inode, self._offset, self.events = inode, 0, []
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.events
        end = chunk.rfind(b"\n") + 1
        self._offset += end
        for line in chunk[:end].splitlines():
            try:
                self.events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return self.events

    @classmethod
    def read(cls, path: str | os.PathLike) -> list[dict]:
        """All complete events of a log as it is now (a torn last line is skipped)."""
        if not Path(path).exists():
            raise FileNotFoundError(path)
        return cls(path).poll()

    def last(self, kind: str) -> dict | None:
        return next((e for e in reversed(self.events) if e["event"] == kind), None)

    def count(self, kind: str, **match) -> int:
        return sum(1 for e in self.events if e["event"] == kind and all(e.get(k) == v for k, v in match.items()))
