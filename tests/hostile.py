"""A hostile island for tests: a real islands-node whose contributions to rounds are poisoned.

    python -m tests.hostile MODE [islands-node options]

MODE `nan` sends NaN pseudo-gradients, `huge` random ones 1e3 times larger than
any honest update, `mixed` alternates the two by round; `reducer` contributes
honestly but returns the slice of every round it reduces for the others (a reduce-scatter
round: 3 or more islands, uncompressed) 50 times too large. Everything else (DHT, records,
swarm key, rounds) is the real node's.
"""

from __future__ import annotations

import sys

import torch


def poison(mode: str, round_: int, delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if mode == "mixed":
        mode = "nan" if round_ % 2 else "huge"
    if mode == "nan":
        return {n: torch.full_like(t, float("nan")) for n, t in delta.items()}
    return {n: torch.randn_like(t) * 1e3 for n, t in delta.items()}


def main() -> int:
    mode, argv = sys.argv[1], sys.argv[2:]
    if mode not in ("nan", "huge", "mixed", "reducer"):
        raise SystemExit(f"hostile: unknown mode {mode!r}")
    if mode == "reducer":
        from islands.node.net import transport
        from islands.protocols.parts import decode_part, encode_part

        reduce = transport.reduce_slice

        def spoiled(order, me, pieces):
            meta, values = decode_part(reduce(order, me, pieces))
            weight = meta.pop("weight")
            for key in ("codec", "numel"):
                meta.pop(key)
            return encode_part(values * 50, weight, "none", meta)

        transport.reduce_slice = spoiled
    else:
        from islands.protocols.diloco import StreamingDiLoCo

        honest = StreamingDiLoCo.contribution

        def poisoned(self, fragment, round_, step, params):
            c = honest(self, fragment, round_, step, params)
            c.delta = poison(mode, round_, c.delta)
            return c

        StreamingDiLoCo.contribution = poisoned
    from islands.node.cli import main as node_main

    return node_main(argv)


if __name__ == "__main__":
    sys.exit(main())
