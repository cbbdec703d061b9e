"""The attention function and mask function :func:`upipe_compile.integrations.transformers.register`
installs in transformers (what its module docstring describes), apart from the registration so
that the families' own attention layers (transformers_own_attention.py) can call them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from upipe_compile.errors import display_path
from upipe_compile.integrations.transformers_kwargs import IGNORED_KWARGS

ATTN_IMPLEMENTATION = "upipe"


@torch._dynamo.disable
def _is_all_ones(attention_mask: torch.Tensor) -> bool:
    """Outside the graph (a host read of the mask, once per step, where the mask is made):
    while tracing, transformers cannot tell an all-ones mask from padding."""
    return bool(attention_mask.all())


@dataclass(frozen=True)
class SlidingWindowMask:
    """What the mask function returns for a sliding-window layer without padding: no tensor
    (a mask over the local shard would be wrong), just the window, so that a layer which
    relies on its mask alone (and passes no ``sliding_window=``) still gets it."""

    size: int


@dataclass(frozen=True)
class ChunkedMask:
    """What the mask function returns for a chunked-attention layer (Llama 4's
    ``attention_chunk_size``) without padding: causal attention inside fixed chunks of the
    global positions, which the attention function runs as packed documents."""

    size: int


class NoMask:
    """No mask, for a model that converts the mask it is given itself (MPT's
    ``create_causal_mask(...).to(torch.bool)``): its ``.to`` keeps it what it is."""

    def to(self, *args, **kwargs) -> "NoMask":
        return self


def _causal_sdpa_mask(*, attention_mask=None, local_size=None, config=None, **kwargs):
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None or (attention_mask.dim() == 2 and _is_all_ones(attention_mask)):
        # one causal sequence per batch row (or packed documents): SDPA's is_causal=True
        if local_size is None:
            return NoMask() if getattr(config, "model_type", None) == "mpt" else None
        return (ChunkedMask(int(local_size)) if _is_chunk_size(config, local_size)
                else SlidingWindowMask(int(local_size)))
    return sdpa_mask(attention_mask=attention_mask, local_size=local_size, config=config, **kwargs)


def _is_chunk_size(config, local_size) -> bool:
    """transformers hands a chunked layer's chunk size and a sliding layer's window to the mask
    function under one name (``local_size``): tell them apart by the config."""
    chunk, window = getattr(config, "attention_chunk_size", None), getattr(config, "sliding_window", None)
    if chunk is None or int(local_size) != chunk:
        return False
    if window is not None and int(window) == chunk:
        from upipe_compile.errors import UnsupportedAttention

        raise UnsupportedAttention(
            f"config.attention_chunk_size and config.sliding_window are both {chunk}: upipe cannot tell a chunked "
            "layer's mask from a sliding-window layer's. Make them differ")
    return True


def _where(module) -> str:
    """The model's attention forward, ``file:line (Class.forward)``, for messages."""
    import inspect

    cls = type(module)
    forward = getattr(cls.forward, "__wrapped_original__", cls.forward)  # the model's, where upipe replaced it
    try:
        return f"{display_path(inspect.getsourcefile(cls))}:{forward.__code__.co_firstlineno} ({cls.__name__}.forward)"
    except (TypeError, AttributeError):
        return cls.__name__


def _upipe_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                             sliding_window=None, softcap=None, s_aux=None, position_ids=None, cu_seq_lens_q=None,
                             cu_seq_lens_k=None, alibi_slopes=None, **kwargs):
    """transformers' attention function for register()'s models. ``alibi_slopes`` ([Hq], one
    per head) is upipe's own keyword, for the families whose ALiBi layers it routes here."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from upipe_compile.packed.document_sdpa import document_sdpa
    from upipe_compile.errors import UnsupportedAttention

    unknown = sorted(set(kwargs) - IGNORED_KWARGS)
    if unknown:
        raise UnsupportedAttention(
            f"{_where(module)} passes {unknown} to the attention function; upipe does not know what they change "
            "and refuses rather than drop them. It understands sliding_window, softcap, s_aux (sinks), "
            "position_ids, cu_seq_lens_q/k, scaling, dropout=0 and is_causal: train this model without context "
            "parallelism, or without the feature behind those keywords"
        )
    if isinstance(attention_mask, NoMask):
        attention_mask = None
    if isinstance(attention_mask, ChunkedMask):
        # causal attention inside chunks of the global positions: packed documents whose
        # boundaries are the chunk starts (and each document's start, where positions restart)
        if position_ids is None or cu_seq_lens_q is not None:
            raise UnsupportedAttention(
                f"{_where(module)} runs chunked attention (chunks of {attention_mask.size} tokens); upipe takes "
                "its chunks from position_ids (global positions, restarting per packed document) and needs "
                "them without cu_seq_lens_q: call the model with position_ids only")
        position_ids, attention_mask = position_ids % attention_mask.size, None
    if isinstance(attention_mask, SlidingWindowMask):
        if sliding_window is not None and sliding_window != attention_mask.size:
            raise UnsupportedAttention(
                f"{_where(module)} passes sliding_window={sliding_window} but its mask was made for a window of "
                f"{attention_mask.size}; upipe cannot tell which the model means: make config.sliding_window and "
                "the layer's window agree"
            )
        sliding_window, attention_mask = attention_mask.size, None
    variant = sliding_window is not None or softcap is not None or s_aux is not None or alibi_slopes is not None
    cu_seqlens = cu_seq_lens_q
    if cu_seqlens is None and attention_mask is None and position_ids is not None:
        # Positions may restart per document (a packed row fed as flash_attention_2 users do):
        # the op reads the documents from the full sequence's positions, one all-gather per
        # step, and attends densely when they count straight through.
        cu_seqlens, cu_seq_lens_k = position_ids, None
    if cu_seqlens is None and not variant:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal)
    if attention_mask is not None or dropout != 0.0 or (cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seqlens):
        raise UnsupportedAttention(
            "upipe attention with packed sequences or attention variants (sliding window, softcap, sinks) takes no "
            "padding mask, no attention dropout and cu_seq_lens_k identical to cu_seq_lens_q (self-attention over "
            "one packed sequence)"
        )
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    # transformers' window counts the query itself: sliding_window=w sees keys (i - w, i].
    window = None if sliding_window is None else (sliding_window - 1, sliding_window - 1)
    out = document_sdpa(query, key, value, cu_seqlens, is_causal=causal, scale=scaling, enable_gqa=True,
                        window=window, softcap=softcap, sinks=s_aux, alibi_slopes=alibi_slopes)
    return out.transpose(1, 2).contiguous(), None


def _context_parallel() -> bool:
    """Whether this forward is being compiled for more than one context-parallel rank (the
    backend's default group is the world: what register()'s models run under)."""
    return (torch.compiler.is_compiling() and dist.is_available() and dist.is_initialized()
            and dist.get_world_size() > 1)
