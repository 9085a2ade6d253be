"""Checks on what comes back from a round, and who is to blame when it is bad. Pure.

What a round returns is the token-weighted mean of the members' pseudo-gradients,
`avg = Σ w_i Δ_i / Σ w_i`: a convex combination, so `‖avg‖ ≤ max_i ‖Δ_i‖`. Honest
islands of one run train the same model with the same inner optimizer, learning
rate schedule and window, so their pseudo-gradients have norms of the same order
(measured: bench/README.md, "A hostile peer"). An average far above this
island's own norm, or above the norms it accepted recently, cannot come from
honest members: someone sent a huge update, claimed a huge weight, or — as
reducer of one part of the vector in hivemind's butterfly all-reduce — returned
garbage for that part. Each of these ends up in the result, which is what is
checked: finite, the right shapes and dtype, and a norm within `NORM_RATIO` of
the reference; every member of a round runs every member's check on the same
result, with the references the members carry in their parts (`round_verdict`),
so a round is applied by all its members or by none. Each member's reduced part
is checked too (`spoiled_spans`), which names the reducer to blame. A consensus round (the agreed values themselves averaged
again) must land close to this island's own agreed values (`consensus_bound`).

What is not caught: a member, or a reducer for its part, that stays within the
bound. It can bias a round by at most NORM_RATIO times an honest update.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

import torch

NORM_RATIO = 4.0
"""An averaged pseudo-gradient may be at most this many times the reference norm (max of this
island's own and the median of recently accepted averages). Convexity gives at most the largest
member's norm; measured |avg| / |own| in honest rounds: 0.53 to 0.88 (bench.hostile), so 4 leaves
room for islands whose updates are larger than this one's."""
HISTORY = 16
DRIFT_RATIO = 0.1
"""How far a consensus round may move this island's agreed values, as a fraction of their norm
(unless NORM_RATIO accepted updates are more: consensus_bound)."""


def tensors_norm(values: Iterable[torch.Tensor]) -> float:
    total = 0.0
    for t in values:
        total += float(t.detach().double().pow(2).sum())
    return math.sqrt(total) if math.isfinite(total) else math.inf


def problem(values: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor]) -> str | None:
    """Why `values` cannot stand in for `like` (names, shapes, dtype, finiteness), or None."""
    if set(values) != set(like):
        return "tensor names differ"
    for name, ref in like.items():
        t = values[name]
        if not isinstance(t, torch.Tensor) or t.shape != ref.shape:
            return f"{name}: shape {tuple(getattr(t, 'shape', ()))} instead of {tuple(ref.shape)}"
        if t.dtype != ref.dtype:
            return f"{name}: dtype {t.dtype} instead of {ref.dtype}"
        if not torch.isfinite(t).all():
            return f"{name}: non-finite values"
    return None


@dataclasses.dataclass
class NormHistory:
    """The norms of the averaged pseudo-gradients one fragment accepted recently."""

    norms: deque = dataclasses.field(default_factory=lambda: deque(maxlen=HISTORY))

    def reference(self, own_norm: float) -> float:
        """What an update's norm is compared with: the recent accepted norms' median, or this
        island's own update's norm if larger; 0 when it has neither (nothing to judge by)."""
        if not self.norms:
            return own_norm
        return max(own_norm, statistics.median(self.norms))

    def accept(self, norm: float) -> None:
        self.norms.append(norm)

    def seed(self, norms: object) -> int:
        """Take a donor's recent accepted norms (a joiner's state download carries them), unless
        this history has its own: a joiner then judges its first rounds as the swarm does, not
        by its own update alone, which covers only the steps since it joined. Keeps the finite
        positive numbers of a list; returns how many it took."""
        if self.norms or not isinstance(norms, list):
            return 0
        good = [float(n) for n in norms if _number(n) and math.isfinite(n) and n > 0]
        self.norms.extend(good[-HISTORY:])
        return len(self.norms)


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_update(
    averaged: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor], history: NormHistory,
    ratio: float = NORM_RATIO,
) -> tuple[str | None, float]:
    """(why the averaged pseudo-gradient is rejected by this island's own check or None, its
    norm): round_verdict with this island the only judge."""
    why, norm, _ = round_verdict(averaged, own, {"this island": history.reference(tensors_norm(own.values()))}, ratio)
    return why, norm


def round_verdict(
    averaged: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor], references: Mapping[str, object],
    ratio: float = NORM_RATIO,
) -> tuple[str | None, float, list[str]]:
    """A committed round's verdict, the same on every member: (why its averaged pseudo-gradient
    is rejected or None, its norm, the members whose check rejects it).

    A member's check: the result is finite and like `own` (names, shapes, dtype: one layout for
    the run), and its norm is at most `ratio` times that member's reference
    (`NormHistory.reference` of its own update, carried in its part's metadata; 0 when it has
    nothing to judge by; anything but a finite number >= 0 rejects). Every member holds the same
    result and the same references, so each computes every member's check and applies the
    result only if none rejects it: a round is applied by all its members or by none."""
    why = problem(averaged, own)
    if why is not None:
        return why, math.nan, []
    norm = tensors_norm(averaged.values())
    judges, bound = [], math.inf
    for peer in sorted(references):
        ref = references[peer]
        if not _number(ref) or not math.isfinite(ref) or ref < 0:
            judges.append(peer)
            bound = 0.0
        elif ref > 0 and norm > ratio * ref:
            judges.append(peer)
            bound = min(bound, ratio * ref)
    if not judges:
        return None, norm, []
    return f"norm {norm:.4g} above {bound:.4g} ({ratio:g}x the reference of {', '.join(judges)})", norm, judges


def check_deposit(
    deposit: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor], history: NormHistory, staleness: int,
    ratio: float = NORM_RATIO,
) -> str | None:
    """Why a satellite's deposited pseudo-gradient is refused, or None: not like `own` (names,
    shapes, dtype, finite), or a norm above `ratio` times the reference (as check_update) times
    1 + staleness: a satellite's delta is its progress over the 1 + staleness windows since its
    base, about that many times an island's."""
    why = problem(deposit, own)
    if why is not None:
        return why
    norm = tensors_norm(deposit.values())
    bound = ratio * (1 + max(0, staleness)) * history.reference(tensors_norm(own.values()))
    if norm > bound:
        return f"norm {norm:.4g} above {bound:.4g}"
    return None


def consensus_bound(agreed_norm: float, update_reference: float, apart: float = 0.0) -> float:
    """How far a consensus re-average may move this island's agreed values (or momentum):
    `DRIFT_RATIO` of their norm, `NORM_RATIO` typical accepted updates, or `NORM_RATIO` times
    `apart`, whichever is more.

    Honest islands drift apart by the updates they applied separately (a rejected round,
    a partition), so the bound follows the update scale. `apart` is the path this island's
    values travelled alone since they last agreed with others' (DiLoCo's `apart`): after a
    partition of many rounds, two sides are at most their two paths apart, and a consensus of
    n members moves this island by (n-1)/n of its distance to the others' mean, so an honest
    other side whose path is up to about 2 * NORM_RATIO - 1 times this island's is accepted.
    A member that sends values from nowhere near the swarm's moves the average much further;
    what an island that was cut off for long cannot tell is a poisoner within its path's reach."""
    return max(DRIFT_RATIO * agreed_norm, NORM_RATIO * update_reference, NORM_RATIO * apart)


def flatten(values: Iterable[torch.Tensor]) -> torch.Tensor:
    """Tensors as one float vector, in the order given (the averager's)."""
    return torch.cat([v.detach().reshape(-1).float() for v in values])


def unflatten(flat: torch.Tensor, names: Sequence[str], like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`flatten`'s inverse: the tensors named `names`, shaped as in `like`, as views of `flat`."""
    out, at = {}, 0
    for n in names:
        k = like[n].numel()
        out[n] = flat[at : at + k].view_as(like[n])
        at += k
    return out


def spoiled_spans(
    averaged: torch.Tensor, own: torch.Tensor, spans: Mapping[str, Sequence[Sequence[int]]], reference: float,
    ratio: float = NORM_RATIO,
) -> list[str]:
    """The members whose reduced part of the averaged vector is non-finite or out of bounds.

    In hivemind's butterfly all-reduce every member averages one part of the vector
    (its `span`: [start, end) ranges) for the whole group, and the others take that
    part as it comes back. A malicious reducer can return anything there. Honest
    averaging never makes a part larger than its members' parts, so a part is out
    of bounds if its norm exceeds `ratio` times this island's own part, or the
    reference norm's share of it (sqrt of the fraction of elements), whichever is
    larger. What a reducer can still do undetected is move its part within that
    bound for one round."""
    total = max(own.numel(), 1)
    bad = []
    for peer, ranges in spans.items():
        try:
            index = [slice(int(a), int(b)) for a, b in ranges if 0 <= int(a) < int(b) <= own.numel()]
        except (TypeError, ValueError):
            continue
        if not index:
            continue
        part = torch.cat([averaged[i] for i in index])
        mine = torch.cat([own[i] for i in index])
        if not torch.isfinite(part).all():
            bad.append(peer)
            continue
        bound = ratio * max(float(mine.norm()), reference * math.sqrt(part.numel() / total))
        if float(part.norm()) > bound + 1e-12:
            bad.append(peer)
    return bad


def check_consensus(averaged: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor], bound: float) -> str | None:
    """Why re-averaged agreed values (or momentum) are rejected, or None: not like `own`, or
    moved further than `bound` (consensus_bound)."""
    why = problem(averaged, own)
    if why is not None:
        return why
    drift = tensors_norm(averaged[n] - own[n] for n in own)
    if drift > bound + 1e-12:
        return f"moves the values by {drift:.4g}, above the bound {bound:.4g}"
    return None


def member_report_bad(meta: object, reference: float, ratio: float = NORM_RATIO) -> bool:
    """Whether a member's own report of its contribution (`norm`, `weight` in its gathered metadata)
    already shows it bad: missing, non-finite, or out of bounds."""
    if not isinstance(meta, Mapping):
        return True
    try:
        norm, weight = float(meta["norm"]), float(meta["weight"])
    except (KeyError, TypeError, ValueError):
        return True
    return not (math.isfinite(norm) and math.isfinite(weight)) or norm > ratio * reference or weight < 0


BAN_AFTER = 3
"""Rejected rounds blamed on one peer (without an accepted round with it in between) before it is banned."""
FLAGRANT_RATIO = 100.0
"""A member whose own part is not finite or this many times the reference norm is banned at its
first rejected round: no honest update is that far off (honest members' norms stay within a few
times one another's: NORM_RATIO), so waiting for BAN_AFTER rounds only lets it spoil more (the
chaos soak: a poisoner spoiled a round of each of three fragments before its ban)."""


def member_flagrant(meta: object, reference: float) -> bool:
    """Whether a member's part (its `norm` and `weight`, as member_report_bad reads them) is so far
    off that one rejected round is proof enough: not finite, or FLAGRANT_RATIO times the reference —
    both as reported and as this island `measured` it itself (a reduce-scatter's other reducers
    report the rest of a member's norm, and one of them could frame it); no measure: not flagrant."""
    if not isinstance(meta, Mapping) or meta.get("measured") is None:
        return False
    return member_report_bad(meta, reference, FLAGRANT_RATIO) and member_report_bad({**meta, "norm": meta["measured"]}, reference, FLAGRANT_RATIO)
BAN_S = 600.0
TRUST_S = 300.0
"""A peer with which this island had an accepted round this recently is not blamed for a bad round
whose bad member is unknown (a member that lies about its own contribution)."""


@dataclasses.dataclass
class Reputation:
    """Which peers spoil rounds: strikes per peer, bans with an expiry, trust from good rounds."""

    strikes: dict[str, int] = dataclasses.field(default_factory=dict)
    banned_until: dict[str, float] = dataclasses.field(default_factory=dict)
    good_at: dict[str, float] = dataclasses.field(default_factory=dict)

    def accepted(self, peers: Iterable[str], now: float) -> None:
        for p in peers:
            self.strikes.pop(p, None)
            self.good_at[p] = now

    def blame(self, reported_bad: Iterable[str], others: Iterable[str], now: float, flagrant: Iterable[str] = ()) -> list[str]:
        """A rejected round: strike the members whose reports show them bad, or, if none does, the
        other members not trusted lately; `flagrant` ones (member_flagrant) are banned at once.
        Returns the peers banned by this call."""
        suspects = list(reported_bad) or [p for p in others if now - self.good_at.get(p, -math.inf) > TRUST_S]
        flagrant = set(flagrant)
        newly = []
        for p in dict.fromkeys([*suspects, *sorted(flagrant)]):
            self.strikes[p] = self.strikes.get(p, 0) + 1
            if (self.strikes[p] >= BAN_AFTER or p in flagrant) and not self.is_banned(p, now):
                self.banned_until[p] = now + BAN_S
                self.strikes[p] = 0
                newly.append(p)
        return newly

    def is_banned(self, peer: str, now: float) -> bool:
        return self.banned_until.get(peer, -math.inf) > now

    def banned(self, now: float) -> list[str]:
        return sorted(p for p, t in self.banned_until.items() if t > now)
