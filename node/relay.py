"""A link emulator: a TCP relay on loopback that adds one-way delay and caps the rate per direction.

The kernel here has no netem, so long links are emulated in user space. Put a
relay in front of a node and make the node announce the relay:

    islands-node relay --listen 127.0.0.1:0 --to 127.0.0.1:4000 --profile intercontinental
    islands-node --listen /ip4/127.0.0.1/tcp/4000 --announce /ip4/127.0.0.1/tcp/RELAY_PORT ...

Everything that dials the node through its announced address then crosses the
emulated link. The rate cap is the link's, per direction: the bytes of all its
connections leave at the capped rate, one after the other in the order they
came (`departure`), and arrive `delay_s` later. With `--window-kb`, a
connection has at most that many bytes in flight until their acknowledgement
is back (one round trip after they left), as a TCP connection with that window
has: one connection then moves at most window / round trip. A relay with `--contact SPEC` forwards nothing out of contact (the bytes
wait, as on a link that is down); SIGSTOP and SIGCONT of the relay make a
partition and heal it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Sequence

from .contact import ContactClock
from .files import write_lines

logger = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 1024
QUEUE_CHUNKS = 256
"""Chunks in flight per direction before the relay stops reading (bounded memory: ~16 MiB)."""
CONTACT_POLL_S = 0.05
STATS_EVERY_S = 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkProfile:
    delay_s: float
    """One-way delay."""
    rate_bytes_per_s: float | None
    """Cap per direction; None: no cap."""
    contact: str | None = None
    """Contact windows (satellite links), as --contact takes them."""
    window_bytes: int | None = None
    """Bytes a connection may have in flight per direction (a TCP window); None: no limit."""

    def __post_init__(self):
        if self.window_bytes is not None and self.window_bytes <= 0:
            raise ValueError(f"window must be > 0, got {self.window_bytes}")
        if self.delay_s < 0:
            raise ValueError(f"delay must be >= 0, got {self.delay_s}")
        if self.rate_bytes_per_s is not None and self.rate_bytes_per_s <= 0:
            raise ValueError(f"rate must be > 0, got {self.rate_bytes_per_s}")


PROFILES = {
    "lan": LinkProfile(delay_s=0.0005, rate_bytes_per_s=None),
    # 150 ms round trip, 100 Mbit/s: a long-haul path between two sites
    "intercontinental": LinkProfile(delay_s=0.075, rate_bytes_per_s=100e6 / 8),
    # a ground-station pass: 300 ms one way, 10 Mbit/s, up 20 s of every 60 s
    "satellite": LinkProfile(delay_s=0.3, rate_bytes_per_s=10e6 / 8, contact="up 20s every 60s"),
}


def departure(now_s: float, size_bytes: int, last_departure_s: float, rate_bytes_per_s: float | None) -> float:
    """When the last byte of a chunk that arrived at now_s leaves a link of this rate, behind
    the chunks before it (which leave by last_departure_s)."""
    if rate_bytes_per_s is None:
        return now_s
    return max(now_s, last_departure_s) + size_bytes / rate_bytes_per_s


def chunk_bytes(rate_bytes_per_s: float | None) -> int:
    """Read at most ~10 ms of the link's rate at once, so that pacing stays smooth."""
    if rate_bytes_per_s is None:
        return CHUNK_BYTES
    return int(min(CHUNK_BYTES, max(1024, rate_bytes_per_s * 0.01)))


class Relay:
    """Accepts on `listen`, dials `target` for each connection, forwards both ways through the link."""

    def __init__(
        self, target: tuple[str, int], profile: LinkProfile, contact: ContactClock | None = None,
        by_source: dict[str, LinkProfile] | None = None,
    ):
        """`by_source`: connections from these source addresses cross that link instead (its delay
        and rate; no contact windows: the node at the other end keeps its own)."""
        self.target = target
        self.profile = profile
        self.contact = contact
        self.by_source = dict(by_source or {})
        self.server: asyncio.Server | None = None
        self.connections = 0
        self.bytes = {"to_node": 0, "from_node": 0}
        """Bytes forwarded each way (what the emulated link carried)."""
        self._last: dict[tuple[int, str], float] = {}
        """(link, direction) -> when its last byte queued so far leaves: the cap is shared."""

    async def start(self, host: str, port: int) -> int:
        self.server = await asyncio.start_server(self._serve, host, port)
        return self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        peer = client_writer.get_extra_info("peername")
        special = self.by_source.get(peer[0]) if peer else None
        profile, contact = (special, None) if special is not None else (self.profile, self.contact)
        try:
            upstream_reader, upstream_writer = await asyncio.wait_for(asyncio.open_connection(*self.target), timeout=10)
        except (TimeoutError, OSError) as e:
            logger.info("relay: cannot reach %s:%d: %r", *self.target, e)
            client_writer.close()
            return
        await asyncio.gather(
            self._pump(client_reader, upstream_writer, "to_node", profile, contact),
            self._pump(upstream_reader, client_writer, "from_node", profile, contact),
            return_exceptions=True,
        )
        for w in (client_writer, upstream_writer):
            w.close()

    @staticmethod
    async def _open(contact: ContactClock | None) -> None:
        while contact is not None and not contact.in_contact():
            await asyncio.sleep(CONTACT_POLL_S)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str, profile: LinkProfile,
        contact: ContactClock | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue(QUEUE_CHUNKS)
        delay_s, rate, window = profile.delay_s, profile.rate_bytes_per_s, profile.window_bytes
        size = chunk_bytes(rate)
        link = (id(profile), direction)
        in_flight = 0
        acked = asyncio.Event()

        def ack(n: int) -> None:
            nonlocal in_flight
            in_flight -= n
            acked.set()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                if data is None:
                    break
                wait_s = due - loop.time()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                await self._open(contact)
                writer.write(data)
                await writer.drain()
                self.bytes[direction] += len(data)
                if window is not None:
                    loop.call_later(delay_s, ack, len(data))  # the acknowledgement's way back

        sender = asyncio.ensure_future(send())
        try:
            while True:
                await self._open(contact)
                n = size
                if window is not None:
                    while in_flight >= window:
                        acked.clear()
                        await acked.wait()
                    n = min(size, window - in_flight)
                data = await reader.read(n)
                if not data:
                    break
                in_flight += len(data)
                self._last[link] = departure(loop.time(), len(data), self._last.get(link, 0.0), rate)
                await queue.put((self._last[link] + delay_s, data))
        except (ConnectionError, OSError):
            pass
        finally:
            await queue.put((0.0, None))
            try:
                await sender
            except (ConnectionError, OSError):
                pass
            try:
                writer.write_eof()
            except (OSError, RuntimeError):
                pass


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    try:
        return host or "127.0.0.1", int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}") from None


def _source_profile(text: str) -> tuple[str, LinkProfile]:
    ip, sep, name = text.partition("=")
    if not sep or not ip or name not in PROFILES:
        raise argparse.ArgumentTypeError(f"expected SOURCE_IP=PROFILE with a profile of {', '.join(sorted(PROFILES))}, got {text!r}")
    return ip, PROFILES[name]


def _profile(args: argparse.Namespace) -> LinkProfile:
    base = PROFILES[args.profile]
    rate = base.rate_bytes_per_s if args.rate_mbit is None else (args.rate_mbit * 1e6 / 8 if args.rate_mbit > 0 else None)
    return LinkProfile(
        delay_s=base.delay_s if args.delay_ms is None else args.delay_ms / 1000,
        rate_bytes_per_s=rate,
        contact=args.contact if args.contact is not None else base.contact,
        window_bytes=None if args.window_kb is None else args.window_kb * 1024,
    )


def main(argv: Sequence[str], prog: str = "islands-node") -> int:
    from .cli import _Parser

    parser = _Parser(
        prog=f"{prog} relay",
        description="A TCP relay that emulates a long link (delay and rate cap per direction, contact windows). "
        "Put it in front of a node and pass the node --announce /ip4/HOST/tcp/RELAY_PORT.",
    )
    parser.add_argument("--listen", type=_host_port, default=("127.0.0.1", 0), metavar="HOST:PORT", help="where the relay accepts (default 127.0.0.1:0)")
    parser.add_argument("--to", type=_host_port, required=True, metavar="HOST:PORT", help="the node's real listen address")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="lan", help="named link: " + "; ".join(
        f"{n}: {p.delay_s * 1000:g} ms one way, {'no cap' if p.rate_bytes_per_s is None else f'{p.rate_bytes_per_s * 8 / 1e6:g} Mbit/s'}"
        + (f", {p.contact}" if p.contact else "") for n, p in PROFILES.items()))
    parser.add_argument("--delay-ms", type=float, metavar="MS", help="one-way delay instead of the profile's")
    parser.add_argument(
        "--rate-mbit", type=float, metavar="MBIT", help="rate cap per direction instead of the profile's (0: none), shared by the link's connections",
    )
    parser.add_argument(
        "--window-kb", type=int, metavar="KB", help="a connection's TCP window: at most this much in flight until acknowledged "
        "(one round trip later), so one connection moves at most window / round trip (default: no limit)",
    )
    parser.add_argument("--contact", metavar="SPEC", help="forward only in these windows, e.g. 'up 10s every 30s'")
    parser.add_argument(
        "--from", dest="by_source", type=_source_profile, action="append", default=[], metavar="SOURCE_IP=PROFILE",
        help="connections from this source address cross that profile's link instead (its delay and rate; a satellite's "
        "node keeps its own contact windows), e.g. 127.0.0.2=satellite for a satellite node listening on 127.0.0.2 (repeatable)",
    )
    parser.add_argument("--port-file", metavar="PATH", help="write the port the relay listens on here")
    parser.add_argument("--stats-file", metavar="PATH", help=f"write the bytes forwarded each way here (JSON), every {STATS_EVERY_S:g} s and at exit")
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as e:
        return int(e.code or 0)
    try:
        profile = _profile(args)
        contact = ContactClock(profile.contact) if profile.contact else None
    except ValueError as e:
        print(f"{prog} relay: error: {e}", file=sys.stderr)
        return 2

    async def serve() -> int:
        relay = Relay(args.to, profile, contact, dict(args.by_source))
        try:
            port = await relay.start(*args.listen)
        except OSError as e:
            print(f"{prog} relay: error: cannot listen on {args.listen[0]}:{args.listen[1]}: {e.strerror}", file=sys.stderr)
            return 2
        if args.port_file:
            write_lines(args.port_file, [str(port)])
        rate = "no cap" if profile.rate_bytes_per_s is None else f"{profile.rate_bytes_per_s * 8 / 1e6:g} Mbit/s"
        print(f"relay {args.listen[0]}:{port} -> {args.to[0]}:{args.to[1]}: {profile.delay_s * 1000:g} ms one way, {rate}"
              + (f", contact {profile.contact}" if profile.contact else ""), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        import signal

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        started = time.monotonic()

        def write_stats() -> None:
            if args.stats_file:
                stats = {**relay.bytes, "connections": relay.connections, "seconds": round(time.monotonic() - started, 3)}
                write_lines(args.stats_file, [json.dumps(stats)])

        while not stop.is_set():
            write_stats()
            try:
                await asyncio.wait_for(stop.wait(), timeout=STATS_EVERY_S)
            except TimeoutError:
                pass
        await relay.close()
        write_stats()
        logger.info("relay ran %.1fs, %d connections", time.monotonic() - started, relay.connections)
        return 0

    return asyncio.run(serve())
