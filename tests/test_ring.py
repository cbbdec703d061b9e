"""Ring attention (upipe_compile.attention.ring) over real gloo ranks against eager SDPA on
the full sequence: output, log-sum-exp and every gradient, on every rank's share (rank 0's
causal share needs the fewest others and can look right when the rest is wrong)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import block_jobs
import ring_jobs
from block_support import BlockCase
from test_numerics import _fp32_tolerances
from tests_support import DTYPES, TOLERANCE, AttentionCase, make_inputs, relative_error
from upipe_compile.attention.zigzag import zigzag_shard, zigzag_unshard
from upipe_compile.attention.schedule import shape_problems


@st.composite
def ring_cases(draw):
    ring = draw(st.sampled_from([2, 4]))
    kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 3]))  # GQA ratio (1: MHA, kv_heads 1: MQA)
    chunk = draw(st.sampled_from([1, 3, 8]))  # tokens per zigzag chunk; 1 leaves one key on the diagonal
    return AttentionCase(
        world=ring, batch=draw(st.sampled_from([1, 2])), q_heads=kv_heads * group, kv_heads=kv_heads,
        seq_local=2 * chunk, head_dim=draw(st.sampled_from([8, 16])), heads_per_stage=ring,
        is_causal=draw(st.booleans()), scale=draw(st.sampled_from([None, 0.3])),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])), seed=draw(st.integers(0, 5)),
    )


def reference(case: AttentionCase):
    q, k, v, dout = make_inputs(case)
    q, k, v = (x.double().requires_grad_(True) for x in (q, k, v))
    scores = (q @ k.repeat_interleave(case.q_heads // case.kv_heads, 1).transpose(-1, -2))
    scores = scores * (case.scale if case.scale is not None else q.shape[-1] ** -0.5)
    if case.is_causal:
        scores = scores.masked_fill(torch.ones(case.seq, case.seq, dtype=torch.bool).triu(1), float("-inf"))
    lse = scores.logsumexp(-1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=case.is_causal, scale=case.scale, enable_gqa=True)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


@settings(max_examples=12, deadline=None)
@given(case=ring_cases())
def test_ring_matches_eager_attention_on_every_rank(rank_pools, case):
    shares = rank_pools(case.world).run(ring_jobs.ring_case, case)
    expected = reference(case)
    for name, index, wanted in zip(("out", "lse", "dq", "dk", "dv"), range(5), expected):
        for rank, share in enumerate(shares):
            got = share[index]
            assert got.dtype == (torch.float32 if name == "lse" else DTYPES[case.dtype]), name
            part = zigzag_shard(wanted, rank, case.world, dim=2)
            error = relative_error(got, part)
            assert error <= TOLERANCE[case.dtype], (name, rank, error, case)
        assert relative_error(zigzag_unshard([s[index] for s in shares], dim=2), wanted) <= TOLERANCE[case.dtype]


@settings(max_examples=16, deadline=None)
# left = 0 is left out: a causal query that sees only itself has dq = dk = 0 exactly, where
# relative error means nothing
@given(case=ring_cases(), left=st.sampled_from([-1, 1, 3, 7, 20]), right=st.sampled_from([-1, 0, 2, 5]),
       softcap=st.sampled_from([0.0, 2.0]))
def test_ring_with_window_and_softcap_matches_attention_on_every_rank(rank_pools, case, left, right, softcap):
    """A sliding window in global positions, shifted to each chunk pair (bands right or left
    of a pair's diagonal run on the rows and keys that see each other), and a softcap: every
    rank's out, dq, dk, dv against the written-out attention on the full sequence."""
    from tests_support import variant_reference

    window = (left, right)
    shares = rank_pools(case.world).run(ring_jobs.ring_case, case, window, softcap)
    expected = variant_reference(case, window, softcap or None)
    for name, index, wanted in (("out", 0, expected[0]), ("dq", 2, expected[1]), ("dk", 3, expected[2]),
                                ("dv", 4, expected[3])):
        for rank, share in enumerate(shares):
            error = relative_error(share[index], zigzag_shard(wanted, rank, case.world, dim=2))
            assert error <= TOLERANCE[case.dtype], (name, rank, error, case, window, softcap)


@st.composite
def packed_ring_cases(draw):
    case = draw(ring_cases())
    cuts = draw(st.sets(st.integers(1, case.seq - 1), max_size=case.seq - 1)) if case.seq > 1 else set()
    return case, (0, *sorted(cuts), case.seq)


@settings(max_examples=16, deadline=None)
@given(packed=packed_ring_cases())
# documents crossing the zigzag chunks and ranks, one of a single token, on a ring of 4
@example(packed=(AttentionCase(world=4, batch=1, q_heads=4, kv_heads=2, seq_local=6, head_dim=8, heads_per_stage=4,
                               is_causal=True, scale=None, dtype="float32", seed=1), (0, 5, 6, 17, 24)))
def test_packed_documents_over_the_ring_match_each_document_alone(rank_pools, packed):
    """Packed documents cut to each chunk pair (a chunk against itself: the documents within
    it; against another: each document both touch, in full): every rank's out, dq, dk, dv
    against attention run on each document alone (dq and dk measured against dv's scale
    where every document is one token and they are zero)."""
    from tests_support import eager_documents_reference

    case, bounds = packed
    shares = rank_pools(case.world).run(ring_jobs.ring_case, case, (-1, -1), 0.0, bounds)
    expected = eager_documents_reference(case, bounds)
    exact = eager_documents_reference(case, bounds, float64=True)
    _assert_packed_shares(shares, expected, case, bounds, own=(expected, exact))


@settings(max_examples=20, deadline=None)
@given(packed=packed_ring_cases(), left=st.sampled_from([-1, 1, 2, 5, 12]), right=st.sampled_from([-1, 0, 1, 4]),
       softcap=st.sampled_from([0.0, 2.0]))
# a window reaching back over a chunk boundary into a document that crosses chunks and ranks
@example(packed=(AttentionCase(world=4, batch=1, q_heads=4, kv_heads=2, seq_local=6, head_dim=8, heads_per_stage=4,
                               is_causal=True, scale=None, dtype="float32", seed=1), (0, 5, 6, 17, 24)), left=5,
         right=0, softcap=2.0)
def test_packed_documents_with_window_and_softcap_over_the_ring(rank_pools, packed, left, right, softcap):
    """Packed documents with a sliding window and a softcap over the ring: a chunk against
    itself runs its documents with the window; against another chunk, the one document
    crossing both runs on the rows and keys its window lets see each other (fewer rows than
    keys, or more, aligned at the last of each). Every rank's out, dq, dk, dv against the
    written-out attention inside each document (dq and dk measured against dv's scale where
    they vanish: single-token documents, or a window of the query alone)."""
    from tests_support import variant_reference

    case, bounds = packed
    window = (left, right)
    shares = rank_pools(case.world).run(ring_jobs.ring_case, case, window, softcap, bounds)
    expected = variant_reference(case, window, softcap or None, bounds=bounds)
    own = (variant_reference(case, window, softcap or None, bounds=bounds, in_case_dtype=True), expected) \
        if case.dtype == "float32" else None
    _assert_packed_shares(shares, expected, case, bounds, window, softcap, own=own)


def _assert_packed_shares(shares, expected, case, bounds, *context, own=None):
    """Every rank's out, dq, dk, dv against the reference's zigzag share; dq and dk measured
    against dv's scale where they (nearly) vanish: single-token documents, or a window of the
    query alone, where relative error means nothing. ``own``: the reference's math in the
    case's dtype and in float64: an fp32 share may be off by ten times fp32's own error there
    where that passes 1e-5 (a two-token document's dq cancels in any fp32 kernel)."""
    scale = expected[3].double().norm()
    for j, (name, index) in enumerate((("out", 0), ("dq", 2), ("dk", 3), ("dv", 4))):
        for rank, share in enumerate(shares):
            part = zigzag_shard(expected[j], rank, case.world, dim=2)
            error = relative_error(share[index], part)
            bound = TOLERANCE[case.dtype]
            if name in ("dq", "dk") and part.double().norm() < 1e-3 * scale:
                error = ((share[index].double() - part.double()).norm() / scale).item()
            elif own is not None:  # fp32: 1e-5, or ten times fp32's own error on this share
                in_dtype, exact = (zigzag_shard(t[j], rank, case.world, dim=2) for t in own)
                bound = _fp32_tolerances(case, [in_dtype], [exact])[0] or bound
            assert error <= bound, (name, rank, error, bound, case, bounds, *context)


def test_zigzag_layout_balances_causal_work():
    """Each rank holds chunks r and 2R-1-r: the same number of visible (query, key) chunk pairs."""
    from upipe_compile.attention.ring import _visible_pairs

    ring = 4
    work = [sum(1 for source in range(ring) for _ in _visible_pairs(r, source, ring, 4, True)) for r in range(ring)]
    assert len(set(work)) == 1, work
    full = torch.arange(16).view(1, 1, 16, 1)
    shares = [zigzag_shard(full, r, ring, dim=2) for r in range(ring)]
    assert shares[0].flatten().tolist() == [0, 1, 14, 15]
    assert torch.equal(zigzag_unshard(shares, dim=2), full)


def test_uneven_sequence_refused_with_the_fix():
    with pytest.raises(ValueError, match="pad it to a multiple of 8"):
        zigzag_shard(torch.zeros(1, 1, 12, 4), 0, 4, dim=2)


def test_odd_share_refused_on_every_rank(rank_pools):
    from upipe_compile.launch import RankError

    with pytest.raises(RankError, match="two equal chunks"):
        rank_pools(2).run(ring_jobs.odd_share_case)


def _expected_shard(full: torch.Tensor, rank: int, ring: int, a2a: int) -> torch.Tensor:
    """Global rank ``rank``'s shard (mesh ranks row-major: ring rank rank // A, a2a rank rank % A)."""
    share = zigzag_shard(full, rank // a2a, ring, dim=2)
    piece = share.shape[2] // a2a
    return share.narrow(2, (rank % a2a) * piece, piece)


@st.composite
def hybrid_cases(draw):
    world, ring = draw(st.sampled_from([(4, 2), (8, 2), (8, 4), (2, 1)]))  # (2, 1): a ring of one
    a2a = world // ring
    kv_heads = draw(st.sampled_from([1, a2a, 2 * a2a]))
    q_heads = kv_heads * draw(st.sampled_from([1, 2, 4]))
    units = [u for u in (a2a, 2 * a2a, q_heads) if q_heads % u == 0 and u % a2a == 0]
    assume(units and not shape_problems((1, q_heads, 2, 8), (1, kv_heads, 2, 8), (1, kv_heads, 2, 8), True, a2a,
                                        units[0]))
    chunk = draw(st.sampled_from([1, 2]))  # tokens per rank per zigzag chunk
    return AttentionCase(
        world=world, batch=draw(st.sampled_from([1, 2])), q_heads=q_heads, kv_heads=kv_heads, seq_local=2 * chunk,
        head_dim=8, heads_per_stage=draw(st.sampled_from(units)), is_causal=draw(st.booleans()),
        scale=draw(st.sampled_from([None, 0.3])), dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        seed=draw(st.integers(0, 5)), prefetch=draw(st.sampled_from(["forward", "both"])),
    ), ring


@settings(max_examples=10, deadline=None)
@given(drawn=hybrid_cases())
@example(drawn=(AttentionCase(world=2, batch=1, q_heads=4, kv_heads=2, seq_local=4, head_dim=8, heads_per_stage=2,
                              is_causal=True, scale=None, dtype="float32"), 1))  # a ring of one
def test_ring_by_all_to_all_matches_eager_on_every_rank(rank_pools, drawn):
    """upipe_attention over a (ring, all-to-all) mesh: every rank's out, dq, dk, dv against
    eager attention on the full sequence, laid out as shard_sequence lays it out; the
    positions and gather_sequence agree with that layout."""
    case, ring = drawn
    a2a = case.world // ring
    shards = rank_pools(case.world).run(ring_jobs.hybrid_case, case, ring)
    expected = reference(case)
    for rank, shard in enumerate(shards):
        for name, got, full in zip(("out", "dq", "dk", "dv"), shard[:4], (expected[0], *expected[2:])):
            error = relative_error(got, _expected_shard(full, rank, ring, a2a))
            assert error <= TOLERANCE[case.dtype], (name, rank, error, case, ring)
        positions = _expected_shard(torch.arange(case.seq).view(1, 1, -1, 1), rank, ring, a2a).flatten()
        assert shard[4].flatten().tolist() == positions.tolist()
        assert relative_error(shard[5], expected[0]) <= TOLERANCE[case.dtype]


def test_ring_by_all_to_all_refuses_what_it_cannot_run(rank_pools):
    """A 2-D mesh with other names and a length the zigzag layout cannot cut are refused
    with the setting named, on every rank."""
    for messages in rank_pools(4).run(ring_jobs.hybrid_refusals):
        assert "('cp_ring', 'cp_a2a')" in messages["names"] and "('dp', 'cp')" in messages["names"]
        assert "pad it to a multiple of 8" in messages["uneven"]


@settings(max_examples=6, deadline=None)
@given(drawn=hybrid_cases(), inner=st.sampled_from(["eager", "aot_eager"]))
def test_compiled_model_over_ring_by_all_to_all_matches_eager(rank_pools, drawn, inner):
    """An attention layer compiled with backend="upipe" over a (ring, all-to-all) mesh: every
    rank's output and input gradient against the eager layer on the full sequence, and the
    ranks' parameter gradients summed against its parameter gradients."""
    from tests_support import eager_block_reference

    case, ring = drawn
    a2a = case.world // ring
    shards = rank_pools(case.world).run(ring_jobs.compiled_hybrid_case, case, ring, inner)
    out, dx, grads = eager_block_reference(case)
    for rank, shard in enumerate(shards):
        for name, got, full in (("out", shard[0], out), ("dx", shard[1], dx)):
            expected = _expected_shard(full.unsqueeze(1), rank, ring, a2a).squeeze(1)
            error = relative_error(got, expected)
            assert error <= TOLERANCE[case.dtype], (name, rank, error, case, ring)
    for name, grad in grads.items():
        error = relative_error(sum(s[2][name] for s in shards), grad)
        assert error <= TOLERANCE[case.dtype], (name, error, case, ring)


@pytest.mark.parametrize("case, ring, recompute", [
    (AttentionCase(world=4, batch=1, q_heads=4, kv_heads=2, seq_local=4, head_dim=8, heads_per_stage=2, is_causal=True,
                   scale=None, dtype="float32", seed=1), 2, False),
    (AttentionCase(world=4, batch=2, q_heads=8, kv_heads=2, seq_local=2, head_dim=8, heads_per_stage=4,
                   is_causal=False, scale=0.3, dtype="float32", seed=2, prefetch="both"), 2, True),
    (AttentionCase(world=8, batch=1, q_heads=8, kv_heads=4, seq_local=2, head_dim=8, heads_per_stage=4, is_causal=True,
                   scale=None, dtype="float32", seed=3), 2, False),
    (AttentionCase(world=8, batch=1, q_heads=4, kv_heads=2, seq_local=2, head_dim=8, heads_per_stage=2,
                   is_causal=False, scale=None, dtype="bfloat16", seed=4, prefetch="both"), 4, False),
], ids=["2x2-causal", "2x2-full-recompute", "2x4-causal", "4x2-full-bf16"])
def test_compiled_fused_block_over_ring_by_all_to_all_matches_eager(rank_pools, case, ring, recompute):
    """A Llama-like layer (GQA, RoPE from global_positions) compiled with backend="upipe" over
    a (ring, all-to-all) mesh runs as ONE fused upipe::attention_block (not the plain op): every
    rank's output and input gradient against the eager layer on the full sequence (positions
    0..S-1), and the ranks' parameter gradients summed against its parameter gradients."""
    from tests_support import make_block_inputs

    a2a = case.world // ring
    shards = rank_pools(case.world).run(ring_jobs.compiled_fused_ring_case, case, ring, recompute)
    for shard in shards:
        assert shard[3] == ["upipe.attention_block.default"], shard[3]
    x, dout = make_block_inputs(case)
    out, dx, grads = ring_jobs.rope_block_grads(ring_jobs.TinyRopeAttention(case), x, dout,
                                                torch.arange(case.seq).unsqueeze(0))
    for rank, shard in enumerate(shards):
        for name, got, full in (("out", shard[0], out), ("dx", shard[1], dx)):
            expected = _expected_shard(full.unsqueeze(1), rank, ring, a2a).squeeze(1)
            error = relative_error(got, expected)
            assert error <= TOLERANCE[case.dtype], (name, rank, error, case, ring)
    assert set(grads) == {f"layer.w{r}.weight" for r in "qkvo"}
    for name, grad in grads.items():
        error = relative_error(sum(s[2][name] for s in shards), grad)
        assert error <= TOLERANCE[case.dtype], (name, error, case, ring)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("case, ring, window, softcap, with_sinks", [
    (AttentionCase(world=4, batch=1, q_heads=4, kv_heads=2, seq_local=4, head_dim=8, heads_per_stage=2, is_causal=True,
                   scale=None, dtype="float32", seed=3), 2, (3, 0), 3.0, True),
    (AttentionCase(world=8, batch=1, q_heads=8, kv_heads=2, seq_local=2, head_dim=8, heads_per_stage=4,
                   is_causal=False, scale=0.4, dtype="float32", seed=4), 2, (2, 3), 2.0, False),
    (AttentionCase(world=8, batch=2, q_heads=4, kv_heads=2, seq_local=4, head_dim=8, heads_per_stage=2, is_causal=True,
                   scale=None, dtype="bfloat16", seed=5), 4, None, None, True),
], ids=["2x2-causal-window-softcap-sinks", "2x4-full-window-softcap", "4x2-causal-sinks-bf16"])
def test_variants_over_ring_by_all_to_all(rank_pools, case, ring, window, softcap, with_sinks, fuse):
    """A sliding window (shifted to each chunk pair), softcap (every chunk pair's kernel
    applies it) and sinks (joined once, after the ring's merge) under backend="upipe" over a
    (ring, all-to-all) mesh: every rank's output and input gradient, and the summed parameter
    gradients (sinks included), against the written-out attention on the full sequence."""
    from tests_support import TinyVariantAttention, block_grads, make_block_inputs

    a2a = case.world // ring
    shards = rank_pools(case.world).run(ring_jobs.compiled_variant_ring_case, case, ring, window, softcap, with_sinks,
                                        fuse)
    for shard in shards:
        assert shard[3] == ["upipe.attention_block.default" if fuse else "upipe.attention.default"], shard[3]
    x, dout = make_block_inputs(case)
    out, dx, grads = block_grads(TinyVariantAttention(case, window, softcap, with_sinks, reference=True), x, dout)
    for rank, shard in enumerate(shards):
        for name, got, full in (("out", shard[0], out), ("dx", shard[1], dx)):
            error = relative_error(got, _expected_shard(full.unsqueeze(1), rank, ring, a2a).squeeze(1))
            assert error <= TOLERANCE[case.dtype], (name, rank, error)
    assert ("sinks" in grads) == with_sinks
    for name, grad in grads.items():
        error = relative_error(sum(s[2][name] for s in shards), grad)
        assert error <= TOLERANCE[case.dtype], (name, error)


@pytest.mark.parametrize("mode", ["op", "eager"])
@pytest.mark.parametrize("case, ring", [
    (BlockCase(world=4, batch=1, q_heads=8, kv_heads=2, seq_local=2, head_dim=8, heads_per_stage=2, is_causal=True,
               scale=None, dtype="float32", seed=2, kind="rope"), 2),
    (BlockCase(world=8, batch=1, q_heads=8, kv_heads=4, seq_local=2, head_dim=8, heads_per_stage=4, is_causal=True,
               scale=None, dtype="float32", seed=3, kind="qwen3", biases=True, recompute_output=True), 2),
    (BlockCase(world=8, batch=2, q_heads=4, kv_heads=2, seq_local=2, head_dim=8, heads_per_stage=2, is_causal=False,
               scale=0.5, dtype="bfloat16", seed=4, kind="rope"), 4),
    (BlockCase(world=4, batch=1, q_heads=4, kv_heads=4, seq_local=4, head_dim=8, heads_per_stage=2, is_causal=True,
               scale=None, dtype="float32", seed=5, kind="mla"), 2),
], ids=["2x2-rope", "2x4-qwen3-recompute", "4x2-full-bf16", "2x2-mla"])
def test_fused_block_api_over_ring_by_all_to_all(rank_pools, case, ring, mode):
    """upipe_attention_block (the op, and its eager twin) with a (ring, all-to-all) cp_mesh:
    every rank's shard and every weight and norm gradient against the eager block on the full
    sequence (the checks of tests/test_block_loop.py)."""
    from test_block_loop import _check

    _check(rank_pools(case.world).run(block_jobs.fused_block_case, case, mode, ring), case)
