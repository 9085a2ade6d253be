"""A round of the project's own averaging protocol, sans-IO: its members, what each must hold, and
when it commits or aborts (issue 17; its data path: node/net/transport.py).

A round is (fragment, number). Its members are the live islands whose records advertise it; a
satellite never is one. Every member contributes one *part* — its weighted contribution, encoded
(quantized) once — and sends it to every other member (an all-gather: with a few islands each
value then crosses the wire once per receiver and is quantized only by its owner). A member that
holds every member's part says so to the others (`have`, with a digest of the parts it holds).
The round commits at a member once every member has said `have` with the same digest: then all
of them hold the same parts and reduce them in the same order (`reduction_order`), in fp32, so
their results are bit-identical. A member that is gone (its connections closed) or silent past
the attempt's deadline aborts the attempt; the survivors retry at once without it, keeping the
parts they already hold from each other, until `max_attempts`. A member that aborts tells the
survivors (`SendAbort`): one that did not see the member go (a killed member may never have
connected to it, and its own sends may all have fit in socket buffers) follows at once (`Aborted`)
instead of waiting for the dead member to its deadline and then dropping the one that went
ahead. With fewer than two members left the round fails (each applies its own update alone, as
today). A member that dies after every `have` was sent may leave some members committed and
others retrying: a committed member answers a retrying one's `have` with what it committed, and
the other, which holds the same parts (it said so), commits the same (`Committed`). A member
lost after this one said `have` is asked again once, over a new connection, before it is
dropped (a broken connection is not a dead member), and so is one still silent at the deadline
after this one said `have`, with one more attempt's time to answer (its own `have` may be late
behind a busy event loop): if it committed, its answer makes this one commit too. What can
still split a round is a member that commits on a `have` whose sender had given up on it even
after asking again; the fingerprints of the agreed values (consensus.py) catch that, as they
catch a partition.

With more members an all-gather moves (n - 1) parts in and out of every member and makes each
reduce n whole parts; `ScatterRound` is the same protocol as a reduce-scatter and an all-gather of
the reduced slices: each member's part is cut into one slice per member (`parts.slice_bounds`),
member i receives every member's slice i, reduces it (fp32, fixed order) and sends the result to
the others. Each value is still encoded once by its owner, and each slice is reduced by one member
only, so the members that commit hold the same bits. `have` then means "I hold every member's
reduced slice", and its digest names them; an attempt's slices depend on its members, so a retry
cuts and sends them again, and a member that had said `have` says it again for the attempt it left
(a member that committed on it never sends the new attempt's slices; it answers `Committed`).
`uses_scatter` chooses (measured: bench/README.md).

Parts as bytes, and their reduction: protocols/parts.py.

Events in: `PartArrived`, `SliceArrived`, `Reduced`, `HaveAll`, `Committed`, `Aborted`, `PeerGone`,
`Tick`. Actions out: `SendPart`, `Reduce`, `SendSlice`, `SendHave`, `SendAbort`, `SendCommitted`,
`Commit`, `Abort`, `Fail`. Time comes in as an argument (`now`); nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Mapping, Sequence

# --- events ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PartArrived:
    """`peer`'s whole part arrived (every chunk, authenticated); `digest` is its hash."""

    peer: str
    digest: str
    attempt: int = 1


@dataclasses.dataclass(frozen=True)
class SliceArrived:
    """`peer`'s reduced slice of `attempt` arrived whole (a ScatterRound)."""

    peer: str
    digest: str
    attempt: int


@dataclasses.dataclass(frozen=True)
class Reduced:
    """This member reduced its slice of `attempt` (a ScatterRound); `digest` names the result."""

    digest: str
    attempt: int


@dataclasses.dataclass(frozen=True)
class HaveAll:
    """`peer` holds every part of its attempt's members; `parts` digests which (parts_digest)."""

    peer: str
    parts: str
    attempt: int


@dataclasses.dataclass(frozen=True)
class Committed:
    """`peer` committed the round with these members' parts (it answers a member still retrying)."""

    peer: str
    members: tuple[str, ...]
    parts: str
    attempts: int


@dataclasses.dataclass(frozen=True)
class Aborted:
    """`peer` aborted an attempt and went on to `attempt` with `members` (it tells the survivors: one
    of them may not have seen the member it dropped go, and would wait for it until its deadline)."""

    peer: str
    members: tuple[str, ...]
    attempt: int


@dataclasses.dataclass(frozen=True)
class PeerGone:
    """The transport lost `peer` (its connections closed or it was refused)."""

    peer: str


@dataclasses.dataclass(frozen=True)
class Tick:
    """Time passed (a deadline may have)."""


Event = PartArrived | SliceArrived | Reduced | HaveAll | Committed | Aborted | PeerGone | Tick

# --- actions --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SendPart:
    """Send this member's part to `to` (a ScatterRound: its slice of `attempt`'s members' layout)."""

    to: str
    attempt: int = 1


@dataclasses.dataclass(frozen=True)
class Reduce:
    """Reduce the members' slices of this member's share, in `members`' order; report `Reduced`."""

    members: tuple[str, ...]
    attempt: int


@dataclasses.dataclass(frozen=True)
class SendSlice:
    """Send this member's reduced slice of `attempt` to `to`."""

    to: str
    attempt: int


@dataclasses.dataclass(frozen=True)
class SendHave:
    to: str
    parts: str
    attempt: int


@dataclasses.dataclass(frozen=True)
class SendAbort:
    """Tell `to` (a survivor) that this member went on to `attempt` with `members`."""

    to: str
    members: tuple[str, ...]
    attempt: int


@dataclasses.dataclass(frozen=True)
class SendCommitted:
    """Tell `to` (still retrying) what this member committed."""

    to: str
    commit: Commit


@dataclasses.dataclass(frozen=True)
class Commit:
    """Reduce these members' parts in this order: every member of the round does the same."""

    members: tuple[str, ...]
    parts: str
    attempts: int


@dataclasses.dataclass(frozen=True)
class Abort:
    """This attempt ends without `dropped`; the next one runs with `members` (retry at once)."""

    reason: str
    dropped: tuple[str, ...]
    members: tuple[str, ...]
    attempt: int


@dataclasses.dataclass(frozen=True)
class Fail:
    """No round: too few members left, or too many attempts. Each member goes on alone."""

    reason: str
    attempts: int


Action = SendPart | Reduce | SendSlice | SendHave | SendAbort | SendCommitted | Commit | Abort | Fail


# --- pure helpers ---------------------------------------------------------------------------


def reduction_order(members: Iterable[str]) -> tuple[str, ...]:
    """The order every member adds the parts in: by peer id."""
    return tuple(sorted(set(members)))


def parts_digest(parts: Mapping[str, str], members: Sequence[str]) -> str:
    """A short hash of which part each member contributed (equal on members that hold the same)."""
    text = "\n".join(f"{m}:{parts[m]}" for m in reduction_order(members))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --- the state machine ----------------------------------------------------------------------


class Round:
    """One member's view of one round."""

    def __init__(
        self, me: str, members: Iterable[str], my_digest: str, now: float, attempt_s: float, max_attempts: int = 3,
    ):
        """`members` includes `me`; `my_digest`: the hash of this member's own part; `attempt_s`: how
        long an attempt may wait for parts and `have`s before the silent members are dropped."""
        self.me = me
        self.members = reduction_order(members)
        if me not in self.members:
            raise ValueError(f"{me} is not a member of its own round {self.members}")
        if attempt_s <= 0 or max_attempts < 1:
            raise ValueError("attempt_s must be > 0 and max_attempts >= 1")
        self.attempt_s = attempt_s
        self.max_attempts = max_attempts
        self.attempt = 1
        self.deadline = now + attempt_s
        self.parts: dict[str, str] = {me: my_digest}
        self.have: dict[str, tuple[int, str]] = {}
        """peer -> (attempt, parts digest) of the newest `have` it sent."""
        self.gone: set[str] = set()
        self.sent_have = False
        self.asked: set[str] = set()
        """Members lost after this one said `have`, asked again once before they are dropped."""
        self.outcome: Commit | Fail | None = None

    @property
    def done(self) -> bool:
        return self.outcome is not None

    def start(self) -> list[Action]:
        """Send this member's part to every other member (the round may end at once: alone)."""
        if len(self.members) < 2:
            return self._fail("no other member")
        return [SendPart(p) for p in self.members if p != self.me]

    def handle(self, event: Event, now: float) -> list[Action]:
        if self.done:
            if isinstance(event, HaveAll) and isinstance(self.outcome, Commit) and event.peer in self.outcome.members:
                return [SendCommitted(event.peer, self.outcome)]  # it lost a member after this one committed
            return []
        if isinstance(event, Committed):
            return self._adopt(event)
        if isinstance(event, Aborted):
            return self._follow(event, now)
        if isinstance(event, PartArrived):
            if event.peer not in self.members or event.peer in self.parts:
                return []  # a stranger's, or a duplicate
            self.parts[event.peer] = event.digest
            return self._progress()
        if isinstance(event, HaveAll):
            if event.peer not in self.members or event.attempt < max(self.attempt, self.have.get(event.peer, (0, ""))[0]):
                return []  # a stale one (messages may cross); one of a later attempt counts once this member gets there
            self.have[event.peer] = (event.attempt, event.parts)
            return self._progress()
        if isinstance(event, PeerGone):
            if event.peer not in self.members or event.peer == self.me:
                return []
            if self.sent_have and event.peer not in self.asked:
                # it may have committed on this member's `have` before its link broke: ask it again
                # (over a new connection) before dropping it; a committed member answers `Committed`
                self.asked.add(event.peer)
                return [SendHave(event.peer, self.have[self.me][1], self.attempt)]
            return self._retry([event.peer], f"{event.peer} is gone", now)
        if isinstance(event, Tick):
            if now < self.deadline:
                return []
            holds_all = self._holds_all()
            silent = [
                p for p in self.members
                if p != self.me and (self._lacks(p) or (holds_all and self.have.get(p, (0, ""))[0] != self.attempt))
            ]
            if not silent:  # a `have` that disagrees: the others' view of the members will settle it
                silent = [p for p in self.members if p != self.me]
            unasked = [p for p in silent if p not in self.asked] if self.sent_have else []
            if unasked:
                # they may have committed on this member's `have`, their own still on its way (a busy
                # member): ask them again, and wait one more attempt's time before dropping them
                self.asked.update(unasked)
                self.deadline = now + self.attempt_s
                return [SendHave(p, self.have[self.me][1], self.attempt) for p in unasked]
            return self._retry(silent, f"no agreement with {', '.join(silent)} within {self.attempt_s:g}s", now)
        if isinstance(event, SliceArrived):
            # a member that runs the other kind of round: not between nodes of one data protocol
            # version (uses_scatter depends on the codec alone), but should it happen, the two
            # cannot agree on this round, so this member fails now rather than at the deadline
            return self._fail(f"{event.peer} runs this round as a reduce-scatter")
        raise TypeError(f"unknown event {event!r}")

    def _held_at(self, attempt: int) -> Mapping[str, str]:
        """What the `have` of `attempt` names: each member's part (any attempt: a part does not change)."""
        return self.parts

    def _lacks(self, peer: str) -> bool:
        """Whether this member still waits for something of `peer`'s in this attempt."""
        return peer not in self.parts

    def _holds_all(self) -> bool:
        held = self._held_at(self.attempt)
        return all(p in held for p in self.members)

    def _progress(self) -> list[Action]:
        actions: list[Action] = []
        if not self._holds_all():
            return actions
        mine = parts_digest(self._held_at(self.attempt), self.members)
        if not self.sent_have:
            self.sent_have = True
            self.have[self.me] = (self.attempt, mine)
            actions.extend(SendHave(p, mine, self.attempt) for p in self.members if p != self.me)
        if all(self.have.get(p) == (self.attempt, mine) for p in self.members):
            self.outcome = Commit(self.members, mine, self.attempt)
            actions.append(self.outcome)
        return actions

    def _adopt(self, event: Committed) -> list[Action]:
        """Another member committed while this one was retrying (a member died after every `have` was
        sent): it holds every part of that set too (it said so), so it commits the same."""
        held = self._held_at(event.attempts)
        if event.peer not in self.members or any(m not in held for m in event.members):
            return []
        if parts_digest(held, event.members) != event.parts:
            return []
        self.outcome = Commit(event.members, event.parts, event.attempts)
        return [self.outcome]

    def _follow(self, event: Aborted, now: float) -> list[Action]:
        """Another member went on to a later attempt: go there too, without the members it dropped
        (it saw them go or fall silent; this member may not have, and would wait for them)."""
        if event.peer not in self.members or event.attempt <= self.attempt or self.me not in event.members:
            return []  # a stranger's, a stale one, or one that dropped this member (its deadline settles that)
        dropped = [p for p in self.members if p not in event.members]
        self.attempt = event.attempt - 1  # the attempts it went through count here too
        why = f"without {', '.join(dropped)}" if dropped else "with the same members"
        return self._retry(dropped, f"{event.peer} went on to attempt {event.attempt} {why}", now)

    def _retry(self, dropped: list[str], reason: str, now: float) -> list[Action]:
        survivors = tuple(p for p in self.members if p not in dropped)
        self.gone.update(dropped)
        if len(survivors) < 2:
            return self._fail(f"{reason}; no other member left")
        if self.attempt >= self.max_attempts:
            return self._fail(f"{reason}; {self.attempt} attempts")
        self.attempt += 1
        self.members = survivors
        # the parts of dropped members stay: another member may have committed with them (_adopt)
        self.have = {p: h for p, h in self.have.items() if p in survivors and h[0] >= self.attempt}
        self.sent_have = False
        self.deadline = now + self.attempt_s
        tell = [SendAbort(p, survivors, self.attempt) for p in survivors if p != self.me]
        return [Abort(reason, tuple(sorted(dropped)), survivors, self.attempt), *tell, *self._progress()]

    def _fail(self, reason: str) -> list[Action]:
        self.outcome = Fail(reason, self.attempt)
        return [self.outcome]


SCATTER_FROM = 2
"""Members from which an uncompressed round is a reduce-scatter (bench/README.md, 100 MB: 0.25 s
against an all-gather's 0.40 s at 3 islands, 0.37 against 0.78 at 4; at 2 islands 0.171 s
against 0.155, both moving one part each way). Every uncompressed round is one, whatever its members:
members whose records differ count different members, and a round whose kind depended on the
count could not be agreed even once their retries had settled on the same members (the chaos
soak found two islands failing every round that way, bench/README.md)."""


def uses_scatter(members: int, codec: str) -> bool:
    """Whether a round of `members` islands with parts in `codec` runs as a `ScatterRound`: a
    compressed part would need its reduced slices sent in fp32 (or quantized a second time), so
    compressed rounds stay all-gathers. The kind depends on the run's codec alone (SCATTER_FROM)."""
    return codec == "none" and members >= SCATTER_FROM


class ScatterRound(Round):
    """One member's view of a round run as a reduce-scatter and an all-gather of the reduced slices:
    `SendPart(to, attempt)` sends `to`'s slice of this member's part (cut for that attempt's
    members), `Reduce` asks for this member's slice to be reduced once every member's arrived,
    `SendSlice` sends the result to the others; `have` names every member's reduced slice."""

    def __init__(self, me: str, members: Iterable[str], now: float, attempt_s: float, max_attempts: int = 3):
        super().__init__(me, members, "", now, attempt_s, max_attempts)
        self.parts = {}
        self.pieces: dict[int, dict[str, str]] = {1: {me: "own"}}
        """attempt -> member -> its slice (of this member's share) that arrived."""
        self.slices: dict[int, dict[str, str]] = {}
        """attempt -> member -> its reduced slice that arrived (this member's own once reduced)."""
        self.reducing: set[int] = set()

    def _held_at(self, attempt: int) -> Mapping[str, str]:
        return self.slices.get(attempt, {})

    def _lacks(self, peer: str) -> bool:
        return peer not in self.pieces.get(self.attempt, {}) or peer not in self.slices.get(self.attempt, {})

    def handle(self, event: Event, now: float) -> list[Action]:
        if self.done or not isinstance(event, PartArrived | SliceArrived | Reduced):
            return super().handle(event, now)
        if event.attempt < self.attempt:
            return []  # of an attempt this member left
        if isinstance(event, Reduced):
            self.slices.setdefault(event.attempt, {})[self.me] = event.digest
            sends: list[Action] = [SendSlice(p, event.attempt) for p in self.members if p != self.me]
            return sends + self._progress()
        if event.peer not in self.members or event.peer == self.me:
            return []
        held = (self.pieces if isinstance(event, PartArrived) else self.slices).setdefault(event.attempt, {})
        if event.peer in held:
            return []  # a duplicate
        held[event.peer] = event.digest
        return self._progress()

    def _progress(self) -> list[Action]:
        actions: list[Action] = []
        pieces = self.pieces.get(self.attempt, {})
        if self.attempt not in self.reducing and all(p in pieces for p in self.members):
            self.reducing.add(self.attempt)
            actions.append(Reduce(self.members, self.attempt))
        return actions + super()._progress()

    def _retry(self, dropped: list[str], reason: str, now: float) -> list[Action]:
        self.pieces.setdefault(self.attempt + 1, {})[self.me] = "own"
        said = self.have.get(self.me) if self.sent_have else None
        actions = super()._retry(dropped, reason, now)
        if self.done:
            return actions
        # the slices depend on the members: cut and send them again
        again = [SendPart(p, self.attempt) for p in self.members if p != self.me]
        if said is not None:
            # every member may have said `have` and one of them committed (the dropped member's
            # `have` reached it, not this one): it never sends this attempt's slices, so tell it
            # the `have` of the attempt left; a committed member answers what it committed (_adopt)
            again += [SendHave(p, said[1], said[0]) for p in self.members if p != self.me]
        tell = [a for a in actions if isinstance(a, SendAbort)]
        rest = [a for a in actions[1:] if not isinstance(a, SendAbort)]
        return [actions[0], *tell, *again, *rest]
