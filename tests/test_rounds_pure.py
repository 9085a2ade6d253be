"""The round protocol's state machine, wire format and parts (protocols/rounds.py, wire.py, parts.py),
and who the members of a round are (records.round_peers)."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from islands.protocols.compression import BLOCK
from islands.protocols.parts import (
    PartError,
    SliceSpoiled,
    assemble,
    decode_part,
    encode_part,
    encode_slices,
    new_buffer,
    part_bytes,
    part_size,
    part_span,
    reduce_parts,
    reduce_slice,
    result_digest,
    slice_bounds,
    take,
)
from islands.protocols.records import (
    IslandRecord,
    data_address,
    left_round,
    parse_address,
    parse_island_record,
    round_peers,
    state_donors,
    typical_step,
)
from islands.protocols.rounds import (
    Abort,
    Aborted,
    Commit,
    Committed,
    Fail,
    HaveAll,
    PartArrived,
    PeerGone,
    Reduce,
    Reduced,
    Round,
    ScatterRound,
    SendAbort,
    SendCommitted,
    SendHave,
    SendPart,
    SendSlice,
    SliceArrived,
    Tick,
    parts_digest,
    uses_scatter,
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

    def __init__(self, names, now=0.0, scatter=False):
        self.now = now
        if scatter:
            self.rounds = {n: ScatterRound(n, names, now, ATTEMPT_S) for n in names}
        else:
            self.rounds = {n: Round(n, names, f"d-{n}", now, ATTEMPT_S) for n in names}
        self.inbox: list[tuple[str, object]] = []
        self.dead: set[str] = set()
        self.killed: set[str] = set()
        """Dead members whose connections closed (a frozen member's did not)."""
        self.log: dict[str, list] = {n: [] for n in names}
        for n, r in self.rounds.items():
            self._send(n, r.start())

    def _send(self, sender, actions):
        self.log[sender].extend(actions)
        for a in actions:
            if getattr(a, "to", None) in self.dead and a.to in self.killed:
                self.inbox.append((sender, PeerGone(a.to)))  # the transport cannot reach it: its send fails
            elif isinstance(a, SendPart):
                self.inbox.append((a.to, PartArrived(sender, f"d-{sender}", a.attempt)))
            elif isinstance(a, Reduce):  # the reduction ends later, like a message to itself
                self.inbox.append((sender, Reduced(f"r-{sender}-{a.attempt}", a.attempt)))
            elif isinstance(a, SendSlice):
                self.inbox.append((a.to, SliceArrived(sender, f"r-{sender}-{a.attempt}", a.attempt)))
            elif isinstance(a, SendHave):
                self.inbox.append((a.to, HaveAll(sender, a.parts, a.attempt)))
            elif isinstance(a, SendAbort):
                self.inbox.append((a.to, Aborted(sender, a.members, a.attempt)))
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
        self.killed.add(name)
        self.inbox = [(to, e) for to, e in self.inbox if getattr(e, "peer", None) != name and to != name]
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


def test_a_silent_member_is_asked_again_at_the_deadline_then_dropped_and_the_round_retries_at_once():
    net = Net(["a", "b", "c"])
    net.dead.add("c")  # frozen after it sent its part: no `have` from it, no connection closed either
    net.run()
    assert not any(r.done for n, r in net.rounds.items() if n != "c")
    net.now = ATTEMPT_S + 0.1
    for n in "ab":  # it may have committed on their `have`s: they ask it again and wait once more
        asked = net.rounds[n].handle(Tick(), net.now)
        assert [(type(x), x.to) for x in asked] == [(SendHave, "c")] and not net.rounds[n].done
    net.now = 2 * ATTEMPT_S + 0.2
    for n in "ab":
        net._send(n, net.rounds[n].handle(Tick(), net.now))
    net.run()
    for n in "ab":
        abort = [x for x in net.log[n] if isinstance(x, Abort)]
        assert abort[0].dropped == ("c",) and abort[0].members == ("a", "b") and abort[0].attempt == 2
        assert net.rounds[n].outcome == Commit(("a", "b"), parts_digest({"a": "d-a", "b": "d-b"}, "ab"), 2)


def test_a_member_whose_have_comes_late_after_the_other_committed_commits_the_same():
    net = Net(["a", "b"])
    while net.inbox:  # every part and every `have` arrives, except b's `have` to a: late behind b's busy loop
        i = next((k for k, (to, e) in enumerate(net.inbox) if not (to == "a" and isinstance(e, HaveAll))), None)
        if i is None:
            late = net.inbox.pop()
            break
        net.deliver(i)
    assert isinstance(net.rounds["b"].outcome, Commit) and not net.rounds["a"].done
    net.now = ATTEMPT_S + 0.1
    net._send("a", net.rounds["a"].handle(Tick(), net.now))  # asks b again instead of dropping it
    net.run()
    assert net.rounds["a"].outcome == net.rounds["b"].outcome  # b answered with what it committed
    assert late[1].peer == "b"


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


def test_a_member_whose_peer_runs_the_round_as_a_reduce_scatter_fails_it_saying_why():
    """An all-gather member that receives a reduced slice (a peer that runs another kind of round)
    fails at once, saying why, instead of waiting for the deadline."""
    r = Round("a", ["a", "b"], "d-a", 0.0, ATTEMPT_S)
    r.start()
    [fail] = r.handle(SliceArrived("b", "s", 1), 0.1)
    assert isinstance(fail, Fail) and "b runs this round as a reduce-scatter" in fail.reason
    assert r.handle(PartArrived("b", "d-b"), 0.2) == []  # done


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


def test_a_member_lost_after_the_have_is_asked_again_and_its_commit_is_adopted():
    """a and b hold both parts and have said so; a's `have` reached b, which committed, but the
    connection broke before b's `have` reached a: a asks b again instead of failing alone."""
    a, b = Round("a", ["a", "b"], "d-a", 0.0, ATTEMPT_S), Round("b", ["a", "b"], "d-b", 0.0, ATTEMPT_S)
    a.start(), b.start()
    [have_a] = a.handle(PartArrived("b", "d-b"), 0.0)
    b.handle(PartArrived("a", "d-a"), 0.0)
    [commit_b] = b.handle(HaveAll("a", have_a.parts, 1), 0.0)
    assert a.handle(PeerGone("b"), 0.1) == [SendHave("b", have_a.parts, 1)]
    [answer] = b.handle(HaveAll("a", have_a.parts, 1), 0.2)
    assert answer == SendCommitted("a", commit_b)
    assert a.handle(Committed("b", commit_b.members, commit_b.parts, commit_b.attempts), 0.3) == [commit_b]
    # lost again (it is really gone): dropped, and with nobody left the round fails
    c = Round("c", ["c", "d"], "d-c", 0.0, ATTEMPT_S)
    c.start()
    c.handle(PartArrived("d", "d-d"), 0.0)
    assert isinstance(c.handle(PeerGone("d"), 0.1)[0], SendHave)
    assert isinstance(c.handle(PeerGone("d"), 0.2)[0], Fail)


def test_a_have_from_a_later_attempt_counts_once_this_member_gets_there():
    r = Round("a", ["a", "b", "c"], "d-a", 0.0, ATTEMPT_S)
    r.start()
    r.handle(PartArrived("b", "d-b"), 0.0)
    two = parts_digest({"a": "d-a", "b": "d-b"}, "ab")
    assert r.handle(HaveAll("b", two, 2), 0.0) == []  # b dropped c first
    acts = r.handle(PeerGone("c"), 0.1)
    assert isinstance(acts[0], Abort) and acts[-1] == Commit(("a", "b"), two, 2)


def test_a_scatter_round_reduces_each_slice_once_and_commits_when_every_member_holds_every_slice():
    names = ["a", "b", "c", "d"]
    net = Net(names, scatter=True)
    net.run()
    outcomes = net.outcomes()
    digest = parts_digest({m: f"r-{m}-1" for m in names}, names)
    assert set(outcomes.values()) == {Commit(tuple(names), digest, 1)}
    for n in names:  # one reduction each, of its own slice, with every member's
        assert [x for x in net.log[n] if isinstance(x, Reduce)] == [Reduce(tuple(names), 1)]
        assert sorted(x.to for x in net.log[n] if isinstance(x, SendSlice)) == [m for m in names if m != n]


@pytest.mark.parametrize("when", [0, 5, 14, 28, 34, 40])
def test_a_scatter_round_retries_without_a_killed_member_with_slices_cut_again(when):
    names = ["a", "b", "c", "d"]
    net = Net(names, scatter=True)
    for _ in range(when):
        net.deliver()
    net.kill("d")
    net.run()
    outcomes = net.outcomes()
    assert len(set(outcomes.values())) == 1, outcomes
    [commit] = set(outcomes.values())
    assert isinstance(commit, Commit)
    if commit.members == ("a", "b", "c"):  # cut again for three, sent again, reduced again
        assert commit.attempts == 2 and commit.parts == parts_digest({m: f"r-{m}-2" for m in "abc"}, "abc")
        for n in "abc":
            assert {x.to for x in net.log[n] if isinstance(x, SendPart) and x.attempt == 2} == set("abc") - {n}
            assert Reduce(("a", "b", "c"), 2) in net.log[n]
    else:
        assert commit == Commit(tuple(names), parts_digest({m: f"r-{m}-1" for m in names}, names), 1)


def test_a_scatter_round_ignores_what_belongs_to_an_attempt_it_left_and_keeps_what_comes_early():
    r = ScatterRound("a", ["a", "b", "c"], 0.0, ATTEMPT_S)
    assert r.start() == [SendPart("b", 1), SendPart("c", 1)]
    assert r.handle(PartArrived("b", "x", 2), 0.0) == []  # b dropped c already: kept for attempt 2
    acts = r.handle(PeerGone("c"), 0.1)
    assert isinstance(acts[0], Abort) and acts[1:] == [SendAbort("b", ("a", "b"), 2), SendPart("b", 2), Reduce(("a", "b"), 2)]
    assert r.handle(PartArrived("b", "old", 1), 0.1) == [] and r.handle(SliceArrived("b", "old", 1), 0.1) == []
    assert r.handle(Reduced("r-a", 2), 0.2) == [SendSlice("b", 2)]
    [have] = r.handle(SliceArrived("b", "r-b", 2), 0.2)
    assert have == SendHave("b", parts_digest({"a": "r-a", "b": "r-b"}, "ab"), 2)
    assert r.handle(HaveAll("b", have.parts, 2), 0.3) == [Commit(("a", "b"), have.parts, 2)]


@pytest.mark.parametrize("scatter", [False, True], ids=["all-gather", "reduce-scatter"])
def test_a_member_that_never_saw_the_dead_one_go_follows_the_survivor_that_did_at_once(scatter):
    """The CI failure of 2026-12-05: c dies before its first part, having connected to a only; b's
    own part for c fit in socket buffers, so b's transport never sees c go. a aborts and goes on
    with b; b follows a's word at once instead of waiting for c to its deadline (and then dropping
    a, which had gone ahead): both commit attempt 2 well before any deadline."""
    net = Net(["a", "b", "c"], scatter=scatter)
    net.dead.add("c")  # frozen to b: its sends to c vanish, no PeerGone
    net.inbox = [(to, e) for to, e in net.inbox if to != "c" and getattr(e, "peer", None) != "c"]
    net._send("a", net.rounds["a"].handle(PeerGone("c"), net.now))
    net.run()
    outcomes = net.outcomes()
    assert set(outcomes) == {"a", "b"} and len(set(outcomes.values())) == 1, outcomes
    [commit] = set(outcomes.values())
    assert isinstance(commit, Commit) and commit.members == ("a", "b") and commit.attempts == 2
    assert [x for x in net.log["b"] if isinstance(x, Abort)][0].reason == "a went on to attempt 2 without c"
    assert net.now < net.rounds["b"].deadline  # no deadline passed: the test's clock never moved


def test_an_abort_from_a_stranger_a_stale_one_or_one_that_dropped_this_member_changes_nothing():
    r = Round("b", ["a", "b", "c"], "d-b", 0.0, ATTEMPT_S)
    r.start()
    assert r.handle(Aborted("x", ("b", "x"), 2), 0.0) == []
    assert r.handle(Aborted("a", ("a", "b"), 1), 0.0) == []
    assert r.handle(Aborted("a", ("a", "c"), 2), 0.0) == []
    assert r.attempt == 1 and r.members == ("a", "b", "c")
    acts = r.handle(Aborted("a", ("a", "b"), 3), 0.0)  # two attempts on at a: both count here too
    assert acts[:2] == [Abort("a went on to attempt 3 without c", ("c",), ("a", "b"), 3), SendAbort("a", ("a", "b"), 3)]
    assert r.attempt == 3 and r.members == ("a", "b")


@pytest.mark.parametrize("scatter", [False, True], ids=["all-gather", "reduce-scatter"])
def test_a_member_killed_after_its_have_reached_only_some_leaves_no_survivor_behind(scatter):
    """c dies having said `have` to a but not to b: a commits with c; b drops c and retries, and
    (a retry of a reduce-scatter cuts new slices that a, done, never sends) learns a's commit."""
    net = Net(["a", "b", "c"], scatter=scatter)
    while True:
        i = next((k for k, (to, e) in enumerate(net.inbox) if not (to == "b" and isinstance(e, HaveAll) and e.peer == "c")), None)
        if i is None:
            break
        net.deliver(i)
    assert isinstance(net.rounds["a"].outcome, Commit) and not net.rounds["b"].done
    net.kill("c")
    net.run()
    assert net.rounds["b"].outcome == net.rounds["a"].outcome


def test_the_kind_of_a_round_depends_on_its_codec_alone():
    """Members may count different members (their records differ), so the kind of round must not
    depend on the count: uncompressed rounds are reduce-scatters, compressed ones all-gathers."""
    assert uses_scatter(2, "none") and uses_scatter(3, "none") and uses_scatter(9, "none")
    assert not uses_scatter(2, "int8") and not uses_scatter(8, "int8") and not uses_scatter(8, "fp16")


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 10**6), members=st.integers(2, 5), kill=st.integers(-1, 4), at=st.integers(0, 40), scatter=st.booleans(),
)
def test_members_that_commit_always_commit_the_same_parts(seed, members, kill, at, scatter):
    """Any delivery order, any member killed at any point, either kind of round: no round splits
    (every survivor commits the same members' parts, or every survivor fails)."""
    rng = random.Random(seed)
    names = [f"p{i}" for i in range(members)]
    net = Net(names, scatter=scatter)
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


def _record(peer, step, last_step=-1, data="127.0.0.1:9000", role="island", state="training", since=-1, outcomes=(None, None)):
    return IslandRecord(
        peer_id=peer, role=role, step=step, batch_tokens=64, tokens_per_s=1.0, step_seconds=0.1, next_sync=[0, 0],
        last_sync=[{"step": last_step, "outcome": outcomes[0]}, {"outcome": outcomes[1]}], contact=None, version="x", time=0.0,
        state=state, maddrs=[], data=data, since=since,
    )


def test_round_peers_are_the_live_islands_that_have_not_applied_the_round_yet():
    live = {
        "me": _record("me", 40),
        "behind": _record("behind", 31, data="10.0.0.2:7000"),  # still training towards step 40: a member
        "inside": _record("inside", 44, data="[::1]:7001"),  # started it and is within the overlap
        "past": _record("past", 46),  # beyond step 40 + overlap 5: it has applied the round
        "applied": _record("applied", 41, last_step=40),
        "no transport": _record("no transport", 40, data=None),
        "satellite": _record("satellite", 40, role="satellite"),
        "starting": _record("starting", 0, state="starting"),
        "bad address": _record("bad address", 40, data="nowhere"),
        "behind nat": _record("behind nat", 40, data="p2p"),  # reached over libp2p streams
    }
    assert round_peers("me", live, 0, 40, 5) == {"behind": ("10.0.0.2", 7000), "inside": ("::1", 7001), "behind nat": ("p2p", 0)}
    assert round_peers("me", live, 1, 40, 5)["applied"] == ("127.0.0.1", 9000)  # that was fragment 0's round


def test_an_island_that_began_training_past_a_rounds_start_is_not_its_member_nor_waited_for():
    """The chaos soak's convoy: an island restarted (or joined) at a step past a round's start never
    runs that round, yet the others waited the attempts' deadlines for it, round after round."""
    live = {
        "me": _record("me", 40),
        "resumed before": _record("resumed before", 30, since=30),  # trains towards step 40: a member
        "joined after": _record("joined after", 42, since=42),  # took the state at step 42
        "joined at": _record("joined at", 40, since=40),
    }
    assert set(round_peers("me", live, 0, 40, 5)) == {"resumed before"}
    assert [p for p, r in live.items() if left_round(r, 0, 40, 5)] == ["joined after", "joined at"]
    # what else a fresh record says: past the overlap, the round applied (alone), gone for good
    assert left_round(_record("past", 46), 0, 40, 5) and left_round(_record("applied", 41, last_step=40), 0, 40, 5)
    assert left_round(_record("left", 41, state="left"), 0, 40, 5)
    assert not left_round(_record("inside", 44), 0, 40, 5) and not left_round(_record("starting", 0, state="starting"), 0, 40, 5)
    # an older node's record says nothing of it: never taken as having left
    old = _record("old", 40).to_value()
    del old["since"]
    assert parse_island_record("old", old).since == -1 and not left_round(parse_island_record("old", old), 0, 40, 5)


def test_state_comes_first_from_islands_whose_last_rounds_agreed_with_the_swarm():
    """A poisoner whose rounds the others rejected is often the furthest island (it never waits): a
    satellite of the chaos soak took its state and trained from it for minutes."""
    live = {
        "me": _record("me", 40),
        "poisoner": _record("poisoner", 60, outcomes=("rejected", "solo")),
        "honest": _record("honest", 41, outcomes=("ok", "ok")),
        "half": _record("half", 45, outcomes=("ok", "failed")),
        "restarted": _record("restarted", 50),
    }
    assert state_donors("me", live) == ["honest", "half", "poisoner", "restarted"]
    # where most islands are, not the furthest: the poisoner never waits for a round
    assert typical_step(r for p, r in live.items() if p in ("honest", "poisoner")) == 41
    assert typical_step(r for p, r in live.items() if p != "me") == 45 and typical_step([]) is None


def test_the_announced_transport_address_prefers_what_others_can_dial():
    maddrs = ["/ip4/127.0.0.1/tcp/1/p2p/Qm", "/ip4/10.1.2.3/tcp/1/p2p/Qm"]
    assert data_address("0.0.0.0", 7000, maddrs) == "10.1.2.3:7000"
    assert data_address("0.0.0.0", 7000, maddrs[:1]) == "127.0.0.1:7000"
    assert data_address("192.168.0.9", 7000, maddrs) == "192.168.0.9:7000"
    assert parse_address("[::1]:80") == ("::1", 80)
    for bad in ("host", "host:", ":80", "host:99999", "host:x"):
        with pytest.raises(ValueError):
            parse_address(bad)


# --- parts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("codec,bound", [("none", 0.0), ("fp16", 1e-3), ("int8", 1 / 127), ("int4", 1 / 14), ("fp4", 1 / 4)])
def test_a_part_decodes_to_its_values_within_its_codecs_bound(codec, bound):
    values = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 10, 1000)
    data = encode_part(values, 3.5, codec, {"round": 7, "fp": [1.0, 2.0]})
    assert len(data) % 4 == 0 and len(data) >= part_bytes(1000, codec)
    meta, got = decode_part(data)
    assert meta["weight"] == 3.5 and meta["round"] == 7 and meta["fp"] == [1.0, 2.0] and meta["codec"] == codec
    # relative to the largest magnitude of the value's block (int8: blocks of 256)
    scale = values.abs().max() if codec != "int8" else values.abs().view(-1)[: 1000].max()
    assert (got - values).abs().max().item() <= bound * scale.item() + 1e-7


@pytest.mark.parametrize("codec", ["int4", "fp4", "int2"])
def test_a_4bit_part_reduces_to_its_decoded_values_across_reduction_blocks(codec):
    """Reduction reads a part in pieces (REDUCE_BLOCK values, its scales from the piece's first
    block): the pieces of a 4-bit part give exactly what decoding it whole gives."""
    values = torch.randn(300_001, generator=torch.Generator().manual_seed(2))
    data = encode_part(values, 2.0, codec)
    assert len(data) - part_bytes(300_001, codec) < 80 and part_bytes(300_001, codec) < 0.57 * 300_001
    mean, total, _ = reduce_parts(["a"], {"a": data})
    assert total == 2.0 and torch.equal(mean, decode_part(data)[1])


def test_reduction_is_the_weighted_mean_in_a_fixed_order_whatever_order_the_parts_came_in():
    parts = {p: encode_part(torch.randn(513, generator=torch.Generator().manual_seed(k)), w) for k, (p, w) in enumerate([("b", 1.0), ("a", 3.0), ("c", 0.5)])}
    mean, total, metas = reduce_parts(sorted(parts), parts)
    shuffled = dict(reversed(list(parts.items())))
    again, _, _ = reduce_parts(sorted(shuffled), shuffled)
    assert torch.equal(mean, again) and total == 4.5
    expected = sum(decode_part(parts[p])[1] * decode_part(parts[p])[0]["weight"] for p in parts) / 4.5
    assert torch.allclose(mean, expected, atol=1e-6)
    assert metas["a"]["value_norm"] == pytest.approx(float(decode_part(parts["a"])[1].norm()))


@pytest.mark.parametrize("numel", [0, 5, BLOCK * 7 + 3, 100_000])
def test_slices_cover_the_values_in_block_aligned_pieces(numel):
    for members in (1, 2, 3, 4, 7):
        bounds = slice_bounds(numel, members)
        assert len(bounds) == members and bounds[0][0] == 0 and bounds[-1][1] == numel
        assert all(a == b_prev for (_, b_prev), (a, _) in zip(bounds, bounds[1:], strict=False))
        assert all(a % BLOCK == 0 for a, _ in bounds if a < numel)


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_a_reduce_scatter_gives_the_all_gathers_mean(codec):
    """Each member reduces its slice of every part; the slices laid end to end are the mean the
    reduction of the whole parts gives (the same operations on each value; torch may round a
    vector's tail apart), with the same total weight and per-member norms."""
    g = torch.Generator().manual_seed(3)
    names = ["a", "b", "c", "d"]
    values = {n: torch.randn(BLOCK * 9 + 17, generator=g) for n in names}
    weights = {"a": 1.0, "b": 3.0, "c": 0.5, "d": 2.0}
    whole = {n: encode_part(values[n], weights[n], codec, {"round": 7}) for n in names}
    expect, total, metas = reduce_parts(names, whole)
    expect = expect.clone()
    cut = {n: encode_slices(values[n], weights[n], codec, {"round": 7}, names) for n in names}
    reduced = {m: reduce_slice(names, m, {n: cut[n][m] for n in names}) for m in names}
    segments, got_total, got_metas = assemble(names, reduced)
    got = torch.cat(segments)
    assert (got - expect).abs().max() < 1e-6 and got_total == total
    for n in names:
        assert got_metas[n]["round"] == 7 and got_metas[n]["weight"] == weights[n]
        assert got_metas[n]["value_norm"] == pytest.approx(metas[n]["value_norm"], rel=1e-6)


@pytest.mark.parametrize("factor", [50.0, 1.5])
def test_a_slice_spoiled_by_its_reducer_is_blamed_on_it(factor):
    """A member that returns its reduced slice scaled (tests/hostile.py `reducer`) is named by every
    member alike: a mean cannot be longer than its terms' weighted lengths."""
    g = torch.Generator().manual_seed(5)
    names = ["a", "b", "c"]
    values = {n: torch.randn(BLOCK * 6, generator=g) + 3.0 for n in names}  # alike: the mean is nearly as long as each
    cut = {n: encode_slices(values[n], 1.0 + "abc".index(n), "none", {}, names) for n in names}
    reduced = {m: reduce_slice(names, m, {n: cut[n][m] for n in names}) for m in names}
    assemble(names, reduced)  # honest: no complaint
    meta, mean = decode_part(reduced["b"])
    kept = {k: v for k, v in meta.items() if k not in ("weight", "codec", "numel")}
    reduced["b"] = encode_part(mean * factor, meta["weight"], "none", kept)
    with pytest.raises(SliceSpoiled) as e:
        assemble(names, reduced)
    assert e.value.owner == "b"
    # a member's non-finite values are its own to answer for (their norm says so), not the reducer's
    values["a"][3] = float("nan")
    cut["a"] = encode_slices(values["a"], 1.0, "none", {}, names)
    reduced = {m: reduce_slice(names, m, {n: cut[n][m] for n in names}) for m in names}
    metas = assemble(names, reduced)[2]
    assert math.isnan(metas["a"]["value_norm"]) and math.isfinite(metas["b"]["value_norm"])


def test_a_results_digest_is_of_its_values_however_they_are_cut():
    whole = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    digest = result_digest([whole])
    assert result_digest([whole[:300], whole[300:]]) == digest  # a reduce-scatter's slices, end to end
    other = whole.clone()
    other[999] = torch.nextafter(other[999], torch.tensor(2.0))  # one bit of one value
    assert result_digest([other]) != digest and len(digest) == 8


def test_segments_read_end_to_end_give_views_within_one_and_copies_across():
    whole = torch.arange(10.0)
    segments = [whole[:3], whole[3:7], whole[7:]]
    for a, b in [(0, 10), (0, 3), (3, 7), (2, 8), (9, 10), (5, 5)]:
        assert torch.equal(take(segments, a, b), whole[a:b])
    assert take(segments, 3, 7).data_ptr() == whole[3:].data_ptr()  # a view: not copied
    with pytest.raises(IndexError):
        take(segments, 4, 11)


def test_an_uncompressed_slice_is_sent_from_the_values_themselves_as_the_part_it_encodes():
    """In "none" a slice is (header and meta, a view of the values): not copied, and its bytes on
    the wire, chunk by chunk at any chunk size, are those of the part encode_part writes."""
    x = torch.randn(BLOCK * 5 + 9, generator=torch.Generator().manual_seed(2))
    names = ["a", "b", "c"]
    cut = encode_slices(x, 2.5, "none", {"round": 4}, names)
    for i, m in enumerate(names):
        a, b = slice_bounds(x.numel(), 3)[i]
        whole = bytes(encode_part(x[a:b], 2.5, "none", {"round": 4, "members": names, "numel_all": x.numel(), "slice": i}))
        head, body = cut[m]
        assert part_size(cut[m]) == len(whole) and torch.frombuffer(body, dtype=torch.float32).data_ptr() == x[a:].data_ptr()
        for chunk in (1, 7, len(head), len(head) + 1, 4096, len(whole)):
            assert b"".join(bytes(part_span(cut[m], o, chunk)) for o in range(0, len(whole), chunk)) == whole
        assert decode_part(whole)[0] == decode_part(bytes(head) + bytes(body))[0]


@pytest.mark.parametrize("scale", [1e-20, 1e18, float("inf")])
def test_a_reduced_slice_has_room_for_its_sums_however_long_they_print(scale):
    """A slice is reduced into its part before the sums of squares in its meta are known: their
    room is reserved for the longest float, tiny, huge or not finite."""
    names = ["a", "b"]
    values = {n: torch.full((BLOCK * 2,), scale * (1 + k) / 3) for k, n in enumerate(names)}
    cut = {n: encode_slices(values[n], 1.0 / 3, "none", {"fp": "x" * 40}, names) for n in names}
    reduced = {m: reduce_slice(names, m, {n: cut[n][m] for n in names}) for m in names}
    meta, mean = decode_part(reduced["a"])
    assert "error" not in meta and meta["metas"]["b"]["fp"] == "x" * 40 and meta["numel"] == BLOCK
    assert torch.equal(mean, (values["a"][:BLOCK] * 0.5 + values["b"][:BLOCK] * 0.5)) or not math.isfinite(scale)


def test_a_slice_cut_for_other_members_makes_every_member_reject_the_round():
    names = ["a", "b", "c"]
    x = torch.ones(BLOCK * 4)
    cut = {n: encode_slices(x, 1.0, "none", {}, names) for n in names}
    cut["c"] = encode_slices(x, 1.0, "none", {}, ["a", "b"])  # c saw two members
    reduced = {m: reduce_slice(names, m, {n: cut[n].get(m, cut[n]["a"]) for n in names}) for m in names}
    with pytest.raises(PartError, match="was cut for"):
        assemble(names, reduced)


def test_malformed_parts_are_refused():
    good = bytes(encode_part(torch.ones(10), 1.0))
    with pytest.raises(ValueError):
        encode_part(torch.ones(10), float("nan"))
    for bad in (b"", good[:-4], good + b"xxxx", b"\x00\x00\x00\x02{}" + bytes(40), b"\xff\xff\xff\xff"):
        with pytest.raises(PartError):
            decode_part(bad)
    with pytest.raises(PartError):
        reduce_parts(["a", "b"], {"a": good, "b": encode_part(torch.ones(11), 1.0)})
    with pytest.raises(PartError):
        reduce_parts(["a"], {"a": encode_part(torch.ones(10), 0.0)})


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


def test_every_frame_on_a_connection_has_its_own_nonce():
    seen = {nonce(sequence, direction) for direction in (0, 1) for sequence in (0, 1, 2, 1 << 40)}
    assert len(seen) == 8 and all(len(n) == 12 for n in seen)
    with pytest.raises(WireError):
        nonce(1 << 64, 0)


def test_a_parts_buffer_is_reused_only_once_nothing_refers_to_it():
    def address(buffer) -> int:
        return torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()

    size = (1 << 20) + 8  # a size no other test asks for
    first = new_buffer(size)
    held = torch.frombuffer(first, dtype=torch.float32)[10:20]  # a view, as a reduced fragment's tensors are
    a = address(first)
    del first
    second = new_buffer(size)
    b = address(second)
    assert b != a  # the first is still in use
    del held, second
    assert address(new_buffer(size)) in {a, b}  # both are free now: one is reused, no new memory
