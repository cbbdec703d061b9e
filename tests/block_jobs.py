"""Rank jobs for the fused attention block (module-level so spawn can pickle them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from block_support import BlockCase, make_region, make_tensors, needs_grad, sequence_dim
from upipe_compile.block.ops import BlockSettings, attention_block_op, upipe_attention_block
from upipe_compile.block.region import register_region


def fused_block_case(case: BlockCase, mode: str, ring: int = 1):
    """The fused op on this rank's shard (``mode``: "op", "eager" twin, or "compiled" with
    aot_eager): (y shard, dx shard, weight grads, grads of the non-positional extras).
    ``ring`` > 1: over a (ring, all-to-all) mesh, on the shards ``shard_sequence`` lays out;
    y and dx are gathered and handed back as contiguous shards, so callers compare alike."""
    from upipe_compile.sharding import gather_sequence, shard_sequence

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = None
    if ring > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (ring, world // ring), mesh_dim_names=("cp_ring", "cp_a2a"))
    shard = ((lambda t, dim=1: t.chunk(world, dim=dim)[rank].clone()) if mesh is None else
             (lambda t, dim=1: shard_sequence(t, mesh, dim=dim).clone()))
    x, dy, weights, extras = make_tensors(case)
    x, dy = shard(x), shard(dy)
    dims = [sequence_dim(case, e) for e in extras]
    extras = [(e if d is None else shard(e, d)).requires_grad_(needs_grad(case, e)) for e, d in zip(extras, dims)]
    weights = [None if w is None else w.requires_grad_() for w in weights]
    x.requires_grad_()
    region = make_region(case)

    def block(x, *tensors):
        return upipe_attention_block(x, *tensors[:8], list(tensors[8:]), region,
                                     heads_per_stage=case.heads_per_stage, prefetch=case.prefetch,
                                     recompute_attention_output=case.recompute_output,
                                     eager=mode == "eager", cp_mesh=mesh)

    if mode == "compiled":  # the op as the fusion pass inserts it: a graph node, region by id
        torch._dynamo.reset()
        settings = BlockSettings(register_region(region), case.heads_per_stage, world, dist.group.WORLD.group_name,
                                 case.prefetch, case.recompute_output).op_args()

        @torch.compile(backend="aot_eager", fullgraph=True)
        def block(x, *tensors):
            return attention_block_op(x, *tensors[:8], list(tensors[8:]), None, *settings)[0]
    y = block(x, *weights, *extras)
    y.backward(dy)
    y, dx = y.detach(), x.grad
    extra_grads = [e.grad for e in extras if e.requires_grad]
    if mesh is not None:
        y, dx = (gather_sequence(t, mesh, dim=1).chunk(world, dim=1)[rank] for t in (y, dx))
        extra_grads = [g if d is None else gather_sequence(g, mesh, dim=d).chunk(world, dim=d)[rank]
                       for g, d in zip(extra_grads, [d for e, d in zip(extras, dims) if e.requires_grad])]
    return (y, dx, [None if w is None else w.grad for w in weights], extra_grads)
