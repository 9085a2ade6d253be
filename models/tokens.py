"""Pre-tokenized data: token shards in the two formats people already have, read by memmap.

- nanoGPT: a raw array of uint16 token ids, no header (`train.bin`).
- llm.c / modded-nanogpt: a header of 256 int32 — magic 20240520 (uint16 tokens) or 20240801
  (uint32 tokens), a version, the number of tokens — then the tokens.

The tokens are cut into blocks; a block is held out for evaluation by a hash of its index and the
others are dealt round-robin into shards, as the byte corpus does (data.py), so islands that hold
different shards never read the same tokens, and a batch is a pure function of (seed, shard, key).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from .data import is_eval_block

HEADER_INTS = 256
HEADER_BYTES = 4 * HEADER_INTS
MAGICS = {20240520: np.uint16, 20240801: np.uint32}
"""llm.c's magic numbers and the token type each announces."""
BLOCK_TOKENS = 1 << 16


class TokenFileError(ValueError):
    """A token file that cannot be read as it says: the message names the file and what is wrong."""


def _looks_like_header(first: np.ndarray) -> bool:
    """A header with a magic this reader does not know: a date-like number and a small version."""
    return len(first) >= 2 and 20_000_000 <= int(first[0]) < 30_000_000 and 1 <= int(first[1]) <= 16


def open_tokens(path: str | Path, vocab_size: int | None = None) -> np.memmap:
    """The token ids of one file, as a read-only memmap (uint16 or uint32); TokenFileError if the
    file has an unknown magic, a body shorter or longer than its header says, an odd length (raw
    uint16), no tokens, or (with `vocab_size`) an id at or above the vocabulary."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    first = np.frombuffer(head[: len(head) // 4 * 4], dtype=np.int32)
    if len(first) and int(first[0]) in MAGICS:
        if size < HEADER_BYTES:
            raise TokenFileError(f"{path}: truncated llm.c header ({size} bytes of {HEADER_BYTES})")
        dtype = MAGICS[int(first[0])]
        count = int(first[2])
        body = size - HEADER_BYTES
        if body != count * np.dtype(dtype).itemsize:
            raise TokenFileError(
                f"{path}: its header says {count} tokens of {np.dtype(dtype).itemsize} bytes, its body holds {body} bytes"
                + (" (truncated)" if body < count * np.dtype(dtype).itemsize else "")
            )
        tokens = np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,)) if count else np.zeros(0, dtype)
    elif _looks_like_header(first):
        known = ", ".join(f"{m} ({np.dtype(t).name} tokens)" for m, t in MAGICS.items())
        raise TokenFileError(f"{path}: unknown magic {int(first[0])} in its header; llm.c shards have {known}")
    else:
        if size % 2:
            raise TokenFileError(f"{path}: odd length {size} bytes; raw (nanoGPT) token files hold uint16 ids, 2 bytes each")
        tokens = np.memmap(path, dtype=np.uint16, mode="r") if size else np.zeros(0, np.uint16)
    if len(tokens) == 0:
        raise TokenFileError(f"{path}: holds no tokens")
    if vocab_size is not None:
        top = int(tokens.max())
        if top >= vocab_size:
            where = int(np.argmax(tokens >= vocab_size))
            raise TokenFileError(f"{path}: token id {top} (first out of range at position {where}) is not below the vocabulary size {vocab_size}")
    return tokens


@dataclasses.dataclass(frozen=True)
class TokenSplit:
    """Blocks of token ids (one shard's, or the held-out ones), each a view into a memmap."""

    blocks: tuple[np.ndarray, ...]

    def batch(self, seed: int, key: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets: rows at blocks and offsets drawn from (seed, key)."""
        usable = [b for b in self.blocks if len(b) >= seq_len + 1]
        g = torch.Generator().manual_seed((seed * 1_000_003 + key) % (1 << 63))
        picks = torch.randint(0, len(usable), (batch_size,), generator=g).tolist()
        rows = []
        for i in picks:
            block = usable[i]
            start = int(torch.randint(0, len(block) - seq_len, (1,), generator=g))
            rows.append(torch.from_numpy(block[start : start + seq_len + 1].astype(np.int64)))
        x = torch.stack(rows)
        return x[:, :-1], x[:, 1:]


class TokenCorpus:
    """Token files cut into blocks, dealt into shards, with a held-out split (the byte Corpus's interface)."""

    def __init__(self, files: Sequence[str | Path], num_shards: int, eval_fraction: float, seq_len: int, vocab_size: int | None = None):
        blocks = []
        for path in files:
            tokens = open_tokens(path, vocab_size)
            blocks += [tokens[i : i + BLOCK_TOKENS] for i in range(0, len(tokens), BLOCK_TOKENS)]
        blocks = [b for b in blocks if len(b) >= seq_len + 1]
        held = [b for i, b in enumerate(blocks) if is_eval_block(i, eval_fraction)]
        train = [b for i, b in enumerate(blocks) if not is_eval_block(i, eval_fraction)]
        if not held and train:
            held = [train.pop()]  # a small data set: its last block is held out
        if len(train) < num_shards:
            raise ValueError(
                f"token data too small: {len(train)} training blocks of up to {BLOCK_TOKENS} tokens "
                f"(of at least {seq_len + 1}) for {num_shards} shards, plus a held-out block"
            )
        self.eval = TokenSplit(tuple(held))
        self._shards = [tuple(train[s::num_shards]) for s in range(num_shards)]
        self.num_tokens = sum(len(b) for b in blocks)

    def shard(self, index: int) -> TokenSplit:
        return TokenSplit(self._shards[index])
