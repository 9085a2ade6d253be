"""The round protocol over its data plane (node/net/transport.py): real sockets on 127.0.0.1, one process."""

import asyncio

import pytest
import torch
from islands.node.net.transport import DataPlane, Identity
from islands.protocols.parts import assemble, encode_part, encode_slices, reduce_parts
from islands.protocols.rounds import Commit, Fail, PeerGone

pytestmark = [pytest.mark.network, pytest.mark.timeout(120)]

KEY = b"0123456789abcdef0123456789abcdef"


async def _planes(n, key=KEY, chunk_bytes=1 << 20, refusals=None):
    planes = []
    for _ in range(n):
        plane = DataPlane(Identity.generate(), key, pool=2, chunk_bytes=chunk_bytes, on_refused=(refusals if refusals is not None else []).append)
        await plane.start()
        planes.append(plane)
    return planes, {p.me.peer_id: ("127.0.0.1", p.port) for p in planes}


def _values(k, numel=300_000):
    return torch.randn(numel, generator=torch.Generator().manual_seed(k))


def test_every_member_of_a_committed_round_holds_the_same_bits():
    async def main():
        planes, members = await _planes(3)
        try:
            parts = [encode_part(_values(k), k + 1.0) for k in range(3)]
            got = await asyncio.gather(*(p.run_round(2, 7, members, parts[k], attempt_s=20) for k, p in enumerate(planes)))
            return [(outcome, reduce_parts(sorted(held), held)[0]) for outcome, held in got], [p.bytes_sent for p in planes]
        finally:
            await asyncio.gather(*(p.close() for p in planes))

    results, sent = asyncio.run(main())
    assert all(isinstance(o, Commit) and len(o.members) == 3 and o.attempts == 1 for o, _ in results)
    first = results[0][1]
    assert all(torch.equal(first, mean) for _, mean in results[1:])  # bit-identical
    exact = sum((k + 1.0) * _values(k) for k in range(3)) / 6.0
    assert (first - exact).abs().max() < 1e-5
    assert all(s > 2 * 1.2e6 for s in sent)  # each part went to both others (4 B a value, plus framing)


def test_a_member_that_dies_mid_transfer_costs_the_others_one_attempt():
    async def main():
        planes, members = await _planes(3, chunk_bytes=256 << 10)
        parts = [encode_part(_values(k, 4_000_000), 1.0) for k in range(3)]
        runs = [asyncio.ensure_future(p.run_round(0, 1, members, parts[k], attempt_s=20)) for k, p in enumerate(planes)]
        await asyncio.sleep(0.05)  # its part is on the way
        runs[2].cancel()
        await planes[2].close()  # its connections close, as a killed process's do
        started = asyncio.get_running_loop().time()
        got = await asyncio.gather(*runs[:2])
        await asyncio.gather(*(p.close() for p in planes[:2]))
        return got, asyncio.get_running_loop().time() - started

    got, seconds = asyncio.run(main())
    (a, held_a), (b, held_b) = got
    assert isinstance(a, Commit) and a == b, (a, b)
    if len(a.members) == 2:  # it died before everyone held its part: the others went on without it
        assert a.attempts == 2
    assert torch.equal(reduce_parts(a.members, held_a)[0], reduce_parts(b.members, held_b)[0])
    assert seconds < 10


def _joined(segments, total, metas):
    return torch.cat(segments), total, metas


def _cut(k, numel=300_000):
    return lambda order: encode_slices(_values(k, numel), k + 1.0, "none", {"round": 7}, order)


def test_a_reduce_scatter_round_gives_every_member_the_all_gathers_bits_for_half_the_bytes():
    async def main(scatter):
        planes, members = await _planes(4)
        try:
            if scatter:
                runs = (p.run_round(2, 7, members, None, attempt_s=20, cut=_cut(k)) for k, p in enumerate(planes))
            else:
                runs = (p.run_round(2, 7, members, encode_part(_values(k), k + 1.0), attempt_s=20) for k, p in enumerate(planes))
            got = await asyncio.gather(*runs)
            if scatter:
                return [(o, _joined(*assemble(o.members, held))) for o, held in got], [p.bytes_sent for p in planes]
            return [(o, reduce_parts(o.members, held)) for o, held in got], [p.bytes_sent for p in planes]
        finally:
            await asyncio.gather(*(p.close() for p in planes))

    scattered, sent = asyncio.run(main(True))
    gathered, sent_all = asyncio.run(main(False))
    assert all(isinstance(o, Commit) and len(o.members) == 4 and o.attempts == 1 for o, _ in scattered)
    expect, total, metas = gathered[0][1]
    first = scattered[0][1][0]
    for _, (mean, got_total, got_metas) in scattered:
        assert torch.equal(mean, first)  # bit-identical on every member
        assert (mean - expect).abs().max() < 1e-6 and got_total == total == 10.0  # the same mean (other peers: other order)
        assert sorted(m["weight"] for m in got_metas.values()) == sorted(m["weight"] for m in metas.values())
    assert all(s < 0.55 * a for s, a in zip(sent, sent_all, strict=True))  # 3/4 of a part out and 3 quarters back, against 3 parts


def test_a_member_that_dies_in_a_reduce_scatter_costs_the_others_one_attempt_cut_again():
    async def main():
        planes, members = await _planes(4, chunk_bytes=256 << 10)
        runs = [
            asyncio.ensure_future(p.run_round(0, 1, members, None, attempt_s=20, cut=_cut(k, 4_000_000)))
            for k, p in enumerate(planes)
        ]
        await asyncio.sleep(0.05)
        runs[3].cancel()
        await planes[3].close()
        got = await asyncio.gather(*runs[:3])
        await asyncio.gather(*(p.close() for p in planes[:3]))
        return got

    got = asyncio.run(main())
    outcomes = {o for o, _ in got}
    assert len(outcomes) == 1
    [o] = outcomes
    assert isinstance(o, Commit)
    means = [torch.cat(assemble(o.members, held)[0]) for _, held in got]
    assert all(torch.equal(means[0], m) for m in means[1:])
    if len(o.members) == 3:  # without it: each survivor's part cut in three
        assert o.attempts == 2
        exact = sum((k + 1.0) * _values(k, 4_000_000) for k in range(3)) / 6.0
        assert (means[0] - exact).abs().max() < 1e-5


@pytest.mark.parametrize("kind", ["all-gather", "reduce-scatter"])
def test_a_member_whose_record_says_it_left_the_round_is_not_waited_for(kind):
    """The chaos soak's convoy: a member that restarted past the round's start never comes, and its
    connections may stay open (a new process of the same peer). Once its record says so
    (records.left_round: asked every second while the round waits), the others go on without it,
    long before the attempt's deadline."""
    async def main():
        planes, members = await _planes(3)
        late = planes[2].me.peer_id
        said = asyncio.Event()
        asyncio.get_running_loop().call_later(0.5, said.set)

        def left():
            return {late} if said.is_set() else set()

        def run(k, p):
            if kind == "all-gather":
                return p.run_round(0, 4, members, encode_part(_values(k), k + 1.0), attempt_s=30, left=left)
            return p.run_round(0, 4, members, None, attempt_s=30, cut=_cut(k), left=left)

        started = asyncio.get_running_loop().time()
        try:
            got = await asyncio.gather(*(run(k, p) for k, p in enumerate(planes[:2])))  # the third never runs it
            return got, asyncio.get_running_loop().time() - started, late
        finally:
            await asyncio.gather(*(p.close() for p in planes))

    got, seconds, late = asyncio.run(main())
    (a, _), (b, _) = got
    assert isinstance(a, Commit) and a == b and late not in a.members and len(a.members) == 2, (a, b)
    assert seconds < 10, seconds  # the attempt's deadline is 30 s


@pytest.mark.parametrize("kind", ["all-gather", "reduce-scatter"])
def test_a_member_that_never_saw_the_dead_one_go_follows_the_one_that_did_at_once(kind):
    """The CI failure of 2026-12-05: the dead member never dialled b, so only a saw it go. a's abort
    tells b, which goes on to a's attempt at once instead of waiting out its own deadline."""

    async def main():
        planes, members = await _planes(3)
        a, b, c = planes  # c takes no part: its plane accepts frames and never answers
        scatter = kind == "reduce-scatter"
        runs = [
            asyncio.ensure_future(
                p.run_round(0, 1, members, None if scatter else encode_part(_values(k), 1.0), attempt_s=30, cut=_cut(k) if scatter else None)
            )
            for k, p in enumerate((a, b))
        ]
        await asyncio.sleep(0.2)
        started = asyncio.get_running_loop().time()
        a._inbox(0, 1).events.put_nowait(PeerGone(c.me.peer_id))  # as if a's connection to c had closed
        got = await asyncio.gather(*runs)
        seconds = asyncio.get_running_loop().time() - started
        await asyncio.gather(*(p.close() for p in planes))
        return got, seconds, sorted((a.me.peer_id, b.me.peer_id))

    got, seconds, survivors = asyncio.run(main())
    (oa, _), (ob, _) = got
    assert isinstance(oa, Commit) and oa == ob, (oa, ob)
    assert sorted(oa.members) == survivors and oa.attempts == 2
    assert seconds < 10  # not b's 30 s deadline


def test_a_peer_without_the_swarm_key_cannot_open_a_data_connection():
    async def main():
        mine, theirs = [], []
        planes, members = await _planes(1, refusals=mine)
        stranger = DataPlane(Identity.generate(), b"another key" * 3, pool=1, on_refused=theirs.append)
        await stranger.start()
        members[stranger.me.peer_id] = ("127.0.0.1", stranger.port)
        try:
            return await asyncio.gather(
                planes[0].run_round(0, 1, members, encode_part(_values(0), 1.0), attempt_s=2, max_attempts=1),
                stranger.run_round(0, 1, members, encode_part(_values(1), 1.0), attempt_s=2, max_attempts=1),
            ), mine, theirs
        finally:
            await asyncio.gather(planes[0].close(), stranger.close())

    (ours, strangers), mine, theirs = asyncio.run(main())
    assert isinstance(ours[0], Fail) and isinstance(strangers[0], Fail) and strangers[1] == {}
    # refused and logged on both sides: each side finds the other without this swarm's key
    assert any("does not hold the swarm key" in r for r in mine), mine
    assert any("does not hold the swarm key" in r for r in theirs), theirs


def test_a_chunk_altered_on_the_way_is_never_applied():
    async def main():
        refusals = []
        planes, members = await _planes(2, refusals=refusals)
        a, b = planes

        pumps = []

        async def tamper(reader, writer):  # between a and b: flips one byte after the handshakes
            pumps.append(asyncio.current_task())
            try:
                await relay(reader, writer)
            except asyncio.CancelledError:
                writer.close()

        async def relay(reader, writer):
            up_r, up_w = await asyncio.open_connection("127.0.0.1", b.port)
            seen = 0

            async def pump(src, dst, flip):
                nonlocal seen
                while data := await src.read(1 << 16):
                    if flip and seen < 200_000 <= seen + len(data):
                        data = bytearray(data)
                        data[200_000 - seen] ^= 1
                    if flip:
                        seen += len(data)
                    dst.write(bytes(data))
                    await dst.drain()
                dst.close()

            await asyncio.gather(pump(reader, up_w, True), pump(up_r, writer, False), return_exceptions=True)

        proxy = await asyncio.start_server(tamper, "127.0.0.1", 0)
        via = dict(members)
        via[b.me.peer_id] = ("127.0.0.1", proxy.sockets[0].getsockname()[1])
        try:
            return await asyncio.gather(
                a.run_round(0, 1, via, encode_part(_values(0), 1.0), attempt_s=3, max_attempts=1),
                b.run_round(0, 1, members, encode_part(_values(1), 1.0), attempt_s=3, max_attempts=1),
            ), refusals
        finally:
            proxy.close()
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            await asyncio.gather(a.close(), b.close())

    (at_a, at_b), refusals = asyncio.run(main())
    assert isinstance(at_b[0], Fail) and at_b[1] == {}  # b never took a's altered part
    assert not isinstance(at_a[0], Commit)
    assert any("InvalidTag" in r for r in refusals), refusals


def _run(plane, members, k, numel, scatter, **kwargs):
    """Member k's round with its part, as an all-gather or (`scatter`) a reduce-scatter."""
    if scatter:
        return plane.run_round(0, 1, members, None, cut=_cut(k, numel), **kwargs)
    return plane.run_round(0, 1, members, encode_part(_values(k, numel), 1.0), **kwargs)


def _victim(point: str, scatter: bool, out, go, said_have: str) -> None:
    """A member in its own process that SIGKILLs itself at `point` of its round; it writes to
    `said_have` before it sends a `have` (it may hold the others' parts before its own are out).
    Its last data is its part (an all-gather) or its reduced slice (a reduce-scatter)."""
    import os
    import signal

    from islands.protocols import wire

    last = wire.Kind.SLICE if scatter else wire.Kind.PART
    sent: dict[str, int] = {}
    haves = []
    original = DataPlane._send

    async def send(self, conn, frame, payload):
        if frame.kind == wire.Kind.PART and (
            point == "before its first part" or (point == "mid-transfer" and frame.chunk >= frame.chunks // 2)
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        if frame.kind == wire.Kind.HAVE and point == "while committing" and len(haves) == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # one other member has its `have`, the other not
        if frame.kind == wire.Kind.HAVE:
            with open(said_have, "a") as f:
                f.write("have\n")
        await original(self, conn, frame, payload)
        if frame.kind == wire.Kind.HAVE:
            haves.append(conn.peer)
        if frame.kind == last:
            sent[conn.peer] = sent.get(conn.peer, 0) + 1
            if point == "after its last part" and len(sent) == 2 and all(n == frame.chunks for n in sent.values()):
                os.kill(os.getpid(), signal.SIGKILL)

    DataPlane._send = send

    async def main():
        plane = DataPlane(Identity.generate(), KEY, pool=2, chunk_bytes=256 << 10)
        await plane.start()
        out.put((plane.me.peer_id, plane.port))
        members = await asyncio.to_thread(go.get, True, 60)
        await _run(plane, members, 2, 4_000_000, scatter, attempt_s=ATTEMPT_S)

    asyncio.run(main())


ATTEMPT_S = 5.0


@pytest.mark.parametrize("kind", ["all-gather", "reduce-scatter"])
@pytest.mark.parametrize("point", ["before its first part", "mid-transfer", "after its last part", "while committing"])
def test_a_member_killed_at_any_point_of_a_round_leaves_the_survivors_one_committed_round(point, kind, tmp_path):
    """SIGKILL of a member (a process of its own) at each point of a round: the other two commit
    the same round (equal digests, members, bits) within the attempt's wait plus 2 s."""
    import multiprocessing as mp

    scatter = kind == "reduce-scatter"
    ctx = mp.get_context("spawn")
    out, go = ctx.Queue(), ctx.Queue()
    numel = 4_000_000
    said_have = tmp_path / "said-have"
    victim = ctx.Process(target=_victim, args=(point, scatter, out, go, str(said_have)), daemon=True)
    victim.start()
    try:
        peer, port = out.get(timeout=60)

        async def main():
            planes, members = await _planes(2, chunk_bytes=256 << 10)
            members[peer] = ("127.0.0.1", port)
            go.put(members)
            loop = asyncio.get_running_loop()
            started = loop.time()
            try:
                got = await asyncio.gather(*(_run(p, members, k, numel, scatter, attempt_s=ATTEMPT_S) for k, p in enumerate(planes)))
                return got, loop.time() - started
            finally:
                await asyncio.gather(*(p.close() for p in planes))

        ((a, held_a), (b, held_b)), seconds = asyncio.run(main())
        victim.join(10)
        assert victim.exitcode == -9  # it was killed where the test says, not earlier or later
        assert isinstance(a, Commit) and a == b, (a, b)  # one round: same members, same digest
        if not said_have.exists():  # it never said it held everything: the round went on without it
            assert peer not in a.members and a.attempts == 2
        # else (always while committing; after its last part when the others' parts reached it
        # before its own were out) the others may have committed with it: every member held every part
        if scatter:
            assert torch.equal(torch.cat(assemble(a.members, held_a)[0]), torch.cat(assemble(b.members, held_b)[0]))
        else:
            assert torch.equal(reduce_parts(a.members, held_a)[0], reduce_parts(b.members, held_b)[0])
        print(f"{kind}, {point}: {len(a.members)} members, attempt {a.attempts}, {seconds:.2f} s")
        assert seconds < 2 * ATTEMPT_S + 2  # a member silent after this one's `have` is asked again once (rounds.py)
    finally:
        if victim.is_alive():
            victim.kill()
        victim.join(5)


def test_an_island_that_cannot_be_dialled_takes_part_over_libp2p_streams(tmp_path):
    """Island c listens on no port (`--data-announce p2p`): a and b reach it over libp2p streams to
    its peer id, c dials them over TCP, and the round commits with the same bits everywhere."""
    from hivemind.p2p import P2P
    from islands.node.net.signing import load_identity
    from islands.protocols.records import P2P_ADDRESS

    async def main():
        p2ps, planes = [], []
        try:
            for name in "abc":
                key, peer = load_identity(tmp_path / f"{name}.key")
                initial = [] if not p2ps else await p2ps[0].get_visible_maddrs()
                p2p = await P2P.create(identity_path=str(tmp_path / f"{name}.key"), host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial)
                assert p2p.peer_id.to_base58() == peer
                plane = DataPlane(Identity(key._private_key, peer), KEY, pool=2, chunk_bytes=1 << 20)
                await plane.reach(p2p, "test::rounds")
                if name != "c":
                    await plane.start()
                p2ps.append(p2p)
                planes.append(plane)
            members = {p.me.peer_id: ("127.0.0.1", p.port) for p in planes[:2]}
            members[planes[2].me.peer_id] = (P2P_ADDRESS, 0)
            parts = [encode_part(_values(k), 1.0) for k in range(3)]
            got = await asyncio.wait_for(
                asyncio.gather(*(p.run_round(0, 1, members, parts[k], attempt_s=20) for k, p in enumerate(planes))), 60,
            )
            return [(o, reduce_parts(sorted(held), held)[0]) for o, held in got]
        finally:
            await asyncio.gather(*(p.close() for p in planes), return_exceptions=True)
            await asyncio.gather(*(p.shutdown() for p in p2ps), return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(o, Commit) and len(o.members) == 3 and o.attempts == 1 for o, _ in results), results
    assert all(torch.equal(results[0][1], mean) for _, mean in results[1:])
