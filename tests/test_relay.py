"""The link emulator: measured delay and rate match the profile within 10% (real sockets on 127.0.0.1)."""

import asyncio
import time

import pytest
from islands.node.relay import PROFILES, LinkProfile, Relay, departure

pytestmark = [pytest.mark.network, pytest.mark.timeout(60)]


def test_departure_paces_chunks_at_the_rate():
    assert departure(0.0, 1000, 0.0, None) == 0.0
    assert departure(0.0, 1000, 0.0, 1000.0) == 1.0
    assert departure(0.5, 1000, 1.0, 1000.0) == 2.0  # queued behind the chunk before it
    assert departure(3.0, 500, 1.0, 1000.0) == 3.5  # an idle link sends at once
    assert PROFILES["intercontinental"].delay_s * 2 == pytest.approx(0.150)


async def _echo_server():
    async def echo(reader, writer):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _relay(port, profile):
    relay = Relay(("127.0.0.1", port), profile)
    return relay, await relay.start("127.0.0.1", 0)


async def _median_rtt(port: int, source: str = "127.0.0.1", count: int = 5) -> float:
    """The median round trip of a 4-byte ping through 127.0.0.1:port, sent from `source`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    rtts = []
    for _ in range(count):
        started = time.monotonic()
        writer.write(b"ping")
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
        rtts.append(time.monotonic() - started)
    writer.close()
    return sorted(rtts)[count // 2]


async def test_round_trip_is_twice_the_one_way_delay():
    server, port = await _echo_server()
    relay, relay_port = await _relay(port, LinkProfile(delay_s=0.05, rate_bytes_per_s=None))
    try:
        assert await _median_rtt(relay_port) == pytest.approx(0.100, rel=0.10)
    finally:
        await relay.close()
        server.close()


async def test_rate_cap_per_direction():
    got = asyncio.Event()
    received = []

    async def sink(reader, writer):
        total = 0
        while data := await reader.read(65536):
            total += len(data)
            if total >= 2_000_000:
                received.append(time.monotonic())
                got.set()
        writer.close()

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    rate = 8e6 / 8  # 8 Mbit/s
    relay, relay_port = await _relay(port, LinkProfile(delay_s=0.02, rate_bytes_per_s=rate))
    _, writer = await asyncio.open_connection("127.0.0.1", relay_port)
    started = time.monotonic()
    writer.write(b"x" * 2_000_000)
    await writer.drain()
    await asyncio.wait_for(got.wait(), 10)
    seconds = received[0] - started - 0.02
    for _ in range(100):  # the relay counts a chunk once the node's side took it
        if relay.bytes["to_node"] == 2_000_000:
            break
        await asyncio.sleep(0.01)
    assert relay.bytes == {"to_node": 2_000_000, "from_node": 0}
    writer.close()
    await relay.close()
    server.close()
    assert 2_000_000 / seconds == pytest.approx(rate, rel=0.10), seconds


async def _send_through(profile: LinkProfile, sizes: list[int]) -> list[float]:
    """Send `sizes` bytes over that many connections through one relay at once: the seconds until
    each arrived whole."""
    done: dict[int, float] = {}

    async def sink(reader, writer):
        total, tag = 0, (await reader.readexactly(1))[0]
        while data := await reader.read(65536):
            total += len(data)
            if total >= sizes[tag] - 1:
                done[tag] = time.monotonic()
        writer.close()

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    relay, relay_port = await _relay(server.sockets[0].getsockname()[1], profile)
    writers = [(await asyncio.open_connection("127.0.0.1", relay_port))[1] for _ in sizes]
    started = time.monotonic()
    for tag, (w, n) in enumerate(zip(writers, sizes, strict=True)):
        w.write(bytes([tag]) + b"x" * (n - 1))
    for _ in range(1000):
        if len(done) == len(sizes):
            break
        await asyncio.sleep(0.01)
    for w in writers:
        w.close()
    await relay.close()
    server.close()
    return [done[k] - started for k in range(len(sizes))]


async def test_the_links_connections_share_its_rate_cap():
    rate = 8e6 / 8
    seconds = await _send_through(LinkProfile(delay_s=0.02, rate_bytes_per_s=rate), [1_000_000, 1_000_000])
    assert max(seconds) - 0.02 == pytest.approx(2_000_000 / rate, rel=0.10), seconds  # not twice the cap


async def test_a_connections_window_bounds_it_to_a_window_per_round_trip():
    window, delay = 100_000, 0.05  # 100 kB per 100 ms round trip: 1 MB/s, far under the link's cap
    profile = LinkProfile(delay_s=delay, rate_bytes_per_s=100e6, window_bytes=window)
    (one,) = await _send_through(profile, [1_000_000])
    assert one == pytest.approx(1_000_000 / (window / (2 * delay)), rel=0.15), one
    two = await _send_through(profile, [1_000_000, 1_000_000])
    assert max(two) == pytest.approx(one, rel=0.15), two  # two connections: twice the bytes in the same time


def test_relay_command_refuses_bad_input(capsys):
    from islands.node.cli import main

    assert main(["relay", "--to", "127.0.0.1:1", "--contact", "sometimes"], environ={}) == 2
    assert "contact 'sometimes'" in capsys.readouterr().err
    assert main(["relay", "--to", "nowhere"], environ={}) == 2
    assert "expected HOST:PORT" in capsys.readouterr().err


async def test_relay_command_counts_the_bytes_it_forwarded(tmp_path):
    """`islands-node relay --stats-file`: what the link carried each way, written at exit."""
    import json

    from .procs import RelayProcess

    server, port = await _echo_server()
    stats = tmp_path / "relay.json"
    relay = RelayProcess(port, tmp_path, ["--profile", "lan", "--stats-file", str(stats)])
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        writer.write(b"y" * 100_000)
        await writer.drain()
        assert len(await asyncio.wait_for(reader.readexactly(100_000), 10)) == 100_000
        writer.close()
    finally:
        relay.stop()
        server.close()
    got = json.loads(stats.read_text())
    assert (got["to_node"], got["from_node"], got["connections"]) == (100_000, 100_000, 1), got


async def test_connections_from_a_given_source_cross_their_own_link():
    """A satellite's node listens on 127.0.0.2 and dials from it: the islands' relays give its
    connections the satellite's link, everyone else's the relay's own."""
    server, port = await _echo_server()
    relay = Relay(("127.0.0.1", port), LinkProfile(delay_s=0.0, rate_bytes_per_s=None),
                  by_source={"127.0.0.2": LinkProfile(delay_s=0.05, rate_bytes_per_s=None)})
    relay_port = await relay.start("127.0.0.1", 0)
    try:
        assert await _median_rtt(relay_port, "127.0.0.2") == pytest.approx(0.100, rel=0.10)
        assert await _median_rtt(relay_port) < 0.02
    finally:
        await relay.close()
        server.close()
