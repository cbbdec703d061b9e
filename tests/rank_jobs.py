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


def op_case_with_flash_standin(case: AttentionCase, family: str):
    """op_case with the stage loop's kernels replaced by FlashAttnKernels over a CPU
    stand-in of flash-attn's interface (what the CUDA path runs)."""
    from flash_attn_standins import FAMILIES

    from upipe_compile import kernels

    cpu, interface = kernels._CPU, FAMILIES[family]()
    kernels._CPU = kernels.FlashAttnKernels(interface)
    try:
        result = op_case(case)
    finally:
        kernels._CPU = cpu
    assert interface.calls, "the stage loop did not go through the flash-attn adapter"
    return result


def shape_checks_per_call(shapes: list[tuple[int, int]]):
    """Run the op on local q of each (seq_local, heads) in turn; return how many cross-rank
    shape checks (all-gathers) each call made, or the error it raised."""
    from upipe_compile import collectives

    gathers = []
    real = collectives.all_gather

    def counting(*args, **kwargs):
        gathers.append(1)
        return real(*args, **kwargs)

    collectives.all_gather = counting
    collectives._same_shape_checked.clear()
    counts = []
    try:
        for seq_local, heads in shapes:
            before = len(gathers)
            q = torch.randn(1, heads, seq_local, 8)
            try:
                upipe_compile.upipe_attention(q, q, q, is_causal=True)
                counts.append(len(gathers) - before)
            except upipe_compile.UnsupportedAttention as error:
                counts.append(str(error))
    finally:
        collectives.all_gather = real
    return counts


def uneven_then_even(seq_local: int):
    """An even shape first (checked once), then one rank one token longer (refused on
    every rank), then the even shape again (already checked: no all-gather)."""
    rank = dist.get_rank()
    first = shape_checks_per_call([(seq_local, 2)])
    assert first == [1], first
    from upipe_compile import collectives

    checked = set(collectives._same_shape_checked)
    counts = shape_checks_per_call([(seq_local + 1 + rank, 2)])
    collectives._same_shape_checked.update(checked)
    gathers = []
    real = collectives.all_gather
    collectives.all_gather = lambda *a, **k: gathers.append(1) or real(*a, **k)
    try:
        q = torch.randn(1, 2, seq_local, 8)
        upipe_compile.upipe_attention(q, q, q, is_causal=True)
    finally:
        collectives.all_gather = real
    return counts[0], len(gathers)
