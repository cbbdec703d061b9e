"""torch's varlen_attn (torchtitan 0.3's "varlen" attention) under backend="upipe": the pass
reads it as attention over packed documents, and the block (plain op and fused) equals each
document run alone on the full sequence, every rank's output and input gradient and every
weight gradient, on gloo ranks; what it cannot run exactly is refused with the reason."""

from __future__ import annotations

import pytest
import torch

import varlen_jobs as jobs
from tests_support import relative_error

WORLD = 2  # the fake group of the graph tests


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "plain"])
@pytest.mark.parametrize("world, window", [(2, (-1, 0)), (4, (-1, 0)), (2, (3, 0)), (4, (-1, -1))],
                         ids=["p2-causal", "p4-causal", "p2-window", "p4-full"])
def test_varlen_attn_matches_each_document_alone(rank_pools, world, window, fuse):
    shards = rank_pools(world).run(jobs.compiled_case, window, fuse)
    y, dx, grads = jobs.reference(window)
    assert relative_error(torch.cat([s[0] for s in shards], dim=1), y) < 1e-5
    assert relative_error(torch.cat([s[1] for s in shards], dim=1), dx) < 1e-5
    for name, grad in grads.items():
        assert relative_error(sum(s[2][name] for s in shards), grad) < 1e-5, name
    for *_, events in shards:
        assert events.get("plain sdpa outside upipe", 0) == 0, events
        assert events.get("upipe::attention_block" if fuse else "upipe::attention", 0) > 0, events


def _refusal(block, batch: int = 1) -> str:
    from upipe_compile import UnsupportedAttention
    from upipe_compile.sequence_marks import mark_sequence_dim

    x = mark_sequence_dim(torch.randn(batch, 16, jobs.DIM), 1)
    with pytest.raises(Exception) as refused:
        torch.compile(block, backend="upipe", options={"inner_backend": "eager"})(
            x, torch.tensor([0, 5, 16], dtype=torch.int32), 11)
    assert isinstance(refused.value.__cause__ or refused.value, UnsupportedAttention) or \
        "UnsupportedAttention" in str(refused.value), str(refused.value)
    return str(refused.value)


def test_a_flattened_batch_of_rows_is_refused(world):
    message = _refusal(jobs.VarlenBlock((-1, 0)), batch=2)
    assert "test_varlen_attn.py" in message or "varlen_jobs.py" in message, message
    assert "could not be traced back to one packed row" in message and "local batch size 1" in message, message


def test_its_log_sum_exp_used_is_refused(world):
    message = _refusal(jobs.VarlenBlock((-1, 0), lse=True))
    assert "varlen_attn's log-sum-exp (return_aux)" in message, message
