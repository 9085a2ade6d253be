"""The Streaming DiLoCo core against hand computations."""

import pytest
import torch
from islands.protocols.diloco import DiLoCoConfig, StreamingDiLoCo
from islands.protocols.fragments import layout_digest, split_fragments
from islands.protocols.outer import (
    mix,
    nesterov_outer_step,
    outer_hyper,
    pseudo_gradient,
    token_weight,
    weighted_average,
)
from islands.protocols.policy import Plan, after_failed_rebase, after_round, holds_swarm_base
from islands.protocols.schedule import (
    Schedule,
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
    c = diloco.contribution(0, 1, 8, params)
    assert c.weight == 150 and c.staleness == 0
    diloco.apply(0, 1, c.delta, params)
    diloco.add_tokens(10)
    assert diloco.contribution(0, 2, 16, params).weight == 10
    assert diloco.contribution(1, 1, 12, params).weight == 160


def test_stale_contributions_count_zero_for_islands_and_discounted_for_satellites():
    from islands.protocols.outer import contribution_weight

    assert contribution_weight(1000, 0) == 1000 and contribution_weight(1000, 0, satellite=True) == 1000
    assert contribution_weight(1000, 3) == 0.0  # an island that missed rounds: its base is not the swarm's
    # a satellite that missed 3 rounds brings ~4 windows of progress: it counts as one window's tokens / 4
    assert contribution_weight(4000, 3, satellite=True) == 4000 / 16
    model = _toy_model()
    params = dict(model.named_parameters())
    names = list(params)
    for satellite, expected in ((False, 0.0), (True, 300 / 9)):
        d = StreamingDiLoCo(DiLoCoConfig(window=8, fragments=2), [names[:2], names[2:]], params, satellite=satellite)
        d.add_tokens(300)
        c = d.contribution(0, 3, 24, params)  # rounds 1 and 2 were never applied
        assert c.staleness == 2 and c.tokens == 300 and c.weight == pytest.approx(expected)
    d.keep_accumulating(c)  # the satellite's round did not happen: its tokens wait for the next one
    d.add_tokens(100)
    assert d.contribution(0, 4, 32, params).tokens == 400


def test_contact_windows():
    from islands.protocols.contact import parse_contact

    s = parse_contact("up 10s every 30s")
    assert [s.in_contact(t) for t in (0, 9.9, 10, 29.9, 30, 45)] == [True, True, False, False, True, False]
    assert s.remaining_s(4) == 6 and s.remaining_s(12) == 0 and s.next_start_s(12) == 30
    late = parse_contact("up 1m every 2m after 30s")
    assert not late.in_contact(10) and late.in_contact(30) and late.in_contact(89) and not late.in_contact(90)
    assert late.next_start_s(10) == 30 and late.next_start_s(100) == 150
    windows = parse_contact("0-20, 60-80")
    assert windows.in_contact(5) and not windows.in_contact(30) and windows.in_contact(70)
    assert windows.next_start_s(30) == 60 and windows.next_start_s(90) is None
    assert parse_contact("always").remaining_s(1e6) == float("inf")
    for bad in ("sometimes", "up 0s every 10s", "up 20s every 10s", "20-10", "0-20,10-30", ""):
        with pytest.raises(ValueError, match="contact"):
            parse_contact(bad)


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


def test_an_outer_warmup_goes_from_plain_averaging_to_nesterov():
    assert [outer_hyper(r, 0.7, 0.9, 0) for r in (1, 5)] == [(0.7, 0.9), (0.7, 0.9)]
    got = [outer_hyper(r, 0.7, 0.9, 2) for r in (1, 2, 3, 9)]
    assert got == [(1.0, 0.0), pytest.approx((0.85, 0.45)), (0.7, 0.9), (0.7, 0.9)]
    model = _toy_model()
    params = dict(model.named_parameters())
    names = list(params)
    cfg = DiLoCoConfig(window=8, fragments=1, overlap=0, alpha=0.5, outer_lr=0.7, outer_momentum=0.9, outer_warmup=2)
    assert cfg.manifest_fields()["outer_warmup"] == 2 and "outer_warmup" not in DiLoCoConfig().manifest_fields()
    diloco = StreamingDiLoCo(cfg, [names], params)
    with torch.no_grad():
        for p in params.values():
            p.add_(0.1)
    mean_local = {n: p.detach().clone() for n, p in params.items()}
    diloco.apply(0, 1, diloco.contribution(0, 1, 8, params).delta, params)  # round 1: the mean of the islands, as it is
    for n in names:
        assert torch.allclose(diloco.globals[0][n], mean_local[n], atol=1e-6)
    with pytest.raises(ValueError, match="outer_warmup"):
        DiLoCoConfig(outer_warmup=-1)


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


def test_4bit_codecs_keep_each_value_within_their_step_and_an_outlier_in_its_block():
    from islands.protocols.compression import (
        BLOCK4,
        dequantize_fp4,
        dequantize_int4,
        quantize_fp4,
        quantize_int4,
    )

    torch.manual_seed(0)
    x = torch.randn(1001) * 0.01
    x[17] = 50.0
    for quantize, dequantize, step in ((quantize_int4, dequantize_int4, 1 / 14), (quantize_fp4, dequantize_fp4, 1 / 4)):
        packed, scales = quantize(x)
        assert packed.dtype == torch.uint8 and packed.numel() == 501 and scales.numel() == 16  # 2 a byte, 64 a scale
        y = dequantize(packed, scales, 1001)
        assert y[17].item() == pytest.approx(50.0)  # the largest of its block is exact
        block_max = x.abs().view(-1)[:960].view(-1, BLOCK4).amax(dim=1).repeat_interleave(BLOCK4)
        assert ((x[:960] - y[:960]).abs() <= step * block_max + 1e-9).all()  # relative to its own block
        assert (x[64:] - y[64:]).abs().max() < 0.01  # the outlier costs precision in its block only
        assert torch.equal(dequantize(*quantize(torch.zeros(5)), 5), torch.zeros(5))
    # fp4: a power of two of the block's largest is exact; others within a third of themselves
    z = torch.tensor([1.0, -0.5, 0.25, 2.0**-6, 0.7, -0.3, 0.0, 0.001])
    got = dequantize_fp4(*quantize_fp4(z), 8)
    assert got[:4].tolist() == [1.0, -0.5, 0.25, 2.0**-6] and got[6] == 0 and got[7] == 0
    assert ((got[4:6] - z[4:6]).abs() <= z[4:6].abs() / 3).all()


def test_fingerprints_see_a_slice_left_unaveraged_but_not_fp32_noise():
    from islands.protocols.consensus import (
        TOLERANCE,
        consensus_needed,
        fingerprint,
        fragment_fingerprint,
    )

    torch.manual_seed(0)
    g = torch.randn(512, 256) * 0.05
    noisy = g + torch.randn_like(g) * 5e-7
    stale = g.clone()
    stale[:40] += torch.randn(40, 256) * 0.01  # one slice kept a different value
    tol = TOLERANCE["none"]
    assert not consensus_needed([fingerprint([g]), fingerprint([noisy])], tol)
    assert consensus_needed([fingerprint([g]), fingerprint([stale])], tol)
    # one fingerprint of a whole fragment (the end-of-run check publishes it in the island record)
    bias = torch.randn(256) * 0.05
    assert len(fragment_fingerprint([g, bias])) == 6
    assert not consensus_needed([fragment_fingerprint([g, bias]), fragment_fingerprint([noisy, bias])], tol)
    assert consensus_needed([fragment_fingerprint([g, bias]), fragment_fingerprint([stale, bias])], tol)


def test_balance_fills_a_fast_islands_wait_with_micro_batches_never_past_the_median():
    from islands.protocols.schedule import balance_accumulation

    assert balance_accumulation(0.1, [0.35], current=1) == 3  # 3 x 0.1 s <= 0.35 s
    assert balance_accumulation(0.4, [0.1, 0.2], current=2) == 1  # slower than the others: no accumulation
    assert balance_accumulation(0.1, [0.2, 0.3, 9.0], current=1) == 3  # the median, not the straggler
    assert balance_accumulation(0.01, [10.0], current=1) == 16  # capped
    assert balance_accumulation(0.1, [], current=4) == 4 and balance_accumulation(0.0, [1.0], current=2) == 2
    assert balance_accumulation(0.11, [0.2], current=2) == 2  # 10% over: kept, no flip-flop
    assert balance_accumulation(0.15, [0.2], current=2) == 1  # 50% over: lowered


def test_deposits_fold_into_a_contribution_as_members_would():
    from islands.protocols.outer import fold_deposits

    own = {"w": torch.full((3,), 1.0)}
    sat = {"w": torch.full((3,), 5.0)}
    delta, weight = fold_deposits(own, 300.0, [(sat, 100.0)])
    assert weight == 400.0 and torch.allclose(delta["w"], torch.full((3,), 2.0))  # (300*1 + 100*5) / 400
    # a stale island (weight 0) carries the satellite's delta with the satellite's weight
    delta, weight = fold_deposits(own, 0.0, [(sat, 100.0)])
    assert weight == 100.0 and torch.allclose(delta["w"], sat["w"])
    assert fold_deposits(own, 0.0, [(sat, 0.0)])[0]["w"].equal(own["w"])
    assert fold_deposits(own, 7.0, [])[1] == 7.0


def test_the_last_round_makes_the_agreed_values_the_islands_mean_without_an_outer_step():
    model = _toy_model()
    params = dict(model.named_parameters())
    names = list(params)
    cfg = DiLoCoConfig(window=8, fragments=1, overlap=0, outer_lr=0.7, outer_momentum=0.9)
    diloco = StreamingDiLoCo(cfg, [names], params)
    diloco.momentum[0] = {n: torch.ones_like(t) for n, t in diloco.globals[0].items()}
    g0 = {n: t.clone() for n, t in diloco.globals[0].items()}
    other = {n: g0[n] + 0.3 for n in names}  # another island's local values
    with torch.no_grad():
        for p in params.values():
            p.add_(0.1)
    mine = diloco.contribution(0, 5, 40, params).delta
    avg = {n: (mine[n] + (g0[n] - other[n])) / 2 for n in names}
    diloco.apply_last(0, 5, avg)
    for n in names:
        assert torch.allclose(diloco.globals[0][n], (params[n].detach() + other[n]) / 2, atol=1e-6)
        assert torch.equal(diloco.momentum[0][n], torch.ones_like(g0[n]))
    assert diloco.counters[0].round == 5


def test_the_schedule_says_what_happens_at_each_step():
    s = Schedule(window=20, fragments=4, overlap=3)
    assert [s.starting(t) for t in (19, 20, 25, 30, 35, 40)] == [[], [0], [1], [2], [3], [0]]
    assert (s.round_of(25), s.round_of(45), s.applied_at(25), s.spacing) == (1, 2, 28, 5)
    assert s.next_round(19) == (0, 20) and s.next_round(20) == (1, 25) and s.next_starts(36) == [40, 45, 50, 55]
    assert [t for t in range(1, 61) if s.ends_window(t)] == [20, 40, 60]
    for t in range(1, 200):  # a fragment starts at t exactly when t is its next start seen from t - 1
        assert s.starting(t) == [p for p in range(4) if s.next_start(t - 1, p) == t]
        # the last round of each fragment started by t: the round of its last start (0: none yet)
        assert [s.last_round(p, t) for p in range(4)] == [
            max([s.round_of(u) for u in range(1, t + 1) if p in s.starting(u)], default=0) for p in range(4)
        ]
    with pytest.raises(ValueError, match="overlap 5 must be below"):
        Schedule(window=20, fragments=4, overlap=5)
    assert DiLoCoConfig(window=20, fragments=4).schedule == Schedule(20, 4, 4)


@pytest.mark.parametrize(
    "outcome, deposited, consensus, staleness, satellite, expected",
    [
        ("ok", False, False, 0, False, Plan("apply", "averaged", settle=True)),
        ("ok", False, True, 0, False, Plan("apply", "averaged", heal=True)),
        ("ok", False, True, 2, False, Plan("apply", "averaged", mix_local=False, heal=True)),
        ("ok", False, False, 2, False, Plan("rebase", "rebased")),
        ("ok", False, False, 2, True, Plan("rebase", "rebased")),
        ("solo", False, False, 0, False, Plan("apply", "own_update", alone=True)),
        ("failed", False, False, 3, False, Plan("apply", "own_update", alone=True)),
        ("rejected", False, False, 0, False, Plan("apply", "own_update", alone=True)),
        ("failed", False, False, 0, True, Plan("accumulate", "accumulate")),
        ("skipped_no_contact", False, False, 0, True, Plan("accumulate", "accumulate")),
        ("ok", True, False, 1, True, Plan("take_swarm", "deposited")),
    ],
)
def test_the_plan_after_a_round(outcome, deposited, consensus, staleness, satellite, expected):
    assert after_round(outcome, deposited, consensus, staleness, satellite) == expected


def test_after_a_failed_rebase_an_island_applies_to_its_stale_base_and_a_satellite_waits():
    assert after_failed_rebase(satellite=False) == Plan("apply", "averaged", advance_round=False)
    assert after_failed_rebase(satellite=True) == Plan("accumulate", "accumulate")


@pytest.mark.parametrize(
    "outcome, policy, staleness, consensus, expected",
    [
        ("ok", "averaged", 0, None, True),  # averaged on the swarm's base
        ("ok", "rebased", 3, None, True),  # took an island's values
        ("ok", "averaged", 3, None, False),  # the rebase found no donor: still its own base
        ("ok", "averaged", 3, "ok", True),  # the group's values, re-averaged
        ("ok", "averaged", 3, "failed", False),
        ("failed", "own_update", 0, None, False),
        ("solo", "own_update", 0, None, False),
        ("rejected", "own_update", 0, None, False),
    ],
)
def test_which_rounds_give_an_island_the_swarms_values(outcome, policy, staleness, consensus, expected):
    assert holds_swarm_base(outcome, policy, staleness, consensus) is expected


def test_layer_groups_read_from_parameter_names():
    from islands.models.transformer import Transformer, model_config
    from islands.protocols.fragments import groups_by_name

    model = Transformer(model_config("tiny"))
    names = [n for n, _ in model.named_parameters()]
    assert groups_by_name(names) == model.layer_groups()  # the built-in model says the same
    hf = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.block_sparse_moe.experts.7.w1.weight",
        "model.layers.1.self_attn.q_proj.weight", "model.layers.1.input_layernorm.weight",
        "model.norm.weight", "lm_head.weight",
    ]
    groups = groups_by_name(hf)
    assert [groups[n] for n in hf] == ["embed", 0, 0, 1, 1, "head", "head"]
    assert split_fragments(groups, 2) == [hf[:3], hf[3:]]
    gpt2 = ["transformer.wte.weight", "transformer.h.0.attn.w", "transformer.shared_gate", "transformer.h.1.attn.w", "transformer.ln_f.weight"]
    assert [groups_by_name(gpt2)[n] for n in gpt2] == ["embed", 0, 0, 1, "head"]
    with pytest.raises(ValueError, match="no parameter name holds a layer index"):
        groups_by_name(["w", "b"])


def test_the_2bit_codec_puts_each_value_in_its_cell_of_the_blocks_rms_and_packs_four_to_a_byte():
    from islands.protocols.compression import (
        BLOCK4,
        dequantize_int2,
        pack_crumbs,
        quantize_int2,
        unpack_crumbs,
    )

    codes = torch.tensor([0, 1, 2, 3, 3, 2, 1], dtype=torch.uint8)
    assert pack_crumbs(codes).numel() == 2 and torch.equal(unpack_crumbs(pack_crumbs(codes), 7), codes)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    packed, scales = quantize_int2(x)
    assert packed.numel() == 250 and scales.numel() == 16
    y = dequantize_int2(packed, scales, 1000)
    s = torch.cat([x, x.new_zeros(24)]).view(-1, BLOCK4).pow(2).mean(1).sqrt().repeat_interleave(BLOCK4)[:1000]
    inside = x.abs() < 2 * s
    assert ((x - y).abs()[inside] <= s[inside] / 2 + 1e-7).all()  # the middle of its cell
    assert ((y.abs() - 1.5 * s).abs()[~inside] < 1e-6).all()  # beyond 2 s: the outer level
    assert float((x - y).norm() / x.norm()) < 0.36  # 0.34 on Gaussian values
    assert torch.equal(dequantize_int2(*quantize_int2(torch.zeros(5)), 5), torch.zeros(5))


def _feedback_island(decay, compression="int2"):
    params = {"w": torch.zeros(300), "v": torch.zeros(7)}
    cfg = DiLoCoConfig(window=4, fragments=1, compression=compression, error_feedback=decay)
    return StreamingDiLoCo(cfg, [["w", "v"]], params), params


def test_error_feedback_sends_over_the_rounds_the_sum_of_the_true_updates():
    """With a decay of 1 what the rounds reduced (each contribution's codec output), plus the
    residual still kept, is the sum of the pseudo-gradients: nothing is lost, only delayed."""
    from islands.protocols.parts import roundtrip
    from islands.protocols.validation import flatten

    d, params = _feedback_island(1.0)
    gen = torch.Generator().manual_seed(1)
    true_sum, sent_sum = torch.zeros(307), torch.zeros(307)
    for r in range(1, 9):
        with torch.no_grad():
            for p in params.values():
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
        true_sum += flatten([d.globals[0][n] - params[n] for n in ("w", "v")])
        c = d.contribution(0, r, 4 * r, params)
        sent = roundtrip(flatten([c.delta["w"], c.delta["v"]]), "int2")
        sent_sum += sent
        d.apply(0, r, {"w": sent[:300], "v": sent[300:]}, params)
    kept = flatten([d.residual[0]["w"], d.residual[0]["v"]])
    assert torch.allclose(sent_sum + kept, true_sum, atol=1e-4)
    assert float(kept.norm()) < 0.5 * float(true_sum.norm())  # most of it went


def test_error_feedback_keeps_its_residual_decayed_and_drops_it_when_the_island_applies_its_own_update():
    d, params = _feedback_island(0.5)
    with torch.no_grad():
        params["w"].add_(torch.linspace(-1, 1, 300))
    first = d.contribution(0, 1, 4, params)
    kept = {n: t.clone() for n, t in d.residual[0].items()}
    assert float(kept["w"].abs().max()) > 0
    second = d.contribution(0, 1, 8, params)  # nothing applied: the same delta, plus half the residual
    assert torch.allclose(second.delta["w"], first.delta["w"] + 0.5 * kept["w"])
    d.keep_accumulating(second)  # the round did not happen: the residual is the one before
    assert torch.equal(d.residual[0]["w"], kept["w"])
    d.apply(0, 1, first.delta, params, alone=True)  # its own whole delta, residual and all
    assert d.residual[0] == {}
    stale = _feedback_island(0.5)
    stale[0].contribution(0, 3, 12, stale[1])  # two rounds missed: its contribution weighs ~0
    assert stale[0].residual[0] == {}


def test_a_resumed_island_continues_with_its_residual(tmp_path):
    from islands.node import checkpoint as ckpt_io

    d, params = _feedback_island(0.95)
    with torch.no_grad():
        params["w"].add_(torch.linspace(-1, 1, 300))
    d.apply(0, 1, d.contribution(0, 1, 4, params).delta, params)  # a round of the swarm: the residual stays
    assert d.residual_state()
    ckpt_io.save(tmp_path, ckpt_io.Checkpoint(
        step=4, manifest={"run_id": "r"}, global_state=d.global_state(), local_state=dict(params), outer_state=d.momentum_state(),
        inner_opt_state={}, fragments=d.counters_state(), totals={}, inner_opt="adamw", residual_state=d.residual_state(),
    ))
    got = ckpt_io.load(tmp_path, {"run_id": "r"})
    resumed, _ = _feedback_island(0.95)
    resumed.load(got.global_state, got.outer_state, got.fragments, got.residual_state)
    with torch.no_grad():
        params["w"].add_(0.01)
    went_on, again = d.contribution(0, 2, 8, params), resumed.contribution(0, 2, 8, params)
    assert torch.equal(went_on.delta["w"], again.delta["w"]) and torch.equal(d.residual[0]["w"], resumed.residual[0]["w"])


def test_error_feedback_needs_a_lossy_codec_and_a_decay_in_0_1():
    assert DiLoCoConfig(compression="int2").feedback == 0.95 and DiLoCoConfig(compression="int4").feedback == 0.0
    assert DiLoCoConfig(compression="int4", error_feedback=0.9).feedback == 0.9
    with pytest.raises(ValueError, match="lossy"):
        DiLoCoConfig(compression="none", error_feedback=0.9)
    with pytest.raises(ValueError, match="error_feedback"):
        DiLoCoConfig(compression="int2", error_feedback=1.5)
