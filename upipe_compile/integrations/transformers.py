"""Hugging Face transformers models under backend="upipe".

With ``attn_implementation="sdpa"``, transformers 5.x materialises a boolean causal mask
under torch.compile even when no ``attention_mask`` is given (it cannot prove "no packed
sequences" from ``position_ids`` while tracing), so SDPA receives ``attn_mask=<local mask>``
and upipe refuses it — rightly: that mask covers the local shard only.

:func:`register` adds an attention implementation, ``"upipe_sdpa"``, through transformers'
own extension points:

- attention: the stock SDPA attention function, or, when the model is called with document
  boundaries ``cu_seq_lens_q`` (transformers' name for them, as
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` produces them for
  flash_attention_2), :func:`upipe_compile.document_sdpa` with those boundaries, which the
  upipe pass rewrites into UPipe. Boundaries are made once per step (:func:`packed_batch`
  makes them from the full sequence's position_ids), never per layer.
- without ``cu_seq_lens_q``, the per-layer ``position_ids`` (this rank's shard) stand for the
  boundaries: a document starts wherever a position is not the previous one + 1, read by
  the op from all ranks' positions once per step. Positions counting straight through are
  one causal sequence (the dense kernels, as plain SDPA); positions restarting per document
  (``DataCollatorWithFlattening`` without flash kwargs) never attend across documents.
- mask: None when there is no padding (SDPA then gets ``is_causal=True``,
  ``enable_gqa=True``, which upipe rewrites), including an all-ones ``attention_mask``
  (checked once per step, outside the compiled graph). A real padding mask goes to
  transformers' SDPA mask, so upipe refuses it at compile time instead of dropping it.

    from upipe_compile.integrations.transformers import register, packed_batch
    model = LlamaForCausalLM.from_pretrained(..., attn_implementation=register())
    logits = torch.compile(model, backend="upipe")(**packed_batch(ids, position_ids)).logits
"""

from __future__ import annotations

import torch

ATTN_IMPLEMENTATION = "upipe_sdpa"


@torch._dynamo.disable
def _is_all_ones(attention_mask: torch.Tensor) -> bool:
    """Outside the graph (a host read of the mask, once per step, where the mask is made):
    while tracing, transformers cannot tell an all-ones mask from padding."""
    return bool(attention_mask.all())


def _causal_sdpa_mask(*, attention_mask=None, **kwargs):
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None or (attention_mask.dim() == 2 and _is_all_ones(attention_mask)):
        return None  # one causal sequence per batch row (or packed documents): SDPA's is_causal=True
    return sdpa_mask(attention_mask=attention_mask, **kwargs)


def _upipe_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                             **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None and attention_mask is None and kwargs.get("position_ids") is not None:
        # Positions may restart per document (a packed row fed as flash_attention_2 users do):
        # the op reads the documents from the full sequence's positions, one all-gather per
        # step, and attends densely when they count straight through.
        cu_seqlens = kwargs["position_ids"]
        kwargs["cu_seq_lens_k"] = None
    if cu_seqlens is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    from upipe_compile.document_sdpa import document_sdpa
    from upipe_compile.errors import UnsupportedAttention

    cu_k = kwargs.get("cu_seq_lens_k")
    if attention_mask is not None or dropout != 0.0 or (cu_k is not None and cu_k is not cu_seqlens):
        raise UnsupportedAttention(
            "packed sequences (cu_seq_lens_q) under upipe_sdpa take no padding mask, no attention dropout and "
            "cu_seq_lens_k identical to cu_seq_lens_q (self-attention over one packed sequence)"
        )
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = document_sdpa(query, key, value, cu_seqlens, is_causal=causal, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register ``"upipe_sdpa"`` with transformers (idempotent) and return the name."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _upipe_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _causal_sdpa_mask)
    return ATTN_IMPLEMENTATION


def packed_batch(input_ids: torch.Tensor, position_ids: torch.Tensor, cp_mesh=None, **per_token) -> dict:
    """Model kwargs for this rank from one packed, padding-free row over the FULL sequence:
    ``input_ids`` and ``position_ids`` ``[1, S]`` (positions restarting at 0 per document,
    as ``DataCollatorWithFlattening`` makes them), plus any other ``[1, S]`` tensors
    (e.g. ``labels=``). Returns this rank's shards of each and the documents' boundaries
    ``cu_seq_lens_q``/``cu_seq_lens_k`` over the full sequence, derived once here.
    Call the model with ``model(**packed_batch(...))``."""
    from upipe_compile.documents import cu_seqlens_from_position_ids
    from upipe_compile.sharding import shard_sequence

    if input_ids.shape[0] != 1 or position_ids.shape != input_ids.shape:
        raise ValueError(
            f"packed_batch takes one packed row: input_ids and position_ids [1, S], got {tuple(input_ids.shape)} "
            f"and {tuple(position_ids.shape)}"
        )
    cu_seqlens = cu_seqlens_from_position_ids(position_ids).to(input_ids.device)
    kwargs = {name: shard_sequence(t, cp_mesh, dim=1) for name, t in
              dict(input_ids=input_ids, position_ids=position_ids, **per_token).items()}
    kwargs.update(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens)
    return kwargs
