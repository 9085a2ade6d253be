"""Telling whether islands still hold the same agreed fragment, without sending it.

hivemind can return success from a round in which some slices were averaged
over fewer peers or left at local values, and replicas are never bit-identical.
So each island sends a small fingerprint of its agreed fragment with every
round; everyone in the group sees the same fingerprints, so everyone reaches
the same verdict, and when they disagree beyond the compression's noise the
group averages the agreed values themselves (a consensus round).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

STRIDES = 4
TOLERANCE = {"none": 1e-4, "fp16": 1e-3, "int8": 3e-3, "int4": 3e-2, "fp4": 3e-2, "int2": 3e-2}
"""Largest fingerprint difference that is replica noise, by the compression on the wire (the 4-bit
codecs' relative error is ~10x int8's: protocols/compression.py)."""


def fingerprint(tensors: Sequence[torch.Tensor]) -> list[float]:
    """Per tensor: mean, RMS, and STRIDES strided sums scaled by 1/sqrt(count).

    A slice that differs by d per element moves a strided sum by about d * sqrt(slice share),
    while fp32 noise of e per element moves it by about e."""
    out: list[float] = []
    for t in tensors:
        x = t.detach().reshape(-1).to(torch.float64)
        n = max(1, x.numel())
        out.append(float(x.mean()) if x.numel() else 0.0)
        out.append(float(x.pow(2).mean().sqrt()) if x.numel() else 0.0)
        for s in range(STRIDES):
            part = x[s::STRIDES]
            out.append(float(part.sum()) / max(1.0, (n / STRIDES) ** 0.5))
    return out


def fingerprints_agree(a: Sequence[float], b: Sequence[float], tol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b, strict=True))


def consensus_needed(fingerprints: Iterable[Sequence[float]], tol: float) -> bool:
    """True if any two of the group's fingerprints disagree."""
    fps = list(fingerprints)
    return any(not fingerprints_agree(fps[0], f, tol) for f in fps[1:])


def fragment_fingerprint(tensors: Sequence[torch.Tensor]) -> list[float]:
    """One fingerprint of a whole fragment (its tensors flattened into one): six numbers, small
    enough to publish in an island record (records.IslandRecord.final)."""
    return fingerprint([torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])])


def fragments_to_heal(mine: Sequence[Sequence[float]], others: Iterable[Sequence[Sequence[float]]], tol: float) -> list[int]:
    """The fragments whose fingerprints (one per fragment, from this island and each other island)
    disagree anywhere. Every island that sees the same fingerprints gets the same list."""
    others = [o for o in others if len(o) == len(mine)]
    return [p for p, fp in enumerate(mine) if consensus_needed([fp, *(o[p] for o in others)], tol)]
