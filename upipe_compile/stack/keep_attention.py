"""Keep attention through activation checkpointing: a ``context_fn`` for
``torch.utils.checkpoint`` whose selective-checkpointing policy saves upipe's attention ops'
outputs (``upipe::attention``, ``upipe::attention_block``: the output and what their backward
needs) and recomputes everything else, as full checkpointing does. The recompute in backward
then reruns each block but not its attention, at long context almost all of a block's work;
the cost is one attention output per block (x-sized with fused blocks) held until that
block's backward.

    torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=keep_attention)
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": keep_attention})

torchtitan: ``[upipe] keep_attention = true`` with ``[activation_checkpoint] mode = "full"``.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import upipe_compile.attention.ops  # noqa: F401  registers upipe::attention
import upipe_compile.block.ops  # noqa: F401  registers upipe::attention_block

KEPT_OPS = frozenset({torch.ops.upipe.attention.default, torch.ops.upipe.attention_block.default})
"""The ops whose outputs the forward keeps for backward instead of running them again."""


def _keep_upipe_attention(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def keep_attention():
    """The checkpoint ``context_fn`` (a fresh pair of contexts per checkpointed call)."""
    return create_selective_checkpoint_contexts(_keep_upipe_attention)
