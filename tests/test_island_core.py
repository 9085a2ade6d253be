"""The island core in process: real IslandCore, FragmentSync and Streaming DiLoCo; fake records,
fake rounds with scripted faults, and a clock the test moves (tests/fakes.py). Each scenario
asserts the exact sequence of rounds an island sees, which multi-process tests can only bound."""

import asyncio

import pytest
import torch

from .fakes import Board, Clock, Hub, ToyIsland, config

pytestmark = pytest.mark.timeout(30)


def _swarm(*targets: float, **cfg_kwargs):
    board, hub = Board(Clock()), Hub()
    cfg = config(**cfg_kwargs)
    return board, hub, [ToyIsland(name, board, hub, cfg, t) for name, t in zip("abcdef", targets, strict=False)]


def _same(x: ToyIsland, y: ToyIsland) -> bool:
    gx, gy = x.core.diloco.global_state(), y.core.diloco.global_state()
    return all(torch.equal(gx[n], gy[n]) for n in gx)


def _starts(steps: int, window: int = 10):
    """(start step, fragment) of every round of a run of `steps` steps, window 10, two fragments."""
    return [(t, p) for t in range(window, steps + 1) for p in (0, 1) if t % window == p * window // 2]


async def test_two_islands_average_every_round_and_end_with_one_model():
    board, hub, (a, b) = _swarm(1.0, -1.0, steps=40)
    for island in (a, b):
        await island.join()
    await asyncio.gather(a.run(40), b.run(40))
    await asyncio.gather(a.leave(), b.leave())
    for island in (a, b):
        assert island.syncs() == [(t, p, "ok") for t, p in _starts(40)]
        agree = island.events.of("agree")[0]
        assert agree["last_rounds"] == ["ok", "ok"] and agree["fragments"] == ["ok", "ok"]
    assert _same(a, b)
    assert not torch.equal(a.params["a"], b.params["a"])  # the local values stay each island's own


async def test_a_member_that_dies_mid_round_fails_that_round_then_is_routed_around():
    """B dies in the round of fragment 1 that starts at step 45 (round 4): A's round fails and A
    applies its own update; A's next rounds fail while B's record is live (12 s: 24 of A's steps of
    0.5 s; the fake rounds fail them at once, the real ones after their match wait), then A goes on
    alone."""
    board, hub, (a, b) = _swarm(1.0, -1.0, steps=120)
    hub.crash[(1, 4)] = "b"
    for island in (a, b):
        await island.join()
    await asyncio.gather(a.run(120), b.run(120))
    assert b.step == 45 and b.syncs()[-1][:2] == (40, 0)
    await a.leave()
    assert a.syncs() == _expect(120, ok=44, failed=65, solo=120)
    assert [e["policy"] for e in a.events.of("sync") if e["step"] == 45] == ["own_update"]
    assert a.events.of("agree") == []  # alone at the end: nobody to agree with


async def test_a_split_last_round_is_healed_by_the_end_of_run_agreement():
    """The end-of-run round of fragment 0 splits (A `ok`, B `failed`): their agreed values differ;
    the islands' fingerprints show it, and one consensus round makes them one model again."""
    board, hub, (a, b) = _swarm(1.0, -1.0, steps=40)
    for island in (a, b):
        await island.join()
    await asyncio.gather(a.run(40), b.run(40))
    last = a.core.schedule.round_of(40) + 1  # the end-of-run round, after fragment 0's round 4
    hub.split[(0, last)] = "b"
    await asyncio.gather(a.leave(), b.leave())
    assert a.events.of("agree")[0]["last_rounds"] == ["ok", "ok"]
    assert b.events.of("agree")[0]["last_rounds"] == ["failed", "ok"]
    for island in (a, b):
        assert island.events.of("agree")[0]["fragments"] == ["ok", "ok"]
    # one consensus round, of fragment 0, keyed by the look after the last round
    assert sorted(k for k in hub.log if k[0] == "consensus") == [("consensus", 0, last + 1, p, True) for p in "ab"]
    assert _same(a, b)


async def test_an_island_a_round_behind_in_a_fragment_at_the_end_still_ends_with_the_others_model():
    """B took the swarm's state right before the end while fragment 1's round was in flight at its
    donor (a rejoin, the chaos smoke run): its fragment 1 is a round behind. The end-of-run round is
    numbered by the schedule, so B meets A in it (stale) rather than in a round of its own, and
    the consensus round after it makes them one model."""
    board, hub, (a, b) = _swarm(1.0, -1.0, steps=40)
    for island in (a, b):
        await island.join()
    await asyncio.gather(a.run(40), b.run(40))
    d = b.core.diloco
    d.counters[1].round -= 1
    for value in d.globals[1].values():
        value.add_(0.01)  # the values of the round before
    await asyncio.gather(a.leave(), b.leave())
    last = a.core.schedule.last_round(1, 40) + 1
    assert [e["last_rounds"] for e in (a.events.of("agree")[0], b.events.of("agree")[0])] == [["ok", "ok"]] * 2
    assert ("consensus", 1, last + 1, "b", True) in hub.log
    for island in (a, b):
        assert island.events.of("agree")[0]["fragments"] == ["ok", "ok"]
    assert _same(a, b)


async def test_a_split_round_in_training_is_healed_by_the_next_round_of_its_fragment():
    """A round of fragment 1 splits mid-run: the next round of that fragment sees different
    fingerprints and runs a consensus round; from then on the islands agree."""
    board, hub, (a, b) = _swarm(1.0, -1.0, steps=60)
    hub.split[(1, 2)] = "b"  # fragment 1's round that starts at step 25
    for island in (a, b):
        await island.join()
    await asyncio.gather(a.run(60), b.run(60))
    await asyncio.gather(a.leave(), b.leave())
    for island, at_25 in ((a, "ok"), (b, "failed")):
        syncs = {(e["step"], e["fragment"]): e for e in island.events.of("sync")}
        assert syncs[(25, 1)]["outcome"] == at_25
        assert {k for k, e in syncs.items() if e["consensus"] is not None} == {(35, 1)}
        assert syncs[(35, 1)]["consensus"] == "ok"
    assert sorted(k for k in hub.log if k[0] == "consensus") == [("consensus", 1, 3, p, True) for p in "ab"]
    assert _same(a, b)


async def test_a_partition_trains_apart_and_the_first_round_after_it_merges_the_sides():
    """Cut after step 30: each side's rounds fail while the other's record (as of the cut) is
    live, then run alone; after the heal at step 80 the first round of each fragment finds the
    bases apart and re-merges them with a consensus round."""
    board, hub, (a, b) = _swarm(1.0, -1.0, steps=120)
    for island in (a, b):
        await island.join()
    await asyncio.gather(a.run(30), b.run(30))
    board.partition({"a"}, {"b"})
    await asyncio.gather(a.run(80), b.run(80))
    board.heal()
    await asyncio.gather(a.run(120), b.run(120))
    await asyncio.gather(a.leave(), b.leave())
    for island in (a, b):
        assert island.syncs() == _expect(120, ok=30, failed=40, solo=80, ok_again=120)
        merged = {(e["step"], e["fragment"]) for e in island.events.of("sync") if e["consensus"] is not None}
        assert merged == {(85, 1), (90, 0)}
        assert all(e["consensus"] == "ok" for e in island.events.of("sync") if e["consensus"] is not None)
        assert island.events.of("agree")[0]["fragments"] == ["ok", "ok"]
    assert _same(a, b)


async def test_a_joiner_takes_the_swarm_state_and_step_and_then_averages_with_it():
    board, hub, (a, b, c) = _swarm(1.0, -1.0, 0.5, steps=80)
    for island in (a, b):
        await island.join()
    await asyncio.gather(a.run(33), b.run(33))
    await c.join()
    joined = c.events.of("join")[0]
    # the donor furthest ahead (both at 33 here: the larger peer id)
    assert joined == {**joined, "step": 33, "state_from": "b", "sources": ["b", "b"], "bytes": 2 * 2 * 6 * 4}
    assert _same(c, a)
    assert all(torch.equal(c.params[n], c.core.diloco.global_state()[n]) for n in c.params)
    await asyncio.gather(a.run(80), b.run(80), c.run(80))
    assert [(t, p) for t, p, _ in c.syncs()] == [s for s in _starts(79) if s[0] > 33]  # 80's is in flight
    assert all(e["outcome"] == "ok" and e["group_size"] == 3 for e in c.events.of("sync"))


def _expect(steps: int, **until: int) -> list[tuple[int, int, str]]:
    """The rounds of a run of `steps` steps, each with the outcome of the phase it starts in:
    `until` maps outcomes, in order, to the last start step of their phase (`ok_again`: `ok`)."""
    bounds = list(until.items())
    out = []
    for t, p in _starts(steps):
        outcome = next(o for o, last in bounds if t <= last)
        out.append((t, p, outcome.removesuffix("_again")))
    return out


async def test_a_satellite_deposits_in_contact_and_the_islands_never_wait_for_it():
    """A satellite in contact 10 s of every 30 s (the clock runs 1.5 s a step of the three):
    out of contact its rounds are skipped and it keeps accumulating; in contact it leaves its
    progress (of the fragment most overdue) with an island, whose next round of that fragment folds it in; the islands' rounds
    are pairs throughout, and the satellite takes no part in the end-of-run agreement."""
    board, hub = Board(Clock()), Hub()
    a, b = (ToyIsland(n, board, hub, config(steps=120), t) for n, t in (("a", 1.0), ("b", -1.0)))
    spec = "up 10s every 30s"
    # a round needs --match-wait-s + 1 s of contact left (Network.round_budget_s): 3 s here
    sat = ToyIsland("s", board, hub, config(steps=120, role="satellite", contact=spec, match_wait_s=2.0), 0.5, contact=spec)
    for island in (a, b, sat):
        await island.join()
    await asyncio.gather(a.run(120), b.run(120), sat.run(120))
    await asyncio.gather(a.leave(), b.leave(), sat.leave())
    for island in (a, b):
        assert island.syncs() == _expect(120, ok=120)
        assert all(e["group_size"] == 2 for e in island.events.of("sync"))
    theirs = sat.events.of("sync")
    assert {(e["outcome"], e["policy"]) for e in theirs} == {("skipped_no_contact", "accumulate"), ("ok", "deposited")}
    deposited = [e for e in theirs if e["outcome"] == "ok"]
    # its windows (every 20 steps) meet only one fragment's turn (every 10): at each turn in contact
    # it deposits the fragment most overdue, so the two take turns (at the slot's own fragment
    # alone, fragment 1 went undeposited from step 45 to the end, its tokens lost)
    assert [e["fragment"] for e in deposited] == [1, 0, 1, 0, 1]
    assert max(c.tokens_since_sync for c in sat.core.diloco.counters) < 2 * max(e["tokens"] for e in deposited)
    # every deposit reached a round of the island it was left with (the first by peer id here)
    assert sum(e["deposits"] for e in a.events.of("sync")) == len(deposited) >= 4
    assert sum(e["deposits"] for e in b.events.of("sync")) == 0
    assert [e["in_contact"] for e in sat.events.of("contact")][:4] == [True, False, True, False]
    assert sat.events.of("agree") == [] and a.events.of("agree")[0]["fragments"] == ["ok", "ok"]
    assert _same(a, b)


async def test_a_restarted_island_behind_the_swarm_catches_up_and_ends_with_its_model():
    """B is back from its checkpoint at step 12 while A is at 40: B takes A's state and step,
    averages with A from its next round on, and the two end with one model."""
    board, hub, (a, b) = _swarm(1.0, -1.0, steps=80)
    await a.join()
    await a.run(40)
    b.step = 12  # resumed from its checkpoint (the resumed state itself is the checkpoint tests')
    await b.join()
    assert b.events.of("join")[0]["step"] == 40 and _same(a, b)
    await asyncio.gather(a.run(80), b.run(80))
    await asyncio.gather(a.leave(), b.leave())
    assert b.syncs() == [(t, p, "ok") for t, p in _starts(80) if t > 40]
    assert [o for t, _, o in a.syncs() if t > 40] == ["ok"] * 8
    assert _same(a, b)


async def test_an_island_back_from_a_freeze_takes_the_swarms_state_and_step_instead_of_training_alone():
    """The chaos soak: B, frozen (SIGSTOP) at step 30 while A trained on to 70, came back and
    trained alone through rounds A had applied, its tokens in none of them. Now, more than a window
    behind, B takes A's state and step between two rounds, and averages with A from then on."""
    board, hub, (a, b) = _swarm(1.0, -1.0, steps=120)
    for island in (a, b):
        await island.join()
    await asyncio.gather(a.run(30), b.run(30))
    board.partition({"a"}, {"b"})  # B is frozen: A cannot reach it, and B does nothing
    await a.run(70)
    board.heal()
    await b.run(35)  # back: it applies the round it was in, then takes A's state and step
    back = b.events.of("join")[-1]
    assert b.step == 70 and back["step"] == 70 and back["state_from"] == "a"
    assert [t for t, _, _ in b.syncs() if t > 30] == []  # no round of the steps it missed
    await asyncio.gather(a.run(120), b.run(120))
    await asyncio.gather(a.leave(), b.leave())
    after = [e for e in b.events.of("sync") if e["step"] > 30]
    assert [(e["step"], e["fragment"]) for e in after] == [s for s in _starts(120) if s[0] > 70]
    assert all(e["group_size"] == 2 for e in after)  # every round with A from then on
    # its first round of fragment 0 after the jump is stale (A's was in flight at step 70): it
    # rebases, as a joiner does; the toy's islands pull towards +1 and -1, so the delta B brings
    # next, from those values, is 4x A's own lately and that round is rejected by both; the next
    # heals it, and the two end with one model
    assert [e["policy"] for e in after if e["fragment"] == 0][:3] == ["rebased", "own_update", "averaged"]
    assert b.events.of("agree")[0]["fragments"] == ["ok", "ok"]
    assert _same(a, b)


async def test_a_poisoned_round_is_rejected_by_both_and_the_next_round_of_its_fragment_heals_them():
    """B's contribution to fragment 0's round 2 (step 20) arrives 1000 times too large: both
    islands' checks of the result (protocols/validation.py) reject it and apply their own update;
    their bases then differ, and the next round of fragment 0 re-merges them."""
    board, hub, (a, b) = _swarm(1.0, -1.0, steps=60)
    hub.poison[(0, 2)] = "b"
    for island in (a, b):
        await island.join()
    await asyncio.gather(a.run(60), b.run(60))
    await asyncio.gather(a.leave(), b.leave())
    for island in (a, b):
        syncs = {(e["step"], e["fragment"]): e for e in island.events.of("sync")}
        assert [k for k, e in syncs.items() if e["outcome"] != "ok"] == [(20, 0)]
        assert syncs[(20, 0)]["policy"] == "own_update" and "above" in syncs[(20, 0)]["reason"]
        assert [k for k, e in syncs.items() if e["consensus"] is not None] == [(30, 0)]
    assert _same(a, b)


async def test_a_joiner_whose_first_update_is_small_applies_its_first_rounds_as_the_others_do():
    """C joins at step 38, two steps before fragment 0's round at 40, with its own update in that
    round a sliver of A's and B's (as a joiner's first window is: a few steps; here its target is
    where it starts). On its own check (no accepted norms yet: its own update the reference) it
    would reject their average while they apply it: one round, two models. Now it judges with
    the norms its donor accepted (NormHistory.seed), and every member runs every member's check
    on the same result (validation.round_verdict): every round is applied by all three alike."""
    board, hub, (a, b, c) = _swarm(1.0, 1.2, 0.0, steps=80)
    for island in (a, b):
        await island.join()
    await asyncio.gather(a.run(38), b.run(38))
    await c.join()
    assert c.events.of("join")[0]["step"] == 38
    assert len(c.core.rounds.history[0].norms) == 3  # the rounds of fragment 0 at steps 10, 20, 30
    c.target = {n: p + 1e-4 for n, p in c.params.items()}
    await asyncio.gather(a.run(80), b.run(80), c.run(80))
    await asyncio.gather(a.leave(), b.leave(), c.leave())
    assert c.syncs()[0] == (40, 0, "ok")
    for island in (a, b):
        assert [s for s in island.syncs() if s[0] >= 40] == c.syncs()
    assert _same(a, c) and _same(b, c)


async def test_a_joiner_that_got_no_state_gives_none_until_a_round_gives_it_the_swarms():
    """The chaos soak's finding: C joined as its only donor died mid-download, so it trained on
    from its own initial values at the swarm's step; a restarted island then took C's values as
    the swarm's, and a second joiner took C's state at step 0 (C's record still said 0). Now
    C gives no state until a round gives it the swarm's values; D, joining next, takes A's or
    B's even though C is first in the donors' order (same step, larger peer id); E, asking D
    before D's first step, gets D's step; and after its first rounds C gives the swarm's state.
    A stale island rebases on a donor at the round it needs, not on one as stale as itself."""
    board, hub, (a, b, c, d, e) = _swarm(1.0, -1.0, 0.5, 0.2, 0.3, steps=80)
    for island in (a, b):
        await island.join()
    await asyncio.gather(a.run(33), b.run(33))
    hub.no_state = {"a", "b"}
    await c.join()
    assert c.events.of("join")[0] == {**c.events.of("join")[0], "step": 33, "state_from": None, "bytes": 0}
    assert c.core.unsound == {0, 1} and not _same(c, a)
    hub.no_state = set()
    await d.join()
    assert d.events.of("join")[0] == {**d.events.of("join")[0], "step": 33, "sources": ["b", "b"]}
    assert _same(d, a)
    hub.no_state = {"a", "b"}
    await e.join()
    assert e.events.of("join")[0] == {**e.events.of("join")[0], "step": 33, "sources": ["d", "d"]}
    hub.no_state = set()
    await asyncio.gather(*(i.run(60) for i in (a, b, c, d, e)))
    # C's first round of each fragment was stale (weight ~0) and rebased it on an island's values
    # (D and E, whose state came as fragment 0's round 3 was in flight, are stale in round 4 too:
    # they rebase on A's or B's, not on each other's, which is behind; every island at its round)
    assert [(ev["fragment"], ev["outcome"], ev["policy"]) for ev in c.events.of("sync")][:2] == [(1, "ok", "rebased"), (0, "ok", "rebased")]
    assert all([ev["policy"] for ev in i.events.of("sync")][:2] == ["averaged", "rebased"] for i in (d, e))
    assert c.core.unsound == set()
    hub.no_state = {"a", "b", "d", "e"}
    f = ToyIsland("f", board, hub, config(steps=80), 0.0)
    await f.join()
    assert f.events.of("join")[0]["sources"] == ["c", "c"] and _same(f, c)
    await asyncio.gather(*(i.run(80) for i in (a, b, c, d, e, f)))
    await asyncio.gather(*(i.leave() for i in (a, b, c, d, e, f)))
    assert all(_same(a, i) for i in (b, c, d, e, f))


async def test_an_island_told_to_wait_for_islands_does_not_once_the_run_is_under_way():
    """--wait-islands N holds the start of a run until N islands are here; an island restarted
    later with the same command line (its checkpoint set aside: step 0) joins at once. Found by
    the chaos soak: the restarted island waited the whole wait timeout while its record, in the
    others' count of the swarm, made their rounds fail with no member to average with."""
    board, hub, (a, b, c) = _swarm(1.0, -1.0, 0.5, steps=40)
    start = board.clock()
    await c.network.refresh()
    assert await c.network.wait_for_islands(3, 60.0, lambda: False, lambda n: None) == 1
    assert board.clock() - start == 60.0  # alone at the start of a run: the whole wait
    await a.join()
    await a.run(5)
    await b.network.refresh()  # as a node's start-up has read the records before it waits
    start = board.clock()
    assert await b.network.wait_for_islands(4, 60.0, lambda: False, lambda n: None) == 3
    assert board.clock() == start  # A has trained: B joins the run at once
