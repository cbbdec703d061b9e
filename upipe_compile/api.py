"""``upipe_attention``: the public eager entry point to the stage-loop op, for code that
calls attention on sequence shards itself (the backend reaches the same op by rewriting
SDPA calls)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from upipe_compile.attention import collectives
from upipe_compile.attention.checks import AttentionCall, attention_problems
from upipe_compile.attention.head_dims import cut_to_value_dim, one_head_dim
from upipe_compile.errors import UnsupportedAttention
from upipe_compile.attention.ops import attention_op, op_arguments
from upipe_compile.attention.stage_loop import DEFAULT_PREFETCH, StageLoopSettings
from upipe_compile.options import normalised_variant, option_problems, resolved_heads_per_stage


def upipe_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
    cp_mesh=None, heads_per_stage: Optional[int] = None, prefetch: str = DEFAULT_PREFETCH,
    cu_seqlens: Optional[torch.Tensor] = None, window: Optional[tuple[int, int]] = None,
    softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on sequence-sharded inputs.

    Rank r passes q ``[B, Hq, S/P, D]`` and k, v ``[B, Hkv, S/P, D]`` for tokens
    ``[r*S/P, (r+1)*S/P)`` and gets back the same shard of attention over the full
    sequence. ``heads_per_stage`` (U, a multiple of P; default P) sets how many query heads
    all ranks together compute per stage; U = Hq is plain Ulysses. ``prefetch`` is one of
    :data:`~upipe_compile.attention.stage_loop.PREFETCH_MODES`.

    ``cu_seqlens`` (packed sequences): the cumulative document lengths over the *full*
    sequence, ``[0, len_0, len_0 + len_1, ..., S]`` (int32/int64, the same on every rank);
    attention then stays inside each document (causal within it when ``is_causal``).
    See docs/packed_sequences.md.

    Ring x all-to-all (several nodes): ``cp_mesh`` a 2-D DeviceMesh named
    ``("cp_ring", "cp_a2a")``, R ring ranks by A all-to-all ranks (P = R x A; put the A
    dimension within a node). Each stage's all-to-all then runs over A (U a multiple of A)
    and its attention as ring attention over R. The sequence is laid out as
    :func:`upipe_compile.shard_sequence` does for that mesh (zigzag over the ring, for causal
    balance): shard inputs and positions with it. No packed documents, variants or sinks yet.

    Attention variants (see docs/attention_variants.md): ``window=(left, right)`` as
    flash-attn counts it (query i sees keys ``[i - left, i + right]`` of the full sequence,
    -1 = unbounded; with ``is_causal`` the right edge is 0); ``softcap`` (scores become
    ``softcap * tanh(scores / softcap)``); ``sinks`` ``[Hq]``, one learned logit per query
    head joining every row's softmax with no value (GPT-OSS). Each rank's ``sinks.grad`` holds
    the heads that rank computed: sum it over the ranks, as any replicated parameter's.
    ``alibi_slopes`` ``[Hq]`` (ALiBi: Bloom, MPT): the score of query ``i`` and key ``j``, global
    positions of the full sequence (within a document with ``cu_seqlens``), gets
    ``-slope[h] * |i - j|`` added after the softcap (causal: ``-slope * (i - j)``); fixed
    slopes, no gradient (one that requires grad is refused).
    """
    window_left, window_right, softcap = normalised_variant(window, softcap)
    call = AttentionCall.of(q, k, v, enable_gqa=enable_gqa, window=(window_left, window_right), softcap=softcap,
                            sinks=sinks, alibi_slopes=alibi_slopes)
    if problems := attention_problems(call, 1, q.shape[1]):  # the call itself, before any process group
        raise UnsupportedAttention("upipe_attention: " + "; ".join(problems))
    group, ring_group = collectives.resolve_groups(cp_mesh)
    world = group.size()
    if problems := option_problems(world=world, heads_per_stage=heads_per_stage, prefetch=prefetch):
        raise UnsupportedAttention("upipe_attention: " + "; ".join(problems))
    heads_per_stage = resolved_heads_per_stage(heads_per_stage, world)
    if problems := attention_problems(call, world, heads_per_stage):
        raise UnsupportedAttention("upipe_attention: " + "; ".join(problems))
    plain = (window_left, window_right, softcap) == (-1, -1, 0.0) and sinks is None and alibi_slopes is None
    if world == 1 and ring_group is None and cu_seqlens is None and plain:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    q, k, v, scale, value_dim = one_head_dim(q, k, v, scale)
    settings = StageLoopSettings(is_causal, scale, heads_per_stage, world, group.group_name, prefetch, window_left,
                                 window_right, softcap, "" if ring_group is None else ring_group.group_name)
    out, _ = attention_op(*op_arguments(q, k, v, settings, cu_seqlens, sinks, alibi_slopes))
    return cut_to_value_dim(out, value_dim)
