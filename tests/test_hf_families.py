"""Sliding window, softcap and sinks in real transformers models: each family compiled
with backend="upipe" (loaded with register()) on 2 and 4 gloo ranks equals transformers'
own eager attention on the full sequence, logits and every parameter gradient (fp32)."""

from __future__ import annotations

import pytest
import torch

import hf_families_jobs as jobs
from tests_support import relative_error

FAMILIES = ["mistral", "qwen2", "gemma3", "gemma2", "gpt_oss"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_full_sequence_eager(rank_pools, family, world):
    shards = rank_pools(world).run(jobs.compiled_family_case, family, world, True)
    logits, grads = jobs.eager_reference(family, world)
    for rank, shard in enumerate(shards):  # every rank's shard, not only the gathered whole
        part = logits.chunk(world, dim=1)[rank]
        assert relative_error(shard[0], part) < 1e-5, f"logits on rank {rank}"
        events = shard[2]
        assert events.get("plain sdpa outside upipe", 0) == 0, events
        assert any(name.startswith("upipe::attention") for name in events), events
    assert set(shards[0][1]) == set(grads)
    for name, grad in grads.items():
        total = sum(shard[1][name] for shard in shards)
        assert relative_error(total, grad) < 1e-5, name


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
def test_family_unfused_matches(rank_pools, family):
    shards = rank_pools(2).run(jobs.compiled_family_case, family, 2, False)
    logits, grads = jobs.eager_reference(family, 2)
    assert relative_error(torch.cat([s[0] for s in shards], dim=1), logits) < 1e-5
    for name, grad in grads.items():
        assert relative_error(sum(s[1][name] for s in shards), grad) < 1e-5, name
