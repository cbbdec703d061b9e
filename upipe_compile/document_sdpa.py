"""``document_sdpa``: scaled_dot_product_attention over packed documents, for models to call.

An SDPA call cannot carry document boundaries, so a model that packs documents calls
:func:`document_sdpa` instead (the transformers integration does). On one process it is
exact attention within each document (the kernels of :mod:`upipe_compile.kernels`, no
mask). Under ``backend="upipe"`` the graph pass finds its op, ``upipe::document_sdpa``,
like an SDPA call and rewrites it into the stage-loop op with the same boundaries and the
backend's options. Called on a sequence shard without that rewrite it is refused: its
boundaries end at the full sequence length, not the shard's.
"""

from __future__ import annotations

from typing import Optional

import torch

from upipe_compile import kernels
from upipe_compile.documents import Documents, boundary_problems, bounds_from_positions
from upipe_compile.errors import UnsupportedAttention
from upipe_compile.schedule import shape_problems


def _local_documents(cu_seqlens: torch.Tensor, q: torch.Tensor) -> Documents:
    if cu_seqlens.dim() == 2:  # position_ids of the whole (unsharded) sequence
        if cu_seqlens.shape[1] != q.shape[2]:
            raise UnsupportedAttention(
                f"document_sdpa: position_ids cover {cu_seqlens.shape[1]} tokens, the attention {q.shape[2]}. On "
                "sequence shards (context parallelism) it must run under torch.compile(backend='upipe')")
        try:
            return Documents.from_bounds(bounds_from_positions(cu_seqlens.long()), q.device)
        except ValueError as e:
            raise UnsupportedAttention(f"document_sdpa: {e}") from None
    problems = boundary_problems(cu_seqlens, q.shape[2])
    if problems:
        raise UnsupportedAttention(
            "document_sdpa: " + "; ".join(problems) + ". On sequence shards (context parallelism) it must run "
            "under torch.compile(backend='upipe'), which hands the full-sequence boundaries to UPipe"
        )
    return Documents.from_bounds(cu_seqlens.tolist(), q.device)


@torch.library.custom_op("upipe::document_sdpa", mutates_args=())
def document_sdpa_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, is_causal: bool,
    scale: Optional[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = kernels.forward(q, k, v, is_causal, scale, _local_documents(cu_seqlens, q))
    return out.contiguous(), lse


@document_sdpa_op.register_fake
def _document_sdpa_fake(q, k, v, cu_seqlens, is_causal, scale):
    batch, heads, seq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, seq), dtype=torch.float32)


@torch.library.custom_op("upipe::document_sdpa_backward", mutates_args=())
def document_sdpa_backward_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens: torch.Tensor, is_causal: bool, scale: Optional[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = kernels.backward(dout, q, k, v, out, lse, is_causal, scale, _local_documents(cu_seqlens, q))
    return tuple(g.contiguous() for g in grads)


@document_sdpa_backward_op.register_fake
def _document_sdpa_backward_fake(dout, q, k, v, out, lse, cu_seqlens, is_causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, is_causal, scale = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens)
    ctx.is_causal, ctx.scale = is_causal, scale


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = document_sdpa_backward_op(dout.contiguous(), q, k, v, out, lse, cu_seqlens, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None, None


document_sdpa_op.register_autograd(_backward, setup_context=_setup_context)


def document_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
    is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=..., scale=..., enable_gqa=...)``
    within each document of a packed sequence: ``cu_seqlens`` ``[0, len_0, ..., S]`` are
    the documents' cumulative lengths over the *full* sequence (int32/int64); or, 2-D, the
    ``position_ids [B, S_local]`` of this call's tokens, a document starting wherever a
    position is not the previous one + 1 (under upipe, gathered from every rank once per
    step, so each rank passes its own shard).
    q ``[B, Hq, S, D]``, k/v ``[B, Hkv, S, D]``; every batch row has the same documents."""
    # Under torch.compile the upipe pass validates shapes (with P) from the graph instead.
    problems = [] if torch.compiler.is_compiling() else shape_problems(q.shape, k.shape, v.shape, enable_gqa, 1, q.shape[1])
    if problems:
        raise UnsupportedAttention("document_sdpa: " + "; ".join(problems))
    out, _ = document_sdpa_op(q, k, v, cu_seqlens, is_causal, scale)
    return out
