"""The Streaming DiLoCo core against hand computations."""

import pytest
import torch
from islands.protocols.diloco import DiLoCoConfig, StreamingDiLoCo
from islands.protocols.fragments import layout_digest, split_fragments
from islands.protocols.outer import (
    mix,
    nesterov_outer_step,
    pseudo_gradient,
    token_weight,
    weighted_average,
)
from islands.protocols.schedule import (
    check_schedule,
    default_overlap,
    fragment_offsets,
    fragments_starting,
    next_sync_step,
    round_number,
)

GROUPS = {"embed.weight": "embed", "pos": "embed", **{f"blocks.{i}.w": i for i in range(6)}, "norm.weight": "head", "head.weight": "head"}


def test_strided_split_by_depth():
    frags = split_fragments(GROUPS, 4)
    assert frags == [
        ["embed.weight", "pos", "blocks.0.w", "blocks.4.w"],
        ["blocks.1.w", "blocks.5.w"],
        ["blocks.2.w"],
        ["blocks.3.w", "norm.weight", "head.weight"],
    ]


def test_split_one_fragment_holds_everything():
    assert split_fragments(GROUPS, 1) == [list(GROUPS)]


def test_split_refuses_more_fragments_than_blocks():
    with pytest.raises(ValueError, match="exceeds the model's 6 blocks"):
        split_fragments(GROUPS, 7)


def test_layout_digest_changes_with_layout_and_shapes():
    shapes = {n: (2, 2) for n in GROUPS}
    d4 = layout_digest(split_fragments(GROUPS, 4), shapes)
    assert d4 == layout_digest(split_fragments(GROUPS, 4), shapes)
    assert d4 != layout_digest(split_fragments(GROUPS, 3), shapes)
    assert d4 != layout_digest(split_fragments(GROUPS, 4), {**shapes, "pos": (3, 2)})


def test_offsets_are_floor_p_h_over_p():
    assert fragment_offsets(20, 4) == [0, 5, 10, 15]
    assert fragment_offsets(50, 4) == [0, 12, 25, 37]
    assert fragment_offsets(50, 3) == [0, 16, 33]


def test_rounds_start_at_offsets_from_the_first_full_window():
    starts = {t: fragments_starting(t, 20, 4) for t in range(1, 61) if fragments_starting(t, 20, 4)}
    assert starts == {20: [0], 25: [1], 30: [2], 35: [3], 40: [0], 45: [1], 50: [2], 55: [3], 60: [0]}
    assert round_number(25, 20) == 1 and round_number(40, 20) == 2


def test_next_sync_step():
    assert next_sync_step(0, 1, 20, 4) == 25
    assert next_sync_step(24, 1, 20, 4) == 25
    assert next_sync_step(25, 1, 20, 4) == 45
    assert next_sync_step(19, 0, 20, 4) == 20


def test_overlap_rules():
    assert default_overlap(50, 4) == 5
    assert default_overlap(20, 4) == 4  # tau < H/P = 5
    assert default_overlap(4, 4) == 0
    check_schedule(20, 4, 4)
    with pytest.raises(ValueError, match="overlap 5 must be below window/fragments = 5"):
        check_schedule(20, 4, 5)
    with pytest.raises(ValueError, match="cannot be divided into 8 fragments"):
        check_schedule(4, 8, 0)


def test_pseudo_gradient_and_nesterov_by_hand():
    g, local = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 2.5])
    delta = pseudo_gradient(g, local)
    assert torch.equal(delta, torch.tensor([0.5, -0.5]))
    m = torch.tensor([0.2, 0.0])
    new_g, new_m = nesterov_outer_step(g, delta, m, lr=0.7, mu=0.9)
    # m' = 0.9*m + d = [0.68, -0.5];  g' = g - 0.7*(d + 0.9*m') = [1 - 0.7*1.112, 2 - 0.7*(-0.95)]
    assert torch.allclose(new_m, torch.tensor([0.68, -0.5]))
    assert torch.allclose(new_g, torch.tensor([1 - 0.7 * 1.112, 2 + 0.7 * 0.95]))


def test_nesterov_matches_torch_sgd():
    g = torch.randn(5)
    p = torch.nn.Parameter(g.clone())
    opt = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    m = torch.zeros(5)
    for _ in range(3):
        d = torch.randn(5)
        p.grad = d.clone()
        opt.step()
        g, m = nesterov_outer_step(g, d, m, 0.7, 0.9)
    assert torch.allclose(p.detach(), g, atol=1e-6)


def test_mix():
    local, g = torch.tensor([2.0]), torch.tensor([4.0])
    assert mix(local, g, 0.5).item() == 3.0
    assert mix(local, g, 0.0).item() == 4.0
    assert mix(local, g, 1.0).item() == 2.0


def test_token_weighting_counts_twice_the_tokens_twice():
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([4.0, 3.0])
    avg = weighted_average([a, b], [token_weight(1000), token_weight(2000)])
    # (1*a + 2*b) / 3 : the island with twice the tokens counts as two islands
    assert torch.allclose(avg, (a + b + b) / 3)
    assert torch.allclose(weighted_average([a, b], [0, 0]), (a + b) / 2)


def _toy_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def test_one_island_lr1_momentum0_alpha0_reproduces_plain_training():
    """global <- global - 1*(global - local) = local, and alpha=0 copies it back: no change to training."""
    data = [(torch.randn(16, 4), torch.randn(16, 1)) for _ in range(40)]

    def train(with_diloco: bool) -> torch.Tensor:
        model = _toy_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        params = dict(model.named_parameters())
        names = list(params)
        cfg = DiLoCoConfig(window=8, fragments=2, overlap=0, alpha=0.0, outer_lr=1.0, outer_momentum=0.0)
        diloco = StreamingDiLoCo(cfg, [names[:2], names[2:]], params)
        for t, (x, y) in enumerate(data, start=1):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            diloco.add_tokens(16)
            if with_diloco:
                for p in fragments_starting(t, cfg.window, cfg.fragments):
                    c = diloco.contribution(p, round_number(t, cfg.window), t, params)
                    diloco.apply(p, c.round, c.delta, params)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.allclose(train(True), train(False), atol=1e-6)


def test_contribution_weight_is_tokens_since_last_sync():
    model = _toy_model()
    params = dict(model.named_parameters())
    names = list(params)
    diloco = StreamingDiLoCo(DiLoCoConfig(window=8, fragments=2), [names[:2], names[2:]], params)
    diloco.add_tokens(100)
    diloco.add_tokens(50)
    assert diloco.contribution(0, 1, 8, params).weight == 150
    diloco.add_tokens(10)
    assert diloco.contribution(0, 2, 16, params).weight == 10
    assert diloco.contribution(1, 1, 12, params).weight == 160


def test_apply_is_outer_step_then_mix():
    model = _toy_model()
    params = dict(model.named_parameters())
    names = list(params)
    cfg = DiLoCoConfig(window=8, fragments=1, overlap=0, alpha=0.5, outer_lr=0.7, outer_momentum=0.9)
    diloco = StreamingDiLoCo(cfg, [names], params)
    g0 = {n: t.clone() for n, t in diloco.globals[0].items()}
    with torch.no_grad():
        for p in params.values():
            p.add_(0.1)
    c = diloco.contribution(0, 1, 8, params)
    local_before = {n: p.detach().clone() for n, p in params.items()}
    diloco.apply(0, 1, c.delta, params)
    for n in names:
        d = g0[n] - local_before[n]
        expect_g = g0[n] - 0.7 * (d + 0.9 * d)
        assert torch.allclose(diloco.globals[0][n], expect_g, atol=1e-6)
        assert torch.allclose(params[n].detach(), 0.5 * local_before[n] + 0.5 * expect_g, atol=1e-6)
    assert diloco.counters[0].round == 1


def test_blockwise_int8_round_trip_never_clips():
    from islands.protocols.compression import dequantize_blockwise, quantize_blockwise

    torch.manual_seed(0)
    x = torch.randn(1000) * 0.01
    x[17] = 50.0  # an outlier costs precision in its own block only
    codes, scales = quantize_blockwise(x, block=256)
    assert codes.dtype == torch.int8 and codes.numel() == 1000 and scales.numel() == 4
    y = dequantize_blockwise(codes, scales, block=256)
    assert abs(y[17].item() - 50.0) < 1e-4
    err = (x - y).abs()
    assert err[256:].max() <= scales[1:].max() / 2 + 1e-9  # half a step, no clipping
    assert torch.equal(dequantize_blockwise(*quantize_blockwise(torch.zeros(5))), torch.zeros(5))


def test_fingerprints_see_a_slice_left_unaveraged_but_not_fp32_noise():
    from islands.protocols.consensus import TOLERANCE, consensus_needed, fingerprint

    torch.manual_seed(0)
    g = torch.randn(512, 256) * 0.05
    noisy = g + torch.randn_like(g) * 5e-7
    stale = g.clone()
    stale[:40] += torch.randn(40, 256) * 0.01  # one slice kept a different value
    tol = TOLERANCE["none"]
    assert not consensus_needed([fingerprint([g]), fingerprint([noisy])], tol)
    assert consensus_needed([fingerprint([g]), fingerprint([stale])], tol)
