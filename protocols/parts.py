"""A member's part of a round (protocols/rounds.py) as bytes, and the reduction of a committed
round's parts: pure functions.

A part is one member's weighted contribution, encoded once by its owner and never re-encoded:

    meta length u32 | meta (JSON, padded with spaces to a multiple of 8 bytes) | values

`meta` holds the weight, the codec, the number of values and what the round checks (the round,
step, fingerprint of the agreed values, staleness). The values, by codec:
- "none": float32;  "fp16": float16;
- "int8": int8 codes (blockwise absmax, protocols/compression.py), padded to 4 bytes, then one
  float32 scale a block.
Every member of a committed round holds the same parts (rounds.py) and reduces them in the same
order in float32 (`reduce_parts`), so their results are bit-identical.
"""

from __future__ import annotations

import json
import math
import struct
import warnings
from collections.abc import Mapping, Sequence

import torch

from .compression import BLOCK, dequantize_blockwise, quantize_blockwise

CODECS = ("none", "fp16", "int8")
_LEN = struct.Struct("!I")
MAX_META_BYTES = 1 << 16


class PartError(ValueError):
    """A part that does not decode: its member is dropped from the reduction's checks."""


def part_bytes(numel: int, codec: str) -> int:
    """Bytes of a part's values (its meta not counted)."""
    if codec == "none":
        return 4 * numel
    if codec == "fp16":
        return 2 * numel
    if codec == "int8":
        return _pad4(numel) + 4 * math.ceil(numel / BLOCK)
    raise ValueError(f"unknown codec {codec!r}; one of {', '.join(CODECS)}")


def _pad4(n: int) -> int:
    return n + (-n) % 4


def encode_part(values: torch.Tensor, weight: float, codec: str = "none", meta: Mapping | None = None) -> bytes:
    """The part of a member with these flat `values` (any float dtype, any device) and `weight`."""
    if not (math.isfinite(weight) and weight >= 0):
        raise ValueError(f"a part's weight must be finite and >= 0, got {weight}")
    flat = values.detach().to("cpu", torch.float32).contiguous().reshape(-1)
    head = json.dumps({**(meta or {}), "weight": float(weight), "codec": codec, "numel": flat.numel()}).encode()
    head += b" " * ((-(len(head) + _LEN.size)) % 8)
    if codec == "none":
        body = flat.numpy().tobytes()
    elif codec == "fp16":
        body = flat.to(torch.float16).numpy().tobytes()
    elif codec == "int8":
        codes, scales = quantize_blockwise(flat)
        body = codes.numpy().tobytes() + bytes((-codes.numel()) % 4) + scales.to(torch.float32).numpy().tobytes()
    else:
        raise ValueError(f"unknown codec {codec!r}; one of {', '.join(CODECS)}")
    return _LEN.pack(len(head)) + head + body


def _frombuffer(view: memoryview, dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():  # read only: a part received as bytes is not writable
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=dtype) if len(view) else torch.empty(0, dtype=dtype)


def decode_part(data: bytes | bytearray | memoryview) -> tuple[dict, torch.Tensor]:
    """(meta, the values as float32) of a part; PartError if it is malformed."""
    view = memoryview(data).cast("B")
    if len(view) < _LEN.size:
        raise PartError("a part shorter than its header")
    (n,) = _LEN.unpack(view[: _LEN.size])
    if n > MAX_META_BYTES or _LEN.size + n > len(view):
        raise PartError(f"a part's meta of {n} bytes does not fit")
    try:
        meta = json.loads(bytes(view[_LEN.size : _LEN.size + n]))
        weight, codec, numel = float(meta["weight"]), str(meta["codec"]), int(meta["numel"])
    except (ValueError, KeyError, TypeError) as e:
        raise PartError(f"a part's meta is malformed: {e}") from None
    if not (math.isfinite(weight) and weight >= 0) or numel < 0 or codec not in CODECS:
        raise PartError(f"a part with weight {weight}, {numel} values, codec {codec!r}")
    body = view[_LEN.size + n :]
    if len(body) != part_bytes(numel, codec):
        raise PartError(f"a part of {numel} values in {codec} is {part_bytes(numel, codec)} bytes, got {len(body)}")
    if codec == "none":
        values = _frombuffer(body, torch.float32)
    elif codec == "fp16":
        values = _frombuffer(body, torch.float16).to(torch.float32)
    else:
        codes = _frombuffer(body[:numel], torch.int8)
        scales = _frombuffer(body[_pad4(numel) :], torch.float32)
        values = dequantize_blockwise(codes, scales)
    return meta, values


def reduce_parts(order: Sequence[str], parts: Mapping[str, bytes | bytearray | memoryview]) -> tuple[torch.Tensor, float, dict[str, dict]]:
    """The weighted mean of the members' parts, added in `order` in float32 — the same bits on every
    member that holds the same parts (a committed round) — its total weight, and each member's meta
    with the norm of the values it sent added (`value_norm`, for the checks of validation.py).
    PartError if a part is malformed or the parts differ in size."""
    total, acc, metas = 0.0, None, {}
    for peer in order:
        meta, values = decode_part(parts[peer])
        metas[peer] = {**meta, "value_norm": float(torch.linalg.vector_norm(values))}
        if acc is None:
            acc = torch.zeros(values.numel(), dtype=torch.float32)
        if values.numel() != acc.numel():
            raise PartError(f"{peer}'s part has {values.numel()} values, the others {acc.numel()}")
        acc.add_(values, alpha=float(meta["weight"]))
        total += float(meta["weight"])
    if acc is None or total <= 0:
        raise PartError("no parts, or no weight, to reduce")
    return acc.div_(total), total, metas
