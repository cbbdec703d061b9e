"""The CUDA kernels' packed-sequence backward runs one varlen call per group of documents
(workspace.varlen_backward_groups), so that flash's per-document padding never makes a call's
workspace larger than the dense kernel's. Checked on CPU with a stand-in varlen kernel
(per-document CPU flash calls on the [S, H, D] views the CUDA adapters receive): the grouped
backward equals one call over all documents, for packed and padded log-sum-exp layouts;
and the modelled workspace of 1000 documents stays within the dense kernel's."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from upipe_compile.attention import kernels
from upipe_compile.attention.kernels import varlen
from upipe_compile.measure import workspace
from upipe_compile.attention.document_boundaries import Documents


class StandInVarlen(kernels.VarlenKernels):
    """What a CUDA varlen kernel computes, from CPU flash calls per document."""

    def __init__(self, lse_padded: bool):
        self.cpu, self.lse_padded, self.calls = kernels.CpuKernels(), lse_padded, []

    def _varlen_forward_row(self, q, k, v, documents, is_causal, scale, window=(-1, -1), softcap=0.0,
                            alibi_slopes=None):
        out, lse = self.cpu.forward_documents(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), documents,
                                              is_causal, scale, window, softcap, alibi_slopes)
        lse = lse[0]
        return out[0].transpose(0, 1), (varlen._padded_lse(lse, documents) if self.lse_padded else lse)

    def _varlen_backward_row(self, dout, q, k, v, out, lse, documents, is_causal, scale, window=(-1, -1),
                             softcap=0.0, alibi_slopes=None):
        self.calls.append(len(documents.spans))
        if self.lse_padded:
            lse = varlen._packed_lse(lse, documents)
        as_bhsd = [t.transpose(0, 1).unsqueeze(0) for t in (dout, q, k, v, out)]
        grads = self.cpu.backward_documents(*as_bhsd, lse.unsqueeze(0), documents, is_causal, scale, window, softcap,
                                            alibi_slopes)
        return tuple(g[0].transpose(0, 1) for g in grads)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=2, max_size=30), heads=st.sampled_from([(2, 2), (4, 2)]),
       batch=st.integers(1, 2), is_causal=st.booleans(), lse_padded=st.booleans())
def test_grouped_varlen_backward_equals_one_call(lengths, heads, batch, is_causal, lse_padded):
    q_heads, kv_heads = heads
    seq = sum(lengths)
    documents = Documents.from_bounds([0, *torch.tensor(lengths).cumsum(0).tolist()], torch.device("cpu"))
    gen = torch.Generator().manual_seed(seq)
    q, dout = (torch.randn(batch, q_heads, seq, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, seq, 16, generator=gen) for _ in range(2))
    kernel = StandInVarlen(lse_padded)
    out, lse = kernel.forward_documents(q, k, v, documents, is_causal, None)
    grouped = kernel.backward_documents(dout, q, k, v, out, lse, documents, is_causal, None)
    reference = kernels.CpuKernels().backward_documents(dout, q, k, v, out, lse, documents, is_causal, None)
    for got, want in zip(grouped, reference):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    groups = workspace.varlen_backward_groups(documents, q_heads, deterministic=False)
    assert [first for first, _ in groups] == [0] + [last for _, last in groups[:-1]]  # in order, no gaps
    assert groups[-1][1] == len(lengths)
    assert kernel.calls == [last - first for first, last in groups] * batch


def test_many_short_documents_stay_within_the_dense_workspace():
    """1M tokens of 1000 documents, one query head per rank (U = P): no varlen call pads
    more rows than the dense kernel holds, and the modelled peak workspace is the dense one's
    at most."""
    seq, count = 1 << 20, 1000
    bounds = torch.linspace(0, seq, count + 1).round().long().tolist()
    documents = Documents.from_bounds(bounds, torch.device("cpu"))
    for deterministic in (False, True):
        groups = workspace.varlen_backward_groups(documents, 1, deterministic)
        # deterministic: the dense kernel splits dq over all 132 SMs, one padded call is smaller
        assert len(groups) == (1 if deterministic else 2)
        for first, last in groups:
            tokens, n = bounds[last] - bounds[first], last - first
            splits = -(-workspace.H100_SMS // n) if deterministic else 1
            dense_splits = workspace.H100_SMS if deterministic else 1
            assert splits * (tokens + 128 * n) <= dense_splits * seq or n == 1
