"""Shared test inputs and the eager reference on the full, unsharded sequence."""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


@dataclass(frozen=True)
class AttentionCase:
    world: int
    batch: int
    q_heads: int
    kv_heads: int
    seq_local: int
    head_dim: int
    heads_per_stage: int
    is_causal: bool
    scale: float | None
    dtype: str
    seed: int = 0
    prefetch: str = "forward"
    value_dim: int | None = None
    """v's head dim where it differs from q's and k's (MLA); None: head_dim."""

    @property
    def seq(self) -> int:
        return self.seq_local * self.world


def make_inputs(case: AttentionCase):
    """Full-sequence q, k, v and an upstream gradient, identical on every process."""
    gen = torch.Generator().manual_seed(case.seed)
    dtype = DTYPES[case.dtype]

    def randn(heads, dim=case.head_dim):
        return torch.randn(case.batch, heads, case.seq, dim, generator=gen).to(dtype)

    value_dim = case.value_dim or case.head_dim
    return randn(case.q_heads), randn(case.kv_heads), randn(case.kv_heads, value_dim), randn(case.q_heads, value_dim)


def eager_reference(case: AttentionCase):
    q, k, v, dout = make_inputs(case)
    for x in (q, k, v):
        x.requires_grad_(True)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=case.is_causal, scale=case.scale, enable_gqa=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


class TinyAttention(torch.nn.Module):
    """An attention layer as models write it: projections, head split, SDPA, output projection."""

    def __init__(self, case: AttentionCase):
        super().__init__()
        self.case = case
        hidden = case.q_heads * case.head_dim
        gen = torch.Generator().manual_seed(case.seed + 1)
        dtype = DTYPES[case.dtype]

        def linear(out_features):
            layer = torch.nn.Linear(hidden, out_features, bias=False)
            layer.weight.data = (torch.randn(out_features, hidden, generator=gen) / hidden**0.5).to(dtype)
            return layer

        self.wq = linear(case.q_heads * case.head_dim)
        self.wk = linear(case.kv_heads * case.head_dim)
        self.wv = linear(case.kv_heads * case.head_dim)
        self.wo = linear(hidden)

    def forward(self, x):
        b, s, _ = x.shape
        c = self.case
        q = self.wq(x).view(b, s, c.q_heads, c.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
        out = self.attend(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def attend(self, q, k, v):
        c = self.case
        return F.scaled_dot_product_attention(q, k, v, is_causal=c.is_causal, scale=c.scale, enable_gqa=True)


def make_block_inputs(case: AttentionCase):
    gen = torch.Generator().manual_seed(case.seed + 2)
    hidden = case.q_heads * case.head_dim
    dtype = DTYPES[case.dtype]
    x = torch.randn(case.batch, case.seq, hidden, generator=gen).to(dtype)
    return x, torch.randn(case.batch, case.seq, hidden, generator=gen).to(dtype)


def block_grads(model: torch.nn.Module, x: torch.Tensor, dout: torch.Tensor):
    """Output, input gradient and parameter gradients (by name) of one forward + backward."""
    x = x.detach().clone().requires_grad_(True)
    out = model(x)
    out.backward(dout)
    module = getattr(model, "_orig_mod", model)  # torch.compile wraps the module
    return out.detach(), x.grad, {name: p.grad for name, p in module.named_parameters()}


def eager_block_reference(case: AttentionCase, float64: bool = False):
    """TinyAttention's (out, dx, param grads) in the case's dtype, or (``float64``) on its
    tensors upcast: the exact answer the dtype's own error is measured against."""
    x, dout = make_block_inputs(case)
    if float64:
        return block_grads(TinyAttention(case).double(), x.double(), dout.double())
    return block_grads(TinyAttention(case), x, dout)


def assert_shards_match(shards, logits: torch.Tensor, grads: dict, tolerance: float = 1e-5) -> None:
    """Every rank's logits (``shards[r][0]``) equal its contiguous slice of the full-sequence
    ``logits``, and the parameter gradients (``shards[r][1]``), summed over ranks, equal ``grads``."""
    world = len(shards)
    for rank, shard in enumerate(shards):  # every rank's shard, not only the gathered whole
        assert relative_error(shard[0], logits.chunk(world, dim=1)[rank]) < tolerance, f"logits on rank {rank}"
    assert set(shards[0][1]) == set(grads)
    for name, grad in grads.items():
        assert relative_error(sum(shard[1][name] for shard in shards), grad) < tolerance, name


def per_document_logits(model: torch.nn.Module, ids: torch.Tensor, dout: torch.Tensor, lengths) -> torch.Tensor:
    """Each document of a packed row through ``model`` on its own, forward and backward of
    ``sum(logits * dout)``: the logits laid end to end (gradients accumulate in the model)."""
    logits, start = [], 0
    for n in lengths:
        doc_logits = model(input_ids=ids[:, start:start + n], use_cache=False).logits
        (doc_logits * dout[:, start:start + n]).sum().backward()
        logits.append(doc_logits.detach())
        start += n
    return torch.cat(logits, dim=1)


def attention_events(prof) -> collections.Counter:
    """From a torch.profiler run: how often each upipe op ran, and SDPA kernels that ran
    outside them (plain attention on a shard would be a silent wrong answer)."""
    counts = collections.Counter()
    for event in prof.events():
        if event.name.startswith("upipe::"):
            counts[event.name] += 1
        elif "scaled_dot_product" in event.name:
            parent = event.cpu_parent
            while parent is not None and not parent.name.startswith("upipe::"):
                parent = parent.cpu_parent
            if parent is None:
                counts["plain sdpa outside upipe"] += 1
    return counts


def eager_documents_reference(case: AttentionCase, bounds: tuple[int, ...], float64: bool = False):
    """Eager SDPA run separately on each document of the full sequence: (out, dq, dk, dv);
    ``float64``: on the case's tensors upcast."""
    q, k, v, dout = (t.double() if float64 else t for t in make_inputs(case))
    for x in (q, k, v):
        x.requires_grad_(True)
    pieces = [
        F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=case.is_causal,
                                       scale=case.scale, enable_gqa=True)
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    out = torch.cat(pieces, dim=2)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def variant_reference(case: AttentionCase, window=None, softcap=None, sinks=None, bounds=None,
                      in_case_dtype: bool = False):
    """Attention written out in float64 on the full sequence, with a sliding ``window``
    (flash-attn's (left, right), -1 unbounded), a logit ``softcap``, per-head ``sinks``
    and documents ``bounds``: ``(out, dq, dk, dv, dsinks)`` (dsinks None without sinks).
    ``in_case_dtype``: the same math in the case's dtype (what fp32 itself can promise)."""
    upcast = (lambda t: t) if in_case_dtype else (lambda t: t.double())
    q, k, v, dout = (upcast(t).requires_grad_(True) for t in make_inputs(case))
    group = case.q_heads // case.kv_heads
    scale = case.scale if case.scale is not None else case.head_dim ** -0.5
    scores = q @ k.repeat_interleave(group, dim=1).transpose(-1, -2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(case.seq)[:, None]
    j = torch.arange(case.seq)[None, :]
    allowed = torch.ones(case.seq, case.seq, dtype=torch.bool)
    if case.is_causal:
        allowed &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
    if bounds is not None:
        doc = torch.bucketize(torch.arange(case.seq), torch.tensor(bounds[1:-1]), right=True)
        allowed &= doc[:, None] == doc[None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink_param = None
    if sinks is not None:
        sink_param = upcast(sinks).detach().requires_grad_(True)
        column = sink_param[None, :, None, None].expand(case.batch, -1, case.seq, 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = probs @ v.repeat_interleave(group, dim=1)
    out.backward(dout.detach())
    return out.detach(), q.grad, k.grad, v.grad, None if sinks is None else sink_param.grad


def make_sinks(case: AttentionCase) -> torch.Tensor:
    gen = torch.Generator().manual_seed(case.seed + 3)
    return (torch.randn(case.q_heads, generator=gen) * 2).to(DTYPES[case.dtype])


def variant_math(q, k, v, *, is_causal, scale, window=None, softcap=None, sinks=None, slopes=None, bounds=None):
    """Attention with a window / softcap / sinks / ALiBi ``slopes`` (``-slope[h] * |i - j|``
    after the softcap) and documents ``bounds`` written out on the whole sequence (the
    reference's math), differentiable."""
    group = q.shape[1] // k.shape[1]
    seq = q.shape[2]
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    scores = q @ k.repeat_interleave(group, dim=1).transpose(-1, -2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    if slopes is not None:
        scores = scores - slopes.to(scores.dtype)[:, None, None] * (i - j).abs().to(scores.dtype)
    allowed = (j <= i) if is_causal else torch.ones(seq, seq, dtype=torch.bool)
    if window is not None:
        if window[0] >= 0:
            allowed = allowed & (j >= i - window[0])
        if window[1] >= 0:
            allowed = allowed & (j <= i + window[1])
    if bounds is not None:
        doc = torch.bucketize(torch.arange(seq), torch.tensor(bounds[1:-1]), right=True)
        allowed = allowed & (doc[:, None] == doc[None, :])
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        column = sinks.to(scores.dtype)[None, :, None, None].expand(q.shape[0], -1, seq, 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs @ v.repeat_interleave(group, dim=1)).to(q.dtype)


class TinyVariantAttention(TinyAttention):
    """TinyAttention whose attention has a sliding window, softcap and/or sinks, called as a
    model does through ``upipe_compile.document_sdpa``; ``reference=True`` writes it out."""

    def __init__(self, case: AttentionCase, window=None, softcap=None, with_sinks=False, reference=False):
        super().__init__(case)
        self.window, self.softcap, self.reference = window, softcap, reference
        self.sinks = torch.nn.Parameter(make_sinks(case)) if with_sinks else None

    def attend(self, q, k, v):
        from upipe_compile import document_sdpa

        c = self.case
        if self.reference:
            return variant_math(q.double(), k.double(), v.double(), is_causal=c.is_causal, scale=c.scale,
                                window=self.window, softcap=self.softcap, sinks=self.sinks).to(q.dtype)
        return document_sdpa(q, k, v, is_causal=c.is_causal, scale=c.scale, enable_gqa=True, window=self.window,
                             softcap=self.softcap, sinks=self.sinks)


def wrapped_name(name: str) -> str:
    """A parameter's name without the wrappers compile and activation checkpointing add."""
    return name.replace("._orig_mod", "").replace("._checkpoint_wrapped_module", "")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (e.g. an FSDP-sharded gradient); a plain one as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def load_full_weights(model: torch.nn.Module, full_state: dict) -> None:
    """Every parameter of a parallelized ``model`` (FSDP DTensors or plain) set to its shard
    of the full model's ``full_state`` (by unwrapped name)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, param in model.named_parameters():
            full = full_state[wrapped_name(name)]
            if isinstance(param, DTensor):
                param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements).to_local())
            else:
                param.copy_(full)
