"""A block calling torch's varlen_attn (torchtitan 0.3's "varlen" attention), and its
full-sequence reference: each document alone through SDPA. Module-level for spawned ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import upipe_compile
from tests_support import attention_events

HEADS, KV_HEADS, HEAD_DIM, DIM = 4, 2, 8, 32
LENGTHS = (5, 1, 14, 12)  # 32 tokens: a document of one token, documents crossing the shards of 2 and 4 ranks


class VarlenBlock(nn.Module):
    def __init__(self, window: tuple[int, int], batch: int = 1, lse: bool = False):
        super().__init__()
        self.window, self.batch, self.lse = window, batch, lse
        self.q, self.o = nn.Linear(DIM, HEADS * HEAD_DIM), nn.Linear(HEADS * HEAD_DIM, DIM)
        # no key bias: softmax ignores what it adds to every score of a query (its gradient is 0)
        self.k, self.v = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False), nn.Linear(DIM, KV_HEADS * HEAD_DIM)

    def forward(self, x, cu_seqlens, max_len: int, reference: bool = False):
        from torch.nn.attention.varlen import AuxRequest, varlen_attn

        batch, seq, _ = x.shape
        tokens = batch * seq  # the batch flattened into one token dim, as torchtitan 0.3 does
        q = self.q(x).view(tokens, HEADS, HEAD_DIM)
        k, v = self.k(x).view(tokens, KV_HEADS, HEAD_DIM), self.v(x).view(tokens, KV_HEADS, HEAD_DIM)
        if reference:
            o = each_document_alone(q, k, v, cu_seqlens, self.window)
        elif self.lse:
            o, lse = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, window_size=self.window,
                                 enable_gqa=True, return_aux=AuxRequest(lse=True))
            o = o * lse.transpose(0, 1).unsqueeze(-1).exp()
        else:
            o = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, window_size=self.window,
                            enable_gqa=True)
        return self.o(o.reshape(batch, seq, HEADS * HEAD_DIM))


def each_document_alone(q, k, v, cu_seqlens, window):
    """[T, H, D] attention within each document, flash-attn's window (left, right; -1 unbounded)."""
    left, right = window
    outs = []
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        qd, kd, vd = (t[a:b].transpose(0, 1) for t in (q, k, v))
        kd, vd = (t.repeat_interleave(HEADS // KV_HEADS, dim=0) for t in (kd, vd))
        i, j = torch.arange(b - a)[:, None], torch.arange(b - a)[None, :]
        allowed = torch.ones(b - a, b - a, dtype=torch.bool)
        if left >= 0:
            allowed &= i - j <= left
        if right >= 0:
            allowed &= j - i <= right
        outs.append(F.scaled_dot_product_attention(qd, kd, vd, attn_mask=allowed).transpose(0, 1))
    return torch.cat(outs)


def tensors(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    seq = sum(LENGTHS)
    x, dy = torch.randn(1, seq, DIM, generator=gen), torch.randn(1, seq, DIM, generator=gen)
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return x, dy, cu_seqlens


def model(window):
    torch.manual_seed(0)
    return VarlenBlock(window)


def reference(window):
    """(y, dx, weight grads) on the full sequence, each document alone."""
    block = model(window)
    x, dy, cu_seqlens = tensors()
    x.requires_grad_()
    y = block(x, cu_seqlens, max(LENGTHS), reference=True)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}


def compiled_case(window, fuse: bool):
    """This rank's shard through the block compiled with backend="upipe": (y, dx, weight
    grads, upipe op counts)."""
    torch._dynamo.reset()
    block = model(window)
    x, dy, cu_seqlens = tensors()
    x, dy = (upipe_compile.shard_sequence(t, dim=1) for t in (x, dy))
    x.requires_grad_()
    compiled = torch.compile(block, backend="upipe", options={"inner_backend": "aot_eager", "fuse_projections": fuse})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y = compiled(x, cu_seqlens, max(LENGTHS))
        y.backward(dy)
    assert dist.get_world_size() > 1
    return y.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}, dict(attention_events(prof))
