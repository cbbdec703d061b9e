"""Jobs that run on every rank of a RankPool (module-level so spawn can pickle them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import upipe_compile
from tests_support import AttentionCase, make_inputs


def op_case(case: AttentionCase):
    """upipe_attention on this rank's shard; returns (out, dq, dk, dv) shards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = (x.chunk(world, dim=2)[rank].clone() for x in make_inputs(case))
    for x in (q, k, v):
        x.requires_grad_(True)
    out = upipe_compile.upipe_attention(
        q, k, v, is_causal=case.is_causal, scale=case.scale, enable_gqa=True, heads_per_stage=case.heads_per_stage,
        prefetch=case.prefetch,
    )
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def compiled_block_case(case: AttentionCase, inner_backend: str):
    """TinyAttention compiled with backend="upipe" on this rank's shard: (out, dx, param grads)."""
    from tests_support import TinyAttention, block_grads, make_block_inputs

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    x, dout = (t.chunk(world, dim=1)[rank] for t in make_block_inputs(case))
    model = torch.compile(
        TinyAttention(case), backend="upipe",
        options={"heads_per_stage": case.heads_per_stage, "prefetch": case.prefetch, "inner_backend": inner_backend},
    )
    return block_grads(model, x, dout)


def uneven_shards_case():
    rank = dist.get_rank()
    q = torch.randn(1, 4, 3 + rank, 8)
    return upipe_compile.upipe_attention(q, q, q, is_causal=True)
