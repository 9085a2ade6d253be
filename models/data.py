"""Byte-level training data: the Python standard library's own source, or text files.

The corpus is cut into fixed blocks. A block is held out for evaluation by a
hash of its index; the others are dealt round-robin into `num_shards` shards,
so islands that hold different shard indexes never read the same bytes. A
training batch is a pure function of (seed, shard, step): a resumed island
reads exactly the batches it would have read.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import sysconfig
from pathlib import Path

import torch

BLOCK_BYTES = 1 << 16
MAX_CORPUS_BYTES = 1 << 27  # 128 MiB: plenty for the sizes here, bounded start-up
DATA_STDLIB = "stdlib"
TOKENS_PREFIX = "tokens:"
"""`--data tokens:GLOB`: pre-tokenized shards (tokens.py) instead of bytes."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    data: str = dataclasses.field(
        default=DATA_STDLIB,
        metadata={"help": "`stdlib` (the Python standard library's source: nothing to download), a file, folder or glob of text files, "
                          "or tokens:GLOB for token shards (nanoGPT's raw uint16 .bin or llm.c's, with --vocab-size)"},
    )
    num_shards: int = dataclasses.field(default=16, metadata={"help": "training shards the corpus is dealt into; the same on every island"})
    shard: int = dataclasses.field(default=-1, metadata={"help": "this island's shard, 0..num_shards-1; -1 picks one (0 when alone)"})
    eval_fraction: float = dataclasses.field(default=0.02, metadata={"help": "share of the corpus held out for eval_loss"})
    eval_batches: int = dataclasses.field(default=8, metadata={"help": "batches of held-out data in one evaluation"})

    def __post_init__(self):
        if not self.data:
            raise ValueError("data must be `stdlib` or a path")
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        if not -1 <= self.shard < self.num_shards:
            raise ValueError(f"shard must be -1 or in 0..{self.num_shards - 1}, got {self.shard}")
        if not 0.0 < self.eval_fraction < 0.5:
            raise ValueError(f"eval_fraction must be in (0, 0.5), got {self.eval_fraction}")
        if self.eval_batches < 1:
            raise ValueError(f"eval_batches must be >= 1, got {self.eval_batches}")


def corpus_files(spec: str) -> list[Path]:
    """The files a data spec names, sorted; raises ValueError if there are none."""
    if spec == DATA_STDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts]
    else:
        path = Path(spec).expanduser()
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")]
        else:
            files = [Path(p) for p in glob.glob(spec, recursive=True) if os.path.isfile(p)]
            if not files:
                raise ValueError(f"data path {spec!r} does not exist")
    files = sorted(files)
    if not files:
        raise ValueError(f"data path {spec!r} holds no files")
    return files


def read_corpus(spec: str, max_bytes: int = MAX_CORPUS_BYTES) -> bytes:
    parts, total = [], 0
    for path in corpus_files(spec):
        try:
            chunk = path.read_bytes()
        except OSError:
            continue  # unreadable files are skipped, not fatal
        parts.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            break
    corpus = b"".join(parts)[:max_bytes]
    return corpus


def is_eval_block(index: int, eval_fraction: float) -> bool:
    """Whether block `index` is held out for evaluation: a hash of the index, the same on every island."""
    h = int.from_bytes(hashlib.blake2b(index.to_bytes(8, "little"), digest_size=8).digest(), "little")
    return (h % 1_000_000) < eval_fraction * 1_000_000


@dataclasses.dataclass(frozen=True)
class Split:
    """Blocks of one shard (or of the held-out split), as one tensor of bytes."""

    data: torch.Tensor  # uint8

    def batch(self, seed: int, key: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets at offsets drawn from (seed, key)."""
        g = torch.Generator().manual_seed((seed * 1_000_003 + key) % (1 << 63))
        starts = torch.randint(0, len(self.data) - seq_len - 1, (batch_size,), generator=g)
        rows = torch.stack([self.data[s : s + seq_len + 1] for s in starts.tolist()]).long()
        return rows[:, :-1], rows[:, 1:]


class Corpus:
    """A corpus cut into blocks, dealt into shards, with a held-out split."""

    def __init__(self, raw: bytes, cfg: DataConfig, min_bytes: int):
        self.cfg = cfg
        blocks = [raw[i : i + BLOCK_BYTES] for i in range(0, len(raw), BLOCK_BYTES)]
        eval_ids = [i for i in range(len(blocks)) if is_eval_block(i, cfg.eval_fraction)]
        train_ids = [i for i in range(len(blocks)) if not is_eval_block(i, cfg.eval_fraction)]
        if not eval_ids or len(train_ids) < cfg.num_shards:
            # too small to cut by blocks: hold out the tail, deal the rest by bytes
            cut = max(min_bytes, int(len(raw) * cfg.eval_fraction))
            if len(raw) - cut < cfg.num_shards * min_bytes:
                raise ValueError(
                    f"data is too small: {len(raw)} bytes for {cfg.num_shards} shards "
                    f"of sequences of {min_bytes - 1} bytes plus a held-out split"
                )
            self.eval = Split(_as_tensor(raw[-cut:]))
            body = raw[:-cut]
            size = len(body) // cfg.num_shards
            self._shards = [body[i * size : (i + 1) * size] for i in range(cfg.num_shards)]
        else:
            self.eval = Split(_as_tensor(b"".join(blocks[i] for i in eval_ids)))
            self._shards = [
                b"".join(blocks[i] for i in train_ids[s :: cfg.num_shards]) for s in range(cfg.num_shards)
            ]
        self.num_bytes = len(raw)

    def shard(self, index: int) -> Split:
        return Split(_as_tensor(self._shards[index]))


def _as_tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def load_corpus(cfg: DataConfig, seq_len: int, vocab_size: int | None = None) -> Corpus:
    """Read and cut the corpus (bytes, or token shards for `tokens:GLOB`, every id checked below
    `vocab_size`); ValueError (with the reason) if the data is missing, bad or too small."""
    if cfg.data.startswith(TOKENS_PREFIX):
        from .tokens import TokenCorpus

        files = corpus_files(cfg.data.removeprefix(TOKENS_PREFIX))
        return TokenCorpus(files, cfg.num_shards, cfg.eval_fraction, seq_len, vocab_size)
    raw = read_corpus(cfg.data)
    if not raw:
        raise ValueError(f"data path {cfg.data!r} holds no bytes")
    return Corpus(raw, cfg, min_bytes=seq_len + 2)
