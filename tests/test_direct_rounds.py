"""Training rounds over the project's own protocol (node/net/direct.py): the
islands' `Rounds` over real data planes on 127.0.0.1, in one process, with the membership given."""

import asyncio

import pytest
import torch
from islands.node.net.direct import DirectRounds
from islands.node.net.transport import DataPlane, Identity
from islands.node.timeouts import Timeouts
from islands.protocols.diloco import Contribution
from islands.protocols.parts import part_bytes
from islands.protocols.validation import BAN_AFTER

pytestmark = [pytest.mark.network, pytest.mark.timeout(120)]

KEY = b"0123456789abcdef0123456789abcdef"
SHAPES = [[("w", (64, 32)), ("b", (32,))], [("v", (100,))]]


async def _islands(n, compression="none"):
    planes = [DataPlane(Identity.generate(), KEY, pool=2) for _ in range(n)]
    for p in planes:
        await p.start()
    address = {p.me.peer_id: ("127.0.0.1", p.port) for p in planes}
    timeouts = Timeouts(match_wait_s=2.0, next_chunk_s=3.0)

    def rounds(plane):
        others = {k: v for k, v in address.items() if k != plane.me.peer_id}
        return DirectRounds(
            plane, "test", SHAPES, compression, timeouts, members=lambda fragment, step: dict(others),
            others=lambda: len(others), arrival=lambda step: 0.0, donors=lambda: [], everyone=lambda: dict(others),
        )

    return planes, [rounds(p) for p in planes]


def _contribution(k, fragment=0, round_=3, scale=1.0, tokens=100):
    g = torch.Generator().manual_seed(100 * fragment + k)
    delta = {n: torch.randn(s, generator=g) * scale for n, s in SHAPES[fragment]}
    return Contribution(fragment=fragment, round=round_, step=20 * round_, delta=delta, weight=float(tokens * (k + 1)), fingerprint=[1.0, 2.0])


async def _close(planes):
    await asyncio.gather(*(p.close() for p in planes))


@pytest.mark.parametrize(("islands", "compression"), [(2, "none"), (3, "int8"), (3, "none"), (4, "none")])
def test_every_island_applies_the_same_token_weighted_mean(islands, compression):
    """Compressed parts: an all-gather; in fp32: a reduce-scatter (rounds.uses_scatter)."""
    async def main():
        planes, rounds = await _islands(islands, compression)
        try:
            cs = [_contribution(k) for k in range(islands)]
            return planes, cs, await asyncio.gather(*(r.average(c) for r, c in zip(rounds, cs, strict=True)))
        finally:
            await _close(planes)

    planes, cs, results = asyncio.run(main())
    total = sum(c.weight for c in cs)
    assert [r.outcome for r in results] == ["ok"] * islands
    assert all(r.group_size == islands and r.weight == total and not r.consensus and r.attempts == 1 for r in results)
    assert len({r.digest for r in results}) == 1 and results[0].members == sorted(p.me.peer_id for p in planes)
    for n in results[0].delta:
        assert all(torch.equal(results[0].delta[n], r.delta[n]) for r in results[1:])  # bit-identical
        expected = sum(c.weight * c.delta[n] for c in cs) / total
        assert torch.allclose(results[0].delta[n], expected, atol=1e-6 if compression == "none" else 0.05)
    # on the wire, counted by the transport, with metas, frame headers, tags and `have`s: an
    # all-gather sends the part to each other island; a reduce-scatter sends n - 1 of its n slices
    # and its reduced slice (fp32) to the n - 1 others: 2 (n - 1) / n parts
    values = part_bytes(64 * 32 + 32, compression)
    scatter = compression == "none"
    parts = 2 * (islands - 1) / islands if scatter else islands - 1
    meta = 6144 if scatter else 640  # each reduced slice carries every member's meta
    assert all(parts * values < r.bytes_sent < parts * values + meta for r in results), [r.bytes_sent for r in results]
    assert all(parts * values < r.bytes_recv < parts * values + meta for r in results)


def test_a_member_that_is_gone_is_left_out_and_the_others_still_average():
    async def main():
        planes, rounds = await _islands(3)
        await planes[2].close()  # its record still says it trains
        try:
            return await asyncio.gather(*(r.average(_contribution(k)) for k, r in enumerate(rounds[:2])))
        finally:
            await _close(planes[:2])

    results = asyncio.run(main())
    assert [(r.outcome, r.group_size) for r in results] == [("ok", 2), ("ok", 2)]
    assert torch.equal(results[0].delta["w"], results[1].delta["w"])


@pytest.mark.parametrize(("islands", "compression", "scale"), [(3, "int8", 1e4), (3, "none", 1e4), (4, "none", 1e4), (3, "none", 20.0)])
def test_a_poisoned_part_is_rejected_everywhere_and_its_sender_banned(islands, compression, scale):
    """In a reduce-scatter (fp32) each member's norm is summed from the slices' owners. A part
    flagrantly off (validation.FLAGRANT_RATIO) has its sender banned at the first rejected round;
    one merely out of bounds takes BAN_AFTER rounds."""
    async def main():
        planes, rounds = await _islands(islands, compression)
        try:
            outcomes, banned = [], []
            for r in range(1, 5):
                cs = [_contribution(k, round_=r, scale=scale if k == 2 else 1.0) for k in range(islands)]
                got = await asyncio.gather(*(x.average(c) for x, c in zip(rounds, cs, strict=True)))
                outcomes.append([g.outcome for g in got])
                banned.append([list(x.banned_events) for x in rounds[:2]])
            return planes, rounds, outcomes, banned, cs, got
        finally:
            await _close(planes)

    planes, rounds, outcomes, banned, cs, got = asyncio.run(main())
    poisoner = planes[2].me.peer_id
    assert outcomes[0][:2] == ["rejected", "rejected"]
    assert rounds[0].banned_events == [poisoner] and rounds[1].banned_events == [poisoner]
    first = 0 if scale >= 1e4 else BAN_AFTER - 1
    assert [b == [[poisoner]] * 2 for b in banned] == [r >= first for r in range(4)]


@pytest.mark.parametrize(("islands", "compression"), [(2, "none"), (3, "none"), (3, "int4")])
def test_a_result_one_members_check_rejects_is_rejected_by_every_member(islands, compression):
    """The last island's update in round 3 is a thousandth of the others' and it has accepted no
    round yet (a joiner whose window was a few steps): its check alone rejects the mean (norm
    above 4 times its own), which the others' checks accept. Every member runs every member's
    check on the same result (validation.round_verdict), so all keep their own update and none
    applies the mean: no round is applied by one member and not another. The others blame it
    (its check alone rejected what theirs accept); round 4, whose mean every check accepts,
    every member applies, and that clears the strikes."""
    async def main():
        planes, rounds = await _islands(islands, compression)
        try:
            scale = lambda k: 1e-3 if k == islands - 1 else 1.0  # noqa: E731
            first = await asyncio.gather(*(r.average(_contribution(k, round_=3, scale=scale(k))) for k, r in enumerate(rounds)))
            strikes = [dict(x.reputation.strikes) for x in rounds]
            second = await asyncio.gather(*(r.average(_contribution(k, round_=4)) for k, r in enumerate(rounds)))
            return planes, rounds, first, strikes, second
        finally:
            await _close(planes)

    planes, rounds, first, strikes, second = asyncio.run(main())
    judge = planes[-1].me.peer_id
    assert [r.outcome for r in first] == ["rejected"] * islands
    assert len({r.reason for r in first}) == 1 and judge in first[0].reason
    assert all(torch.equal(r.delta["w"], _contribution(k, round_=3, scale=1.0 if k < islands - 1 else 1e-3).delta["w"]) for k, r in enumerate(first))
    assert strikes[:-1] == [{judge: 1}] * (islands - 1)
    assert [r.outcome for r in second] == ["ok"] * islands and len({r.digest for r in second}) == 1
    assert all(not x.reputation.strikes for x in rounds)  # an accepted round clears the strikes


def test_alone_the_round_is_solo_and_with_nobody_left_in_it_failed():
    async def main():
        planes, rounds = await _islands(1)
        try:
            r = rounds[0]
            solo = await r.average(_contribution(0))
            r.others = lambda: 1
            r.members = lambda fragment, step: {}
            return solo, await r.average(_contribution(0))
        finally:
            await _close(planes)

    solo, failed = asyncio.run(main())
    assert (solo.outcome, failed.outcome) == ("solo", "failed")


@pytest.mark.parametrize("islands", [3, 4])
def test_a_consensus_round_gives_every_member_the_exact_mean_of_the_agreed_values_and_momentum(islands):
    async def main():
        planes, rounds = await _islands(islands)
        try:
            base = _contribution(99).delta  # agreed values a little apart (a round that split, a partition)
            near = [{n: base[n] + 0.01 * d for n, d in _contribution(k).delta.items()} for k in range(2 * islands)]
            state = [(near[k], near[k + islands]) for k in range(islands)]
            got = await asyncio.gather(*(r.consensus(0, 5, g, m) for r, (g, m) in zip(rounds, state, strict=True)))
            return state, got
        finally:
            await _close(planes)

    state, got = asyncio.run(main())
    assert all(g is not None for g in got)
    for n in ("w", "b"):
        assert all(torch.equal(got[0][0][n], g[0][n]) and torch.equal(got[0][1][n], g[1][n]) for g in got[1:])
        assert torch.allclose(got[0][0][n], sum(s[0][n] for s in state) / islands, atol=1e-6)
        assert torch.allclose(got[0][1][n], sum(s[1][n] for s in state) / islands, atol=1e-6)
    assert got[0][2] > 0


def test_a_joiner_downloads_a_fragments_state_from_the_first_donor_that_gives_it():
    """Over libp2p (node/net/state.py): the furthest island first; a donor that has no state yet, or a
    requester without the swarm key, gets nothing; the state arrives bit for bit."""
    from islands.node.net.dht import SwarmDHT
    from islands.node.net.state import StateBox

    key = bytes(range(32))
    dhts = []
    try:
        dhts.append(SwarmDHT.start("t", host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        for _ in range(2):
            dhts.append(SwarmDHT.start("t", host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=dhts[0].visible_maddrs()))
        donor, empty, joiner = dhts
        state = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, (_, s) in enumerate(SHAPES[1] * 2)]

        async def scenario():
            refused = []
            boxes = []
            for d, k in ((donor, key), (empty, key), (joiner, key), (joiner, None)):
                boxes.append(StateBox(await d.dht.replicate_p2p(), "t", SHAPES, k, on_refused=refused.append))
            giver, nothing, taker, stranger = boxes
            giver.provider = lambda fragment: ({"peer_id": donor.peer_id, "step": 40, "round": 2}, state)
            await giver.open()
            await nothing.open()
            try:
                got = await taker.fetch([empty.peer_id, donor.peer_id], 1, timeout_s=20)
                none = await stranger.fetch([donor.peer_id], 1, timeout_s=10)
                wrong = await taker.fetch([donor.peer_id], 0, timeout_s=10)  # its tensors do not fit fragment 0
                values = await taker.fetch([donor.peer_id], 1, timeout_s=20, codec="fp16", momentum=False)  # a satellite's
                return got, none, wrong, values, refused
            finally:
                await giver.close()
                await nothing.close()

        got, none, wrong, values, refused = asyncio.run(scenario())
        meta, tensors = got
        assert meta["round"] == 2 and meta["peer_id"] == donor.peer_id
        assert all(torch.equal(a, b) for a, b in zip(tensors, state, strict=True))
        assert 0 < meta["wire_bytes"] - 2 * part_bytes(100, "none") < 200  # values and momentum, each with its meta
        assert none is None and wrong is None
        assert any("no valid tag" in why for why in refused), refused
        meta, tensors = values
        assert len(tensors) == 1 and torch.equal(tensors[0], state[0].half().float())
        assert 0 < meta["wire_bytes"] - part_bytes(100, "fp16") < 100  # the values only, in half the bytes
    finally:
        for d in reversed(dhts):
            d.shutdown()


def test_a_satellite_deposits_in_the_runs_codec_and_a_stranger_or_a_wrong_deposit_is_refused_before_its_values():
    """Over libp2p (node/net/deposit.py): the island keeps a deposit of the key's holder (int8, within
    its bound); one without the key, for no such fragment or of another size is refused and logged."""
    from islands.node.net.deposit import DepositBox, DepositRefused
    from islands.node.net.dht import SwarmDHT
    from islands.protocols.admission import derive

    round_key = derive(KEY, "rounds")
    dhts = []
    try:
        dhts.append(SwarmDHT.start("t", host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        dhts.append(SwarmDHT.start("t", host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=dhts[0].visible_maddrs()))
        island, satellite = dhts
        delta = {n: torch.randn(s, generator=torch.Generator().manual_seed(7)) for n, s in SHAPES[0]}

        async def scenario():
            refused = []
            box = DepositBox(await island.dht.replicate_p2p(), "t", SHAPES, "int8", round_key, on_refused=refused.append)
            sender = DepositBox(await satellite.dht.replicate_p2p(), "t", SHAPES, "int8", round_key)
            stranger = DepositBox(await satellite.dht.replicate_p2p(), "t", SHAPES, "int8", None)
            await box.open()
            why = []
            try:
                sent = await sender.send(island.peer_id, 0, 4, delta, 12.5, 1, timeout_s=20)
                for attempt in (
                    lambda: stranger.send(island.peer_id, 0, 4, delta, 1.0, 0, timeout_s=20),
                    lambda: sender.send(island.peer_id, 1, 4, {"v": torch.zeros(99)}, 1.0, 0, timeout_s=20),
                ):
                    try:
                        await attempt()
                    except DepositRefused as e:
                        why.append(str(e))
                return sent, box.take(0), box.take(1), why, refused
            finally:
                await box.close()

        sent, kept, none, why, refused = asyncio.run(scenario())
        [d] = kept
        assert (d.fragment, d.round, d.weight, d.staleness, d.peer) == (0, 4, 12.5, 1, satellite.peer_id)
        for n, t in delta.items():
            assert d.delta[n].shape == t.shape and (d.delta[n] - t).abs().max() <= t.abs().max() / 127 + 1e-6
        assert sent == d.nbytes and sent < 64 * 32 * 4 / 3  # int8: a byte a value and a scale a block
        assert none == [] and len(why) == 2 and "no valid tag" in why[0] and "99 values" in why[1], why
        assert len(refused) == 2, refused
    finally:
        for d in reversed(dhts):
            d.shutdown()
