"""The model and the data: shapes, routing, sharding, held-out split."""

import pytest
import torch
from islands.models.data import DataConfig, corpus_files, load_corpus
from islands.models.transformer import MODEL_SIZES, Transformer, model_config


def test_moe_forward_backward_and_aux_loss():
    torch.manual_seed(0)
    cfg = model_config("tiny")
    assert cfg.num_experts == 32 and cfg.top_k == 1
    model = Transformer(cfg)
    x = torch.randint(0, 256, (2, 16))
    logits, loss, aux = model(x, x)
    assert logits.shape == (2, 16, 256)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.05  # zero head: uniform
    assert aux.item() >= 0.99  # Switch loss is >= 1, with equality when balanced
    (loss + aux).backward()
    assert model.blocks[0].ffn.router.weight.grad is not None


def test_dense_variant_has_same_active_width():
    moe, dense = Transformer(model_config("tiny")), Transformer(model_config("tiny", dense=True))
    assert dense.cfg.num_experts == 1
    assert sum(p.numel() for p in dense.parameters()) < sum(p.numel() for p in moe.parameters())
    _, loss, aux = dense(torch.randint(0, 256, (1, 8)), torch.randint(0, 256, (1, 8)))
    assert aux.item() == 0.0


def test_layer_groups_cover_every_parameter():
    model = Transformer(MODEL_SIZES["tiny"])
    groups = model.layer_groups()
    assert set(groups) == {n for n, _ in model.named_parameters()}
    assert groups["embed.weight"] == "embed" and groups["head.weight"] == "head"
    assert groups["blocks.3.ffn.w_up_EFD"] == 3


def test_stdlib_corpus_shards_are_disjoint_and_batches_deterministic():
    corpus = load_corpus(DataConfig(num_shards=4), seq_len=64)
    assert corpus.num_bytes > 1_000_000
    a, b = corpus.shard(0), corpus.shard(1)
    assert len(a.data) and len(b.data) and len(corpus.eval.data)
    xa, ya = a.batch(0, 5, 4, 64)
    assert torch.equal(xa, a.batch(0, 5, 4, 64)[0])
    assert torch.equal(xa[:, 1:], ya[:, :-1])
    # a sequence of shard 0 appears in no other shard and not in the held-out split
    needle = bytes(a.data[1000:1064].tolist())
    for other in (b, corpus.shard(2), corpus.shard(3), corpus.eval):
        assert needle not in bytes(other.data.tolist())


def test_data_path_file_folder_glob(tmp_path):
    (tmp_path / "d").mkdir()
    for i in range(3):
        (tmp_path / "d" / f"{i}.txt").write_text("hello islands " * 2000)
    assert len(corpus_files(str(tmp_path / "d"))) == 3
    assert len(corpus_files(str(tmp_path / "d" / "*.txt"))) == 3
    assert len(corpus_files(str(tmp_path / "d" / "0.txt"))) == 1
    corpus = load_corpus(DataConfig(data=str(tmp_path / "d"), num_shards=2), seq_len=32)
    assert len(corpus.shard(1).data) > 0


def test_missing_and_empty_data(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(DataConfig(data=str(tmp_path / "nope")), 32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no files"):
        load_corpus(DataConfig(data=str(tmp_path / "empty")), 32)
    (tmp_path / "z.txt").write_text("")
    with pytest.raises(ValueError, match="holds no bytes"):
        load_corpus(DataConfig(data=str(tmp_path / "z.txt")), 32)
    (tmp_path / "small.txt").write_text("abc")
    with pytest.raises(ValueError, match="too small"):
        load_corpus(DataConfig(data=str(tmp_path / "small.txt")), 32)
