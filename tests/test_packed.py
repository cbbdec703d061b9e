"""Packed sequences: UPipe with document boundaries equals eager SDPA run separately on each
document of the full sequence (outputs and all gradients), on real gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import rank_jobs
from test_numerics import SETTINGS, _fp32_tolerances, attention_cases
from tests_support import TOLERANCE, AttentionCase, eager_documents_reference, relative_error


@st.composite
def packed_cases(draw):
    case = draw(attention_cases(worlds=(2, 4)))
    # Documents: any strictly increasing cut points (many short ones, length 1, crossing shards).
    cuts = draw(st.sets(st.integers(1, case.seq - 1), max_size=case.seq - 1)) if case.seq > 1 else set()
    return case, (0, *sorted(cuts), case.seq)


def _check(shards, case, bounds):
    expected = eager_documents_reference(case, bounds)
    # fp32: 1e-5, or ten times eager fp32's own error where that is larger (two-token documents)
    tolerances = _fp32_tolerances(case, expected, eager_documents_reference(case, bounds, float64=True))
    for i, name in enumerate(["out", "dq", "dk", "dv"]):
        gathered = torch.cat([shard[i] for shard in shards], dim=2)
        # dq and dk are zero where every document has one token (the softmax of one score):
        # rounding then is measured against dv's scale, not against zero
        scale = expected[3].double().norm() if name in ("dq", "dk") else None
        tolerance = TOLERANCE[case.dtype]
        if scale is not None and expected[i].double().norm() < 1e-6 * scale:
            error = ((gathered.double() - expected[i].double()).norm() / scale).item()
        else:
            error = relative_error(gathered, expected[i])
            tolerance = tolerances[i] or tolerance
        assert error < tolerance, f"{name}: relative error {error:.3e} (tolerance {tolerance:.1e}) for {case}, " \
            f"documents {bounds}"


@settings(max_examples=int(os.environ.get("UPIPE_PACKED_EXAMPLES", "40")), **SETTINGS)
@given(packed=packed_cases())
# A document crossing the shard boundary next to documents of length 1, GQA, U > P, P = 2.
@example(packed=(AttentionCase(world=2, batch=1, q_heads=8, kv_heads=2, seq_local=6, head_dim=8, heads_per_stage=4,
                               is_causal=True, scale=None, dtype="float32", seed=1), (0, 1, 2, 9, 10, 12)))
# Many short documents at P = 4, MQA replicated over ranks, fp32 dK/dV accumulation.
@example(packed=(AttentionCase(world=4, batch=2, q_heads=8, kv_heads=1, seq_local=4, head_dim=16, heads_per_stage=4,
                               is_causal=True, scale=None, dtype="float32", seed=2, prefetch="both"),
                 (0, 1, 3, 5, 6, 8, 9, 11, 12, 13, 14, 16)))
# Non-causal, every document of length 1.
@example(packed=(AttentionCase(world=2, batch=1, q_heads=4, kv_heads=4, seq_local=3, head_dim=8, heads_per_stage=2,
                               is_causal=False, scale=0.5, dtype="float32", seed=3), (0, 1, 2, 3, 4, 5, 6)))
def test_packed_op_matches_eager_per_document(rank_pools, packed):
    case, bounds = packed
    _check(rank_pools(case.world).run(rank_jobs.packed_op_case, case, bounds), case, bounds)


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_single_document_is_exactly_the_causal_path(rank_pools, dtype):
    case = AttentionCase(world=2, batch=1, q_heads=8, kv_heads=2, seq_local=5, head_dim=8, heads_per_stage=2,
                         is_causal=True, scale=None, dtype="float32", seed=4)
    pool = rank_pools(2)
    packed = pool.run(rank_jobs.packed_op_case, case, (0, case.seq), dtype)
    plain = pool.run(rank_jobs.op_case, case)
    for rank in range(2):
        for got, want in zip(packed[rank], plain[rank]):
            assert torch.equal(got, want)


BAD_BOUNDARIES = [
    ([[0, 3, 8], [0, 4, 8]], "int32", "differ across the context-parallel ranks"),
    ([[0, 3, 7], [0, 3, 7]], "int64", "must end at the full sequence length 8"),
    ([[1, 3, 8], [1, 3, 8]], "int32", "must start at 0"),
    ([[0, 5, 3, 8], [0, 5, 3, 8]], "int32", "strictly increasing"),
    ([[0, 3, 3, 8], [0, 3, 3, 8]], "int32", "strictly increasing"),
    ([[0.0, 8.0], [0.0, 8.0]], "float32", "must be int32 or int64"),
    ([[0, 8], [0, 9]], "int32", r"rank\(s\) \[1\]"),  # only one rank's are invalid: both raise
]


@pytest.mark.parametrize("bounds_per_rank,dtype,message", BAD_BOUNDARIES, ids=[b[2] for b in BAD_BOUNDARIES])
def test_bad_boundaries_refused_on_every_rank(rank_pools, bounds_per_rank, dtype, message):
    import re

    errors = rank_pools(2).run(rank_jobs.packed_bad_boundaries_case, bounds_per_rank, dtype)
    assert all(error is not None and re.search(message, error) for error in errors), errors


@pytest.mark.parametrize("modify_between", [False, True])
def test_boundaries_are_checked_once_per_tensor(rank_pools, modify_between):
    counts = rank_pools(2).run(rank_jobs.boundary_checks_per_call, (0, 3, 8), 3, modify_between)
    assert counts == [[1, 1, 1] if modify_between else [1, 0, 0]] * 2


def test_a_remembered_check_is_used_only_when_every_rank_remembers_it(rank_pools):
    """Rank 0 reuses its checked boundaries tensor, rank 1 brings a new one: every rank checks
    again (rather than rank 1 waiting in an all-gather rank 0 skips: a hang), and new
    boundaries that differ are refused on both."""
    same = rank_pools(2).run(rank_jobs.boundaries_fresh_on_rank_1, (0, 3, 8), (0, 3, 8))
    assert same == [[1, 1], [1, 1]]
    differ = rank_pools(2).run(rank_jobs.boundaries_fresh_on_rank_1, (0, 3, 8), (0, 5, 8))
    for outcomes in differ:
        assert outcomes[0] == 1 and "differ across the context-parallel ranks" in outcomes[1], differ


@pytest.mark.parametrize(
    "case,bounds,inner",
    [
        (AttentionCase(world=2, batch=1, q_heads=8, kv_heads=2, seq_local=6, head_dim=8, heads_per_stage=4,
                       is_causal=True, scale=None, dtype="float32", seed=6), (0, 1, 5, 9, 12), "aot_eager"),
        (AttentionCase(world=4, batch=2, q_heads=4, kv_heads=4, seq_local=3, head_dim=8, heads_per_stage=4,
                       is_causal=True, scale=0.5, dtype="float32", seed=7, prefetch="both"), (0, 2, 3, 11, 12),
         "inductor"),
    ],
    ids=str,
)
def test_compiled_document_sdpa_block_matches_one_process(rank_pools, case, bounds, inner):
    """A block calling document_sdpa, compiled with backend="upipe" on shards, equals the same
    block uncompiled on one process (which equals attention per document: see the op tests)."""
    shards = rank_pools(case.world).run(rank_jobs.compiled_document_block_case, case, bounds, inner)
    out, dx, grads = rank_jobs.document_block_reference(case, bounds)
    tolerance = TOLERANCE[case.dtype]
    assert relative_error(torch.cat([s[0] for s in shards], dim=1), out) < tolerance
    assert relative_error(torch.cat([s[1] for s in shards], dim=1), dx) < tolerance
    for name, grad in grads.items():
        assert relative_error(sum(s[2][name] for s in shards), grad) < tolerance, name


def test_document_sdpa_on_one_process_equals_attention_per_document():
    case = AttentionCase(world=1, batch=2, q_heads=6, kv_heads=3, seq_local=10, head_dim=8, heads_per_stage=6,
                         is_causal=True, scale=None, dtype="float32", seed=8)
    bounds = (0, 1, 4, 10)
    q, k, v, dout = (x.requires_grad_(i < 3) for i, x in enumerate(__import__("tests_support").make_inputs(case)))
    import upipe_compile

    out = upipe_compile.document_sdpa(q, k, v, torch.tensor(bounds), is_causal=True, enable_gqa=True)
    out.backward(dout)
    expected = eager_documents_reference(case, bounds)
    for actual, want in zip((out, q.grad, k.grad, v.grad), expected):
        assert relative_error(actual.detach(), want) < 1e-5


def test_document_sdpa_on_a_shard_is_refused():
    """Without the upipe rewrite, full-sequence boundaries on a shard are refused, never run."""
    import upipe_compile

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(upipe_compile.UnsupportedAttention, match="must end at the full sequence length 4"):
        upipe_compile.document_sdpa(q, q, q, torch.tensor([0, 3, 8]), is_causal=True)
