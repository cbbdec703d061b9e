"""``document_sdpa``: scaled_dot_product_attention over packed documents and with the
attention variants SDPA lacks (sliding window, logit softcap, sinks, ALiBi), for models to call.

An SDPA call cannot carry document boundaries or these variants, so a model that needs them
calls :func:`document_sdpa` instead (the transformers integration does). On one process it
is exact attention within each document (the kernels of :mod:`upipe_compile.attention.kernels`, no
mask). Under ``backend="upipe"`` the graph pass finds its op, ``upipe::document_sdpa``,
like an SDPA call and rewrites it into the stage-loop op with the same boundaries,
variants and the backend's options. Called on a sequence shard without that rewrite it is refused: its
boundaries end at the full sequence length, not the shard's.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from upipe_compile.attention import kernels
from upipe_compile.attention.alibi import kernel_slopes
from upipe_compile.attention.document_boundaries import Documents, boundary_problems, bounds_from_positions
from upipe_compile.errors import UnsupportedAttention
from upipe_compile.options import normalised_variant
from upipe_compile.attention.checks import AttentionCall, attention_problems
from upipe_compile.attention.head_dims import cut_to_value_dim, one_head_dim
from upipe_compile.attention.sinks import apply_sinks, sink_gradient


def _local_documents(boundaries_or_positions: torch.Tensor, q: torch.Tensor) -> Documents:
    if boundaries_or_positions.dim() == 2:  # position_ids of the whole (unsharded) sequence
        positions = boundaries_or_positions
        if positions.shape[1] != q.shape[2]:
            raise UnsupportedAttention(
                f"document_sdpa: position_ids cover {positions.shape[1]} tokens, the attention {q.shape[2]}. On "
                "sequence shards (context parallelism) it must run under torch.compile(backend='upipe')")
        try:
            return Documents.from_bounds(bounds_from_positions(positions.long()), q.device)
        except ValueError as e:
            raise UnsupportedAttention(f"document_sdpa: {e}") from None
    cu_seqlens = boundaries_or_positions
    problems = boundary_problems(cu_seqlens, q.shape[2])
    if problems:
        raise UnsupportedAttention(
            "document_sdpa: " + "; ".join(problems) + ". On sequence shards (context parallelism) it must run "
            "under torch.compile(backend='upipe'), which hands the full-sequence boundaries to UPipe"
        )
    return Documents.read(cu_seqlens, q.device)


_read: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""boundaries (or positions) tensor -> ((its version counter, seq, device), Documents): every layer's forward
and backward of a step pass the same tensor, so it is read back (and copied) once, not per call."""


def _documents(boundaries_or_positions: Optional[torch.Tensor], q: torch.Tensor) -> Optional[Documents]:
    if boundaries_or_positions is None:
        return None
    if torch._guards.detect_fake_mode() is not None:  # nothing cached: a fake tensor must not outlive its mode
        return _local_documents(boundaries_or_positions, q)
    key = (boundaries_or_positions._version, q.shape[2], q.device)
    cached = _read.get(boundaries_or_positions)
    if cached is None or cached[0] != key:
        cached = _read[boundaries_or_positions] = (key, _local_documents(boundaries_or_positions, q))
    return cached[1]


@torch.library.custom_op("upipe::document_sdpa", mutates_args=())
def document_sdpa_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor], is_causal: bool,
    scale: Optional[float], window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None, alibi_slopes: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``. ``cu_seqlens`` is either the boundaries or, 2-D, the position ids
    (as :func:`document_sdpa` takes them); the schema keeps the public name."""
    out, lse = kernels.forward(q, k, v, is_causal, scale, _documents(cu_seqlens, q), window=(window_left, window_right),
                               softcap=softcap, alibi_slopes=kernel_slopes(alibi_slopes, q.device))
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
    return out.contiguous(), lse


@document_sdpa_op.register_fake
def _document_sdpa_fake(q, k, v, cu_seqlens, is_causal, scale, window_left=-1, window_right=-1, softcap=0.0,
                        sinks=None, alibi_slopes=None):
    batch, heads, seq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, seq), dtype=torch.float32)


@torch.library.custom_op("upipe::document_sdpa_backward", mutates_args=())
def document_sdpa_backward_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens: Optional[torch.Tensor], is_causal: bool, scale: Optional[float], window_left: int = -1,
    window_right: int = -1, softcap: float = 0.0, sinks: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dsinks)``; dsinks is empty without sinks (the ALiBi slopes take none)."""
    grads = kernels.backward(dout, q, k, v, out, lse, is_causal, scale, _documents(cu_seqlens, q),
                             window=(window_left, window_right), softcap=softcap,
                             alibi_slopes=kernel_slopes(alibi_slopes, q.device))
    dsinks = q.new_empty((0,)) if sinks is None else sink_gradient(dout, out, lse, sinks).to(sinks.dtype)
    return (*(g.contiguous() for g in grads), dsinks)


@document_sdpa_backward_op.register_fake
def _document_sdpa_backward_fake(dout, q, k, v, out, lse, cu_seqlens, is_causal, scale, window_left=-1,
                                 window_right=-1, softcap=0.0, sinks=None, alibi_slopes=None):
    dsinks = q.new_empty((0,)) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, is_causal, scale, window_left, window_right, softcap, sinks, alibi_slopes = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens, sinks, alibi_slopes)
    ctx.options = (is_causal, scale, window_left, window_right, softcap)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens, sinks, alibi_slopes = ctx.saved_tensors
    dq, dk, dv, dsinks = document_sdpa_backward_op(dout.contiguous(), q, k, v, out, lse, cu_seqlens, *ctx.options,
                                                   sinks, alibi_slopes)
    # the ALiBi slopes take no gradient (attention/alibi.py)
    return dq, dk, dv, None, None, None, None, None, None, None if sinks is None else dsinks, None


document_sdpa_op.register_autograd(_backward, setup_context=_setup_context)


def document_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None, *,
    is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
    window: Optional[tuple[int, int]] = None, softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=..., scale=..., enable_gqa=...)``
    with what SDPA cannot say: packed documents and the attention variants.

    ``cu_seqlens``: the documents' cumulative lengths ``[0, len_0, ..., S]`` over the *full*
    sequence (int32/int64); or, 2-D, the ``position_ids [B, S_local]`` of this call's tokens,
    a document starting wherever a position is not the previous one + 1 (under upipe,
    gathered from every rank once per step, so each rank passes its own shard); None: one
    sequence. ``window=(left, right)``, ``softcap``, ``sinks`` and ``alibi_slopes`` as in
    :func:`upipe_compile.upipe_attention` (positions are global; a window never crosses a
    document, and ALiBi's positions count within each document).
    q ``[B, Hq, S, D]``, k/v ``[B, Hkv, S, D]``; every batch row has the same documents."""
    window_left, window_right, softcap = normalised_variant(window, softcap)
    # Under torch.compile the upipe pass validates shapes (with P) from the graph instead.
    call = AttentionCall.of(q, k, v, enable_gqa=enable_gqa, window=(window_left, window_right), softcap=softcap,
                            sinks=sinks, alibi_slopes=alibi_slopes)
    problems = [] if torch.compiler.is_compiling() else attention_problems(call, 1, q.shape[1])
    if problems:
        raise UnsupportedAttention("document_sdpa: " + "; ".join(problems))
    q, k, v, scale, value_dim = one_head_dim(q, k, v, scale)
    out, _ = document_sdpa_op(q, k, v, cu_seqlens, is_causal, scale, window_left, window_right, softcap, sinks,
                              alibi_slopes)
    return cut_to_value_dim(out, value_dim)
