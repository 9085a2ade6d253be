"""Pre-tokenized shards in nanoGPT's and llm.c's formats (models/tokens.py)."""

import numpy as np
import pytest
import torch
from islands.models.tokens import HEADER_INTS, TokenCorpus, TokenFileError, open_tokens


def _llmc(path, tokens, magic=20240520, dtype=np.uint16, count=None):
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = [magic, 1, len(tokens) if count is None else count]
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype=dtype).tobytes())
    return path


def _raw(path, tokens):
    path.write_bytes(np.asarray(tokens, dtype=np.uint16).tobytes())
    return path


def test_both_formats_read_the_same_tokens(tmp_path):
    ids = np.arange(5000) % 1000
    assert np.array_equal(open_tokens(_raw(tmp_path / "train.bin", ids)), ids)
    assert np.array_equal(open_tokens(_llmc(tmp_path / "a.bin", ids)), ids)
    wide = ids + 70000
    got = open_tokens(_llmc(tmp_path / "b.bin", wide, magic=20240801, dtype=np.uint32))
    assert got.dtype == np.uint32 and np.array_equal(got, wide)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: _llmc(p, [1, 2, 3], magic=20240999), "unknown magic 20240999"),
        (lambda p: _llmc(p, [1, 2, 3], count=10), "says 10 tokens of 2 bytes, its body holds 6 bytes (truncated)"),
        (lambda p: p.write_bytes(b"\x01\x00\x02"), "odd length 3 bytes"),
        (lambda p: p.write_bytes(b""), "holds no tokens"),
        (lambda p: _raw(p, [5, 300, 7]), "token id 300 (first out of range at position 1) is not below the vocabulary size 256"),
    ],
)
def test_a_bad_token_file_is_refused_with_its_reason(tmp_path, make, message):
    path = tmp_path / "bad.bin"
    make(path)
    with pytest.raises(TokenFileError) as e:
        open_tokens(path, vocab_size=256)
    assert message in str(e.value) and str(e.value).startswith(str(path))


def test_shards_are_disjoint_and_a_batch_is_a_function_of_seed_and_key(tmp_path):
    files = [_llmc(tmp_path / f"s{i}.bin", (np.arange(200_000) * (i + 3)) % 50_000) for i in range(2)]
    corpus = TokenCorpus(files, num_shards=4, eval_fraction=0.1, seq_len=64, vocab_size=50_000)
    shards = [corpus.shard(s) for s in range(4)]
    ids = [{id(b) for b in s.blocks} for s in shards]
    assert all(ids[i].isdisjoint(ids[j]) for i in range(4) for j in range(i + 1, 4))
    x, y = shards[1].batch(seed=7, key=12, batch_size=4, seq_len=64)
    assert x.shape == y.shape == (4, 64) and x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    again = corpus.shard(1).batch(seed=7, key=12, batch_size=4, seq_len=64)
    assert torch.equal(x, again[0]) and not torch.equal(x, shards[1].batch(seed=7, key=13, batch_size=4, seq_len=64)[0])
    assert corpus.eval.blocks and corpus.num_tokens == 400_000
    with pytest.raises(ValueError, match="token data too small"):
        TokenCorpus(files[:1], num_shards=16, eval_fraction=0.1, seq_len=64)


def _pattern(n, vocab=512, period=37):
    """Tokens a small model learns quickly: a repeating sequence."""
    return (np.arange(n) * 7 % period + np.arange(n) // 9973 % 3) % vocab


@pytest.mark.network
def test_a_node_trains_on_token_shards_in_both_formats(tmp_path, capsys):
    import json

    from islands.node.cli import main

    data = tmp_path / "shards"
    data.mkdir()
    _raw(data / "a.bin", _pattern(300_000))
    _llmc(data / "b.bin", _pattern(300_000) + 100)
    run = tmp_path / "run"
    argv = ["--data", f"tokens:{data}/*.bin", "--vocab-size", "512", "--steps", "40", "--window", "10", "--fragments", "2",
            "--seq-len", "64", "--batch-size", "4", "--num-shards", "2", "--run-dir", str(run), "--progress", "off"]
    assert main(argv, environ={}) == 0
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    losses = [e["loss"] for e in events if e["event"] == "step"]
    assert len(losses) == 40 and np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])
    assert events[0]["manifest"]["model"]["vocab_size"] == 512


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--vocab-size", "30"], "is not below the vocabulary size 30"),
        ([], "token data needs the tokenizer's vocabulary: give --vocab-size"),
    ],
)
def test_bad_token_data_ends_with_one_line_and_exit_2(tmp_path, capsys, argv, message):
    from islands.node.cli import main

    _raw(tmp_path / "a.bin", _pattern(200_000))
    assert main(["--data", f"tokens:{tmp_path}/a.bin", *argv, "--run-dir", str(tmp_path / "run")], environ={}) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
