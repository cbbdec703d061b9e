"""Rank-side jobs for tests/test_ring.py (module-level so spawn can pickle them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests_support import AttentionCase, make_inputs
from upipe_compile.attention.ring import ring_backward, ring_forward, zigzag_shard


def ring_case(case: AttentionCase):
    """Ring attention of this rank's zigzag share over the whole world as the ring:
    (out, lse, dq, dk, dv) shares."""
    rank, ring = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = (zigzag_shard(x, rank, ring, dim=2) for x in make_inputs(case))
    out, lse = ring_forward(q, k, v, case.is_causal, case.scale, dist.group.WORLD)
    dq, dk, dv = ring_backward(dout, q, k, v, out, lse, case.is_causal, case.scale, dist.group.WORLD)
    return out, lse, dq, dk, dv


def odd_share_case():
    q = torch.zeros(1, 2, 3, 8)
    return ring_forward(q, q, q, True, None, dist.group.WORLD)


def hybrid_case(case: AttentionCase, ring: int):
    """upipe_attention over a (ring, all-to-all) mesh of the world: this rank's shard as
    shard_sequence lays it out; returns (out, dq, dk, dv) shards and the shard's positions."""
    from torch.distributed.device_mesh import init_device_mesh

    import upipe_compile

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ring, world // ring), mesh_dim_names=("cp_ring", "cp_a2a"))
    q, k, v, dout = (upipe_compile.shard_sequence(x, mesh, dim=2).clone() for x in make_inputs(case))
    for x in (q, k, v):
        x.requires_grad_(True)
    out = upipe_compile.upipe_attention(q, k, v, is_causal=case.is_causal, scale=case.scale, enable_gqa=True,
                                        cp_mesh=mesh, heads_per_stage=case.heads_per_stage, prefetch=case.prefetch)
    out.backward(dout)
    positions = upipe_compile.global_positions(q.shape[2], mesh)
    gathered = upipe_compile.gather_sequence(out.detach(), mesh, dim=2)
    return out.detach(), q.grad, k.grad, v.grad, positions, gathered


def windowed_attention(x):
    import upipe_compile

    return upipe_compile.document_sdpa(x, x, x, None, is_causal=True, window=(2, 0))


def hybrid_refusals():
    """The messages of what a ring x all-to-all mesh refuses, on this rank."""
    from torch.distributed.device_mesh import init_device_mesh

    import upipe_compile

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp_ring", "cp_a2a"))
    wrong = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    q = torch.randn(1, 4, 4, 8)
    attempts = {
        "documents": lambda: upipe_compile.upipe_attention(q, q, q, cp_mesh=mesh, cu_seqlens=torch.tensor([0, 8, 16])),
        "window": lambda: upipe_compile.upipe_attention(q, q, q, is_causal=True, cp_mesh=mesh, window=(4, 0)),
        "names": lambda: upipe_compile.upipe_attention(q, q, q, cp_mesh=wrong),
        "uneven": lambda: upipe_compile.shard_sequence(torch.zeros(1, 12), mesh, dim=1),
        "backend": lambda: torch.compile(windowed_attention, backend="upipe", options={"cp_mesh": mesh})(q),
        "fused eager API": lambda: upipe_compile.upipe_attention_block(
            q.view(1, 4, 32), *([None] * 8), [], None, cp_mesh=mesh),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = None
        except Exception as error:  # noqa: BLE001  (the test reads the message)
            messages[name] = f"{type(error).__name__}: {error}"
    return messages


def compiled_hybrid_case(case: AttentionCase, ring: int, inner_backend: str):
    """TinyAttention compiled with backend="upipe" over a (ring, all-to-all) mesh, on this
    rank's shard as shard_sequence lays it out: (out, dx, param grads)."""
    from torch.distributed.device_mesh import init_device_mesh

    import upipe_compile
    from tests_support import TinyAttention, block_grads, make_block_inputs

    torch._dynamo.reset()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ring, world // ring), mesh_dim_names=("cp_ring", "cp_a2a"))
    x, dout = (upipe_compile.shard_sequence(t, mesh, dim=1) for t in make_block_inputs(case))
    model = torch.compile(TinyAttention(case), backend="upipe",
                          options={"cp_mesh": mesh, "heads_per_stage": case.heads_per_stage,
                                   "prefetch": case.prefetch, "inner_backend": inner_backend})
    return block_grads(model, x, dout)
