"""A satellite's contact windows on the node's clock (the schedule itself is pure: protocols/contact.py)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from islands.protocols.contact import ContactSchedule, parse_contact

HANDSHAKE_S = 1.5
"""A satellite deposits only this long after its window opens: by then it has read the islands'
records (whom to deposit with), which it reads at once when the window opens."""


class ContactClock:
    """Where a satellite stands in its contact windows, counted from the node's start."""

    def __init__(self, spec: str, clock: Callable[[], float] = time.monotonic):
        self.schedule: ContactSchedule = parse_contact(spec)
        self._clock = clock
        self.started = clock()

    def elapsed_s(self) -> float:
        return self._clock() - self.started

    def in_contact(self) -> bool:
        return self.schedule.in_contact(self.elapsed_s())

    def remaining_s(self) -> float:
        """Seconds left in the current window (0 out of contact)."""
        return self.schedule.remaining_s(self.elapsed_s())

    def open_for_s(self) -> float:
        """Seconds since the current window opened (0 out of contact)."""
        t = self.elapsed_s()
        window = self.schedule.window_at(t)
        return 0.0 if window is None else (math.inf if window[0] == -math.inf else t - window[0])

    def can_round(self, budget_s: float) -> bool:
        """In contact, past the handshake, and with budget_s of the window left for a round."""
        return self.open_for_s() >= HANDSHAKE_S and self.remaining_s() >= budget_s
