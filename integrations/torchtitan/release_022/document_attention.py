"""torchtitan 0.2.2 document masking (the ``varlen`` attention flavors) through UPipe.

torchtitan's document masking: flavors with ``attn_type = "varlen"`` (e.g.
``debugmodel_varlen_attn``, ``8B_varlen``) compute ``VarlenMetadata`` once per step from the
full batch's EOS tokens (``model.get_attention_masks``) and hand it to every layer, whose
``VarlenAttentionWrapper`` calls ``torch.nn.attention.varlen.varlen_attn``. Stock 0.2.2
refuses varlen with context parallelism (in ``update_from_config`` and in ``cp_shard``,
which shards only BlockMasks). Under UPipe the same boundaries serve every rank as they are:
they describe the full sequence, which each rank holds for its heads after the all-to-all.

- :class:`DocumentAttention` replaces ``VarlenAttentionWrapper`` in each layer: it calls
  :func:`upipe_compile.document_sdpa` with ``cu_seq_q``; the upipe pass rewrites it into
  UPipe inside the compiled blocks (CP = 1: exact attention per document on one process).
- The Trainer's ``prepare_context_parallel_input``, routed by
  :mod:`upipe_compile.integrations.torchtitan.cp_layout`, shards inputs and labels and passes
  the metadata on unsharded (stock ``cp_shard`` cannot take it: it asserts BlockMask).
- :func:`varlen_model_args` lets the varlen flavors through ``update_from_config`` with CP.

One packed row per rank batch (``local_batch_size = 1``): torchtitan's metadata flattens the
batch into one sequence, and UPipe takes one set of boundaries for every row.
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from upipe_compile.packed.document_sdpa import document_sdpa
from upipe_compile.errors import UnsupportedAttention


class DocumentAttention(nn.Module):
    """Drop-in for torchtitan's ``VarlenAttentionWrapper`` (same call, same output layout)."""

    def forward(self, xq, xk, xv, attention_masks, scale=None):
        # (bs, heads, seqlen, head_dim) in; varlen's output is read as (bs, seqlen, heads * head_dim)
        if xq.shape[0] != 1:
            raise UnsupportedAttention(
                f"torchtitan varlen attention under upipe takes one packed row per batch (local_batch_size = 1), "
                f"got {xq.shape[0]}: its document boundaries cover the batch flattened into one sequence"
            )
        out = document_sdpa(xq, xk, xv, attention_masks.cu_seq_q, is_causal=True, scale=scale,
                            enable_gqa=xq.shape[1] != xk.shape[1])
        return out.transpose(1, 2).contiguous()


def use_document_attention(model: nn.Module) -> int:
    """Swap every ``VarlenAttentionWrapper`` in ``model`` for :class:`DocumentAttention`;
    returns how many (0 for SDPA flavors)."""
    from torchtitan.models.attention import VarlenAttentionWrapper

    swapped = 0
    for module in model.modules():
        if isinstance(getattr(module, "inner_attention", None), VarlenAttentionWrapper):
            module.inner_attention = DocumentAttention()
            swapped += 1
    return swapped


def varlen_model_args(args):
    """``args`` whose ``update_from_config`` accepts varlen with CP when upipe is enabled
    (torchtitan refuses it because its own ring attention cannot take varlen)."""
    if getattr(args, "attn_type", None) != "varlen":
        return args
    base = type(args)

    class UPipeVarlenArgs(base):
        def update_from_config(self, job_config, **kwargs):
            from upipe_compile.integrations.torchtitan.compile_blocks import upipe_enabled

            parallelism = job_config.parallelism
            cp = parallelism.context_parallel_degree
            if upipe_enabled(job_config):
                parallelism.context_parallel_degree = 1  # only for torchtitan's varlen-with-CP refusal
            try:
                base.update_from_config(self, job_config, **kwargs)
            finally:
                parallelism.context_parallel_degree = cp

    UPipeVarlenArgs.__name__ = UPipeVarlenArgs.__qualname__ = f"UPipeVarlen{base.__name__}"
    return UPipeVarlenArgs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)})
