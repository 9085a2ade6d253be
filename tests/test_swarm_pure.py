"""Record parsing, shard choice, lateness, the codec of a satellite's download."""

import json

from hypothesis import given
from hypothesis import strategies as st
from islands.node.status import lateness, render_table
from islands.protocols.records import (
    IslandRecord,
    choose_shard,
    live_records,
    parse_island_record,
    redial_targets,
    remember,
)

GOOD = {
    "role": "island", "step": 40, "batch_tokens": 1024, "tokens_per_s": 9000.0, "step_seconds": 0.07,
    "next_sync": [60, 45, 50, 55], "last_sync": [{"step": 40, "outcome": "ok", "group_size": 3}], "contact": None,
    "version": "0.1.0", "time": 100.0, "state": "training", "maddrs": [], "shard": 2,
}


def test_record_round_trip():
    r = parse_island_record("peerA", GOOD)
    assert r is not None and r.step == 40 and r.shard == 2
    assert parse_island_record("peerA", r.to_value()) == r


@given(st.dictionaries(st.sampled_from(sorted(GOOD)), st.one_of(st.none(), st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=3))))
def test_malformed_records_are_dropped_not_raised(value):
    r = parse_island_record("p", value)
    assert r is None or isinstance(r, IslandRecord)


def test_bad_roles_and_negative_steps_are_dropped():
    assert parse_island_record("p", {**GOOD, "role": "king"}) is None
    assert parse_island_record("p", {**GOOD, "step": -1}) is None
    assert parse_island_record("p", "not a dict") is None


def _rec(peer, **kw):
    return parse_island_record(peer, {**GOOD, **kw})


def test_remember_keeps_the_newest_record_of_each_peer():
    known = remember({}, {"a": _rec("a", time=100.0, step=1), "b": _rec("b", time=100.0)})
    known = remember(known, {"a": _rec("a", time=90.0, step=0)})  # an older copy from a slow replica
    assert known["a"].step == 1 and set(known) == {"a", "b"}
    known = remember(known, {})  # expired from the DHT: still known
    assert set(known) == {"a", "b"}
    assert remember(known, {"a": _rec("a", time=110.0, step=5)})["a"].step == 5


def test_redial_targets_are_recent_peers_that_did_not_leave_and_join_peers():
    known = {
        "me": _rec("me", maddrs=["/ip4/1.1.1.1/tcp/1/p2p/me"]),
        "a": _rec("a", time=100.0, maddrs=["/ip4/1.1.1.1/tcp/2/p2p/a"]),
        "b": _rec("b", time=100.0, maddrs=["/ip4/1.1.1.1/tcp/3"], state="left"),
        "c": _rec("c", time=100.0 - 700, maddrs=["/ip4/1.1.1.1/tcp/4"]),
        "d": _rec("d", time=100.0, maddrs=[]),
        "sat": _rec("sat", time=100.0, maddrs=["/ip4/1.1.1.1/tcp/5"], role="satellite"),  # a DHT client: never dialled
    }
    join = ["/ip4/9.9.9.9/tcp/9/p2p/j", "/ip4/1.1.1.1/tcp/3/p2p/b", "/ip4/9.9.9.9/tcp/8"]
    targets = redial_targets(known, now=100.0, me="me", join=join)
    assert targets == {"a": ["/ip4/1.1.1.1/tcp/2"], "j": ["/ip4/9.9.9.9/tcp/9"]}


def test_live_records_drop_stale_and_withdrawn():
    records = {"a": _rec("a", time=100.0), "b": _rec("b", time=50.0), "c": _rec("c", time=100.0, state="left")}
    assert set(live_records(records, now=105.0, ttl_s=20)) == {"a"}


def test_islands_starting_together_take_distinct_shards():
    records = {p: _rec(p, state="starting", shard=-1) for p in ("p1", "p2", "p3")}
    shards = {p: choose_shard(p, records, 16) for p in records}
    assert sorted(shards.values()) == [0, 1, 2]


def test_joiner_takes_a_free_shard():
    records = {"a": _rec("a", shard=0), "b": _rec("b", shard=1), "me": _rec("me", state="starting", shard=-1)}
    assert choose_shard("me", records, 16) == 2


def test_lateness_and_table():
    records = {"a": _rec("a", step=100), "b": _rec("b", step=97), "c": _rec("c", step=80)}
    assert lateness(records, window=20, fragments=4) == {"c": 20}
    table = render_table({"run_id": "r", "window": 20, "fragments": 4, "overlap": 4, "model": {"n_layer": 4}}, records, now=101.0)
    assert "3 live island(s)" in table and "20 steps" in table and "f0@40:okx3" in table


def test_islands_never_wait_for_satellites():
    from islands.protocols.records import expected_group

    records = {
        "a": _rec("a"), "b": _rec("b", state="starting"),
        "sat-up": _rec("sat-up", role="satellite", contact_until=130.0),
        "sat-down": _rec("sat-down", role="satellite"),
    }
    # me, a and b: a satellite in contact deposits with an island instead of joining its round
    assert expected_group("me", records) == 3
    assert parse_island_record("s", {**GOOD, "contact_until": "soon"}) is None


def test_a_satellite_deposits_with_live_islands_or_else_the_ones_it_saw_last():
    from islands.protocols.records import deposit_candidates

    live = {"a": _rec("a"), "b": _rec("b", state="starting"), "s": _rec("s", role="satellite")}
    assert deposit_candidates("me", live, {}, now=100.0) == ["a"]
    known = {
        "a": _rec("a", time=60.0), "c": _rec("c", time=80.0), "gone": _rec("gone", time=90.0, state="left"),
        "old": _rec("old", time=100.0 - 700), "s": _rec("s", role="satellite", time=95.0),
    }
    # out of contact the islands' records lapsed: the most recent training islands it saw
    assert deposit_candidates("me", {}, known, now=100.0) == ["c", "a"]


def test_a_round_waits_for_an_island_still_training_towards_it_but_not_for_a_dead_one():
    from islands.node.timeouts import Timeouts
    from islands.protocols.records import arrival_s

    # 1024 tokens at 2048 tokens/s: 0.5 s a step, wall time
    slow = _rec("slow", step=40, time=100.0, tokens_per_s=2048.0)
    assert arrival_s(45, [slow], now=101.0) == 1.5  # at step 45 by 102.5
    assert arrival_s(40, [slow], now=101.0) == 0.0  # already there
    ahead = _rec("ahead", step=50, time=100.0)
    assert arrival_s(45, [ahead, slow], now=101.0) == 1.5
    # a crashed island's record stops at its last step and time: it is soon "due" in the past
    assert arrival_s(45, [slow], now=110.0) == 0.0
    # no pace yet: its compute step time stands in for it
    fresh = _rec("fresh", step=0, time=100.0, tokens_per_s=0.0, step_seconds=0.25)
    assert arrival_s(4, [fresh], now=100.0) == 1.0
    # the end-of-run rounds wait for everyone (bounded)
    assert Timeouts(match_wait_s=3.0).last_round_match_s == 12.0
    assert Timeouts(match_wait_s=30.0).last_round_match_s == 40.0


def test_at_the_end_a_fragment_that_one_island_got_wrong_is_healed_by_all_of_them():
    """A last round can split: this island got `ok`, another `failed` without its result. Only the
    fingerprints the islands publish show it, so every island heals that fragment, then looks again."""
    import asyncio

    from islands.node.sync import FragmentSync
    from islands.node.timeouts import Timeouts
    from islands.protocols.diloco import DiLoCoConfig, RoundResult, StreamingDiLoCo

    from .test_protocols_pure import _toy_model

    params = dict(_toy_model().named_parameters())
    names = list(params)
    diloco = StreamingDiLoCo(DiLoCoConfig(window=8, fragments=2, overlap=0), [names[:2], names[2:]], params)

    class Averager:
        compression = "none"
        healed: list[tuple[int, int, float]] = []

        def fold_deposits(self, c):
            return c

        async def average(self, c, wait_s=None):
            return RoundResult(outcome="ok", delta=c.delta, group_size=2, weight=c.weight)

        async def consensus(self, fragment, round_, global_, momentum, stale=False, apart=(0.0, 0.0), wait_s=None):
            self.healed.append((fragment, round_, wait_s))
            return {n: t + 0.0 for n, t in global_.items()}, momentum, 100

    looks = []

    async def compare(look, mine):
        looks.append(look)
        if look == 1:  # the other island's fragment 1 differs
            return [[mine[0], [x + 1.0 for x in mine[1]]]]
        return [mine]

    async def run_torch(fn, *args):
        return fn(*args)

    averager = Averager()
    sync = FragmentSync(diloco, averager, params, lambda record: None, Timeouts(match_wait_s=3.0), run_torch)
    last_rounds, verdicts, sent = asyncio.run(sync.agree(40, compare))
    assert last_rounds == ["ok", "ok"] and verdicts == ["ok", "ok"] and looks == [1, 2]
    # fragment 1 only, in a consensus round of its own (after its last round: 5, the schedule's
    # round after fragment 1's last start by step 40, 36), waiting as long as the last rounds
    assert averager.healed == [(1, 6, 12.0)] and sent == 100
    # still different after every look: `failed`, and no more than END_LOOKS looks
    averager.healed.clear()
    looks.clear()

    async def differ(look, mine):
        looks.append(look)
        return [[mine[0], [x + 1.0 for x in mine[1]]]]

    assert asyncio.run(sync.agree(40, differ))[1] == ["ok", "failed"] and looks == [1, 2, 3] and len(averager.healed) == 2


def test_an_island_record_carries_its_fingerprints_at_the_end():
    r = _rec("a", final={"check": 2, "fp": [[1.0, 2.0], [3, 4]]})
    assert r.final == {"check": 2, "fp": [[1.0, 2.0], [3.0, 4.0]]}
    assert parse_island_record("a", {**GOOD, "final": {"check": 1}}) is None
    assert parse_island_record("a", {**GOOD, "final": {"check": "x", "fp": []}}) is None
    assert _rec("a").final is None


def test_a_satellite_never_downloads_values_in_int8():
    from islands.protocols.parts import values_codec

    assert values_codec("none") == "none"
    assert values_codec("fp16") == "fp16"
    assert values_codec("int8") == "fp16"


def test_views_over_the_records_of_the_other_islands():
    from islands.protocols.records import furthest, other_islands, peer_progress, swarm_step

    live = {
        "me": _rec("me", step=30),
        "a": _rec("a", step=40, time=100.0, tokens_per_s=2048.0, batch_tokens=1024),
        "b": _rec("b", step=44, time=100.0, tokens_per_s=0.0),
        "sat": _rec("sat", role="satellite", step=90),
        "gone": _rec("gone", step=99, state="left"),
    }
    others = other_islands("me", live)
    assert set(others) == {"a", "b"} and furthest(others) == ("b", 44) and furthest({}) is None
    # a: 2 steps a second since its record at t=100; b: no pace yet, its step as recorded
    assert swarm_step(others.values(), now=103.0) == 46 and swarm_step(others.values(), now=101.0) == 44
    assert peer_progress([live["a"]], 0) == [(40, 40)] and peer_progress([live["a"]], 9) == [(40, -1)]


def test_the_suites_split_check_finds_a_round_that_two_members_ended_differently(tmp_path):
    from types import SimpleNamespace

    from tests.procs import NODE, split_rounds

    def node(name, peer, syncs):
        path = tmp_path / f"{name}.jsonl"
        lines = [{"event": "started", "peer_id": peer}, *({"event": "sync", **s} for s in syncs)]
        path.write_text("".join(json.dumps(e) + "\n" for e in lines))
        return SimpleNamespace(log_path=path, command=NODE)

    ok = {"fragment": 0, "round": 3, "outcome": "ok", "digest": "d1", "members": ["A", "B"]}
    a, b = node("a", "A", [ok]), node("b", "B", [ok])
    assert split_rounds([a, b]) == []
    b = node("b", "B", [{**ok, "outcome": "failed", "digest": None, "members": None}])
    assert split_rounds([a, b]) == ["fragment 0 round 3: A ok d1 with 2 members, B failed None"]
