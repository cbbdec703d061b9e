"""Hybrid models run exactly under backend="upipe": Qwen3-Next and Qwen3.5 (a short causal conv and the
gated delta rule beside softmax attention, MoE) and LFM2 (a gated short conv), loaded with
register() and compiled over 2 and 4 gloo ranks, equal the unsharded model with the
families' own mixer functions: every rank's logits and every parameter gradient (fp32).
The mixers run as ``upipe::head_mixer_loop`` stage loops (a sequence->head all-to-all, the
mixer over the whole sequence for a chunk of heads/channels, the all-to-all back)."""

from __future__ import annotations

import pytest

import hf_hybrids_jobs as jobs
from tests_support import assert_shards_match


@pytest.mark.parametrize("world, heads_per_stage", [(2, None), (2, 4), (4, None)], ids=["P2", "P2-U4", "P4"])
@pytest.mark.parametrize("family", jobs.FAMILIES)
def test_hybrid_family_matches_full_sequence(rank_pools, family, world, heads_per_stage):
    """U = P (the default) and U = all 4 attention heads (Ulysses) for the attention layers."""
    shards = rank_pools(world).run(jobs.compiled_case, family, world, heads_per_stage)
    logits, grads = jobs.eager_reference(family)
    assert_shards_match(shards, logits, grads)
    for *_, ops in shards:
        assert "upipe.head_mixer_loop.default" in ops, ops
        assert "upipe.head_mixer.default" not in ops, ops  # every mixer rewritten


@pytest.mark.parametrize("family", ["qwen3_next", "bamba", "jamba", "minimax"])
def test_hybrid_as_shipped_runs_without_a_cache(rank_pools, family):
    """The config as shipped (``use_cache`` on) and ``model(input_ids=..., position_ids=...)``:
    the mixers still run as stage loops (no cache state reaches them), eager's numbers on
    every rank, and no cache of the local shard returned (the job asserts it)."""
    shards = rank_pools(2).run(jobs.compiled_case, family, 2, None, True)
    logits, grads = jobs.eager_reference(family)
    assert_shards_match(shards, logits, grads)
    for *_, ops in shards:
        assert "upipe.head_mixer_loop.default" in ops and "upipe.head_mixer.default" not in ops, ops


@pytest.mark.parametrize("family", ["qwen3_next", "lfm2", "bamba"])
def test_packed_documents_restart_the_mixers(rank_pools, family):
    """A packed row of three documents (one crossing the shard boundary) at P = 2: the mixers
    transformers hands the boundaries to restart at every document, as each document run alone
    through the eager model."""
    shards = rank_pools(2).run(jobs.compiled_packed_case, family, 2)
    logits, grads = jobs.eager_documents_reference(family)
    assert_shards_match(shards, logits, grads)
    for *_, ops in shards:
        assert "upipe.head_mixer_loop.default" in ops, ops


@pytest.mark.parametrize("family", ["jamba", "minimax"])
def test_packed_documents_as_transformers_runs_them(rank_pools, family):
    """Jamba's selective scan and MiniMax's lightning attention get no document boundaries from
    transformers (their state runs on across documents; attention restarts): the packed row at
    P = 2 equals the eager model on the whole packed row."""
    shards = rank_pools(2).run(jobs.compiled_packed_case, family, 2)
    logits, grads = jobs.eager_packed_reference(family)
    assert_shards_match(shards, logits, grads)
    for *_, ops in shards:
        assert "upipe.head_mixer_loop.default" in ops, ops


def test_uneven_shards_raise_on_every_rank_before_a_mixer_exchanges(rank_pools):
    """LFM2 (a short conv first) with rank 1 at a new length: both ranks raise the shape error;
    no all-to-all sized by a shard runs first."""
    for rank, outcomes in enumerate(rank_pools(2).run(jobs.uneven_case, "lfm2")):
        assert outcomes[0] == "ok", (rank, outcomes)
        assert "equal, contiguous shard" in outcomes[1], (rank, outcomes)
