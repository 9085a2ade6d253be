"""Fragment averaging on real hivemind DHTs and averagers (in one test process, real sockets on 127.0.0.1)."""

import asyncio
import time

import pytest
import torch
from islands.node.net.averaging import FragmentAveraging
from islands.node.net.dht import SwarmDHT
from islands.node.timeouts import Timeouts
from islands.protocols.consensus import fingerprint

pytestmark = [pytest.mark.network, pytest.mark.timeout(120)]

SHAPES = [[("w", (64, 32)), ("b", (32,))]]
TIMEOUTS = Timeouts(match_wait_s=3.0, allreduce_s=20.0, next_chunk_s=5.0)


@pytest.fixture
def pair():
    """Two islands' averaging on two DHTs; everything shut down afterwards."""
    made = []

    def make(compression="none"):
        first = SwarmDHT.start("t", host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        made.append(first)
        second = SwarmDHT.start("t", host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.visible_maddrs())
        made.append(second)
        avs = [FragmentAveraging(d.dht, "t", SHAPES, compression, lambda: 2, TIMEOUTS) for d in (first, second)]
        made.extend(avs)
        return avs

    yield make
    for thing in reversed(made):
        thing.shutdown()


def _contribution(round_, value, weight, global_value=0.0):
    from islands.protocols.diloco import Contribution

    delta = {"w": torch.full((64, 32), value), "b": torch.full((32,), -value)}
    g = [torch.full((64, 32), global_value), torch.zeros(32)]
    return Contribution(fragment=0, round=round_, step=round_ * 20, delta=delta, weight=weight, fingerprint=fingerprint(g))


def _both(a, b, ca, cb, delay_s=0.0):
    async def late():
        await asyncio.sleep(delay_s)
        return await b.average(cb)

    async def run():
        return await asyncio.gather(a.average(ca), late())

    return asyncio.run(run())


def test_token_weighted_round_and_late_partner(pair):
    a, b = pair()
    ra, rb = _both(a, b, _contribution(1, 1.0, 1000.0), _contribution(1, 4.0, 2000.0), delay_s=1.0)
    for r in (ra, rb):
        assert r.outcome == "ok" and r.group_size == 2 and r.weight == 3000.0
        assert torch.allclose(r.delta["w"], torch.full((64, 32), 3.0))  # (1*1000 + 4*2000) / 3000
        assert not r.consensus
        assert r.bytes_sent == 2 * (64 * 32 + 32) * 4 // 2


def test_different_rounds_never_average_and_fail_in_bounded_time(pair):
    a, b = pair()
    start = time.monotonic()
    ra, rb = _both(a, b, _contribution(3, 1.0, 1.0), _contribution(4, 4.0, 1.0))
    assert (ra.outcome, rb.outcome) == ("failed", "failed")
    assert torch.equal(ra.delta["w"], torch.full((64, 32), 1.0))  # own update kept
    assert time.monotonic() - start < 2 * TIMEOUTS.match_wait_s + 10


def test_diverged_agreed_values_trigger_a_consensus_round(pair):
    a, b = pair()
    ra, rb = _both(a, b, _contribution(2, 1.0, 1.0, global_value=1.0), _contribution(2, 1.0, 1.0, global_value=1.1))
    assert ra.consensus and rb.consensus

    async def heal():
        ga = {"w": torch.ones(64, 32), "b": torch.ones(32)}
        gb = {"w": torch.full((64, 32), 1.1), "b": torch.full((32,), 1.2)}
        m = {"w": torch.ones(64, 32), "b": torch.zeros(32)}
        return await asyncio.gather(a.consensus(0, 2, ga, m), b.consensus(0, 2, gb, m))

    (ga, ma, _), (gb, mb, sent) = asyncio.run(heal())
    assert torch.allclose(ga["w"], torch.full((64, 32), 1.05)) and torch.allclose(gb["b"], torch.full((32,), 1.1))
    assert torch.allclose(ma["w"], mb["w"]) and sent > 0


def test_int8_averages_the_whole_vector(pair):
    a, b = pair("int8")
    torch.manual_seed(0)
    ca, cb = _contribution(1, 0.0, 1.0), _contribution(1, 0.0, 1.0)
    ca.delta = {"w": torch.randn(64, 32), "b": torch.randn(32)}
    cb.delta = {"w": torch.randn(64, 32), "b": torch.randn(32)}
    ra, rb = _both(a, b, ca, cb)
    assert ra.outcome == "ok"
    mean = (ca.delta["w"] + cb.delta["w"]) / 2
    # every element moved to (within the codec's step of) the mean; no slice left at local values
    err = (ra.delta["w"] - mean).abs()
    assert err.max() < 0.05, err.max()
    assert ((ra.delta["w"] - ca.delta["w"]).abs() > 0.05).float().mean() > 0.9


def test_a_consensus_round_that_would_drag_the_model_far_is_refused(pair):
    a, b = pair()

    async def heal():
        ga = {"w": torch.ones(64, 32), "b": torch.ones(32)}
        gb = {"w": torch.full((64, 32), 1e6), "b": torch.ones(32)}  # a peer's values from nowhere near ours
        m = {"w": torch.zeros(64, 32), "b": torch.zeros(32)}
        return await asyncio.gather(a.consensus(0, 3, ga, m), b.consensus(0, 3, gb, m))

    ra, _ = asyncio.run(heal())
    assert ra is None  # a keeps its own values and momentum


def test_the_join_guard_is_served_as_a_stream():
    """hivemind registers rpc_join_group as streaming only if its hint says so; a unary
    registration breaks every round (seen: "async_generator can't be used in 'await'")."""
    from islands.node.net.averager import IslandAverager

    IslandAverager._collect_rpc_handlers()
    handler = next(h for h in IslandAverager._rpc_handlers if h.method_name == "rpc_join_group")
    assert handler.stream_output and not handler.stream_input


def test_a_reducer_that_spoils_its_part_is_found_and_banned(monkeypatch):
    """Butterfly all-reduce: each member averages one part for all. A member that contributes an
    honest update (and reports it honestly) but returns its part scaled is blamed, not the others."""
    from hivemind.averaging.partition import TensorPartReducer

    made = []
    try:
        dhts = [SwarmDHT.start("t", host_maddrs=["/ip4/127.0.0.1/tcp/0"])]
        for _ in range(2):
            dhts.append(SwarmDHT.start("t", host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=dhts[0].visible_maddrs()))
        made.extend(dhts)
        # small parts, so that every member reduces some
        a, b = (FragmentAveraging(d.dht, "t", SHAPES, "none", lambda: 3, TIMEOUTS, part_size_bytes=1024) for d in dhts[:2])
        made.extend((a, b))
        honest = TensorPartReducer.accumulate_part

        async def spoiled(self, *args, **kwargs):
            return (await honest(self, *args, **kwargs)) * 50

        # the hostile averager's process is forked with the patch; the honest ones already run without it
        monkeypatch.setattr(TensorPartReducer, "accumulate_part", spoiled)
        p = FragmentAveraging(dhts[2].dht, "t", SHAPES, "none", lambda: 3, TIMEOUTS, part_size_bytes=1024)
        made.append(p)
        monkeypatch.undo()

        async def round_(r):
            torch.manual_seed(r)
            cs = [_contribution(r, 1.0, 1.0) for _ in range(3)]
            for c in cs:
                c.delta = {n: torch.randn_like(t) for n, t in c.delta.items()}
            return await asyncio.gather(*(x.average(c) for x, c in zip((a, b, p), cs, strict=True)))

        for r in range(1, 4):
            ra, rb, _ = asyncio.run(round_(r))
            assert (ra.outcome, rb.outcome) == ("rejected", "rejected"), (ra.outcome, rb.outcome, ra.reason)
            assert p.peer_id in ra.reason and a.peer_id not in ra.reason and b.peer_id not in ra.reason
        assert a.banned_events == [p.peer_id] and b.banned_events == [p.peer_id]
    finally:
        for thing in reversed(made):
            thing.shutdown()


def test_a_satellite_deposits_with_an_island_which_folds_it_into_its_round():
    """A satellite never joins a round: it streams its delta to an island, which counts it, with
    its weight, in its own next contribution. Refused without the swarm's key, dropped if too large."""
    made = []
    try:
        island_dht = SwarmDHT.start("t", host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        made.append(island_dht)
        sat_dht = SwarmDHT.start("t", host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=island_dht.visible_maddrs())
        made.append(sat_dht)
        key = bytes(range(32))
        refused = []
        island = FragmentAveraging(island_dht.dht, "t", SHAPES, "int8", lambda: 2, TIMEOUTS, swarm_key=key, on_refused=refused.append)
        made.append(island)
        sats = [
            FragmentAveraging(
                sat_dht.dht, "t", SHAPES, "int8", lambda: 2, TIMEOUTS, follower=True, swarm_key=k,
                deposit_targets=lambda: [island.peer_id],
            )
            for k in (key, None)
        ]
        made.extend(sats)
        torch.manual_seed(0)
        sat_delta = {"w": torch.randn(64, 32), "b": torch.randn(32)}

        async def scenario():
            for x in (island, *sats):
                await x.open_deposits(island_dht.dht if x is island else sat_dht.dht)
            try:
                sent = _contribution(5, 0.0, 250.0)
                sent.delta, sent.staleness = sat_delta, 2
                keyed = await sats[0].average(sent)
                stranger = await sats[1].average(sent)
                own = _contribution(6, 1.0, 750.0)
                folded = island.fold_deposits(own)
                # a second deposit far larger than an island's update is dropped at the fold
                sent.delta = {n: 1e4 * t for n, t in sat_delta.items()}
                again = await sats[0].average(sent)
                after = island.fold_deposits(own)
                return keyed, stranger, own, folded, again, after
            finally:
                for x in (island, *sats):
                    await x.close_deposits()

        keyed, stranger, own, folded, again, after = asyncio.run(scenario())
        assert keyed.outcome == "ok" and keyed.deposited_with == island.peer_id and keyed.bytes_sent > 0
        # int8 on the wire: about a quarter of fp32
        assert keyed.bytes_sent < 0.35 * (64 * 32 + 32) * 4
        assert stranger.outcome == "failed" and stranger.deposited_with is None
        assert folded.deposits == 1 and folded.weight == 1000.0 and folded.deposit_bytes > 0
        expect = 0.75 * own.delta["w"] + 0.25 * sat_delta["w"]
        assert (folded.delta["w"] - expect).abs().max() < 0.25 * 0.05
        assert again.outcome == "ok" and after.deposits == 0 and torch.equal(after.delta["w"], own.delta["w"])
        # both are reported (the node logs them as `refused` events)
        assert any("no valid tag" in why for why in refused) and any("norm" in why for why in refused), refused
    finally:
        for thing in reversed(made):
            thing.shutdown()
