"""The wire format of the round protocol (protocols/rounds.py), as pure functions: frame headers,
a part's chunks, their striping over a pool of connections, and the nonce of each chunk's AEAD.

A frame is a fixed header, a payload of `length` bytes, then a 16-byte authentication tag (the
AEAD's, over header and payload; the header is the associated data). Big-endian throughout:

    magic "ISLR" | version u8 | kind u8 | fragment u16 | attempt u16 | round u32 |
    chunk u32 | chunks u32 | length u64 | sender u64 (the first 8 bytes of sha256(peer id))
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import struct

MAGIC = b"ISLR"
VERSION = 4
"""2: the ABORT frame; 3: every part's metadata carries its member's reference norm (`ref`,
validation.round_verdict); 4: a round of two members in fp32 is a reduce-scatter too
(rounds.uses_scatter: the kind of a round depends on the codec alone)."""
TAG_BYTES = 16
HEADER = struct.Struct("!4sBBHHIIIQQ")
HEADER_BYTES = HEADER.size
NONCE = struct.Struct("!IQ")
"""direction and kind | fragment | attempt | round | chunk: 12 bytes."""
MAX_CHUNK_BYTES = 64 << 20
"""A chunk larger than this is refused before its payload is read (bounded receive buffers)."""


class Kind(enum.IntEnum):
    PART = 1  # a chunk of a member's part
    HAVE = 2  # "I hold every part": the payload is the parts digest
    COMMITTED = 3  # "I committed": the payload names the members and the parts digest
    SLICE = 4  # a chunk of a member's reduced slice (a reduce-scatter round: rounds.ScatterRound)
    ABORT = 5  # "I went on to this attempt with these members": the payload names them


class WireError(ValueError):
    """A frame that is not one of ours, of another version, or malformed: the connection is dropped."""


@dataclasses.dataclass(frozen=True)
class Frame:
    kind: Kind
    fragment: int
    round: int
    attempt: int
    chunk: int
    chunks: int
    length: int
    sender: int


def sender_id(peer_id: str) -> int:
    """The short id of a peer in a frame header."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "big")


def encode_header(f: Frame) -> bytes:
    if not 0 <= f.chunk < max(f.chunks, 1):
        raise WireError(f"chunk {f.chunk} of {f.chunks}")
    if f.length > MAX_CHUNK_BYTES:
        raise WireError(f"a chunk of {f.length} bytes exceeds {MAX_CHUNK_BYTES}")
    return HEADER.pack(MAGIC, VERSION, int(f.kind), f.fragment, f.attempt, f.round, f.chunk, f.chunks, f.length, f.sender)


def decode_header(data: bytes) -> Frame:
    if len(data) != HEADER_BYTES:
        raise WireError(f"a header is {HEADER_BYTES} bytes, got {len(data)}")
    magic, version, kind, fragment, attempt, round_, chunk, chunks, length, sender = HEADER.unpack(data)
    if magic != MAGIC:
        raise WireError(f"not a round frame (magic {magic!r})")
    if version != VERSION:
        raise WireError(f"frame version {version}, this node speaks {VERSION}")
    try:
        kind = Kind(kind)
    except ValueError:
        raise WireError(f"unknown frame kind {kind}") from None
    if length > MAX_CHUNK_BYTES:
        raise WireError(f"a chunk of {length} bytes exceeds {MAX_CHUNK_BYTES}")
    if chunks < 1 or chunk >= chunks:
        raise WireError(f"chunk {chunk} of {chunks}")
    return Frame(kind, fragment, round_, attempt, chunk, chunks, length, sender)


def chunk_spans(total_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each chunk of a part of `total_bytes` (at least one chunk, maybe empty)."""
    if chunk_bytes < 1 or chunk_bytes > MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES}, got {chunk_bytes}")
    if total_bytes < 0:
        raise ValueError(f"total_bytes must be >= 0, got {total_bytes}")
    if total_bytes == 0:
        return [(0, 0)]
    return [(o, min(chunk_bytes, total_bytes - o)) for o in range(0, total_bytes, chunk_bytes)]


def stripe(chunks: int, connections: int) -> list[list[int]]:
    """Which chunks each connection of a pool carries: chunk i on connection i mod k."""
    if connections < 1:
        raise ValueError(f"connections must be >= 1, got {connections}")
    return [list(range(c, chunks, connections)) for c in range(connections)]


def nonce(sequence: int, direction: int) -> bytes:
    """The 12-byte AEAD nonce of the `sequence`-th frame (from 0) one side sends on a connection:
    never the same twice under one session key, even for a frame sent again (a `Committed` answer);
    the receiver counts the frames it read, so a chunk replayed, dropped or moved fails its tag,
    and the frame header (the associated data) binds the chunk to its place in the protocol."""
    if direction not in (0, 1):
        raise ValueError("direction is 0 (dialer to listener) or 1")
    if not 0 <= sequence < 1 << 64:
        raise WireError(f"frame {sequence}: a connection carries at most 2**64 frames")
    return NONCE.pack(direction, sequence)


# --- the handshake that opens a data connection ----------------------------------------------

HELLO_MAGIC = b"ISLH"
NONCE_BYTES = 32
EPHEMERAL_BYTES = 32  # an X25519 public key


@dataclasses.dataclass(frozen=True)
class Hello:
    """What each side of a new data connection says first: who it is (peer id and the RSA public key
    it derives from), a fresh nonce and an ephemeral key, and which connection of a pool this is."""

    peer_id: str
    public_key: bytes
    nonce: bytes
    ephemeral: bytes
    index: int = 0
    pool: int = 1


def encode_hello(h: Hello) -> bytes:
    pid, key = h.peer_id.encode(), h.public_key
    if len(h.nonce) != NONCE_BYTES or len(h.ephemeral) != EPHEMERAL_BYTES:
        raise WireError("a hello's nonce and ephemeral key are 32 bytes each")
    if not 0 <= h.index < h.pool <= 255 or len(pid) > 255 or len(key) > 4096:
        raise WireError("a hello's peer id, key or pool is out of bounds")
    body = struct.pack("!BHB", len(pid), len(key), VERSION) + pid + key + h.nonce + h.ephemeral + bytes([h.index, h.pool])
    return HELLO_MAGIC + struct.pack("!H", len(body)) + body


def hello_length(prefix: bytes) -> int:
    """The body length of a hello, from its first 6 bytes; WireError if they are not a hello's."""
    if len(prefix) != 6 or prefix[:4] != HELLO_MAGIC:
        raise WireError("not a compute-islands data connection")
    return struct.unpack("!H", prefix[4:])[0]


def decode_hello(body: bytes) -> Hello:
    try:
        pid_len, key_len, version = struct.unpack("!BHB", body[:4])
        if version != VERSION:
            raise WireError(f"data protocol version {version}, this node speaks {VERSION}")
        at = 4
        pid = body[at : at + pid_len].decode()
        at += pid_len
        key = bytes(body[at : at + key_len])
        at += key_len
        nonce_, eph = bytes(body[at : at + NONCE_BYTES]), bytes(body[at + NONCE_BYTES : at + NONCE_BYTES + EPHEMERAL_BYTES])
        at += NONCE_BYTES + EPHEMERAL_BYTES
        index, pool = body[at], body[at + 1]
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        raise WireError(f"a malformed hello: {e}") from None
    if at + 2 != len(body) or len(eph) != EPHEMERAL_BYTES:
        raise WireError("a malformed hello: wrong length")
    return Hello(pid, key, nonce_, eph, index, pool)


def transcript(dialer: bytes, listener: bytes, swarm_tag: bytes) -> bytes:
    """What both sides sign and key the connection from: both hellos and the swarm (its key's tag)."""
    return hashlib.sha256(b"compute-islands data v1\0" + swarm_tag + dialer + listener).digest()
