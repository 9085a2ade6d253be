"""Streaming DiLoCo state of one island: agreed fragments, outer momentum, token counters.

No clocks, no sockets: the node decides when to call `contribution` and
`apply` (by the schedule), and how the contributions are averaged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, get_args

import torch

from . import PROTOCOL_VERSION
from .consensus import fingerprint, fragment_fingerprint
from .outer import contribution_weight, mix, nesterov_outer_step, outer_hyper, pseudo_gradient
from .parts import roundtrip
from .schedule import Schedule, check_schedule, default_overlap
from .validation import flatten, tensors_norm, unflatten

Compression = Literal["none", "fp16", "int8", "int4", "fp4", "int2"]
FEEDBACK_INT2 = 0.95
"""The default decay of the error feedback of 2-bit contributions (MuLoCo, SparseLoCo: 0.9-0.95)."""
Outcome = Literal["ok", "solo", "failed", "skipped_no_contact", "rejected"]
OUTCOMES: tuple[str, ...] = get_args(Outcome)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiLoCoConfig:
    window: int = dataclasses.field(default=50, metadata={"help": "H: inner steps per window; each fragment syncs once a window"})
    fragments: int = dataclasses.field(default=4, metadata={"help": "P: strided fragments the model is cut into (at most its blocks)"})
    overlap: int | None = dataclasses.field(
        default=None, metadata={"help": "tau: steps between a round's start and its application, below H/P (default 5, lowered to fit)"}
    )
    alpha: float = dataclasses.field(default=0.5, metadata={"help": "mixing: local <- alpha*local + (1-alpha)*global (0 replaces)"})
    outer_lr: float = dataclasses.field(default=0.7, metadata={"help": "outer Nesterov SGD learning rate"})
    outer_momentum: float = dataclasses.field(default=0.9, metadata={"help": "outer Nesterov SGD momentum"})
    outer_warmup: int = dataclasses.field(
        default=0, metadata={
            "help": "rounds over which each fragment's outer step goes from plain averaging (lr 1, momentum 0) "
            "to --outer-lr and --outer-momentum (0: none)", "metavar": "ROUNDS",
        },
    )
    compression: Compression = dataclasses.field(default="none", metadata={"help": "pseudo-gradients on the wire"})
    error_feedback: float | None = dataclasses.field(
        default=None, metadata={
            "help": "keep what the codec lost of each contribution and add it, times this decay, to the next one "
            "(0: off; default 0.95 with int2, 0 otherwise)", "metavar": "DECAY",
        },
    )
    seed: int = dataclasses.field(default=0, metadata={"help": "initialisation seed, shared by the whole run"})

    def __post_init__(self):
        check_schedule(self.window, self.fragments, self.tau)
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.outer_lr <= 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.outer_warmup < 0:
            raise ValueError(f"outer_warmup must be >= 0, got {self.outer_warmup}")
        if self.compression not in get_args(Compression):
            raise ValueError(f"compression must be one of {', '.join(get_args(Compression))}, got {self.compression!r}")
        if self.error_feedback is not None and not 0.0 <= self.error_feedback <= 1.0:
            raise ValueError(f"error_feedback must be in [0, 1], got {self.error_feedback}")
        if self.feedback and self.compression == "none":
            raise ValueError("error_feedback needs a lossy --compression (fp16, int8, int4, fp4, int2)")

    @property
    def feedback(self) -> float:
        """The decay of the codec's error carried to the next contribution (0: none)."""
        if self.error_feedback is not None:
            return self.error_feedback
        return FEEDBACK_INT2 if self.compression == "int2" else 0.0

    @property
    def tau(self) -> int:
        return default_overlap(self.window, self.fragments) if self.overlap is None else self.overlap

    @property
    def schedule(self) -> Schedule:
        return Schedule(self.window, self.fragments, self.tau)

    def manifest_fields(self) -> dict:
        """The hyper-parameters every island of a run must share."""
        return {
            "protocol_version": PROTOCOL_VERSION,
            "window": self.window,
            "fragments": self.fragments,
            "overlap": self.tau,
            "alpha": self.alpha,
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "seed": self.seed,
        } | ({"outer_warmup": self.outer_warmup} if self.outer_warmup else {})


@dataclasses.dataclass
class Contribution:
    """What an island brings to one round of one fragment."""

    fragment: int
    round: int
    step: int
    delta: dict[str, torch.Tensor]
    weight: float
    fingerprint: list[float] = dataclasses.field(default_factory=list)
    """Of the agreed values the delta was taken against (see consensus.py)."""
    staleness: int = 0
    """Rounds of this fragment the island missed (it joined, restarted or was cut off, or is a
    satellite out of contact): its base is not the swarm's (see outer.contribution_weight)."""
    tokens: int = 0
    """Tokens trained since the fragment's last contribution (a satellite gets them back if the round fails)."""
    deposits: int = 0
    """Satellites' deposits folded into `delta` and `weight` (averaging.fold_deposits)."""
    deposit_bytes: int = 0


@dataclasses.dataclass
class RoundResult:
    """What came back from averaging one contribution."""

    outcome: Outcome
    delta: dict[str, torch.Tensor]
    group_size: int = 1
    weight: float = 0.0
    """Total weight of the group (the island's own weight when alone)."""
    bytes_sent: int = 0
    bytes_recv: int = 0
    seconds: float = 0.0
    staleness: int = 0
    consensus: bool = False
    """The group's agreed values disagreed: run a consensus round after applying."""
    reason: str | None = None
    """Why a round was `rejected` (its result is then the island's own update)."""
    norm_ratio: float | None = None
    """Norm of the averaged update over the island's own (rounds that averaged)."""
    deposited_with: str | None = None
    """A satellite's round: the island that took its deposit."""
    digest: str | None = None
    """A committed round: a short hash of its result (parts.result_digest; equal on every member)."""
    members: list[str] | None = None
    """A committed round of the own protocol: its members' peer ids."""
    attempts: int | None = None
    """A round of the own protocol: the attempts it took."""


@dataclasses.dataclass
class FragmentCounters:
    round: int = 0
    """The last round applied to this fragment."""
    tokens_since_sync: int = 0
    syncs: dict[str, int] = dataclasses.field(default_factory=dict)
    apart: float = 0.0
    """How far the agreed values travelled (sum of the norms of their changes) in rounds this island
    applied alone since its bases last agreed with other islands': a partition, rejected rounds.
    Two honest islands can be at most their two paths apart (see validation.consensus_bound)."""
    apart_momentum: float = 0.0
    """The same for the outer momentum."""


class StreamingDiLoCo:
    """Agreed values and outer state of every fragment of one island."""

    def __init__(
        self, cfg: DiLoCoConfig, layout: Sequence[Sequence[str]], params: Mapping[str, torch.Tensor], satellite: bool = False
    ):
        """`satellite`: contributions after missed rounds count with a staleness weight instead of 0."""
        if len(layout) != cfg.fragments:
            raise ValueError(f"layout has {len(layout)} fragments, config {cfg.fragments}")
        self.cfg = cfg
        self.satellite = satellite
        self.layout = [list(names) for names in layout]
        self.globals = [
            {n: params[n].detach().to("cpu", torch.float32).clone() for n in names} for names in self.layout
        ]
        self.momentum = [{n: torch.zeros_like(t) for n, t in g.items()} for g in self.globals]
        self.counters = [FragmentCounters() for _ in self.layout]
        self.residual: list[dict[str, torch.Tensor]] = [{} for _ in self.layout]
        """Error feedback (cfg.feedback): what the codec lost of each fragment's last contribution,
        added (decayed) to its next one; empty when there is none."""
        self._residual_before: list[dict[str, torch.Tensor]] = [{} for _ in self.layout]
        self.on_local_change: Callable[[int], None] = lambda fragment: None
        """Called with a fragment whose local values were just changed outside an inner step."""

    def add_tokens(self, tokens: int) -> None:
        for c in self.counters:
            c.tokens_since_sync += tokens

    def contribution(self, fragment: int, round_: int, step: int, params: Mapping[str, torch.Tensor]) -> Contribution:
        """Snapshot delta_p = global_p - local_p with its token weight, and restart the count."""
        g = self.globals[fragment]
        delta = {n: pseudo_gradient(g[n], params[n]) for n in self.layout[fragment]}
        counters = self.counters[fragment]
        tokens, counters.tokens_since_sync = counters.tokens_since_sync, 0
        staleness = max(0, round_ - counters.round - 1)
        fp = fingerprint([g[n] for n in self.layout[fragment]])
        if self.cfg.feedback:
            delta = self._feed_back(fragment, delta, staleness)
        return Contribution(
            fragment=fragment, round=round_, step=step, delta=delta, fingerprint=fp, staleness=staleness, tokens=tokens,
            weight=contribution_weight(tokens, staleness, self.satellite),
        )

    def _feed_back(self, fragment: int, delta: dict[str, torch.Tensor], staleness: int) -> dict[str, torch.Tensor]:
        """Error feedback: the delta plus the decayed residual of the last contribution, and, as the
        new residual, what the codec will lose of that sum (parts.roundtrip: the bits the round
        reduces; each value is still quantized once, by the round). A stale island's contribution
        weighs ~0 in its round: nothing of it reaches the others, and its residual goes."""
        names = self.layout[fragment]
        kept = self._residual_before[fragment] = self.residual[fragment]
        if staleness and not self.satellite:
            self.residual[fragment] = {}
            return delta
        decay = self.cfg.feedback
        if kept:
            delta = {n: delta[n] + decay * kept[n] for n in names}
        sent = unflatten(roundtrip(flatten(delta[n] for n in names), self.cfg.compression), names, delta)
        self.residual[fragment] = {n: delta[n] - sent[n] for n in names}
        return delta

    def keep_accumulating(self, contribution: Contribution) -> None:
        """A satellite's round did not happen: its tokens count towards its next contribution (and
        its residual is the one before, since its next delta holds this one's progress again)."""
        self.counters[contribution.fragment].tokens_since_sync += contribution.tokens
        self.residual[contribution.fragment] = self._residual_before[contribution.fragment]

    def apply(
        self, fragment: int, round_: int | None, avg_delta: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor],
        mix_local: bool = True, alone: bool = False,
    ) -> None:
        """Outer step on global_p with the averaged delta, then mix local_p towards it (in place).

        `mix_local=False` leaves local_p alone (a stale member mixes after its base was replaced);
        `round_=None` leaves the fragment's round as it was (its base is still not the swarm's);
        `alone`: no other island applies this update (a solo, failed or rejected round), so it
        counts towards how far this island may have drifted from the others (`apart`)."""
        cfg, g, m = self.cfg, self.globals[fragment], self.momentum[fragment]
        lr, mu = outer_hyper(self.counters[fragment].round + 1 if round_ is None else round_, cfg.outer_lr, cfg.outer_momentum, cfg.outer_warmup)
        moved, moved_momentum = [], []
        for n in self.layout[fragment]:
            new_g, new_m = nesterov_outer_step(g[n], avg_delta[n], m[n], lr, mu)
            if alone:
                moved.append(new_g - g[n])
                moved_momentum.append(new_m - m[n])
            g[n], m[n] = new_g, new_m
        if alone:
            self.counters[fragment].apart += tensors_norm(moved)
            self.counters[fragment].apart_momentum += tensors_norm(moved_momentum)
            self.residual[fragment] = {}  # its own delta went in whole, with what the codec would have lost
        if mix_local:
            self.mix_local(fragment, params)
        if round_ is not None:
            self.counters[fragment].round = round_

    def apply_last(self, fragment: int, round_: int, avg_delta: Mapping[str, torch.Tensor], alone: bool = False) -> None:
        """The run's last round: global_p <- global_p - avg_delta, the islands' (token-weighted) mean
        local values when their bases agree. No outer step: its momentum would carry global_p past
        where training ended (bench.parity, int8: agreed eval_loss 2.2459 with it, 2.1345 without). The local
        values and the momentum stay as they are."""
        g = self.globals[fragment]
        for n in self.layout[fragment]:
            g[n] = g[n] - avg_delta[n].to(torch.float32)
        if alone:
            self.counters[fragment].apart += tensors_norm([avg_delta[n].to(torch.float32) for n in self.layout[fragment]])
        self.counters[fragment].round = round_

    def mix_local(self, fragment: int, params: Mapping[str, torch.Tensor]) -> None:
        """local_p <- alpha * local_p + (1 - alpha) * global_p, in place."""
        g = self.globals[fragment]
        with torch.no_grad():
            for n in self.layout[fragment]:
                params[n].copy_(mix(params[n], g[n], self.cfg.alpha))
        self.on_local_change(fragment)

    def replace(
        self, fragment: int, global_: Mapping[str, torch.Tensor], momentum: Mapping[str, torch.Tensor], round_: int | None = None
    ) -> None:
        """Take the swarm's agreed values and outer momentum for this fragment (a consensus, a download)."""
        for n in self.layout[fragment]:
            self.globals[fragment][n] = global_[n].to(torch.float32).clone()
            self.momentum[fragment][n] = momentum[n].to(torch.float32).clone()
        self.settled(fragment)
        if round_ is not None:
            self.counters[fragment].round = round_
            self.counters[fragment].tokens_since_sync = 0

    def agreed_fingerprint(self, fragment: int) -> list[float]:
        """A fingerprint of this fragment's agreed values (consensus.fragment_fingerprint)."""
        return fragment_fingerprint([self.globals[fragment][n] for n in self.layout[fragment]])

    def settled(self, fragment: int) -> None:
        """This fragment's agreed values are the same as other islands' again (a round whose members'
        fingerprints agreed, a consensus, a download): nothing applied alone is left between them."""
        self.counters[fragment].apart = self.counters[fragment].apart_momentum = 0.0

    def fragment_state(self, fragment: int) -> tuple[int, list[torch.Tensor]]:
        """(last applied round, agreed values then momentum in layout order): what a joiner downloads."""
        names = self.layout[fragment]
        return self.counters[fragment].round, [self.globals[fragment][n] for n in names] + [self.momentum[fragment][n] for n in names]

    def state_from_tensors(self, fragment: int, tensors: Sequence[torch.Tensor]) -> tuple[dict, dict]:
        """Split a downloaded tensor list back into (agreed values, momentum) by name; ValueError if it does not fit."""
        names = self.layout[fragment]
        if len(tensors) != 2 * len(names):
            raise ValueError(f"fragment {fragment}: got {len(tensors)} tensors, expected {2 * len(names)}")
        g = dict(zip(names, tensors[: len(names)], strict=True))
        m = dict(zip(names, tensors[len(names) :], strict=True))
        for n in names:
            if g[n].shape != self.globals[fragment][n].shape or m[n].shape != g[n].shape:
                raise ValueError(f"fragment {fragment}: {n} has shape {tuple(g[n].shape)}, expected {tuple(self.globals[fragment][n].shape)}")
        return g, m

    def count(self, fragment: int, outcome: str) -> None:
        syncs = self.counters[fragment].syncs
        syncs[outcome] = syncs.get(outcome, 0) + 1

    # --- checkpoint form ----------------------------------------------------

    def global_state(self) -> dict[str, torch.Tensor]:
        return {n: t for g in self.globals for n, t in g.items()}

    def momentum_state(self) -> dict[str, torch.Tensor]:
        return {n: t for m in self.momentum for n, t in m.items()}

    def counters_state(self) -> list[dict]:
        return [dataclasses.asdict(c) for c in self.counters]

    def residual_state(self) -> dict[str, torch.Tensor]:
        """The error feedback's residuals by parameter name (those of fragments that have one)."""
        return {n: t for r in self.residual for n, t in r.items()}

    def load(
        self, global_state: Mapping[str, torch.Tensor], momentum_state: Mapping[str, torch.Tensor], counters: Sequence[dict],
        residual_state: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        residual_state = residual_state or {}
        for p, names in enumerate(self.layout):
            for n in names:
                self.globals[p][n] = global_state[n].to(torch.float32).clone()
                self.momentum[p][n] = momentum_state[n].to(torch.float32).clone()
            have = [n for n in names if n in residual_state]
            if have and len(have) != len(names):
                raise ValueError(f"fragment {p}: the residual has {len(have)} of its {len(names)} tensors")
            self.residual[p] = {n: residual_state[n].to(torch.float32).clone() for n in have}
        self.counters = [FragmentCounters(**c) for c in counters]
