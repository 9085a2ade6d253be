"""Blockwise codecs for pseudo-gradients: each block of values is scaled by its own largest
magnitude, so a few large values cost precision only in their block and are never clipped (the
uniform 8-bit codec of hivemind clips at a few sigmas: on heavy-tailed pseudo-gradients its
relative error was ~0.3, blockwise int8's ~0.01).

- `int8` (`--compression int8`): an integer in [-127, 127] a value; 1 byte a value plus 4 bytes a
  block of BLOCK.
- `int4`: an integer in [-7, 7] a value, two to a byte; 0.5 byte a value plus 4 bytes a block of
  BLOCK4.
- `fp4`: FP4 E3M0 (Streaming DiLoCo's outer-gradient format): a sign and a power of two, the
  magnitude one of 0, 2^-6 .. 2^0 of the block's largest, rounded to the nearest; two to a byte,
  plus 4 bytes a block of BLOCK4.
- `int2`: one of four levels (c + 1/2) * s, c in -2..1, s the block's root mean square, four to a
  byte, plus 4 bytes a block of BLOCK4. Values beyond 2 s are clipped: it is meant for error
  feedback (diloco.StreamingDiLoCo keeps what the codec lost and sends it with the next round).
"""

from __future__ import annotations

import torch

BLOCK = 256


def quantize_blockwise(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes of every value, fp32 scale of every block) for a tensor of any shape."""
    flat = x.detach().reshape(-1).to(torch.float32)
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    blocks = flat.view(-1, block)
    scales = blocks.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.reshape(-1)[: x.numel()], scales


def dequantize_blockwise(codes: torch.Tensor, scales: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The flat fp32 values back (reshape them yourself)."""
    n = codes.numel()
    pad = (-n) % block
    flat = codes.to(torch.float32)
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, block) * scales[:, None]).reshape(-1)[:n]


BLOCK4 = 64
"""Values a 4-bit block shares its scale with: 4 bytes of scale over 32 of values (an eighth more
than the values alone). Relative error (|x - y| / |x|) on 100k Student-t(3) values, by block of
32 / 64 / 128 / 256: int4 0.146 / 0.183 / 0.226 / 0.274, fp4 0.147 / 0.159 / 0.168 / 0.176
(int8: 0.017); on Gaussian values, at 64: int4 0.107, fp4 0.188."""


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    flat = x.detach().reshape(-1).to(torch.float32)
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


def _scaled(levels: torch.Tensor, scales: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """The first `n` of `levels` (in units of their block's scale) times their block's scale."""
    pad = (-n) % block
    if pad:
        levels = torch.cat([levels, levels.new_zeros(pad)])
    return (levels.view(-1, block) * scales[:, None]).reshape(-1)[:n]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 15], two to a byte (the first in the low half); an odd count gets a 0."""
    c = codes.reshape(-1).to(torch.uint8)
    if c.numel() % 2:
        c = torch.cat([c, c.new_zeros(1)])
    pairs = c.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """`pack_nibbles`' inverse: the first `n` codes."""
    p = packed.reshape(-1).to(torch.uint8)
    return torch.stack([p & 0x0F, p >> 4], dim=1).reshape(-1)[:n]


def quantize_int4(x: torch.Tensor, block: int = BLOCK4) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed 4-bit codes of every value, fp32 scale of every block)."""
    blocks = _blocks(x, block)
    scales = blocks.abs().amax(dim=1) / 7.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(blocks / safe[:, None]).clamp_(-7, 7) + 8
    return pack_nibbles(codes.reshape(-1)[: x.numel()]), scales


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, n: int, block: int = BLOCK4) -> torch.Tensor:
    return _scaled(unpack_nibbles(packed, n).to(torch.float32) - 8, scales, n, block)


def pack_crumbs(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 3], four to a byte (the first in the lowest two bits); padded with 0s."""
    c = codes.reshape(-1).to(torch.uint8)
    if c.numel() % 4:
        c = torch.cat([c, c.new_zeros(4 - c.numel() % 4)])
    q = c.view(-1, 4)
    return q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)


def unpack_crumbs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """`pack_crumbs`' inverse: the first `n` codes."""
    p = packed.reshape(-1).to(torch.uint8)
    return torch.stack([p & 3, (p >> 2) & 3, (p >> 4) & 3, p >> 6], dim=1).reshape(-1)[:n]


def quantize_int2(x: torch.Tensor, block: int = BLOCK4) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed 2-bit codes of every value, fp32 scale, the block's root mean square, of every block).
    Code c + 2 for the level (c + 1/2) * s whose cell [c s, (c + 1) s) holds the value, c clipped to
    -2..1 (the uniform 4-level quantizer of a Gaussian: relative error 0.34 on one, 0.58 on
    Student-t(3) values, where a scale of the block's largest gave 0.51 and 1.35)."""
    blocks = _blocks(x, block)
    scales = blocks.pow(2).mean(dim=1).sqrt()
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.floor(blocks / safe[:, None]).clamp_(-2, 1) + 2
    return pack_crumbs(codes.reshape(-1)[: x.numel()]), scales


def dequantize_int2(packed: torch.Tensor, scales: torch.Tensor, n: int, block: int = BLOCK4) -> torch.Tensor:
    return _scaled(unpack_crumbs(packed, n).to(torch.float32) - 1.5, scales, n, block)


def quantize_fp4(x: torch.Tensor, block: int = BLOCK4) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed FP4 E3M0 codes of every value, fp32 scale, the block's largest magnitude, of every
    block). A code's low 3 bits k give the magnitude 2^(k-7) of the scale (k = 0: zero), its high
    bit the sign; a magnitude is rounded to the nearest of those."""
    blocks = _blocks(x, block)
    scales = blocks.abs().amax(dim=1)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    m = blocks.abs() / safe[:, None]
    e = torch.floor(torch.log2(m.clamp_min(2.0**-8)))
    e = e + (m > 1.5 * torch.exp2(e)).to(e.dtype)  # nearest power of two, not nearest in log
    k = (e + 7).clamp_(1, 7)
    k = torch.where(m < 2.0**-7, torch.zeros_like(k), k)  # nearer 0 than 2^-6
    codes = k + 8 * (blocks < 0).to(k.dtype) * (k > 0).to(k.dtype)
    return pack_nibbles(codes.reshape(-1)[: x.numel()]), scales


def dequantize_fp4(packed: torch.Tensor, scales: torch.Tensor, n: int, block: int = BLOCK4) -> torch.Tensor:
    codes = unpack_nibbles(packed, n).to(torch.int32)
    k = (codes & 7).to(torch.float32)
    magnitude = torch.where(k > 0, torch.exp2(k - 7), torch.zeros_like(k))
    return _scaled(torch.where(codes >= 8, -magnitude, magnitude), scales, n, block)
