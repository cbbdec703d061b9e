"""``upipe_attention``: the public eager entry point to the stage-loop op, for code that
calls attention on sequence shards itself (the backend reaches the same op by rewriting
SDPA calls)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from upipe_compile import collectives, kernels
from upipe_compile.errors import UnsupportedAttention
from upipe_compile.ops import attention_op, op_arguments
from upipe_compile.options import StageLoopSettings, check_prefetch
from upipe_compile.schedule import shape_problems


def upipe_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
    cp_mesh=None, heads_per_stage: Optional[int] = None, prefetch: str = "forward",
    cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on sequence-sharded inputs.

    Rank r passes q ``[B, Hq, S/P, D]`` and k, v ``[B, Hkv, S/P, D]`` for tokens
    ``[r*S/P, (r+1)*S/P)`` and gets back the same shard of attention over the full
    sequence. ``heads_per_stage`` (U, a multiple of P; default P) sets how many query heads
    all ranks together compute per stage; U = Hq is plain Ulysses. ``prefetch`` is one of
    :data:`~upipe_compile.options.PREFETCH_MODES`.

    ``cu_seqlens`` (packed sequences): the cumulative document lengths over the *full*
    sequence, ``[0, len_0, len_0 + len_1, ..., S]`` (int32/int64, the same on every rank);
    attention then stays inside each document (causal within it when ``is_causal``).
    See docs/packed_sequences.md.
    """
    check_prefetch(prefetch)
    group = collectives.resolve_group(cp_mesh)
    world = group.size()
    heads_per_stage = world if heads_per_stage is None else heads_per_stage
    problems = shape_problems(q.shape, k.shape, v.shape, enable_gqa, world, heads_per_stage)
    if q.device.type == "cuda":
        problems += kernels.cuda_problems(q.dtype, q.shape[-1])
    if problems:
        raise UnsupportedAttention("upipe_attention: " + "; ".join(problems))
    if world == 1 and cu_seqlens is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    settings = StageLoopSettings(is_causal, scale, heads_per_stage, world, group.group_name, prefetch)
    out, _ = attention_op(*op_arguments(q, k, v, settings, cu_seqlens))
    return out
