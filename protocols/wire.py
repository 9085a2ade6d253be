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
VERSION = 1
TAG_BYTES = 16
HEADER = struct.Struct("!4sBBHHIIIQQ")
HEADER_BYTES = HEADER.size
NONCE = struct.Struct("!BHBII")
"""direction and kind | fragment | attempt | round | chunk: 12 bytes."""
MAX_CHUNK_BYTES = 64 << 20
"""A chunk larger than this is refused before its payload is read (bounded receive buffers)."""


class Kind(enum.IntEnum):
    PART = 1  # a chunk of a member's part
    HAVE = 2  # "I hold every part": the payload is the parts digest
    COMMITTED = 3  # "I committed": the payload names the members and the parts digest


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


def nonce(frame: Frame, direction: int) -> bytes:
    """The 12-byte AEAD nonce of a frame: unique per (kind, fragment, round, attempt, chunk, sender
    direction) under one session key, so that a chunk replayed into another place fails its tag."""
    if direction not in (0, 1):
        raise ValueError("direction is 0 (dialer to listener) or 1")
    if frame.attempt > 255:
        raise WireError(f"attempt {frame.attempt}: a round has at most 255")
    return NONCE.pack(direction << 7 | int(frame.kind), frame.fragment, frame.attempt, frame.round, frame.chunk)
