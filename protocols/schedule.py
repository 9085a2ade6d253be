"""Fragment schedule: pure functions of the step, the window H, P fragments and overlap tau."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


def default_overlap(window: int, num_fragments: int, preferred: int = 5) -> int:
    """The preferred overlap, lowered to the largest integer below H/P for short windows."""
    return max(0, min(preferred, math.ceil(window / num_fragments) - 1))


def check_schedule(window: int, num_fragments: int, overlap: int) -> None:
    """Raise ValueError, naming the option, unless H, P and tau make a valid schedule."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if num_fragments < 1:
        raise ValueError(f"fragments must be >= 1, got {num_fragments}")
    if num_fragments > window:
        raise ValueError(
            f"window {window} cannot be divided into {num_fragments} fragments: "
            f"need window >= fragments"
        )
    if overlap < 0:
        raise ValueError(f"overlap must be >= 0, got {overlap}")
    if overlap * num_fragments >= window:
        raise ValueError(
            f"overlap {overlap} must be below window/fragments = {window / num_fragments:g}"
        )


def fragment_offset(fragment: int, window: int, num_fragments: int) -> int:
    """o_p = floor(p * H / P)."""
    return fragment * window // num_fragments


def fragment_offsets(window: int, num_fragments: int) -> list[int]:
    return [fragment_offset(p, window, num_fragments) for p in range(num_fragments)]


def round_number(step: int, window: int) -> int:
    """The round that a fragment's sync at `step` belongs to (round r starts in window r)."""
    return step // window


def fragments_starting(step: int, window: int, num_fragments: int) -> list[int]:
    """Fragments whose round starts at this step: step % H == o_p and step >= H."""
    if step < window:
        return []
    phase = step % window
    return [p for p in range(num_fragments) if fragment_offset(p, window, num_fragments) == phase]


def next_sync_step(step: int, fragment: int, window: int, num_fragments: int) -> int:
    """The first step after `step` at which `fragment` starts a round."""
    offset = fragment_offset(fragment, window, num_fragments)
    r = max(1, (step - offset) // window + 1)
    return r * window + offset


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What happens at inner step t: the one place that knows the window H, the P fragments and
    the overlap tau. Fragment p's round r starts at step r*H + o_p (r >= 1) and is applied tau
    steps later; the loop, the sync and the checks ask this value, never H and P themselves."""

    window: int
    fragments: int
    overlap: int

    def __post_init__(self):
        check_schedule(self.window, self.fragments, self.overlap)

    @property
    def spacing(self) -> int:
        """Steps between the starts of two consecutive fragments' rounds (at least 1)."""
        return max(1, self.window // self.fragments)

    def offset(self, fragment: int) -> int:
        return fragment_offset(fragment, self.window, self.fragments)

    def starting(self, step: int) -> list[int]:
        """Fragments whose round starts at `step`."""
        return fragments_starting(step, self.window, self.fragments)

    def round_of(self, step: int) -> int:
        """The round number of a round that starts at `step`."""
        return round_number(step, self.window)

    def last_round(self, fragment: int, step: int) -> int:
        """The round of `fragment`'s last start at or before `step` (0: none yet): what an island
        that missed none of them holds, the same on every island that ends at `step`."""
        return max(0, (step - self.offset(fragment)) // self.window)

    def applied_at(self, start: int) -> int:
        """The step after which a round that started at `start` is applied."""
        return start + self.overlap

    def next_start(self, step: int, fragment: int) -> int:
        """The first step after `step` at which `fragment` starts a round."""
        return next_sync_step(step, fragment, self.window, self.fragments)

    def next_starts(self, step: int) -> list[int]:
        return [self.next_start(step, p) for p in range(self.fragments)]

    def next_round(self, step: int) -> tuple[int, int]:
        """(fragment, step) of the next round to start after `step`."""
        return min(enumerate(self.next_starts(step)), key=lambda x: x[1])

    def ends_window(self, step: int) -> bool:
        """`step` is the last of a window (where --balance looks again)."""
        return step % self.window == 0


BALANCE_SLACK = 0.2
"""--balance lowers the accumulation only once a step takes this much longer than the target."""


def balance_accumulation(micro_seconds: float, peer_step_seconds: Sequence[float], current: int, max_accum: int = 16) -> int:
    """Gradient accumulation (micro-batches per inner step) that makes this island's step take about as
    long as the median of the other islands' steps, never longer: islands meet at every round, so a
    faster island would otherwise wait; with more micro-batches it trains on more tokens instead.

    `micro_seconds`: this island's time for one micro-batch; `peer_step_seconds`: the other islands'
    step times (their own accumulation included). Without either, `current` stays."""
    peers = sorted(s for s in peer_step_seconds if s > 0)
    if micro_seconds <= 0 or not peers:
        return current
    mid = len(peers) // 2
    target = peers[mid] if len(peers) % 2 else (peers[mid - 1] + peers[mid]) / 2
    new = max(1, min(max_accum, int(target / micro_seconds + 1e-9)))
    if new < current and current * micro_seconds <= (1 + BALANCE_SLACK) * target:
        return current  # a little over the target is noise (CPU contention), not a reason to flip back
    return new
