"""ALiBi through UPipe equals attention written out with the explicit bias ``-slope[h] * |i - j|``
on the full, unsharded sequence (global positions; within each document when packed):
outputs and q/k/v gradients on every rank, over real gloo ranks, through every route the
variants take (``document_sdpa`` under backend="upipe", ``upipe_attention``, the fused block,
the ring x all-to-all mesh, the flash-attn adapter), with windows, softcap, sinks, GQA and MLA
head dims; and the refusals of what cannot run it."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import alibi_jobs
from alibi_jobs import alibi_math, alibi_reference, make_slopes
from flash_attn_standins import FAMILIES
from test_numerics import SETTINGS, attention_cases
from test_variants import windows
from tests_support import DTYPES, TOLERANCE, AttentionCase, make_inputs, make_sinks, relative_error
from upipe_compile import UnsupportedAttention, document_sdpa, upipe_attention
from upipe_compile.attention import blocked_kernel, kernels
from upipe_compile.attention.alibi import alibi_bias
from upipe_compile.attention.zigzag import zigzag_shard


@st.composite
def alibi_cases(draw, worlds=(2, 4)):
    """A case (heads, P, U, GQA ratio, MLA value dims, dtype, causal or not), a window or none,
    a softcap or none, sinks or not, and the slopes' kind."""
    case = draw(attention_cases(worlds=worlds))
    window = draw(st.one_of(st.none(), windows(case)))
    softcap = draw(st.one_of(st.none(), st.floats(0.5, 30.0)))
    return case, window, softcap, draw(st.booleans()), draw(st.sampled_from(["geometric", "random"]))


def _close(actual, expected, floor: float, tolerance: float) -> bool:
    """Relative error below ``tolerance``; a reference whose summands cancel to (nearly) zero
    is measured against ``floor`` (the upstream gradient's size) instead."""
    error = (actual.double() - expected.double()).norm().item()
    return error <= tolerance * max(expected.double().norm().item(), floor)


def _check(shards, expected, case, parts=("out", "dq", "dk", "dv")):
    """The gathered shards and every rank's own shard against the full-sequence reference."""
    floor = make_inputs(case)[3].double().norm().item()
    tolerance = TOLERANCE[case.dtype]
    for i, name in enumerate(parts):
        gathered = torch.cat([shard[i] for shard in shards], dim=2)
        assert gathered.dtype == DTYPES[case.dtype] and gathered.shape == expected[i].shape, name
        error = relative_error(gathered, expected[i])
        assert _close(gathered, expected[i], floor, tolerance), f"{name}: relative error {error:.3e}"
        for rank, shard in enumerate(shards):
            part = expected[i].chunk(case.world, dim=2)[rank]
            assert _close(shard[i], part, floor, 4 * tolerance), f"{name} on rank {rank}"


def _check_sinks(shards, expected_dsinks, case, index=4):
    if expected_dsinks is None:
        assert all(shard[index] is None for shard in shards)
        return
    dsinks = sum(shard[index].double() for shard in shards)
    error = relative_error(dsinks, expected_dsinks)
    assert error < TOLERANCE[case.dtype], f"dsinks: relative error {error:.3e}"


# --- document_sdpa under backend="upipe" (what models call) -----------------------------------

@settings(max_examples=int(os.environ.get("UPIPE_ALIBI_EXAMPLES", "30")), **SETTINGS)
@given(drawn=alibi_cases())
# GQA across stages, causal, a window smaller than a shard, with sinks
@example(drawn=(AttentionCase(world=4, batch=1, q_heads=8, kv_heads=2, seq_local=6, head_dim=8, heads_per_stage=4,
                              is_causal=True, scale=None, dtype="float32", seed=1), (2, 0), None, True, "geometric"))
# U > P with softcap and a window crossing a shard, two batch rows
@example(drawn=(AttentionCase(world=2, batch=2, q_heads=8, kv_heads=4, seq_local=5, head_dim=16, heads_per_stage=4,
                              is_causal=True, scale=0.7, dtype="float32", seed=2), (7, -1), 5.0, False, "random"))
# non-causal (the |i - j| bias on both sides) with a two-sided window, Ulysses (U = Hq), bf16
@example(drawn=(AttentionCase(world=4, batch=1, q_heads=12, kv_heads=3, seq_local=3, head_dim=8, heads_per_stage=12,
                              is_causal=False, scale=None, dtype="bfloat16", seed=3), (4, 2), 20.0, True, "geometric"))
# MQA (one KV head, Falcon) with KV replicated over the ranks, non-causal, no window
@example(drawn=(AttentionCase(world=4, batch=1, q_heads=8, kv_heads=1, seq_local=4, head_dim=8, heads_per_stage=4,
                              is_causal=False, scale=None, dtype="float32", seed=4), None, None, False, "random"))
# MLA head dims (v narrower than q/k), causal, prefetch in backward too
@example(drawn=(AttentionCase(world=2, batch=1, q_heads=4, kv_heads=4, seq_local=4, head_dim=24, heads_per_stage=2,
                              is_causal=True, scale=None, dtype="float32", seed=5, prefetch="both", value_dim=16),
                None, None, False, "geometric"))
def test_compiled_document_sdpa_matches_full_sequence_alibi(rank_pools, drawn):
    """``document_sdpa(..., alibi_slopes=...)`` under backend="upipe" (rewritten into the stage
    loop) equals the explicit bias on the full sequence: outputs, dq, dk, dv (and the sinks'
    gradient summed over ranks) on every rank."""
    case, window, softcap, with_sinks, kind = drawn
    slopes = make_slopes(case, kind)
    shards = rank_pools(case.world).run(alibi_jobs.compiled_document_sdpa_case, case, slopes, window, softcap,
                                        with_sinks)
    assert all(shard[5] == ["upipe.attention.default"] for shard in shards), shards[0][5]
    sinks = make_sinks(case) if with_sinks else None
    expected = alibi_reference(case, slopes, window, softcap, sinks)
    _check(shards, expected, case)
    _check_sinks(shards, expected[4], case)


@settings(max_examples=int(os.environ.get("UPIPE_ALIBI_DOC_EXAMPLES", "12")), **SETTINGS)
@given(drawn=alibi_cases(), cuts=st.lists(st.floats(0.05, 0.95), min_size=1, max_size=3))
def test_compiled_document_sdpa_alibi_within_documents(rank_pools, drawn, cuts):
    """Packed documents: ALiBi's positions count within each document (the bias depends on
    i - j only), with the window and sinks per document row."""
    case, window, softcap, with_sinks, kind = drawn
    inner = sorted({max(1, min(case.seq - 1, int(c * case.seq))) for c in cuts}) if case.seq > 1 else []
    bounds = (0, *inner, case.seq)
    slopes = make_slopes(case, kind)
    shards = rank_pools(case.world).run(alibi_jobs.compiled_document_sdpa_case, case, slopes, window, softcap,
                                        with_sinks, bounds)
    expected = alibi_reference(case, slopes, window, softcap, make_sinks(case) if with_sinks else None, bounds)
    _check(shards, expected, case)
    _check_sinks(shards, expected[4], case)


@pytest.mark.parametrize("case, window, softcap, with_sinks, bounds", [
    (AttentionCase(world=2, batch=1, q_heads=4, kv_heads=2, seq_local=5, head_dim=8, heads_per_stage=2,
                   is_causal=True, scale=None, dtype="float32", seed=6), None, None, True, None),
    (AttentionCase(world=4, batch=2, q_heads=8, kv_heads=2, seq_local=3, head_dim=8, heads_per_stage=8,
                   is_causal=False, scale=0.5, dtype="bfloat16", seed=7), (3, 1), 4.0, False, (0, 5, 12)),
], ids=["causal-sinks", "bidirectional-window-softcap-documents-bf16"])
def test_upipe_attention_alibi(rank_pools, case, window, softcap, with_sinks, bounds):
    """The eager entry point on sequence shards takes the slopes too."""
    slopes = make_slopes(case)
    shards = rank_pools(case.world).run(alibi_jobs.alibi_op_case, case, slopes, window, softcap, with_sinks, bounds)
    expected = alibi_reference(case, slopes, window, softcap, make_sinks(case) if with_sinks else None, bounds)
    _check(shards, expected, case)
    _check_sinks(shards, expected[4], case)


@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("window, softcap, bounds", [
    (None, None, None), ((5, 3), 6.0, None), (None, None, (0, 7, 9, 20)),
], ids=["plain", "window-softcap", "documents"])
def test_document_sdpa_on_one_process_is_exact(is_causal, window, softcap, bounds):
    """One process, eager: the CPU blocked kernel with the bias, forward and backward."""
    case = AttentionCase(world=1, batch=2, q_heads=6, kv_heads=2, seq_local=20, head_dim=8, heads_per_stage=1,
                         is_causal=is_causal, scale=None, dtype="float32", seed=8)
    slopes = make_slopes(case, "random")
    q, k, v, dout = (t.clone().requires_grad_(i < 3) for i, t in enumerate(make_inputs(case)))
    out = document_sdpa(q, k, v, None if bounds is None else torch.tensor(bounds), is_causal=is_causal,
                        enable_gqa=True, window=window, softcap=softcap, alibi_slopes=slopes)
    out.backward(dout)
    expected = alibi_reference(case, slopes, window, softcap, None, bounds)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), expected):
        assert relative_error(got, want) < 1e-5, name


def test_causal_bias_is_blooms_up_to_a_row_constant():
    """Causal ``-slope * (i - j)`` is flash-attn's ``-slope * |i - j|`` and Bloom's / MPT's
    ``slope * j`` up to a per-row constant: the same attention."""
    case = AttentionCase(world=1, batch=1, q_heads=4, kv_heads=4, seq_local=16, head_dim=8, heads_per_stage=1,
                         is_causal=True, scale=None, dtype="float32", seed=9)
    q, k, v, _ = make_inputs(case)
    slopes = make_slopes(case)
    bloom = slopes[:, None, None] * torch.arange(case.seq, dtype=torch.float32)[None, None, :]
    bloom = bloom.expand(-1, case.seq, -1).masked_fill(torch.ones(case.seq, case.seq, dtype=torch.bool).triu(1),
                                                      float("-inf"))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bloom)
    got = document_sdpa(q, k, v, is_causal=True, alibi_slopes=slopes)
    assert relative_error(got, expected) < 1e-5


# --- the fused block and the plain op under backend="upipe" -----------------------------------

BLOCK_CASES = [
    (AttentionCase(world=2, batch=1, q_heads=4, kv_heads=2, seq_local=6, head_dim=8, heads_per_stage=2, is_causal=True,
                   scale=None, dtype="float32", seed=10), None, None, False),
    (AttentionCase(world=4, batch=1, q_heads=8, kv_heads=2, seq_local=3, head_dim=8, heads_per_stage=4, is_causal=True,
                   scale=None, dtype="float32", seed=11), (5, -1), 8.0, True),
    (AttentionCase(world=2, batch=2, q_heads=4, kv_heads=4, seq_local=4, head_dim=8, heads_per_stage=4,
                   is_causal=False, scale=0.4, dtype="bfloat16", seed=12), (2, 3), None, False),
]


def _check_block(shards, case, slopes, window, softcap, with_sinks, ring=None):
    out, dx, grads = alibi_jobs.alibi_block_reference(case, slopes, window, softcap, with_sinks)
    tolerance = TOLERANCE[case.dtype]
    if ring is None:
        assert relative_error(torch.cat([s[0] for s in shards], dim=1), out) < tolerance
        assert relative_error(torch.cat([s[1] for s in shards], dim=1), dx) < tolerance
    else:
        from test_ring import _expected_shard

        a2a = case.world // ring
        for rank, shard in enumerate(shards):
            for name, got, full in (("out", shard[0], out), ("dx", shard[1], dx)):
                error = relative_error(got, _expected_shard(full.unsqueeze(1), rank, ring, a2a).squeeze(1))
                assert error <= tolerance, (name, rank, error)
    assert "alibi" not in grads  # a buffer: no gradient
    for name, grad in grads.items():
        assert relative_error(sum(s[2][name] for s in shards), grad) < tolerance, name


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("case, window, softcap, with_sinks", BLOCK_CASES,
                         ids=["causal", "window+softcap+sinks", "bidirectional-window-bf16"])
def test_compiled_alibi_block(rank_pools, case, window, softcap, with_sinks, fuse):
    """A model layer with ALiBi slopes (a buffer) under backend="upipe": fused into
    ``upipe::attention_block`` (the slopes an extra the stages slice like sinks) or the plain op."""
    slopes = make_slopes(case)
    shards = rank_pools(case.world).run(alibi_jobs.compiled_alibi_block_case, case, slopes, window, softcap,
                                        with_sinks, fuse)
    expected = "upipe.attention_block.default" if fuse else "upipe.attention.default"
    assert all(shard[3] == [expected] for shard in shards), shards[0][3]
    _check_block(shards, case, slopes, window, softcap, with_sinks)


def test_fused_alibi_with_recomputed_attention_output(rank_pools):
    case = AttentionCase(world=4, batch=1, q_heads=8, kv_heads=4, seq_local=3, head_dim=8, heads_per_stage=4,
                         is_causal=True, scale=None, dtype="float32", seed=13, prefetch="both")
    slopes = make_slopes(case)
    shards = rank_pools(4).run(alibi_jobs.compiled_alibi_block_case, case, slopes, (4, 0), 3.0, True, True, True)
    assert shards[0][3] == ["upipe.attention_block.default"]
    _check_block(shards, case, slopes, (4, 0), 3.0, True)


# --- the ring (global positions per zigzag chunk) ---------------------------------------------

@st.composite
def ring_alibi_cases(draw):
    ring = draw(st.sampled_from([2, 4]))
    kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 3]))
    chunk = draw(st.sampled_from([1, 3, 5]))
    case = AttentionCase(
        world=ring, batch=draw(st.sampled_from([1, 2])), q_heads=kv_heads * group, kv_heads=kv_heads,
        seq_local=2 * chunk, head_dim=draw(st.sampled_from([8, 16])), heads_per_stage=ring,
        is_causal=draw(st.booleans()), scale=draw(st.sampled_from([None, 0.3])),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])), seed=draw(st.integers(0, 5)),
    )
    edge = st.sampled_from([-1, 0, 1, chunk, 2 * chunk + 1, case.seq + 2])
    left = draw(edge)
    right = 0 if case.is_causal else draw(edge)
    window = draw(st.sampled_from([(-1, -1), (left, right)]))
    softcap = draw(st.sampled_from([0.0, 2.0]))
    documents = draw(st.booleans())
    bounds = None
    if documents and case.seq > 2:
        cuts = sorted(draw(st.sets(st.integers(1, case.seq - 1), min_size=1, max_size=3)))
        bounds = (0, *cuts, case.seq)
    family = draw(st.sampled_from([None, None, "2.6", "2.7/2.8"]))
    return case, window, softcap, bounds, family, draw(st.sampled_from(["geometric", "random"]))


@settings(max_examples=int(os.environ.get("UPIPE_ALIBI_RING_EXAMPLES", "16")), **SETTINGS)
@given(drawn=ring_alibi_cases())
# a full (non-causal) square between chunks: cut into its causal part and the rest, flipped slopes
@example(drawn=(AttentionCase(world=2, batch=1, q_heads=2, kv_heads=1, seq_local=6, head_dim=8, heads_per_stage=2,
                              is_causal=False, scale=None, dtype="float32", seed=1), (-1, -1), 0.0, None, None,
                "random"))
# the same through the flash-attn adapter (chunk pairs of unequal rows and keys, never flash's causal form)
@example(drawn=(AttentionCase(world=4, batch=1, q_heads=4, kv_heads=2, seq_local=6, head_dim=8, heads_per_stage=4,
                              is_causal=False, scale=None, dtype="float32", seed=2), (4, 2), 2.0, None, "2.7/2.8",
                "geometric"))
# causal with a window reaching back over a chunk, packed documents crossing chunks
@example(drawn=(AttentionCase(world=2, batch=1, q_heads=2, kv_heads=2, seq_local=6, head_dim=8, heads_per_stage=2,
                              is_causal=True, scale=None, dtype="float32", seed=3), (4, 0), 0.0, (0, 5, 12), None,
                "random"))
# non-causal documents crossing chunks, with a window (cross-chunk document rectangles)
@example(drawn=(AttentionCase(world=4, batch=1, q_heads=2, kv_heads=1, seq_local=6, head_dim=8, heads_per_stage=4,
                              is_causal=False, scale=None, dtype="float32", seed=4), (3, 5), 0.0, (0, 4, 17, 24),
                "2.6", "geometric"))
def test_ring_alibi_matches_full_sequence_on_every_rank(rank_pools, drawn):
    """Ring attention with ALiBi over the zigzag layout: the output, the log-sum-exp (the
    per-head constants of each cut chunk pair) and the gradients of every rank's share."""
    case, window, softcap, bounds, family, kind = drawn
    slopes = make_slopes(case, kind)
    shares = rank_pools(case.world).run(alibi_jobs.alibi_ring_case, case, slopes, window, softcap, bounds, family)
    out, dq, dk, dv, _ = alibi_reference(case, slopes, None if window == (-1, -1) else window, softcap or None,
                                         bounds=bounds)
    lse = _reference_lse(case, slopes, window, softcap, bounds)
    floor = make_inputs(case)[3].double().norm().item()
    for rank, share in enumerate(shares):
        for name, got, full in zip(("out", "lse", "dq", "dk", "dv"), share, (out, lse, dq, dk, dv)):
            want = zigzag_shard(full, rank, case.world, dim=2)
            assert _close(got, want, floor if name != "lse" else 0.0, TOLERANCE[case.dtype]), (name, rank)


def _reference_lse(case, slopes, window, softcap, bounds):
    q, k, _, _ = (t.double() for t in make_inputs(case))
    group = case.q_heads // case.kv_heads
    scale = case.scale if case.scale is not None else case.head_dim ** -0.5
    scores = q @ k.repeat_interleave(group, dim=1).transpose(-1, -2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores + alibi_bias(slopes, case.seq, case.seq)
    i, j = torch.arange(case.seq)[:, None], torch.arange(case.seq)[None, :]
    allowed = (j <= i) if case.is_causal else torch.ones(case.seq, case.seq, dtype=torch.bool)
    if window[0] >= 0:
        allowed &= j >= i - window[0]
    if window[1] >= 0:
        allowed &= j <= i + window[1]
    if bounds is not None:
        doc = torch.bucketize(torch.arange(case.seq), torch.tensor(bounds[1:-1]), right=True)
        allowed &= doc[:, None] == doc[None, :]
    return scores.masked_fill(~allowed, float("-inf")).logsumexp(-1)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("case, ring, window, softcap, with_sinks", [
    (AttentionCase(world=4, batch=1, q_heads=4, kv_heads=2, seq_local=4, head_dim=8, heads_per_stage=2, is_causal=True,
                   scale=None, dtype="float32", seed=14), 2, (3, 0), 3.0, True),
    (AttentionCase(world=4, batch=1, q_heads=8, kv_heads=2, seq_local=4, head_dim=8, heads_per_stage=4,
                   is_causal=False, scale=0.4, dtype="float32", seed=15), 2, None, None, False),
], ids=["2x2-causal-window-softcap-sinks", "2x2-bidirectional"])
def test_alibi_over_ring_by_all_to_all(rank_pools, case, ring, window, softcap, with_sinks, fuse):
    """Under backend="upipe" over a (ring, all-to-all) mesh: each stage's heads' slopes reach
    ring attention, whose chunk pairs carry their global positions."""
    slopes = make_slopes(case)
    shards = rank_pools(case.world).run(alibi_jobs.compiled_alibi_block_case, case, slopes, window, softcap,
                                        with_sinks, fuse, False, ring)
    expected = "upipe.attention_block.default" if fuse else "upipe.attention.default"
    assert all(shard[3] == [expected] for shard in shards), shards[0][3]
    _check_block(shards, case, slopes, window, softcap, with_sinks, ring)


# --- kernels ----------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(q_len=st.integers(1, 20), k_len=st.integers(1, 20), kv_heads=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 3]), is_causal=st.booleans(), left=st.sampled_from([-1, 0, 2, 7]),
       right=st.sampled_from([-1, 0, 3]), softcap=st.sampled_from([0.0, 3.0]), negative=st.booleans(),
       dtype=st.sampled_from(["float32", "bfloat16"]))
def test_blocked_kernel_alibi_equals_full_math(q_len, k_len, kv_heads, group, is_causal, left, right, softcap, negative,
                                               dtype):
    """The CPU kernel's bias ``-slope * |i + Sk - Sq - j|`` (queries and keys aligned at the
    last of each, slopes of either sign: the ring's cut chunk pairs), its LSE and its backward."""
    gen = torch.Generator().manual_seed(q_len * 31 + k_len)
    heads = kv_heads * group
    q = torch.randn(2, heads, q_len, 8, generator=gen).to(DTYPES[dtype])
    k, v = (torch.randn(2, kv_heads, k_len, 8, generator=gen).to(DTYPES[dtype]) for _ in range(2))
    dout = torch.randn(2, heads, q_len, 8, generator=gen).to(DTYPES[dtype])
    slopes = torch.rand(heads, generator=gen) * (-1.0 if negative else 1.0)
    window = (left, right)

    qd, kd, vd = (t.double().requires_grad_(True) for t in (q, k, v))
    scores = qd @ kd.repeat_interleave(group, 1).transpose(-1, -2) * 8 ** -0.5
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores + alibi_bias(slopes, q_len, k_len)
    i = torch.arange(q_len)[:, None] + (k_len - q_len)
    j = torch.arange(k_len)[None, :]
    hidden = torch.zeros(q_len, k_len, dtype=torch.bool)
    if is_causal:
        hidden |= j > i
    if left >= 0:
        hidden |= j < i - left
    if right >= 0:
        hidden |= j > i + right
    scores = scores.masked_fill(hidden, float("-inf"))
    seen = ~hidden.all(-1)
    lse = scores.logsumexp(-1)
    out = torch.nan_to_num(torch.softmax(scores, -1), nan=0.0) @ vd.repeat_interleave(group, 1)
    out.backward(dout.double())

    got_out, got_lse = blocked_kernel.forward(q, k, v, is_causal, None, window, softcap, block_rows=4,
                                              alibi_slopes=slopes)
    grads = blocked_kernel.backward(dout, q, k, v, got_out, got_lse, is_causal, None, window, softcap, block_rows=4,
                                    alibi_slopes=slopes)
    tolerance = TOLERANCE[dtype]
    assert relative_error(got_out, out.detach()) < tolerance
    if seen.any():
        assert relative_error(got_lse[..., seen], lse.detach()[..., seen]) < 1e-5
    for got, want in zip(grads, (qd.grad, kd.grad, vd.grad)):
        assert _close(got, want, dout.double().norm().item(), tolerance)


def _stage_layout(x):
    return x.transpose(1, 2).contiguous().transpose(1, 2)


@settings(max_examples=30, deadline=None)
@given(family=st.sampled_from(sorted(FAMILIES)), seq=st.integers(1, 20), extra_keys=st.sampled_from([0, 0, 3, -2]),
       is_causal=st.booleans(), left=st.sampled_from([-1, 0, 3, 40]), right=st.sampled_from([-1, 0, 2]),
       packed=st.booleans(), data=st.data())
def test_flash_attn_adapter_alibi(family, seq, extra_keys, is_causal, left, right, packed, data):
    """Every release's dense and varlen paths take ``alibi_slopes`` (float32 [Hq]) and return the
    blocked kernel's out, true LSE and gradients; no call reaches flash's causal form (whose
    bias is ``slope * j``: its LSE off by ``slope * (i + Sk - Sq)``)."""
    from upipe_compile.attention.document_boundaries import Documents

    k_len = max(1, seq + extra_keys)
    documents = None
    if packed and seq > 1:
        k_len = seq
        cuts = sorted(data.draw(st.sets(st.integers(1, seq - 1), min_size=1, max_size=3)))
        documents = Documents.from_bounds((0, *cuts, seq), "cpu")
    gen = torch.Generator().manual_seed(seq * 7 + k_len)
    q, dout = (_stage_layout(torch.randn(2, 4, seq, 16, generator=gen)) for _ in range(2))
    k, v = (_stage_layout(torch.randn(2, 2, k_len, 16, generator=gen)) for _ in range(2))
    slopes = torch.rand(4, generator=gen) * (1.0 if data.draw(st.booleans()) else -1.0)
    window = (left, right)
    interface = FAMILIES[family]()
    flash, cpu = kernels.FlashAttnKernels(interface), kernels.CpuKernels()
    if documents is None:
        results = [kernel.forward(q, k, v, is_causal, None, window, 0.0, slopes) for kernel in (flash, cpu)]
        grads = [kernel.backward(dout, q, k, v, *result, is_causal, None, window, 0.0, slopes)
                 for kernel, result in zip((flash, cpu), results)]
    else:
        results = [kernel.forward_documents(q, k, v, documents, is_causal, None, window, 0.0, slopes)
                   for kernel in (flash, cpu)]
        grads = [kernel.backward_documents(dout, q, k, v, *result, documents, is_causal, None, window, 0.0, slopes)
                 for kernel, result in zip((flash, cpu), results)]
    (out, lse), (want_out, want_lse) = results
    finite = torch.isfinite(want_lse)
    assert relative_error(out, want_out) < 1e-6 and relative_error(lse[finite], want_lse[finite]) < 1e-6
    for got, want in zip(*grads):  # dq cancels to ~0 where a query sees itself alone: against dout's size
        assert _close(got, want, dout.norm().item(), 1e-6)
    calls = alibi_jobs._flash_calls_summary(interface.calls)
    assert len(calls) == len(interface.calls) > 0
    for causal, call_left, call_right in calls:
        clamp = documents.max_length if documents is not None else k_len
        flash_left = -1 if call_left >= clamp else call_left
        assert not (flash_left < 0 and (causal or call_right == 0)), (causal, call_left, call_right)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("bounds", [None, (0, 5, 12)], ids=["dense", "documents"])
def test_stage_loop_alibi_through_flash_attn_adapter(rank_pools, family, bounds):
    """The stage loop through each flash-attn release's interface (CPU stand-ins): the stage's
    slopes reach ``alibi_slopes`` and the answer is exact."""
    case = AttentionCase(world=2, batch=1, q_heads=8, kv_heads=2, seq_local=6, head_dim=16, heads_per_stage=4,
                         is_causal=True, scale=None, dtype="float32", seed=16)
    slopes = make_slopes(case)
    shards = rank_pools(2).run(alibi_jobs.alibi_op_case_with_flash_standin, case, family, slopes, None, None, bounds)
    assert all(shard[4] for shard in shards), "no call with alibi_slopes reached flash-attn"
    assert all(not causal and left >= 0 for shard in shards for causal, left, _ in shard[4])
    _check(shards, alibi_reference(case, slopes, bounds=bounds), case)


# --- refusals ---------------------------------------------------------------------------------

def _aten_flash(monkeypatch):
    monkeypatch.setattr(kernels, "_cuda_kernels", lambda: kernels.AtenCudaKernels())


def test_aten_cuda_flash_kernel_refuses_alibi_naming_flash_attn(monkeypatch):
    """aten's CUDA flash kernel (no flash-attn installed) has no ALiBi in backward: refused by
    the variant check, at compile time and by every entry point's check, naming the fix."""
    from upipe_compile.attention.checks import AttentionCall, attention_problems

    _aten_flash(monkeypatch)
    (problem,) = kernels.variant_problems("cuda", (-1, -1), 0.0, alibi=True)
    assert "aten's CUDA flash kernel" in problem and "alibi_slopes" in problem and "install flash-attn" in problem
    assert kernels.variant_problems("cuda", (-1, -1), 0.0) == []
    call = AttentionCall((1, 4, 8, 64), (1, 2, 8, 64), (1, 2, 8, 64), torch.bfloat16, "cuda",
                         alibi_slopes=torch.ones(4))
    assert any("install flash-attn" in p for p in attention_problems(call, 2, 2))
    # the kernel itself refuses before touching a device
    q = torch.randn(1, 2, 8, 8)
    with pytest.raises(UnsupportedAttention, match="install flash-attn"):
        kernels.AtenCudaKernels().forward(q, q, q, True, None, alibi_slopes=torch.ones(2))
    # flash-attn (a stand-in) runs it
    monkeypatch.setattr(kernels, "_cuda_kernels", lambda: kernels.FlashAttnKernels(FAMILIES["2.6"]()))
    assert kernels.variant_problems("cuda", (-1, -1), 0.0, alibi=True) == []


def test_compile_time_pass_refuses_alibi_on_aten_cuda(monkeypatch):
    """The pass's check of a call with ALiBi slopes (as it finds ``upipe::document_sdpa``'s)."""
    import torch.fx as fx

    from upipe_compile.passes import find_attention, unsupported_reasons

    _aten_flash(monkeypatch)

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    gm = fx.symbolic_trace(attention)
    with FakeTensorMode():
        example = torch.empty(1, 8, 64, 64, dtype=torch.bfloat16, device="cuda")
        slopes = torch.empty(8, device="cuda")
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["example_value"] = example
    (match,) = find_attention(gm)
    assert unsupported_reasons(match, world=2, heads_per_stage=2) == []
    match.alibi_slopes = gm.graph.placeholder("alibi_slopes")
    match.alibi_slopes.meta["example_value"] = slopes
    reasons = unsupported_reasons(match, world=2, heads_per_stage=2)
    assert len(reasons) == 1 and "ALiBi" in reasons[0] and "install flash-attn" in reasons[0], reasons
    match.alibi_slopes = 0.5
    assert any("alibi_slopes must be a tensor" in r for r in unsupported_reasons(match, 2, 2))


def test_flash_attn_interface_without_alibi_parameter_refuses_it():
    """ALiBi is never dropped: an interface whose functions lack alibi_slopes is refused."""
    interface = FAMILIES["2.6"]()
    real_forward = interface._flash_attn_forward

    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, return_softmax):
        return real_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, None, return_softmax)

    interface._flash_attn_forward = _flash_attn_forward
    flash = kernels.FlashAttnKernels(interface)
    (problem,) = flash.variant_problems((-1, -1), 0.0, alibi=True)
    assert "no alibi_slopes parameter in _flash_attn_forward" in problem
    q = torch.randn(1, 2, 8, 8)
    flash.forward(q, q, q, True, None)  # without ALiBi: fine
    with pytest.raises(UnsupportedAttention, match="no alibi_slopes parameter in _flash_attn_forward"):
        flash.forward(q, q, q, True, None, alibi_slopes=torch.ones(2))


@pytest.mark.parametrize("slopes, message", [
    (torch.ones(3), r"alibi_slopes must have shape \[4\]"),
    (torch.ones(1, 4), r"alibi_slopes must have shape \[4\]"),
    (torch.ones(4, dtype=torch.long), "floating-point"),
    (torch.ones(4, requires_grad=True), "requires grad"),
    ([0.5] * 4, "must be a tensor"),
])
def test_bad_slopes_refused(slopes, message):
    q = torch.randn(1, 4, 8, 8)
    with pytest.raises(UnsupportedAttention, match=message):
        upipe_attention(q, q, q, is_causal=True, alibi_slopes=slopes)
    with pytest.raises(UnsupportedAttention, match=message):
        document_sdpa(q, q, q, is_causal=True, alibi_slopes=slopes)


WORLD = 2  # the fake process group of the ``world`` fixture (refusals happen before any exchange)


@pytest.mark.parametrize("slopes, reason", [
    (torch.ones(3), "alibi_slopes must have shape [4]"),
    (torch.ones(4, requires_grad=True), "alibi_slopes requires grad"),
], ids=["shape", "requires-grad"])
def test_every_entry_point_refuses_bad_slopes_alike(world, slopes, reason):
    """upipe_attention, document_sdpa, upipe_attention_block and the compile-time pass give the
    same reason (the one check of attention/checks.py)."""
    import torch.fx as fx

    from upipe_compile.block.ops import upipe_attention_block
    from upipe_compile.block.region import BlockRegion
    from upipe_compile.passes import find_attention, unsupported_reasons

    q_heads, kv_heads, dim = 4, 2, 8
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, q_heads, 4, dim, generator=gen)
    k, v = (torch.randn(1, kv_heads, 4, dim, generator=gen) for _ in range(2))
    messages = {}
    for name, call in (
        ("upipe_attention", lambda: upipe_attention(q, k, v, is_causal=True, enable_gqa=True, alibi_slopes=slopes)),
        ("document_sdpa", lambda: document_sdpa(q, k, v, is_causal=True, enable_gqa=True, alibi_slopes=slopes)),
    ):
        with pytest.raises(UnsupportedAttention) as info:
            call()
        messages[name] = str(info.value)

    def heads(p, n):
        return p.unflatten(-1, (n, dim)).transpose(1, 2)

    hidden = q_heads * dim
    region = BlockRegion(q_heads, kv_heads, dim, heads, heads, heads, True, None, alibi_extra=0)
    weights = [torch.randn(hidden, hidden), None, torch.randn(kv_heads * dim, hidden), None,
               torch.randn(kv_heads * dim, hidden), None, torch.randn(hidden, hidden), None]
    with pytest.raises(UnsupportedAttention) as info:
        upipe_attention_block(torch.randn(1, 4, hidden), *weights, [slopes], region)
    messages["upipe_attention_block"] = str(info.value)

    gm = fx.symbolic_trace(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), (q, k, v)):
        node.meta["example_value"] = value
    (match,) = find_attention(gm)
    match.alibi_slopes = gm.graph.placeholder("alibi_slopes")
    match.alibi_slopes.meta["example_value"] = slopes
    messages["the compile-time pass"] = "; ".join(unsupported_reasons(match, WORLD, WORLD))
    for entry, message in messages.items():
        assert reason in message, f"{entry}: {message}"


def test_alibi_math_matches_the_kernels_bias():
    """The tests' reference and the library's bias helper agree (one definition of the sign)."""
    slopes = torch.tensor([0.5, 0.25])
    bias = alibi_bias(slopes, 5, 5)
    assert bias[0, 4, 1].item() == -1.5 and bias[1, 1, 4].item() == -0.75 and bias[0, 2, 2].item() == 0.0
    q = torch.zeros(1, 2, 5, 8)
    v = torch.eye(5)[None, None, :, :].expand(1, 2, 5, 5).contiguous()
    v = F.pad(v, (0, 3))
    probs = alibi_math(q, q, v, is_causal=False, scale=None, slopes=slopes)[..., :5]
    assert torch.allclose(probs, torch.softmax(bias, -1).float()[None])
