"""Sliding window, logit softcap and attention sinks through UPipe equal attention written
out on the full, unsharded sequence: outputs and every gradient (the sinks' too), every
rank compared, over real gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import rank_jobs
from test_numerics import SETTINGS, _fp32_tolerances, attention_cases
from tests_support import DTYPES, TOLERANCE, AttentionCase, make_inputs, make_sinks, relative_error, variant_reference
from upipe_compile import UnsupportedAttention, upipe_attention


@st.composite
def windows(draw, case: AttentionCase):
    """Edges smaller than a shard, crossing one shard, beyond the sequence, or unbounded."""
    edge = st.sampled_from([
        -1, 0, max(case.seq_local - 1, 0), case.seq_local + 1, 2 * case.seq + 3,
    ]) | st.integers(0, case.seq)
    left = draw(edge)
    right = 0 if case.is_causal and draw(st.booleans()) else draw(edge)
    return (left, right)


@st.composite
def variant_cases(draw):
    case = draw(attention_cases())
    window = draw(st.one_of(st.none(), windows(case)))
    softcap = draw(st.one_of(st.none(), st.floats(0.5, 30.0)))
    with_sinks = draw(st.booleans())
    return case, window, softcap, with_sinks


def _close(actual, expected, floor: float, tolerance: float) -> bool:
    """Relative error below ``tolerance``; a reference whose summands cancel to (nearly) zero,
    such as dq when every query sees one key, is measured against ``floor`` instead."""
    error = (actual.double() - expected.double()).norm().item()
    return error <= tolerance * max(expected.double().norm().item(), floor)


def _check(shards, expected, case, fp32=None):
    """``expected``: the float64 reference; ``fp32``: its math run in fp32 (fp32 cases)."""
    # the upstream gradient's size per element: what a gradient's summands are made of
    floor = make_inputs(case)[3].double().norm().item()
    for i, name in enumerate(["out", "dq", "dk", "dv"]):
        gathered = torch.cat([shard[i] for shard in shards], dim=2)
        assert gathered.dtype == DTYPES[case.dtype] and gathered.shape == expected[i].shape
        error = relative_error(gathered, expected[i])
        assert _close(gathered, expected[i], floor, TOLERANCE[case.dtype]), f"{name}: relative error {error:.3e}"
        # every rank's shard on its own (rank 0's causal shard needs no other rank)
        for rank, shard in enumerate(shards):
            part = expected[i].chunk(case.world, dim=2)[rank]
            assert _close(shard[i], part, floor, 4 * TOLERANCE[case.dtype]), f"{name} on rank {rank}"
    if expected[4] is not None:
        dsinks = sum(shard[4].double() for shard in shards)
        error = relative_error(dsinks, expected[4])
        # a head's dsinks sums its rows' terms, of either sign: where they cancel fp32 loses digits,
        # so 1e-5 or ten times the fp32 math's own error against float64
        (tolerance,) = _fp32_tolerances(case, [fp32[4]], [expected[4]]) if fp32 is not None else (None,)
        tolerance = tolerance or TOLERANCE[case.dtype]
        assert error < tolerance, f"dsinks: relative error {error:.3e} (tolerance {tolerance:.1e})"


@settings(max_examples=int(os.environ.get("UPIPE_VARIANT_EXAMPLES", "60")), **SETTINGS)
@given(drawn=variant_cases())
# window smaller than a shard, with sinks and GQA across stages; window crossing a shard with
# softcap, U > P; non-causal two-sided window; a window beyond the sequence with MQA.
@example(drawn=(AttentionCase(world=4, batch=1, q_heads=8, kv_heads=2, seq_local=6, head_dim=8, heads_per_stage=4,
                              is_causal=True, scale=None, dtype="float32", seed=1), (2, 0), None, True))
@example(drawn=(AttentionCase(world=2, batch=2, q_heads=8, kv_heads=4, seq_local=5, head_dim=16, heads_per_stage=4,
                              is_causal=True, scale=0.7, dtype="float32", seed=2), (7, -1), 5.0, False))
@example(drawn=(AttentionCase(world=4, batch=1, q_heads=12, kv_heads=3, seq_local=3, head_dim=8, heads_per_stage=12,
                              is_causal=False, scale=None, dtype="bfloat16", seed=3), (4, 2), 20.0, True))
@example(drawn=(AttentionCase(world=2, batch=1, q_heads=4, kv_heads=1, seq_local=7, head_dim=8, heads_per_stage=2,
                              is_causal=True, scale=None, dtype="float32", seed=4), (100, -1), None, True))
def test_variants_match_full_sequence_attention(rank_pools, drawn):
    case, window, softcap, with_sinks = drawn
    sinks = make_sinks(case) if with_sinks else None
    shards = rank_pools(case.world).run(rank_jobs.variant_op_case, case, window, softcap, with_sinks)
    fp32 = variant_reference(case, window, softcap, sinks, in_case_dtype=True) if case.dtype == "float32" else None
    _check(shards, variant_reference(case, window, softcap, sinks), case, fp32)


@settings(max_examples=int(os.environ.get("UPIPE_VARIANT_DOC_EXAMPLES", "25")), **SETTINGS)
@given(drawn=variant_cases(), cuts=st.lists(st.floats(0.05, 0.95), min_size=1, max_size=3))
def test_variants_within_documents(rank_pools, drawn, cuts):
    """A window never crosses a document; sinks and softcap per document row."""
    case, window, softcap, with_sinks = drawn
    inner = sorted({max(1, min(case.seq - 1, int(c * case.seq))) for c in cuts}) if case.seq > 1 else []
    bounds = (0, *inner, case.seq)
    sinks = make_sinks(case) if with_sinks else None
    shards = rank_pools(case.world).run(rank_jobs.variant_op_case, case, window, softcap, with_sinks, bounds)
    fp32 = variant_reference(case, window, softcap, sinks, bounds, in_case_dtype=True) \
        if case.dtype == "float32" else None
    _check(shards, variant_reference(case, window, softcap, sinks, bounds), case, fp32)


@pytest.mark.parametrize("kwargs, message", [
    (dict(window=(-2, 0)), r"window=\(-2, 0\): must be \(left, right\), each an int >= -1"),
    (dict(window=(4,)), "must be \\(left, right\\)"),
    (dict(window=(1.5, 0)), "each an int >= -1"),
    (dict(window=(0, True)), "each an int >= -1"),
    (dict(softcap=-1.0), "softcap=-1.0: must be > 0"),
    (dict(softcap=0), "softcap=0: must be > 0"),
    (dict(softcap=float("inf")), "softcap=inf: must be a finite number"),
    (dict(sinks=torch.zeros(3)), r"sinks must have shape \[4\]"),
    (dict(sinks=torch.zeros(4, dtype=torch.long)), "floating-point"),
])
def test_bad_variants_refused(kwargs, message):
    q = torch.randn(1, 4, 8, 8)
    with pytest.raises(UnsupportedAttention, match=message):
        upipe_attention(q, q, q, is_causal=True, **kwargs)


def _check_block(shards, case, window, softcap, with_sinks):
    from tests_support import TinyVariantAttention, block_grads, make_block_inputs

    x, dout = make_block_inputs(case)
    out, dx, grads = block_grads(TinyVariantAttention(case, window, softcap, with_sinks, reference=True), x, dout)
    tolerance = TOLERANCE[case.dtype]
    assert relative_error(torch.cat([s[0] for s in shards], dim=1), out) < tolerance
    assert relative_error(torch.cat([s[1] for s in shards], dim=1), dx) < tolerance
    for name, grad in grads.items():
        # each rank's parameter gradient covers its shard (its heads, for sinks): they sum to the full one
        assert relative_error(sum(s[2][name] for s in shards), grad) < tolerance, name


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("case, window, softcap, with_sinks", [
    (AttentionCase(world=2, batch=1, q_heads=4, kv_heads=2, seq_local=6, head_dim=8, heads_per_stage=2, is_causal=True,
                   scale=None, dtype="float32", seed=5), (3, 0), None, False),
    (AttentionCase(world=4, batch=1, q_heads=8, kv_heads=2, seq_local=3, head_dim=8, heads_per_stage=4, is_causal=True,
                   scale=None, dtype="float32", seed=6), (5, -1), 8.0, True),
    (AttentionCase(world=2, batch=2, q_heads=4, kv_heads=4, seq_local=4, head_dim=8, heads_per_stage=4,
                   is_causal=False, scale=0.4, dtype="float32", seed=7), (2, 3), 2.0, False),
], ids=["window", "window+softcap+sinks", "bidirectional-window+softcap"])
def test_compiled_variant_block(rank_pools, case, window, softcap, with_sinks, fuse):
    """Under backend="upipe": the fused block (or, with fuse_projections off, the plain op), exact."""
    shards = rank_pools(case.world).run(rank_jobs.compiled_variant_block_case, case, window, softcap, with_sinks, fuse)
    ops = shards[0][3]
    expected = "upipe.attention_block.default" if fuse else "upipe.attention.default"
    assert expected in ops, ops
    _check_block(shards, case, window, softcap, with_sinks)


def test_fused_sinks_with_recomputed_attention_output(rank_pools):
    """recompute_attention_output: each stage's forward runs again in backward, sinks included."""
    case = AttentionCase(world=4, batch=1, q_heads=8, kv_heads=4, seq_local=3, head_dim=8, heads_per_stage=4,
                         is_causal=True, scale=None, dtype="float32", seed=8, prefetch="both")
    shards = rank_pools(4).run(rank_jobs.compiled_variant_block_case, case, (4, 0), 3.0, True, True, "aot_eager",
                               True)
    assert "upipe.attention_block.default" in shards[0][3]
    _check_block(shards, case, (4, 0), 3.0, True)


@pytest.mark.parametrize("family, softcap", [("2.5", None), ("2.6", 4.0), ("2.7/2.8", 4.0)])
def test_variants_through_flash_attn_adapter(rank_pools, family, softcap):
    """The stage loop through each flash-attn release's interface (CPU stand-ins): window
    (and softcap from 2.6) reach the kernel and the answer is exact."""
    case = AttentionCase(world=2, batch=1, q_heads=8, kv_heads=2, seq_local=6, head_dim=16, heads_per_stage=4,
                         is_causal=True, scale=None, dtype="float32", seed=9)
    shards = rank_pools(2).run(rank_jobs.variant_op_case_with_flash_standin, case, family, (5, 0), softcap, True)
    _check(shards, variant_reference(case, (5, 0), softcap, make_sinks(case)), case)


def test_softcap_on_flash_attn_2_5_refused(rank_pools):
    case = AttentionCase(world=2, batch=1, q_heads=8, kv_heads=2, seq_local=6, head_dim=16, heads_per_stage=4,
                         is_causal=True, scale=None, dtype="float32", seed=9)
    with pytest.raises(Exception, match="no softcap parameter"):
        rank_pools(2).run(rank_jobs.variant_op_case_with_flash_standin, case, "2.5", None, 4.0, False)
