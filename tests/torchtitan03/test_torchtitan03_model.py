"""torchtitan 0.3 (its Llama3 debug model, varlen attention over the documents of a packed row,
fused wqkv) under backend="upipe" at CP = 2, 4 and over a 2 x 2 ring x all-to-all mesh on
gloo ranks is as accurate as CP = 1 on the whole row: every rank's logits and every parameter
gradient, fused blocks and the plain op, with and without a sliding window, MHA and GQA. Flex attention (0.3's default) is refused with the fix. Runs in the
torchtitan 0.3 tier (scripts/test_torchtitan03.sh)."""

from __future__ import annotations

import pytest
import torch

import tt03_jobs as jobs
from tests_support import relative_error


def assert_as_accurate_as_cp1(shards, window, kv_heads=None):
    """0.3's varlen attention runs in bf16 (it casts q, k, v): a last-bit difference of an fp32
    sum may flip a bf16 rounding, a KV head's query heads may be summed in another order, a
    ring merges its steps' bf16 outputs. So the logits and each gradient are held to CP = 1's
    own error against the same model with fp32 attention: at most twice it (or 1e-5)."""
    logits, grads = jobs.reference(window, kv_heads)
    exact_logits, exact = jobs.reference(window, kv_heads, exact=True)
    ours = relative_error(torch.cat([s[0] for s in shards], dim=1), exact_logits)
    assert ours <= max(1e-5, 2 * relative_error(logits, exact_logits)), ("logits", ours)
    for name, grad in grads.items():
        ours = relative_error(sum(s[1][name] for s in shards), exact[name])
        bound = max(1e-5, 2 * relative_error(grad, exact[name]))
        assert ours <= bound, (name, ours, bound)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "plain"])
@pytest.mark.parametrize("world, window", [(2, None), (4, None), (2, (5, 0))], ids=["cp2", "cp4", "cp2-window"])
def test_varlen_debug_model_matches_cp1(rank_pools, world, window, fuse):
    shards = rank_pools(world).run(jobs.compiled_case, fuse, window)
    assert_as_accurate_as_cp1(shards, window)
    for *_, events in shards:
        assert events.get("plain sdpa outside upipe", 0) == 0, events
        op = "upipe::attention_block" if fuse else "upipe::attention"
        assert events.get(op, 0) > 0 and (fuse or "upipe::attention_block" not in events), events


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "plain"])
def test_gqa_wqkv_per_kv_group_matches_cp1(rank_pools, fuse):
    """GQA (16 query heads, 4 KV heads): 0.3's fused wqkv holds each KV group's query heads, key
    and value together (Llama3-8B's layout); the pass reads each role's rows out of it, and
    the block fuses (each stage projects its own heads' rows only)."""
    shards = rank_pools(2).run(jobs.compiled_case, fuse, None, 4)
    assert_as_accurate_as_cp1(shards, None, 4)
    for *_, events in shards:
        op = "upipe::attention_block" if fuse else "upipe::attention"
        assert events.get(op, 0) > 0 and (fuse or "upipe::attention_block" not in events), events


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "plain"])
def test_varlen_over_a_ring_by_all_to_all_mesh_matches_cp1(rank_pools, fuse):
    """A 2 x 2 ("cp_ring", "cp_a2a") mesh, the zigzag layout's tokens and positions: the
    documents cross the ring's chunks and ranks."""
    shards = rank_pools(4).run(jobs.compiled_case, fuse, None, None, 2)
    assert_as_accurate_as_cp1(shards, None)
    for *_, events in shards:
        assert events.get("upipe::attention_block" if fuse else "upipe::attention", 0) > 0, events


def test_flex_attention_is_refused_with_the_fix(rank_pools):
    for message in rank_pools(2).run(jobs.flex_refusal):
        assert message is not None and "UnsupportedAttention" in message, message
        assert "flex_attention" in message and 'attn_backend="varlen"' in message, message
