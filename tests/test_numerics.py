"""UPipe equals eager SDPA on the full, unsharded sequence: outputs and gradients.

Every example runs on real gloo ranks (kept alive across examples) and is compared with
``F.scaled_dot_product_attention`` on the gathered full sequence in this process.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import rank_jobs
from tests_support import (
    TOLERANCE,
    AttentionCase,
    eager_block_reference,
    eager_reference,
    make_inputs,
    relative_error,
)

SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck))


@st.composite
def attention_cases(draw, worlds=(1, 2, 4)):
    world = draw(st.sampled_from(worlds))
    # KV heads: MHA, GQA, MQA and fewer KV heads than ranks (replicated), kept schedulable.
    kv_heads = draw(st.sampled_from([1, 2, 3, 4, 8]))
    kv_eff = math.lcm(kv_heads, world)
    group_multiplier = draw(st.sampled_from([1, 2, 3, 4]))
    q_heads = kv_eff * group_multiplier
    if q_heads > 24:
        q_heads = kv_eff
    # U: any multiple of P that divides Hq (U = Hq is Ulysses).
    stage_choices = [u for u in range(world, q_heads + 1, world) if q_heads % u == 0]
    return AttentionCase(
        world=world,
        batch=draw(st.integers(1, 2)),
        q_heads=q_heads,
        kv_heads=kv_heads,
        seq_local=draw(st.integers(1, 12)),
        head_dim=draw(st.sampled_from([4, 8, 16, 32])),
        heads_per_stage=draw(st.sampled_from(stage_choices)),
        is_causal=draw(st.booleans()),
        scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        seed=draw(st.integers(0, 2**16)),
        prefetch=draw(st.sampled_from(["none", "forward", "both"])),
        value_dim=draw(st.sampled_from([None, None, None, 4, 12, 40])),  # MLA: v narrower or wider than q/k
    )


def _assert_close(name: str, actual, expected, case, tolerance: float | None = None) -> None:
    error = relative_error(actual, expected)
    tolerance = TOLERANCE[case.dtype] if tolerance is None else tolerance
    assert error < tolerance, f"{name}: relative error {error:.3e} (tolerance {tolerance:.1e}) for {case}"


def _fp32_tolerances(case, expected, exact=None) -> list[float | None]:
    """fp32: 1e-5 against eager, or ten times eager fp32's own error against float64 where that is
    larger: a gradient much smaller than the terms it sums (a two-token row's dq) loses digits
    in any fp32 kernel, and a different kernel (MLA's padded value heads) loses different ones.
    ``expected``: eager's results in fp32; ``exact``: the same in float64 (default: SDPA's)."""
    if case.dtype != "float32":
        return [None] * len(expected)
    if exact is None:
        q, k, v, dout = (t.double() for t in make_inputs(case))
        for x in (q, k, v):
            x.requires_grad_(True)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=case.is_causal, scale=case.scale, enable_gqa=True)
        out.backward(dout)
        exact = (out.detach(), q.grad, k.grad, v.grad)
    return [max(TOLERANCE["float32"], 10 * relative_error(e, x)) for e, x in zip(expected, exact)]


@settings(max_examples=int(__import__("os").environ.get("UPIPE_OP_EXAMPLES", "220")), **SETTINGS)
@given(case=attention_cases())
# Always covered, whatever hypothesis draws: stages whose query heads straddle KV heads
# (gathered KV slots) with fp32 dK/dV accumulation, and KV heads replicated (Hkv < P);
# each prefetch mode across several KV groups (MHA: every stage opens one).
@example(case=AttentionCase(world=2, batch=1, q_heads=12, kv_heads=3, seq_local=5, head_dim=8, heads_per_stage=6,
                            is_causal=True, scale=None, dtype="bfloat16", seed=1, prefetch="both"))
@example(case=AttentionCase(world=4, batch=1, q_heads=24, kv_heads=6, seq_local=3, head_dim=8, heads_per_stage=12,
                            is_causal=False, scale=0.5, dtype="float32", seed=2))
@example(case=AttentionCase(world=4, batch=2, q_heads=8, kv_heads=2, seq_local=3, head_dim=16, heads_per_stage=4,
                            is_causal=True, scale=None, dtype="bfloat16", seed=3, prefetch="none"))
@example(case=AttentionCase(world=4, batch=1, q_heads=16, kv_heads=16, seq_local=3, head_dim=8, heads_per_stage=4,
                            is_causal=True, scale=None, dtype="float32", seed=4, prefetch="both"))
# MLA: q/k head dim 24 (nope + rope), v 16; and v wider than q/k
@example(case=AttentionCase(world=2, batch=1, q_heads=4, kv_heads=4, seq_local=4, head_dim=24, heads_per_stage=2,
                            is_causal=True, scale=None, dtype="float32", seed=5, value_dim=16))
@example(case=AttentionCase(world=2, batch=1, q_heads=4, kv_heads=2, seq_local=3, head_dim=8, heads_per_stage=2,
                            is_causal=False, scale=0.4, dtype="bfloat16", seed=6, value_dim=16))
# A two-token row whose dq is 1 % of q's norm: fp32 cancellation, through MLA's padded kernel
@example(case=AttentionCase(world=2, batch=1, q_heads=2, kv_heads=1, seq_local=1, head_dim=16, heads_per_stage=2,
                            is_causal=False, scale=1.0, dtype="float32", seed=4, prefetch="none", value_dim=12))
def test_op_matches_eager_sdpa(rank_pools, case):
    shards = rank_pools(case.world).run(rank_jobs.op_case, case)
    expected = eager_reference(case)
    tolerances = _fp32_tolerances(case, expected)
    for i, name in enumerate(["out", "dq", "dk", "dv"]):
        gathered = torch.cat([shard[i] for shard in shards], dim=2)
        assert gathered.dtype == expected[i].dtype and gathered.shape == expected[i].shape
        _assert_close(name, gathered, expected[i], case, tolerances[i])


def _check_block(shards, case):
    out, dx, grads = eager_block_reference(case)
    # fp32: the projections' gradients inherit what dq and dk lose where their terms cancel
    exact_out, exact_dx, exact_grads = eager_block_reference(case, float64=True)
    out_tol, dx_tol, *grad_tols = _fp32_tolerances(case, [out, dx, *grads.values()],
                                                   [exact_out, exact_dx, *exact_grads.values()])
    _assert_close("out", torch.cat([s[0] for s in shards], dim=1), out, case, out_tol)
    _assert_close("dx", torch.cat([s[1] for s in shards], dim=1), dx, case, dx_tol)
    for (name, grad), tolerance in zip(grads.items(), grad_tols):
        # Each rank's parameter gradient covers its shard of the sequence: they sum to the full one.
        _assert_close(f"grad {name}", sum(s[2][name] for s in shards), grad, case, tolerance)


@settings(max_examples=int(__import__("os").environ.get("UPIPE_COMPILED_EXAMPLES", "24")), **SETTINGS)
@given(case=attention_cases(worlds=(2, 4)), inner=st.sampled_from(["eager", "aot_eager"]))
def test_compiled_block_matches_eager(rank_pools, case, inner):
    _check_block(rank_pools(case.world).run(rank_jobs.compiled_block_case, case, inner), case)


@pytest.mark.parametrize(
    "case",
    [
        AttentionCase(world=2, batch=1, q_heads=8, kv_heads=2, seq_local=8, head_dim=16, heads_per_stage=2,
                      is_causal=True, scale=None, dtype="float32"),
        AttentionCase(world=4, batch=2, q_heads=8, kv_heads=8, seq_local=4, head_dim=8, heads_per_stage=4,
                      is_causal=False, scale=0.3, dtype="bfloat16", prefetch="both"),
        AttentionCase(world=4, batch=1, q_heads=12, kv_heads=1, seq_local=6, head_dim=8, heads_per_stage=12,
                      is_causal=True, scale=None, dtype="float32"),  # Ulysses, MQA replicated
    ],
    ids=str,
)
def test_inductor_block_matches_eager(rank_pools, case):
    _check_block(rank_pools(case.world).run(rank_jobs.compiled_block_case, case, "inductor"), case)


def test_uneven_shards_refused_on_every_rank(rank_pools):
    """Shards of different lengths would pair the wrong chunks; every rank gets a clear error."""
    with pytest.raises(Exception, match="equal, contiguous shard"):
        rank_pools(2).run(rank_jobs.uneven_shards_case)


def test_inductor_cache_never_reuses_a_graph_across_world_sizes(rank_pools):
    """The same local shapes compiled at P = 2 and then P = 4 (one inductor cache on disk):
    P is an argument of the op, so the P = 2 graph cannot be served for P = 4."""
    for world in (2, 4):
        case = AttentionCase(world=world, batch=1, q_heads=8, kv_heads=4, seq_local=8, head_dim=16,
                             heads_per_stage=world, is_causal=True, scale=None, dtype="float32", seed=7)
        _check_block(rank_pools(world).run(rank_jobs.compiled_block_case, case, "inductor"), case)
