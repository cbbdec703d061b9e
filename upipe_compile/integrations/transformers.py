"""Hugging Face transformers models under backend="upipe".

With ``attn_implementation="sdpa"``, transformers 5.x materialises a boolean causal mask
under torch.compile even when no ``attention_mask`` is given (it cannot prove "no packed
sequences" from ``position_ids`` while tracing), so SDPA receives ``attn_mask=<local mask>``
and upipe refuses it — rightly: that mask covers the local shard only.

:func:`register` adds an attention implementation, ``"upipe_sdpa"``, through transformers'
own extension points: the stock SDPA attention function, with a mask function that returns
None when there is no padding mask (SDPA then gets ``is_causal=True``, ``enable_gqa=True``,
which upipe rewrites). With a padding mask it defers to transformers' SDPA mask, so the model
still gets the mask and upipe refuses it at compile time instead of silently dropping it.

    from upipe_compile.integrations.transformers import register
    model = LlamaForCausalLM.from_pretrained(..., attn_implementation=register())
"""

from __future__ import annotations

ATTN_IMPLEMENTATION = "upipe_sdpa"


def _causal_sdpa_mask(*, attention_mask=None, **kwargs):
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None:
        return None  # one causal sequence per batch row: SDPA's is_causal=True
    return sdpa_mask(attention_mask=attention_mask, **kwargs)


def register() -> str:
    """Register ``"upipe_sdpa"`` with transformers (idempotent) and return the name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(ATTN_IMPLEMENTATION, sdpa_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _causal_sdpa_mask)
    return ATTN_IMPLEMENTATION
