"""A satellite's contact windows: when it can reach the swarm. Pure: times come in as arguments.

`--contact SPEC`, times in seconds since the node started:

- ``up 20s every 60s``: in contact for 20 s at the start of every 60 s;
  ``up 20s every 60s after 30s`` shifts the windows 30 s later.
- ``0-20,60-80,150-170``: explicit windows (start-end), out of contact after the last.
- ``always``: in contact all the time (a satellite that behaves like a late, weak island).

Units: a number may end in ``s``, ``m`` or ``h``; bare numbers are seconds.
"""

from __future__ import annotations

import dataclasses
import math
import re

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "": 1.0}
_DURATION = r"(\d+(?:\.\d+)?)\s*([smh]?)"
_PERIODIC = re.compile(rf"^up\s+{_DURATION}\s+every\s+{_DURATION}(?:\s+after\s+{_DURATION})?$")


@dataclasses.dataclass(frozen=True)
class ContactSchedule:
    """Periodic windows (`up_s` every `period_s` from `after_s`), or explicit `windows`."""

    up_s: float = 0.0
    period_s: float = 0.0
    after_s: float = 0.0
    windows: tuple[tuple[float, float], ...] = ()
    always: bool = False

    def window_at(self, t_s: float) -> tuple[float, float] | None:
        """(start, end) of the contact window that holds time t_s, or None when out of contact."""
        if self.always:
            return (-math.inf, math.inf)
        if self.period_s:
            if t_s < self.after_s:
                return None
            start = self.after_s + math.floor((t_s - self.after_s) / self.period_s) * self.period_s
            return (start, start + self.up_s) if t_s < start + self.up_s else None
        return next(((a, b) for a, b in self.windows if a <= t_s < b), None)

    def in_contact(self, t_s: float) -> bool:
        return self.window_at(t_s) is not None

    def remaining_s(self, t_s: float) -> float:
        """Seconds left in the current window (0 out of contact, inf for `always`)."""
        w = self.window_at(t_s)
        return 0.0 if w is None else w[1] - t_s

    def next_start_s(self, t_s: float) -> float | None:
        """When the next window opens after t_s (t_s itself if in contact); None if never again."""
        if self.in_contact(t_s):
            return t_s
        if self.period_s:
            if t_s < self.after_s:
                return self.after_s
            return self.after_s + (math.floor((t_s - self.after_s) / self.period_s) + 1) * self.period_s
        return next((a for a, _ in self.windows if a > t_s), None)


def _seconds(number: str, unit: str) -> float:
    return float(number) * _UNITS[unit]


def parse_contact(spec: str) -> ContactSchedule:
    """The schedule of a `--contact` spec; ValueError, saying what is wrong, if it is not one."""
    text = " ".join(str(spec).lower().split())
    if text == "always":
        return ContactSchedule(always=True)
    m = _PERIODIC.match(text)
    if m:
        up = _seconds(m.group(1), m.group(2))
        period = _seconds(m.group(3), m.group(4))
        after = _seconds(m.group(5), m.group(6)) if m.group(5) else 0.0
        if not 0 < up <= period:
            raise ValueError(f"contact {spec!r}: need 0 < up <= every, got up {up:g}s every {period:g}s")
        return ContactSchedule(up_s=up, period_s=period, after_s=after)
    windows = []
    for part in (p.strip() for p in text.split(",")):
        w = re.fullmatch(rf"{_DURATION}\s*-\s*{_DURATION}", part)
        if not w:
            raise ValueError(
                f"contact {spec!r} is not 'up 20s every 60s [after 10s]', 'always', or windows like '0-20,60-80'"
            )
        a, b = _seconds(w.group(1), w.group(2)), _seconds(w.group(3), w.group(4))
        if b <= a or (windows and a < windows[-1][1]):
            raise ValueError(f"contact {spec!r}: windows must be increasing and not overlap ({part!r})")
        windows.append((a, b))
    return ContactSchedule(windows=tuple(windows))
