"""The round protocol's data plane (issue 17): direct TCP between islands, authenticated and encrypted.

The data path of the islands' rounds (node/net/direct.py); `bench.allreduce`
measures it side by side, and `tests/test_transport.py` runs rounds over it.

- Each island listens on one TCP port. To send to a peer it dials a pool of `pool` connections to
  it (kept for the next rounds); each connection carries frames one way, dialer to listener.
- A connection opens with a handshake (protocols/wire.py: `Hello`, `transcript`): both sides show
  their identity key (the RSA key their peer id derives from) and sign the transcript with it; with
  a swarm key each also shows an HMAC of the transcript under a key derived from it, so a peer
  without the swarm key is refused, on both sides, before any data. The session key comes from an
  X25519 exchange in the hellos (HKDF, salted with the swarm key's derivation): every frame after
  the handshake is AES-256-GCM with the frame header as associated data and the frame's number on
  its connection as nonce (wire.nonce): an altered, replayed or dropped chunk fails.
- A part (one member's contribution to a round) is cut into chunks striped over the pool; chunks
  are received with `recv_into` into a per-connection buffer and decrypted straight into the
  part's buffer (`parts.new_buffer`: reused from one round of a fragment to the next).
- `run_round` drives protocols/rounds.py's state machine with the frames and the clock.
- Reach: an island that cannot be dialled (behind NAT) publishes `p2p` as its address
  (records.P2P_ADDRESS); the others open its connections as libp2p streams to its peer id (`reach`)
  and speak the same protocol over them: each stream is bridged to one end of a socket pair, so the
  frames, the handshake and the AEAD are the same as over TCP. One stream a peer (libp2p
  multiplexes them over one connection); it costs a copy through the p2p daemon each way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import time
from collections.abc import Callable, Mapping

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa, x25519
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from islands.protocols import rounds as sm
from islands.protocols import wire
from islands.protocols.admission import derive
from islands.protocols.parts import Part, new_buffer, part_size, part_span, reduce_slice
from islands.protocols.records import P2P_ADDRESS

from .signing import peer_id_of

logger = logging.getLogger(__name__)

POOL = 4
"""Connections per peer and direction."""
CHUNK_BYTES = 4 << 20
HANDSHAKE_S = 10.0
CLOSE_S = 5.0
"""How long closing waits for its cancelled readers to end."""
LEFT_CHECK_S = 1.0
"""How often a round that waits asks which members' records say they left it (run_round's `left`)."""
PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=32)


class Refused(Exception):
    """A data connection that failed its handshake: the message says why."""


@dataclasses.dataclass
class Identity:
    key: rsa.RSAPrivateKey
    peer_id: str

    @classmethod
    def generate(cls) -> Identity:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        return cls(key, peer_id_of(key.public_key()))

    @property
    def public_der(self) -> bytes:
        return self.key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


@dataclasses.dataclass
class Conn:
    sock: socket.socket
    aead: AESGCM
    peer: str
    direction: int
    """0: this side dialed and sends; 1: it accepted and receives."""
    scratch: bytearray = dataclasses.field(default_factory=bytearray)
    sequence: int = 0
    """Frames this side sent (a dialer) or read (a listener) on it: the next frame's nonce."""
    sending: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    """One frame at a time: rounds of several fragments share the pool, and a frame is sealed in
    `scratch` and written whole before the next one."""
    dropped: bool = False

    def abandon(self) -> None:
        """Shut it down; close it now, or, while a frame is being sent on it, once that send fails
        (the event loop would wait forever on a socket closed under a pending send)."""
        self.dropped = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if not self.sending.locked():
            self.sock.close()


async def _recv_into(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> None:
    while view:
        n = await loop.sock_recv_into(sock, view)
        if n == 0:
            raise ConnectionError("connection closed")
        view = view[n:]


async def _recv(loop, sock, n: int) -> bytes:
    buf = bytearray(n)
    await _recv_into(loop, sock, memoryview(buf))
    return bytes(buf)


async def _handshake(
    loop, sock: socket.socket, me: Identity, swarm_key: bytes | None, dialer: bool, expect: str | None = None,
    index: int = 0, pool: int = 1,
) -> Conn:
    """Both sides: hellos, then proofs (signature, swarm MAC); the connection's session key."""
    eph = x25519.X25519PrivateKey.generate()
    mine = wire.encode_hello(wire.Hello(
        me.peer_id, me.public_der, os.urandom(wire.NONCE_BYTES),
        eph.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw), index, pool,
    ))
    await loop.sock_sendall(sock, mine)
    prefix = await _recv(loop, sock, 6)
    try:
        theirs = prefix + await _recv(loop, sock, wire.hello_length(prefix))
        hello = wire.decode_hello(theirs[6:])
        public = serialization.load_der_public_key(hello.public_key)
    except (wire.WireError, ValueError) as e:
        raise Refused(f"a bad hello: {e}") from None
    if not isinstance(public, rsa.RSAPublicKey) or peer_id_of(public) != hello.peer_id:
        raise Refused(f"{hello.peer_id}: its key is not the one its peer id derives from")
    if expect is not None and hello.peer_id != expect:
        raise Refused(f"dialled {expect}, answered by {hello.peer_id}")
    # the signatures prove the identities; the MACs prove the swarm key; the session key needs both
    admission = derive(swarm_key, "data") if swarm_key else b""
    script = wire.transcript(mine if dialer else theirs, theirs if dialer else mine, b"")
    role = b"D" if dialer else b"L"
    mac = hmac.new(admission, script + role, hashlib.sha256).digest() if swarm_key else bytes(32)
    signature = me.key.sign(script + role, PSS, hashes.SHA256())
    await loop.sock_sendall(sock, struct.pack("!H", len(signature)) + signature + mac)
    (sig_len,) = struct.unpack("!H", await _recv(loop, sock, 2))
    proof = await _recv(loop, sock, sig_len + 32)
    their_role = b"L" if dialer else b"D"
    try:
        public.verify(proof[:sig_len], script + their_role, PSS, hashes.SHA256())
    except InvalidSignature:
        raise Refused(f"{hello.peer_id}: its signature does not verify") from None
    if swarm_key and not hmac.compare_digest(proof[sig_len:], hmac.new(admission, script + their_role, hashlib.sha256).digest()):
        raise Refused(f"{hello.peer_id} does not hold the swarm key")
    shared = eph.exchange(x25519.X25519PublicKey.from_public_bytes(hello.ephemeral))
    key = HKDF(hashes.SHA256(), 32, salt=admission or None, info=script).derive(shared)
    return Conn(sock, AESGCM(key), hello.peer_id, 0 if dialer else 1)


@dataclasses.dataclass
class _Part:
    buf: memoryview
    """`chunks` whole chunks long: chunk i lands at i * chunk_bytes, the last one is short."""
    chunks: int
    got: set[int] = dataclasses.field(default_factory=set)
    size: int = 0

    @property
    def view(self) -> memoryview:
        return self.buf[: self.size]


class _Inbox:
    """What arrived for one round (fragment, round), possibly before this island started it."""

    def __init__(self):
        self.parts: dict[tuple[str, int], _Part] = {}
        """(peer, attempt) -> its part (an all-gather: attempt 1) or its slice of this member's share."""
        self.slices: dict[tuple[str, int], _Part] = {}
        """(peer, attempt) -> its reduced slice (a reduce-scatter)."""
        self.events: asyncio.Queue = asyncio.Queue()


class DataPlane:
    def __init__(
        self, identity: Identity, swarm_key: bytes | None = None, pool: int = POOL, chunk_bytes: int = CHUNK_BYTES,
        on_refused: Callable[[str], None] | None = None,
    ):
        self.me = identity
        self.swarm_key = swarm_key
        self.pool = pool
        self.chunk_bytes = chunk_bytes
        self.on_refused = on_refused or (lambda what: logger.warning("refused: %s", what))
        self.sid = wire.sender_id(identity.peer_id)
        self.bytes_sent = 0
        self.bytes_recv = 0
        self._round_bytes: dict[tuple[int, int], list[int]] = {}
        """(fragment, round) -> [bytes sent, bytes received] on the wire for it (`round_bytes`)."""
        self._out: dict[str, list[Conn]] = {}
        self._addresses: dict[str, tuple[str, int]] = {}
        self._done: dict[int, tuple[int, sm.Round, Mapping[str, tuple[str, int]]]] = {}
        """fragment -> (round, its state machine, its members' addresses) of the newest round this
        island finished: frames of it or an older round are dropped, except a retrying member's
        `have`, which a committed round answers."""
        self._dialing: dict[str, asyncio.Future] = {}
        self._inboxes: dict[tuple[int, int], _Inbox] = {}
        self._readers: set[asyncio.Task] = set()
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self.port = 0
        self._p2p = None
        self._stream_name = ""

    # --- connections ----------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(128)
        s.setblocking(False)
        self._listener, self.port = s, s.getsockname()[1]
        self._accepting = asyncio.ensure_future(self._accept_loop())
        return self.port

    async def reach(self, p2p, name: str) -> None:
        """Take data connections as libp2p streams of `p2p` (a hivemind P2P) named `name` too, and
        dial peers that publish P2P_ADDRESS that way."""
        self._p2p, self._stream_name = p2p, name
        await p2p.add_binary_stream_handler(name, self._on_stream)

    async def _on_stream(self, _info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._serve(self._bridge(reader, writer))

    def _bridge(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> socket.socket:
        """One end of a socket pair whose other end is pumped to and from a libp2p stream."""
        loop = asyncio.get_running_loop()
        mine, theirs = socket.socketpair()
        for sock in (mine, theirs):
            sock.setblocking(False)

        async def up() -> None:
            while data := await reader.read(1 << 16):
                await loop.sock_sendall(theirs, data)
            theirs.shutdown(socket.SHUT_WR)

        async def down() -> None:
            while data := await loop.sock_recv(theirs, 1 << 16):
                writer.write(data)
                await writer.drain()

        async def pump() -> None:
            try:
                await asyncio.gather(up(), down())
            except (ConnectionError, OSError, asyncio.IncompleteReadError):
                pass
            finally:
                theirs.close()
                writer.close()

        task = asyncio.ensure_future(pump())
        self._readers.add(task)
        task.add_done_callback(self._readers.discard)
        return mine

    async def close(self) -> None:
        if self._p2p is not None:
            try:
                await self._p2p.remove_binary_stream_handler(self._stream_name)
            except Exception as e:  # noqa: BLE001 - the daemon may be gone already
                logger.debug("removing the rounds' stream handler: %r", e)
        if self._accepting is not None:
            self._accepting.cancel()
        for t in list(self._readers):
            t.cancel()
        ending = [*self._readers, *(x for x in [self._accepting] if x)]
        if ending:  # cancelled readers end at once; a bound all the same, so that closing never hangs
            await asyncio.wait(ending, timeout=CLOSE_S)
        for conns in self._out.values():
            for c in conns:
                c.abandon()
        self._out.clear()
        if self._listener is not None:
            self._listener.close()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self._listener)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = asyncio.ensure_future(self._serve(sock))
            self._readers.add(task)
            task.add_done_callback(self._readers.discard)

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        peer = None
        try:
            try:
                conn = await asyncio.wait_for(_handshake(loop, sock, self.me, self.swarm_key, dialer=False), HANDSHAKE_S)
            except (TimeoutError, Refused, ConnectionError, OSError) as e:
                self.on_refused(f"a data connection: {e}")
                return
            peer = conn.peer
            conn.scratch = bytearray(self.chunk_bytes + wire.TAG_BYTES)
            header = bytearray(wire.HEADER_BYTES)
            while True:
                await _recv_into(loop, sock, memoryview(header))
                frame = wire.decode_header(bytes(header))
                body = memoryview(conn.scratch)[: frame.length + wire.TAG_BYTES]
                await _recv_into(loop, sock, body)
                self.bytes_recv += wire.HEADER_BYTES + len(body)
                self._round_bytes.setdefault((frame.fragment, frame.round), [0, 0])[1] += wire.HEADER_BYTES + len(body)
                self._take(conn, frame, bytes(header), body)
        except (ConnectionError, OSError, wire.WireError, InvalidTag) as e:
            if peer is not None:
                # its connections to this island closed: a killed member's do; frames sent to it now
                # would sit in a socket buffer unanswered, so the next send (a re-ask) dials again
                self.drop(peer)
                for inbox in self._inboxes.values():
                    inbox.events.put_nowait(sm.PeerGone(peer))
                if not isinstance(e, ConnectionError):
                    self.on_refused(f"{peer}: {type(e).__name__} {e}: connection dropped")
        finally:
            sock.close()

    def _take(self, conn: Conn, frame: wire.Frame, header: bytes, body: memoryview) -> None:
        """A frame arrived and passed its tag: file it under its round."""
        nonce = wire.nonce(conn.sequence, 0)
        conn.sequence += 1
        done = self._done.get(frame.fragment)
        if done is not None and frame.round <= done[0]:
            if frame.kind == wire.Kind.HAVE and frame.round == done[0]:
                self._answer(frame.fragment, sm.HaveAll(conn.peer, conn.aead.decrypt(nonce, bytes(body), header).decode(), frame.attempt))
            return  # a frame of a round this island has finished: late, nobody waits for it
        inbox = self._inbox(frame.fragment, frame.round)
        if frame.kind in (wire.Kind.PART, wire.Kind.SLICE):
            store = inbox.parts if frame.kind == wire.Kind.PART else inbox.slices
            part = store.get((conn.peer, frame.attempt))
            if part is None:
                part = store[(conn.peer, frame.attempt)] = _Part(new_buffer(frame.chunks * self.chunk_bytes), frame.chunks)
            if frame.chunk in part.got or frame.chunks != part.chunks:
                raise wire.WireError(f"chunk {frame.chunk} of {conn.peer}'s part came twice")
            at = frame.chunk * self.chunk_bytes
            conn.aead.decrypt_into(nonce, body, header, part.buf[at : at + frame.length])
            part.got.add(frame.chunk)
            part.size += frame.length
            if len(part.got) == part.chunks:
                if frame.kind == wire.Kind.PART:
                    inbox.events.put_nowait(sm.PartArrived(conn.peer, _digest(part.size), frame.attempt))
                else:
                    inbox.events.put_nowait(sm.SliceArrived(conn.peer, _digest(part.size, frame.attempt), frame.attempt))
            return
        payload = conn.aead.decrypt(nonce, bytes(body), header)
        if frame.kind == wire.Kind.HAVE:
            inbox.events.put_nowait(sm.HaveAll(conn.peer, payload.decode(), frame.attempt))
        elif frame.kind == wire.Kind.ABORT:
            inbox.events.put_nowait(sm.Aborted(conn.peer, tuple(json.loads(payload)["members"]), frame.attempt))
        else:
            c = json.loads(payload)
            inbox.events.put_nowait(sm.Committed(conn.peer, tuple(c["members"]), c["parts"], int(c["attempts"])))

    def _inbox(self, fragment: int, round_: int) -> _Inbox:
        key = (fragment, round_)
        if key not in self._inboxes:
            self._inboxes[key] = _Inbox()
        return self._inboxes[key]

    def _answer(self, fragment: int, event: sm.HaveAll) -> None:
        """A member still retrying a round this island committed: tell it what was committed."""
        round_, r, members = self._done[fragment]
        for a in r.handle(event, time.monotonic()):
            if isinstance(a, sm.SendCommitted) and a.to in members:
                task = asyncio.ensure_future(self._send_committed(a, members[a.to], fragment, round_))
                self._readers.add(task)
                task.add_done_callback(self._readers.discard)

    async def _conns(self, peer: str, address: tuple[str, int]) -> list[Conn]:
        """The pool of connections to `peer` (dialled once, kept; dialled again if its address changed:
        it restarted)."""
        if self._addresses.get(peer, address) != address:
            self.drop(peer)
        self._addresses[peer] = address
        if peer in self._out:
            return self._out[peer]
        if peer not in self._dialing:
            dialing = self._dialing[peer] = asyncio.ensure_future(self._dial_pool(peer, address))
            # its failure is its callers' to handle; one cancelled meanwhile leaves nobody to read it
            dialing.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            conns = await asyncio.shield(self._dialing[peer])
        finally:
            if self._dialing.get(peer) is not None and self._dialing[peer].done():
                self._dialing.pop(peer, None)
        self._out[peer] = conns
        return conns

    async def _dial_pool(self, peer: str, address: tuple[str, int]) -> list[Conn]:
        loop = asyncio.get_running_loop()
        over_p2p = address[0] == P2P_ADDRESS
        if over_p2p and self._p2p is None:
            raise Refused(f"{peer} is reached over libp2p, and this transport has no p2p (reach)")
        pool = 1 if over_p2p else self.pool

        async def connect() -> socket.socket:
            if over_p2p:
                from hivemind.p2p import PeerID

                _, reader, writer = await self._p2p.call_binary_stream_handler(PeerID.from_base58(peer), self._stream_name)
                return self._bridge(reader, writer)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                await loop.sock_connect(sock, address)
            except BaseException:
                sock.close()
                raise
            return sock

        async def one(index: int) -> Conn:
            sock = await asyncio.wait_for(connect(), HANDSHAKE_S)
            try:
                return await asyncio.wait_for(
                    _handshake(loop, sock, self.me, self.swarm_key, dialer=True, expect=peer, index=index, pool=pool), HANDSHAKE_S,
                )
            except BaseException:
                sock.close()
                raise

        conns = await asyncio.gather(*(one(i) for i in range(pool)), return_exceptions=True)
        bad = [c for c in conns if isinstance(c, BaseException)]
        if bad:
            for c in conns:
                if isinstance(c, Conn):
                    c.sock.close()
            raise bad[0]
        for c in conns:
            c.scratch = bytearray(self.chunk_bytes + wire.TAG_BYTES)
        return list(conns)

    # --- sending -------------------------------------------------------------------------------

    async def _send(self, conn: Conn, frame: wire.Frame, payload: memoryview | bytes) -> None:
        loop = asyncio.get_running_loop()
        header = wire.encode_header(frame)
        async with conn.sending:
            out = memoryview(conn.scratch)[: len(payload) + wire.TAG_BYTES]
            conn.aead.encrypt_into(wire.nonce(conn.sequence, 0), payload, header, out)
            conn.sequence += 1
            try:
                await loop.sock_sendall(conn.sock, header)
                await loop.sock_sendall(conn.sock, out)
            except BaseException:
                if not conn.dropped:  # (a pool dropped already may have been dialled anew since)
                    self.drop(conn.peer)  # a frame cut short (cancelled, failed) would garble the stream
                raise
            finally:
                if conn.dropped:
                    conn.sock.close()
        self.bytes_sent += len(header) + len(out)
        self._round_bytes.setdefault((frame.fragment, frame.round), [0, 0])[0] += len(header) + len(out)

    async def send_part(
        self, peer: str, address: tuple[str, int], fragment: int, round_: int, attempt: int, part: Part,
        kind: wire.Kind = wire.Kind.PART,
    ) -> None:
        conns = await self._conns(peer, address)
        spans = wire.chunk_spans(part_size(part), self.chunk_bytes)

        async def lane(conn: Conn, chunk_ids: list[int]) -> None:
            for i in chunk_ids:
                offset, length = spans[i]
                frame = wire.Frame(kind, fragment, round_, attempt, i, len(spans), length, self.sid)
                await self._send(conn, frame, part_span(part, offset, length))

        await asyncio.gather(*(lane(c, ids) for c, ids in zip(conns, wire.stripe(len(spans), len(conns)), strict=True)))

    async def send_small(self, peer: str, address: tuple[str, int], kind: wire.Kind, fragment: int, round_: int, attempt: int, payload: bytes) -> None:
        conns = await self._conns(peer, address)
        frame = wire.Frame(kind, fragment, round_, attempt, 0, 1, len(payload), self.sid)
        await self._send(conns[0], frame, memoryview(payload))

    async def _send_committed(self, a: sm.SendCommitted, address: tuple[str, int], fragment: int, round_: int) -> None:
        c = a.commit
        payload = json.dumps({"members": list(c.members), "parts": c.parts, "attempts": c.attempts}).encode()
        await self.send_small(a.to, address, wire.Kind.COMMITTED, fragment, round_, c.attempts, payload)

    def round_bytes(self, fragment: int, round_: int) -> tuple[int, int]:
        """(sent, received): the bytes of round (fragment, round_)'s frames on the wire (headers,
        chunks, tags; every attempt) so far; read once its round ended."""
        sent, recv = self._round_bytes.pop((fragment, round_), (0, 0))
        return sent, recv

    def drop(self, peer: str) -> None:
        """Forget the pool to `peer` (it is gone; the next round dials again)."""
        for c in self._out.pop(peer, []):
            c.abandon()

    # --- one round -----------------------------------------------------------------------------

    async def run_round(
        self, fragment: int, round_: int, members: Mapping[str, tuple[str, int]], part: bytes | bytearray | memoryview | None,
        attempt_s: float, max_attempts: int = 3, cut: Callable[[tuple[str, ...]], dict[str, Part]] | None = None,
        left: Callable[[], set[str]] | None = None,
    ) -> tuple[sm.Commit | sm.Fail, dict[str, memoryview]]:
        """Take part in round (fragment, round_) with these members (peer -> address; this island
        included) and this island's part: (Commit, every committed member's part) or (Fail, {}).

        With `cut` instead of a part, the round is a reduce-scatter (rounds.ScatterRound): `cut(members)`
        gives this island's part cut into one slice per member (parts.encode_slices; run in a thread,
        again for each attempt), and a Commit comes with every member's reduced slice
        (parts.reduce_slice; parts.assemble puts them together).

        `left()`, asked every LEFT_CHECK_S while the round waits: members that will not take part
        any more (their records say so: records.left_round); each is gone for the round as if its
        connection had closed, instead of being waited for until the attempt's deadline."""
        if (part is None) == (cut is None):
            raise ValueError("a round takes a part or a cut, not both")
        inbox = self._inbox(fragment, round_)
        me = self.me.peer_id
        clock = time.monotonic
        if cut is None:
            mine = memoryview(part).cast("B")
            r = sm.Round(me, members, _digest(len(mine)), clock(), attempt_s, max_attempts)
        else:
            r = sm.ScatterRound(me, members, clock(), attempt_s, max_attempts)
        cuts: dict[int, asyncio.Future] = {}
        """attempt -> this island's slices for that attempt's members."""
        reduced: dict[int, memoryview] = {}
        """attempt -> this island's reduced slice."""
        sends: dict[asyncio.Task, str | None] = {}
        """What this member still does for the round: task -> the member it sends to (None: a reduction)."""

        def slices(attempt: int, order: tuple[str, ...]) -> asyncio.Future:
            if attempt not in cuts:
                cuts[attempt] = asyncio.ensure_future(asyncio.to_thread(cut, order))
            return cuts[attempt]

        async def send_slice(to: str, attempt: int) -> None:
            await self.send_part(to, members[to], fragment, round_, attempt, reduced[attempt], wire.Kind.SLICE)

        async def send_cut(to: str, attempt: int, order: tuple[str, ...]) -> None:
            pieces = await slices(attempt, order)
            await self.send_part(to, members[to], fragment, round_, attempt, pieces[to])

        async def reduce(a: sm.Reduce) -> None:
            pieces = await slices(a.attempt, a.members)
            held = {p: (pieces[me] if p == me else inbox.parts[(p, a.attempt)].view) for p in a.members}
            reduced[a.attempt] = await asyncio.to_thread(reduce_slice, a.members, me, held)
            inbox.events.put_nowait(sm.Reduced(_digest(len(reduced[a.attempt]), a.attempt), a.attempt))

        def act(actions: list) -> None:
            for a in actions:
                if isinstance(a, sm.SendPart):
                    if cut is None:
                        coro = self.send_part(a.to, members[a.to], fragment, round_, 1, mine)
                    else:
                        coro = send_cut(a.to, a.attempt, r.members)
                elif isinstance(a, sm.Reduce):
                    task = asyncio.ensure_future(reduce(a))
                    sends[task] = None
                    task.add_done_callback(lambda t: sends.pop(t, None))
                    continue
                elif isinstance(a, sm.SendSlice):
                    coro = send_slice(a.to, a.attempt)
                elif isinstance(a, sm.SendHave):
                    coro = self.send_small(a.to, members[a.to], wire.Kind.HAVE, fragment, round_, a.attempt, a.parts.encode())
                elif isinstance(a, sm.SendAbort):
                    payload = json.dumps({"members": list(a.members)}).encode()
                    coro = self.send_small(a.to, members[a.to], wire.Kind.ABORT, fragment, round_, a.attempt, payload)
                elif isinstance(a, sm.SendCommitted):
                    coro = self._send_committed(a, members[a.to], fragment, round_)
                else:
                    continue
                task = asyncio.ensure_future(self._guarded(coro, a.to, inbox))
                sends[task] = a.to
                task.add_done_callback(lambda t: sends.pop(t, None))

        told: set[str] = set()
        next_check = clock() + LEFT_CHECK_S

        def look() -> None:
            for peer in sorted(set(left()) & set(r.members) - told - {me}):
                told.add(peer)
                logger.info("round %d of fragment %d: %s will not take part (its record): not waited for", round_, fragment, peer)
                inbox.events.put_nowait(sm.PeerGone(peer))

        try:
            act(r.start())
            while not r.done:
                if left is not None and clock() >= next_check:
                    next_check = clock() + LEFT_CHECK_S
                    look()
                wake = r.deadline if left is None else min(r.deadline, next_check)
                try:
                    event = await asyncio.wait_for(inbox.events.get(), max(0.0, wake - clock()))
                except TimeoutError:
                    if clock() < r.deadline:
                        continue
                    event = sm.Tick()
                act(r.handle(event, clock()))
            if isinstance(r.outcome, sm.Commit):
                # a committed member still answers the others, for an attempt's time at most (a send
                # that never ends must not hold the round); what it sends to members the round went
                # on without waits for nobody
                answering = [t for t, to in sends.items() if to is None or to in r.outcome.members]
                if answering:
                    await asyncio.wait(answering, timeout=attempt_s)
                if cut is None:
                    parts = {p: (mine if p == me else inbox.parts[(p, 1)].view) for p in r.outcome.members}
                else:
                    a = r.outcome.attempts
                    parts = {p: (reduced[a] if p == me else inbox.slices[(p, a)].view) for p in r.outcome.members}
                return r.outcome, parts
            return r.outcome, {}
        finally:
            self._finish(fragment, round_, r, members)
            for t in list(sends):
                t.cancel()

    def _finish(self, fragment: int, round_: int, r: sm.Round, members: Mapping[str, tuple[str, int]]) -> None:
        """Forget what arrived for this round and older ones of its fragment; keep the round to answer
        a member still retrying it."""
        if round_ >= self._done.get(fragment, (-1,))[0]:
            self._done[fragment] = (round_, r, dict(members))
        for key in [k for k in self._inboxes if k[0] == fragment and k[1] <= round_]:
            del self._inboxes[key]
        for key in [k for k in self._round_bytes if k[0] == fragment and k[1] < round_]:
            del self._round_bytes[key]  # late frames of rounds nobody asks about any more

    async def _guarded(self, coro, peer: str, inbox: _Inbox) -> None:
        try:
            await coro
        except (TimeoutError, ConnectionError, OSError, Refused) as e:
            if isinstance(e, Refused):  # it failed the handshake: say so, as the listener does
                self.on_refused(f"a data connection to {peer}: {e}")
            else:
                logger.info("sending to %s failed: %r", peer, e)
            self.drop(peer)
            inbox.events.put_nowait(sm.PeerGone(peer))


def _digest(size: int, attempt: int | None = None) -> str:
    """A part's name in the state machine: its size (each member sends one part a round, and one
    reduced slice an attempt, authenticated)."""
    return f"{size}" if attempt is None else f"{attempt}:{size}"
