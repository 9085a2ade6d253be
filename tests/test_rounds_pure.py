"""The round protocol's state machine and wire format (protocols/rounds.py, protocols/wire.py)."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from islands.protocols.rounds import (
    Abort,
    Commit,
    Committed,
    Fail,
    HaveAll,
    PartArrived,
    PeerGone,
    Round,
    SendCommitted,
    SendHave,
    SendPart,
    Tick,
    parts_digest,
    round_members,
)
from islands.protocols.wire import (
    HEADER_BYTES,
    Frame,
    Kind,
    WireError,
    chunk_spans,
    decode_header,
    encode_header,
    nonce,
    sender_id,
    stripe,
)

ATTEMPT_S = 2.0


class Net:
    """Members of one round exchanging messages in an order the test picks; `dead` members say nothing."""

    def __init__(self, names, now=0.0):
        self.now = now
        self.rounds = {n: Round(n, names, f"d-{n}", now, ATTEMPT_S) for n in names}
        self.inbox: list[tuple[str, object]] = []
        self.dead: set[str] = set()
        self.log: dict[str, list] = {n: [] for n in names}
        for n, r in self.rounds.items():
            self._send(n, r.start())

    def _send(self, sender, actions):
        self.log[sender].extend(actions)
        for a in actions:
            if isinstance(a, SendPart):
                self.inbox.append((a.to, PartArrived(sender, f"d-{sender}")))
            elif isinstance(a, SendHave):
                self.inbox.append((a.to, HaveAll(sender, a.parts, a.attempt)))
            elif isinstance(a, SendCommitted):
                c = a.commit
                self.inbox.append((a.to, Committed(sender, c.members, c.parts, c.attempts)))

    def deliver(self, i=0):
        to, event = self.inbox.pop(i)
        if to not in self.dead:
            self._send(to, self.rounds[to].handle(event, self.now))

    def run(self, rng=None):
        while self.inbox:
            self.deliver(rng.randrange(len(self.inbox)) if rng else 0)

    def kill(self, name):
        """`name` dies: its queued messages are lost, the others' transports see it go."""
        self.dead.add(name)
        self.inbox = [(to, e) for to, e in self.inbox if getattr(e, "peer", None) != name]
        for n, r in self.rounds.items():
            if n not in self.dead:
                self._send(n, r.handle(PeerGone(name), self.now))

    def outcomes(self):
        return {n: r.outcome for n, r in self.rounds.items() if n not in self.dead}


def test_a_round_commits_when_every_member_holds_every_part():
    net = Net(["a", "b", "c"])
    net.run()
    outcomes = net.outcomes()
    assert all(isinstance(o, Commit) for o in outcomes.values())
    assert {(o.members, o.parts, o.attempts) for o in outcomes.values()} == {(("a", "b", "c"), parts_digest({m: f"d-{m}" for m in "abc"}, "abc"), 1)}


@pytest.mark.parametrize("when", ["before its part", "mid-transfer", "after its last part", "while committing"])
def test_a_member_killed_at_any_point_leaves_the_others_a_committed_round_without_it(when):
    net = Net(["a", "b", "c"])
    delivered = {"before its part": 0, "mid-transfer": 2, "after its last part": 6, "while committing": 10}[when]
    for _ in range(delivered):
        net.deliver()
    net.kill("c")
    net.run()
    outcomes = net.outcomes()
    assert set(outcomes) == {"a", "b"}
    results = {(o.members, o.parts) for o in outcomes.values()}
    assert len(results) == 1 and all(isinstance(o, Commit) for o in outcomes.values()), outcomes
    members, _ = results.pop()
    assert members in (("a", "b"), ("a", "b", "c"))  # committed before it died, all three; else without it
    if members == ("a", "b"):
        assert any(isinstance(x, Abort) and x.dropped == ("c",) for x in net.log["a"])


def test_a_silent_member_is_dropped_at_the_deadline_and_the_round_retries_at_once():
    net = Net(["a", "b", "c"])
    net.dead.add("c")  # frozen: no message from it, no connection closed either
    net.run()
    assert not any(r.done for n, r in net.rounds.items() if n != "c")
    net.now = ATTEMPT_S + 0.1
    for n in "ab":
        net._send(n, net.rounds[n].handle(Tick(), net.now))
    net.run()
    for n in "ab":
        abort = [x for x in net.log[n] if isinstance(x, Abort)]
        assert abort[0].dropped == ("c",) and abort[0].members == ("a", "b") and abort[0].attempt == 2
        assert net.rounds[n].outcome == Commit(("a", "b"), parts_digest({"a": "d-a", "b": "d-b"}, "ab"), 2)


def test_alone_or_out_of_attempts_the_round_fails():
    r = Round("a", ["a"], "d", 0.0, ATTEMPT_S)
    assert r.start() == [Fail("no other member", 1)]
    r = Round("a", ["a", "b"], "d", 0.0, ATTEMPT_S)
    r.start()
    [fail] = r.handle(PeerGone("b"), 0.0)
    assert isinstance(fail, Fail) and "no other member left" in fail.reason
    r = Round("a", ["a", "b", "c", "d"], "d", 0.0, ATTEMPT_S, max_attempts=2)
    r.start()
    assert isinstance(r.handle(PeerGone("b"), 0.0)[0], Abort)
    assert isinstance(r.handle(PeerGone("c"), 0.1)[0], Fail)


def test_strangers_duplicates_and_stale_haves_change_nothing():
    r = Round("a", ["a", "b"], "d-a", 0.0, ATTEMPT_S)
    r.start()
    assert r.handle(PartArrived("z", "d-z"), 0.0) == []
    assert r.handle(HaveAll("z", "x", 1), 0.0) == []
    acts = r.handle(PartArrived("b", "d-b"), 0.0)
    assert acts == [SendHave("b", parts_digest({"a": "d-a", "b": "d-b"}, "ab"), 1)]
    assert r.handle(PartArrived("b", "other"), 0.0) == []  # a duplicate does not replace the part
    assert r.handle(HaveAll("b", "not the same parts", 1), 0.0) == []  # no commit on another digest
    assert not r.done


def test_a_have_from_a_later_attempt_counts_once_this_member_gets_there():
    r = Round("a", ["a", "b", "c"], "d-a", 0.0, ATTEMPT_S)
    r.start()
    r.handle(PartArrived("b", "d-b"), 0.0)
    two = parts_digest({"a": "d-a", "b": "d-b"}, "ab")
    assert r.handle(HaveAll("b", two, 2), 0.0) == []  # b dropped c first
    acts = r.handle(PeerGone("c"), 0.1)
    assert isinstance(acts[0], Abort) and acts[-1] == Commit(("a", "b"), two, 2)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10**6), members=st.integers(2, 5), kill=st.integers(-1, 4), at=st.integers(0, 40))
def test_members_that_commit_always_commit_the_same_parts(seed, members, kill, at):
    """Any delivery order, any member killed at any point: no round splits (every survivor commits
    the same members' parts, or every survivor fails)."""
    rng = random.Random(seed)
    names = [f"p{i}" for i in range(members)]
    net = Net(names)
    for _ in range(min(at, len(net.inbox))):
        net.deliver(rng.randrange(len(net.inbox)))
    if 0 <= kill < members:
        net.kill(names[kill])
    net.run(rng)
    outcomes = net.outcomes()
    commits = {(o.members, o.parts) for o in outcomes.values() if isinstance(o, Commit)}
    assert len(commits) <= 1
    if len(outcomes) >= 2:
        assert all(o is not None for o in outcomes.values()), outcomes  # nobody left waiting
        assert commits and all(isinstance(o, Commit) for o in outcomes.values())


def test_round_members_are_the_islands_that_advertise_the_round():
    assert round_members("b", {"a": 40, "c": 40, "d": 45}, 40) == ("a", "b", "c")
    assert round_members("b", {}, 40) == ("b",)


# --- wire format -----------------------------------------------------------------------------


def test_a_frame_header_round_trips_and_bad_ones_are_refused():
    f = Frame(Kind.PART, fragment=3, round=41, attempt=2, chunk=5, chunks=9, length=1 << 20, sender=sender_id("QmPeer"))
    data = encode_header(f)
    assert len(data) == HEADER_BYTES == 38 and decode_header(data) == f
    for bad, message in [
        (b"XXXX" + data[4:], "not a round frame"),
        (data[:4] + bytes([9]) + data[5:], "frame version 9"),
        (data[:5] + bytes([7]) + data[6:], "unknown frame kind 7"),
        (data[:-1], "a header is 38 bytes"),
    ]:
        with pytest.raises(WireError, match=message):
            decode_header(bad)
    with pytest.raises(WireError, match="exceeds"):
        encode_header(Frame(Kind.PART, 0, 0, 1, 0, 1, 1 << 30, 0))


def test_a_part_is_cut_into_chunks_striped_over_the_pool():
    assert chunk_spans(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert chunk_spans(0, 4) == [(0, 0)]
    assert stripe(5, 2) == [[0, 2, 4], [1, 3]]
    assert sorted(c for conn in stripe(100, 8) for c in conn) == list(range(100))


def test_every_chunk_has_its_own_nonce():
    seen = set()
    for kind in Kind:
        for direction in (0, 1):
            for attempt in (1, 2):
                for chunk in range(4):
                    seen.add(nonce(Frame(kind, 1, 7, attempt, chunk, 4, 0, 0), direction))
    assert len(seen) == len(Kind) * 2 * 2 * 4 and all(len(n) == 12 for n in seen)
