"""Admission, signing and update validation: the pure parts, without a network."""

import asyncio
import math
import os

import pytest
import torch
from hivemind.proto import dht_pb2
from hypothesis import given
from hypothesis import strategies as st
from islands.node.cli import main as node_main
from islands.node.net.authorizer import SwarmKeyAuthorizer
from islands.node.net.signing import load_identity, owner_peer_id
from islands.protocols.admission import (
    SwarmKeyError,
    admission_tag,
    derive,
    load_swarm_key,
    namespace,
    tag_valid,
    write_swarm_key,
)
from islands.protocols.validation import (
    FLAGRANT_RATIO,
    NORM_RATIO,
    NormHistory,
    Reputation,
    check_consensus,
    check_deposit,
    check_update,
    consensus_bound,
    member_flagrant,
    round_verdict,
    spoiled_spans,
)

SECRET = bytes(range(32))


def test_keygen_writes_an_owner_only_key_and_never_overwrites(tmp_path):
    path = tmp_path / "swarm.key"
    assert node_main(["keygen", str(path)]) == 0
    assert path.stat().st_mode & 0o777 == 0o600 and len(load_swarm_key(path)) >= 32
    before = path.read_bytes()
    assert node_main(["keygen", str(path)]) == 2
    assert path.read_bytes() == before


@pytest.mark.parametrize("content", [b"", b"short", b"   \n"])
def test_a_weak_or_empty_key_is_refused(tmp_path, content):
    path = tmp_path / "k"
    path.write_bytes(content)
    with pytest.raises(SwarmKeyError, match="k"):
        load_swarm_key(path)
    with pytest.raises(SwarmKeyError):
        load_swarm_key(tmp_path / "missing")


def test_keys_for_different_purposes_and_runs_differ(tmp_path):
    write_swarm_key(tmp_path / "k")
    other = load_swarm_key(tmp_path / "k")
    assert derive(SECRET, "dht") != derive(SECRET, "rounds") != derive(other, "dht")
    assert namespace("run", None) == "run"
    assert namespace("run", SECRET) != namespace("run", other) and namespace("run", SECRET).startswith("run-")
    assert "." not in namespace("run", SECRET)  # a plain name: it prefixes DHT keys and libp2p protocol names


def test_admission_tags_bind_peer_and_what_they_admit_to():
    key = derive(SECRET, "rounds")
    tag = admission_tag(key, "QmA", "run:frag0.0b01")
    assert tag_valid(key, "QmA", "run:frag0.0b01", tag)
    assert not tag_valid(key, "QmB", "run:frag0.0b01", tag)  # another peer cannot reuse it
    assert not tag_valid(key, "QmA", "run:frag1.0b01", tag)  # nor for another exchange
    assert not tag_valid(derive(b"x" * 32, "rounds"), "QmA", "run:frag0.0b01", tag)
    assert not tag_valid(key, "QmA", "run:frag0.0b01", None) and not tag_valid(key, "QmA", "run:frag0.0b01", 7)


def _roundtrip(client: SwarmKeyAuthorizer, server: SwarmKeyAuthorizer):
    async def run():
        request = dht_pb2.PingRequest(validate=True)
        await client.sign_request(request, None)
        accepted = await server.validate_request(request)
        response = dht_pb2.PingResponse(available=True)
        await server.sign_response(response, request)
        return request, accepted, await client.validate_response(response, request)

    return asyncio.run(run())


def test_dht_requests_carry_a_mac_under_the_swarm_key_and_cannot_be_replayed():
    refused = []
    client = SwarmKeyAuthorizer(SECRET, "QmClient")
    server = SwarmKeyAuthorizer(SECRET, "QmServer", refused.append)
    request, accepted, response_ok = _roundtrip(client, server)
    assert accepted and response_ok and not refused
    assert not asyncio.run(server.validate_request(request))  # the same request again
    assert "replayed" in refused[-1]

    stranger = SwarmKeyAuthorizer(b"y" * 32, "QmStranger")
    _, accepted, response_ok = _roundtrip(stranger, server)
    assert not accepted and "QmStranger" in refused[-1] and "not signed" in refused[-1]
    _, accepted, response_ok = _roundtrip(client, SwarmKeyAuthorizer(b"y" * 32))
    assert not accepted and not response_ok


def test_identity_is_owner_only_and_its_peer_id_is_libp2p_s(tmp_path):
    from hivemind.p2p import PeerID

    path = tmp_path / "run" / "identity.key"
    key, peer_id = load_identity(path)
    assert path.stat().st_mode & 0o077 == 0
    assert peer_id == PeerID.from_identity(path.read_bytes()).to_base58()
    assert load_identity(path)[1] == peer_id  # the same island on restart
    marker = key.get_public_key().to_bytes()
    from hivemind.dht.crypto import RSASignatureValidator

    subkey = RSASignatureValidator(key).local_public_key
    assert owner_peer_id(subkey) == peer_id and marker in subkey
    os.chmod(path, 0o644)
    load_identity(path)
    assert path.stat().st_mode & 0o077 == 0  # tightened if someone loosened it


@given(st.one_of(st.binary(max_size=300), st.text(max_size=50), st.integers(), st.none()))
def test_owner_of_any_subkey_is_a_peer_id_or_none(subkey):
    assert owner_peer_id(subkey) is None or owner_peer_id(subkey).startswith("Qm")


def _t(value, shape=(4, 4)):
    return {"w": torch.full(shape, float(value))}


def test_update_validation_rejects_non_finite_misshaped_and_huge_updates():
    history = NormHistory()
    own = _t(1.0)
    assert check_update(_t(1.5), own, history)[0] is None
    assert "non-finite" in check_update(_t(math.nan), own, history)[0]
    assert "non-finite" in check_update(_t(math.inf), own, history)[0]
    assert "shape" in check_update(_t(1.0, (2, 8)), own, history)[0]
    assert "dtype" in check_update({"w": torch.ones(4, 4, dtype=torch.float16)}, own, history)[0]
    assert "missing" in check_update({}, own, history)[0] or "names" in check_update({}, own, history)[0]
    assert "norm" in check_update(_t(NORM_RATIO * 1.01), own, history)[0]


def test_the_norm_bound_follows_the_accepted_history():
    history = NormHistory()
    for _ in range(8):
        history.accept(10.0)
    # an island whose own update is small this round still accepts a typical average
    assert check_update(_t(10 * NORM_RATIO / 4 * 0.99), _t(0.01), history)[0] is None
    assert check_update(_t(10 * NORM_RATIO / 4 * 1.01), _t(0.01), history)[0] is not None


def test_every_member_of_a_round_reaches_the_same_verdict_from_the_references_in_the_parts():
    """Members hold the same result and each member's reference (its part's `ref`): whichever
    member computes it, the verdict is the same, and a result any member's check rejects is
    rejected by all; a reference of 0 judges nothing, one that is not a finite number >= 0 rejects."""
    result = _t(2.0)  # norm 8
    refs = {"a": 10.0, "b": 1.0, "c": 0.0}
    verdicts = {own: round_verdict(result, _t(own), refs) for own in (0.0, 0.001, 5.0)}  # each member's own update differs
    assert len(set(map(str, verdicts.values()))) == 1
    why, norm, judges = verdicts[0.0]
    assert norm == 8.0 and judges == ["b"] and "above 4 (4x the reference of b)" in why
    assert round_verdict(result, _t(1.0), {"a": 10.0, "b": 2.0, "c": 0.0}) == (None, 8.0, [])
    assert round_verdict(result, _t(1.0), {"a": 0.0}) == (None, 8.0, [])  # nobody has anything to judge by
    for bad in (None, "big", True, math.nan, math.inf, -1.0):
        assert round_verdict(result, _t(1.0), {"a": 10.0, "x": bad})[2] == ["x"]
    assert "non-finite" in round_verdict(_t(math.nan), _t(1.0), {"a": 10.0})[0]


def test_a_joiner_seeds_its_history_with_its_donors_accepted_norms_unless_it_has_its_own():
    history = NormHistory()
    assert history.seed([3.0, "x", math.nan, -1.0, 0.0, 5.0, True, 1]) == 3
    assert list(history.norms) == [3.0, 5.0, 1.0] and history.reference(0.01) == 3.0
    assert history.seed([100.0]) == 0 and list(history.norms) == [3.0, 5.0, 1.0]
    assert NormHistory().seed(None) == 0 and NormHistory().seed({"a": 1}) == 0
    many = NormHistory()
    many.seed([float(i) for i in range(1, 40)])
    assert list(many.norms) == [float(i) for i in range(40 - many.norms.maxlen, 40)]


def test_an_island_that_trained_nothing_and_accepted_nothing_takes_what_the_others_agreed():
    """It joined as the others finished (its update is 0) and has no accepted norms to compare
    with: it applies the round the others accept instead of rejecting it alone (a split model)."""
    assert check_update(_t(3.0), _t(0.0), NormHistory())[0] is None
    assert "non-finite" in check_update(_t(math.nan), _t(0.0), NormHistory())[0]  # still never a broken one
    history = NormHistory()
    history.accept(1.0)
    assert check_update(_t(3.0), _t(0.0), history)[0] is not None  # with a history it judges as before


def test_consensus_may_move_values_by_a_few_updates_but_not_further():
    own = _t(1.0)
    bound = consensus_bound(agreed_norm=4.0, update_reference=0.5)
    assert bound == max(0.4, NORM_RATIO * 0.5)
    assert check_consensus(_t(1.2), own, bound) is None
    assert "bound" in check_consensus(_t(3.0), own, bound)
    assert "non-finite" in check_consensus(_t(math.nan), own, bound)


def test_after_a_partition_the_consensus_bound_covers_both_sides_paths_and_resets_once_agreed():
    from islands.protocols.diloco import DiLoCoConfig, StreamingDiLoCo
    from islands.protocols.validation import tensors_norm

    torch.manual_seed(0)
    params = {"w": torch.randn(64, 8), "b": torch.randn(8)}
    cfg = DiLoCoConfig(window=8, fragments=1, overlap=0, outer_lr=0.7, outer_momentum=0.9)
    a, b = (StreamingDiLoCo(cfg, [list(params)], params) for _ in range(2))
    for d in (a, b):  # both sides apply 12 rounds alone, each its own updates
        for r in range(1, 13):
            d.apply(0, r, {n: 0.05 * torch.randn_like(t) for n, t in params.items()}, {}, mix_local=False, alone=True)
    apart = a.counters[0].apart
    assert apart > 0 and a.counters[0].apart_momentum > 0
    gap = tensors_norm(a.globals[0][n] - b.globals[0][n] for n in params)
    assert gap <= apart + b.counters[0].apart
    # the consensus of the two moves each by half the gap: more than the bound without the path
    mean = {n: (a.globals[0][n] + b.globals[0][n]) / 2 for n in params}
    reference = 0.05 * math.sqrt(sum(t.numel() for t in params.values()))
    without = consensus_bound(tensors_norm(a.globals[0].values()), reference)
    assert check_consensus(mean, a.globals[0], without) is not None
    assert check_consensus(mean, a.globals[0], consensus_bound(tensors_norm(a.globals[0].values()), reference, apart)) is None
    a.replace(0, mean, a.momentum[0])
    b.settled(0)
    assert a.counters[0].apart == b.counters[0].apart == 0 == a.counters[0].apart_momentum
    a.apply(0, 13, {n: torch.ones_like(t) for n, t in params.items()}, {}, mix_local=False)
    assert a.counters[0].apart == 0  # an averaged round is applied by every member


def test_a_spoiled_part_is_blamed_on_its_reducer():
    torch.manual_seed(0)
    own = torch.randn(300)
    averaged = own.clone() * 0.7
    spans = {"QmA": [[0, 100]], "QmB": [[100, 200]], "QmC": [[200, 300]]}
    assert spoiled_spans(averaged, own, spans, float(own.norm())) == []
    averaged[100:200] *= 50
    assert spoiled_spans(averaged, own, spans, float(own.norm())) == ["QmB"]
    averaged[250] = math.nan
    assert spoiled_spans(averaged, own, spans, float(own.norm())) == ["QmB", "QmC"]
    # spans from nowhere are ignored, not a crash
    assert spoiled_spans(averaged, own, {"QmD": [[-5, 10**9]], "QmE": "x", "QmF": [["a", 1]]}, 1.0) == []


def test_a_member_whose_own_part_is_flagrantly_off_is_banned_at_its_first_rejected_round():
    """Not finite, or FLAGRANT_RATIO times the reference, as reported and as measured here: banned at
    once; a framed member (huge as others report it, not as measured here) or one merely over
    NORM_RATIO takes BAN_AFTER rounds, as before."""
    ref = 2.0
    huge = {"norm": 1e6, "weight": 1.0, "measured": 1e6}
    assert member_flagrant(huge, ref) and member_flagrant({**huge, "norm": math.nan, "measured": math.nan}, ref)
    assert not member_flagrant({**huge, "measured": 3.0}, ref)  # framed by another reducer's report
    assert not member_flagrant({**huge, "measured": None}, ref) and not member_flagrant("x", ref)
    over = NORM_RATIO * ref * 1.5
    assert not member_flagrant({"norm": over, "weight": 1.0, "measured": over}, ref) and over < FLAGRANT_RATIO * ref
    rep = Reputation()
    assert rep.blame(["QmBad"], ["QmBad", "QmGood"], now=0, flagrant=["QmBad"]) == ["QmBad"]
    assert rep.is_banned("QmBad", 1) and not rep.is_banned("QmGood", 1)
    assert rep.blame(["QmBad"], ["QmBad"], now=2, flagrant=["QmBad"]) == []  # banned already: not again


def test_repeat_offenders_are_banned_for_a_while_and_trusted_peers_are_not_blamed_blindly():
    rep = Reputation()
    assert rep.blame(["QmBad"], ["QmBad", "QmGood"], now=0) == []
    assert rep.blame(["QmBad"], ["QmBad", "QmGood"], now=1) == []
    assert rep.blame(["QmBad"], ["QmBad", "QmGood"], now=2) == ["QmBad"]
    assert rep.is_banned("QmBad", 3) and not rep.is_banned("QmGood", 3)
    assert not rep.is_banned("QmBad", 2 + 10_000)  # bans expire
    rep.accepted(["QmGood"], now=5)
    for t in range(6, 12):  # nobody reports bad: only peers not trusted lately are suspected
        rep.blame([], ["QmGood"], now=t)
    assert not rep.is_banned("QmGood", 12)
    rep2 = Reputation()
    rep2.blame(["QmX"], ["QmX"], now=0)
    rep2.accepted(["QmX"], now=1)  # an accepted round clears the strikes
    rep2.blame(["QmX"], ["QmX"], now=2)
    rep2.blame(["QmX"], ["QmX"], now=3)
    assert not rep2.is_banned("QmX", 4)


def test_a_deposit_may_be_as_large_as_the_windows_it_covers_and_no_larger():
    own, history = _t(1.0), NormHistory()
    assert check_deposit(_t(NORM_RATIO * 3 * 0.99), own, history, staleness=2) is None
    assert "norm" in check_deposit(_t(NORM_RATIO * 3 * 1.01), own, history, staleness=2)
    assert "non-finite" in check_deposit(_t(math.nan), own, history, staleness=0)
