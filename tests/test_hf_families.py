"""Sliding window, softcap, sinks and MLA (DeepSeek-V3: q/k and v head dims differ) in real
transformers models: each family compiled
with backend="upipe" (loaded with register()) on 2 and 4 gloo ranks equals transformers'
own eager attention on the full sequence, logits and every parameter gradient (fp32)."""

from __future__ import annotations

import pytest
import torch

import hf_families_jobs as jobs
from tests_support import assert_shards_match, relative_error

FAMILIES = ["mistral", "qwen2", "gemma3", "gemma2", "gpt_oss", "deepseek_v3"]
# MLA's block (q from the q latent, k and v from one kv_b_proj over the KV latent, a head-shared
# rotary key part, v padded to q/k's head dim) runs as one fused op
FUSED = {"deepseek_v3"}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_full_sequence_eager(rank_pools, family, world):
    shards = rank_pools(world).run(jobs.compiled_family_case, family, world, True)
    logits, grads = jobs.eager_reference(family, world)
    assert_shards_match(shards, logits, grads)
    for *_, events in shards:
        assert events.get("plain sdpa outside upipe", 0) == 0, events
        assert any(name.startswith("upipe::attention") for name in events), events
        if family in FUSED:
            assert events.get("upipe::attention_block", 0) > 0 and "upipe::attention" not in events, events


@pytest.mark.parametrize("family, world", [("mistral", 2), ("mixtral", 2), ("gpt_oss", 4), ("jetmoe", 2),
                                           ("falcon", 2), ("gpt_neo", 4), ("llama4", 2), ("llama4", 4),
                                           ("bloom", 2), ("mpt", 4)])
def test_family_as_shipped_runs_without_a_cache(rank_pools, family, world):
    """The first call a user makes: the config as shipped (``use_cache`` on) and
    ``model(input_ids=..., position_ids=...)``, a sliding-window family, a MoE family, one
    with sinks, windowed and full layers, and JetMoE (tokens gathered by expert, grouped by
    sizes read on the host: a graph break, and put back), Falcon and GPT-Neo (their own
    attention-class tables; GPT-Neo's window of 6 crosses the shards of 4) and Llama 4 (chunks of
    6: a chunk boundary inside a shard, chunks across shards of 8 and 4; a NoPE layer whose
    query temperature depends on each token's global position), Bloom and MPT (ALiBi written in
    their layers, each with its own slopes): eager's numbers on every rank and no cache of the
    local shard returned (the case asserts it)."""
    shards = rank_pools(world).run(jobs.compiled_family_case, family, world, True, True)
    _assert_as_accurate_as_eager(shards, family, world)


def _assert_as_accurate_as_eager(shards, family: str, world: int) -> None:
    """Every rank's logits and the summed gradients, against the float64 model, within
    max(1e-5, 4x the fp32 eager model's own error): a windowed or unscaled layer's small
    gradients carry more fp32 rounding than the rest (GPT-Neo's local layer: 7e-6 in eager
    itself); a wrong answer is off by 1e-2 or more."""
    exact_logits, exact = jobs.eager_reference(family, world, dtype=torch.float64)
    eager_logits, eager = jobs.eager_reference(family, world)

    def check(what, ours, theirs, truth):
        bound = max(1e-5, 4 * relative_error(theirs.double(), truth))
        error = relative_error(ours.double(), truth)
        assert error < bound, f"{what}: relative error {error:.2e} against float64 (bound {bound:.2e})"

    for rank, shard in enumerate(shards):
        check(f"logits on rank {rank}", shard[0], eager_logits.chunk(world, dim=1)[rank],
              exact_logits.chunk(world, dim=1)[rank])
    assert set(shards[0][1]) == set(exact)
    for name, truth in exact.items():
        check(name, sum(shard[1][name] for shard in shards), eager[name], truth)


def test_a_cache_filled_without_registers_hook_is_refused_naming_the_fix(rank_pools):
    """The sliding-window cache's update reads the sequence: refused, naming the cache and
    the fixes that work (register() before the model is built, or the model switched with
    set_attn_implementation, or use_cache=False)."""
    for message in rank_pools(2).run(jobs.cache_refusal_case, "mistral"):
        assert "cache_utils.py" in message and "build the model after calling" in message, message
        assert "model.set_attn_implementation(register())" in message, message
        assert "use_cache=False" in message and "express it as scaled_dot_product_attention" not in message, message


@pytest.mark.parametrize("keyword", ["past_key_values", "cache"])
def test_a_forward_handed_a_past_is_refused_on_every_rank(rank_pools, keyword):
    messages = rank_pools(2).run(jobs.past_refusal_case, "mistral", keyword)
    assert len(messages) == 2
    for message in messages:
        assert f"called with {keyword}= under context parallelism" in message and "uncompiled" in message, message


@pytest.mark.parametrize("family, world", [("gemma3", 2), ("gpt_oss", 2), ("deepseek_v3", 2), ("deepseek_v3", 4)])
def test_family_unfused_matches(rank_pools, family, world):
    shards = rank_pools(world).run(jobs.compiled_family_case, family, world, False)
    logits, grads = jobs.eager_reference(family, world)
    assert relative_error(torch.cat([s[0] for s in shards], dim=1), logits) < 1e-5
    for name, grad in grads.items():
        assert relative_error(sum(s[1][name] for s in shards), grad) < 1e-5, name


def test_mla_packed_documents_match_each_document_alone(rank_pools):
    """DeepSeek-V3 (MLA) on a packed row of three documents (one of length 1, one crossing the
    ranks) at P = 2 equals each document run alone through the eager model."""
    shards = rank_pools(2).run(jobs.compiled_packed_case, "deepseek_v3", 2)
    logits, grads = jobs.eager_documents_reference("deepseek_v3")
    assert_shards_match(shards, logits, grads)


PACKED_OVER_RING = (5, 1, 14, 12)  # 32 tokens: documents shorter than a chunk, of one token, crossing chunks and ranks


@pytest.mark.parametrize("family, world, ring, seq_local, lengths", [
    ("qwen2", 4, 2, 8, None), ("qwen3", 4, 2, 8, None), ("qwen3", 8, 4, 4, None),
    ("qwen3", 4, 2, 8, PACKED_OVER_RING), ("qwen3", 8, 4, 4, PACKED_OVER_RING), ("gemma2", 4, 2, 8, PACKED_OVER_RING),
    ("deepseek_v3", 4, 2, 8, None), ("deepseek_v3", 4, 2, 8, PACKED_OVER_RING),
    ("llama4", 4, 2, 8, None), ("llama4", 4, 2, 8, PACKED_OVER_RING),
], ids=["qwen2-2x2", "qwen3-2x2", "qwen3-4x2", "qwen3-2x2-packed", "qwen3-4x2-packed", "gemma2-2x2-packed",
        "mla-2x2", "mla-2x2-packed", "llama4-2x2", "llama4-2x2-packed"])
def test_sliding_window_family_over_a_ring_by_all_to_all_mesh(rank_pools, family, world, ring, seq_local, lengths):
    """Qwen2 and Qwen3 (sliding-window and full layers) and Gemma2 (softcap too) over 2 x 2
    and 4 x 2 meshes, the layout's positions or packed documents' (restarting at each): the
    gathered logits on every rank and the summed gradients equal eager on the full sequence, or
    each document run alone (the window of 6 crosses the zigzag chunks of 8 and of 4)."""
    ranks = rank_pools(world).run(jobs.mesh_family_case, family, ring, seq_local, lengths)
    if lengths is None:
        logits, grads = jobs.eager_reference(family, world, seq_local)
    else:
        logits, grads = jobs.eager_documents_reference(family, world, seq_local, lengths)
    for rank, (rank_logits, _) in enumerate(ranks):
        assert relative_error(rank_logits, logits) < 1e-5, rank
    for name, grad in grads.items():
        assert relative_error(sum(r[1][name] for r in ranks), grad) < 1e-5, name


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2", "gemma3", "gpt_oss"])
def test_a_model_built_before_register_and_switched_runs_without_a_cache(rank_pools, family):
    """Built before register() ran (SDPA; eager for Gemma2 and GPT-OSS), at the config's
    defaults (use_cache on), then switched with ``model.set_attn_implementation(register())``:
    its sliding-window cache is off under context parallelism as a model built after register()
    has it, and every rank's logits and the summed gradients equal eager on the full sequence."""
    shards = rank_pools(2).run(jobs.switched_family_case, family, 2)
    logits, grads = jobs.eager_reference(family, 2)
    assert_shards_match(shards, logits, grads)
    for *_, events in shards:
        assert any(name.startswith("upipe::attention") for name in events), events
