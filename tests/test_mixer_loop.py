"""The mixer stage loop (upipe::head_mixer_loop's forward and backward) equals the mixer on
the whole sequence, on real gloo ranks, every rank: the output shard and every input's
gradient (activations, and tensors every head shares: this rank's shard; parameters: summed
over ranks). Hypothesis draws the kind (Mamba2's SSD scan with its B/C groups, the gated
delta rule with its q/k heads shared by groups of value heads, Mamba's
selective scan with B/C shared by every channel, lightning attention), heads, groups, P,
stages and shard length; float64 inputs to the mixers' own implementations (transformers'
Mamba scans compute in float32 inside, hence 1e-5)."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import mixer_jobs
from mixer_jobs import MixerCase
from tests_support import relative_error
from upipe_compile.mixers.registry import KINDS


@st.composite
def mixer_cases(draw):
    kind = draw(st.sampled_from(["mamba2_chunk_scan", "gated_delta_rule", "selective_scan", "lightning_attention"]))
    world = draw(st.sampled_from([2, 4]))
    per_rank = draw(st.sampled_from([1, 2, 3, 4]))
    heads = world * per_rank
    groups = draw(st.sampled_from([g for g in range(1, heads + 1) if heads % g == 0]))
    stages = draw(st.sampled_from([s for s in range(1, per_rank + 1) if per_rank % s == 0]))
    return MixerCase(kind, world, heads, groups, stages, draw(st.integers(1, 5)), draw(st.integers(0, 2**16)))


@settings(max_examples=int(os.environ.get("UPIPE_MIXER_EXAMPLES", "24")), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(case=mixer_cases())
# each rank's heads cover two whole groups; they split groups unevenly (one row per head)
@example(case=MixerCase("mamba2_chunk_scan", 2, 8, 4, 1, 3, 1))
@example(case=MixerCase("mamba2_chunk_scan", 2, 6, 3, 1, 3, 2))
@example(case=MixerCase("gated_delta_rule", 2, 8, 4, 1, 3, 3))
@example(case=MixerCase("gated_delta_rule", 4, 8, 2, 2, 2, 4))
def test_mixer_loop_matches_the_whole_sequence(rank_pools, case):
    shards = rank_pools(case.world).run(mixer_jobs.loop_case, case)
    out, grads, _ = mixer_jobs.reference(case)
    spec = KINDS[case.kind]
    assert relative_error(torch.cat([s[0] for s in shards], dim=spec.output.seq), out) < 1e-5, case
    for i, (layout, expected) in enumerate(zip(spec.inputs, grads)):
        if layout.seq is None:  # a parameter: every rank's share, summed
            actual = sum(s[1][i] for s in shards)
        else:
            actual = torch.cat([s[1][i] for s in shards], dim=layout.seq)
        assert relative_error(actual, expected) < 1e-5, (i, case)
