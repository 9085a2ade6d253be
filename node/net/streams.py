"""Parts (protocols/parts.py) over libp2p streams: what the satellites' deposits (deposit.py) and
the state downloads (state.py) send. A request or an answer is a part of no values whose meta says
it; tensors travel as parts of the fragment's values, flat in layout order, in a codec of the
parts format. The reader learns a part's size from its meta before it reads the values, so it can
refuse a part that is too large or not the one it asked for before any of them arrives.

Over libp2p, not the rounds' direct transport: a satellite or a peer behind NAT can dial an
island's libp2p address without being dialable itself, and the answer comes on its own stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import torch
from islands.protocols.parts import (
    HEAD_BYTES,
    PartError,
    decode_part,
    encode_part,
    meta_length,
    read_meta,
)


def message(meta: Mapping) -> memoryview:
    """A request or an answer: a part of no values, `meta` saying what it is."""
    return encode_part(torch.empty(0), 0.0, "none", meta)


async def send(writer: asyncio.StreamWriter, *parts: memoryview) -> int:
    """Write parts to the stream; the bytes written."""
    for p in parts:
        writer.write(p)
        await writer.drain()
    return sum(len(p) for p in parts)


async def read_head(reader: asyncio.StreamReader) -> tuple[dict, bytes, int]:
    """(meta, the bytes read, the part's whole size) of the next part of a stream: the values not
    yet read. PartError if it is malformed; IncompleteReadError if the stream ends."""
    head = await reader.readexactly(HEAD_BYTES)
    head += await reader.readexactly(meta_length(head))
    meta, size = read_meta(head)
    return meta, head, size


async def read_rest(reader: asyncio.StreamReader, head: bytes, size: int) -> tuple[dict, torch.Tensor]:
    """(meta, values as float32) of the part whose head `read_head` gave."""
    data = bytearray(size)
    data[: len(head)] = head
    data[len(head) :] = await reader.readexactly(size - len(head))
    return decode_part(data)


async def read_message(reader: asyncio.StreamReader) -> dict:
    """The meta of the next part, which must hold no values (a request or an answer)."""
    meta, head, size = await read_head(reader)
    if size != len(head):
        raise PartError(f"a message with {meta['numel']} values")
    return meta


def flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Tensors as one float32 vector, in the order given (a fragment's layout)."""
    if not tensors:
        return torch.empty(0)
    return torch.cat([t.detach().to("cpu", torch.float32).reshape(-1) for t in tensors])


def unflat(values: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """`flat`'s inverse: the vector cut into tensors of these shapes (views)."""
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    return [v.view(s) for v, s in zip(values.split(sizes), shapes, strict=True)]


def numel(shapes: Mapping[str, tuple[int, ...]] | Sequence[tuple[int, ...]]) -> int:
    return sum(int(torch.Size(s).numel()) for s in (shapes.values() if isinstance(shapes, Mapping) else shapes))
