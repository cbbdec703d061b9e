"""The refusal of an op that mixes tokens across the sharded sequence
(:mod:`upipe_compile.passes.token_mixing` finds them): the op, why it mixes, where, and the fix
to name (its own for transformers' KV cache)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from upipe_compile.passes.context import TOKEN_MIXING_OPS, RefusedOp
from upipe_compile.passes.graph_utils import source_module

SEQUENCE_FIX = ("upipe runs every op but attention on this rank's shard of the sequence; run this layer "
                "without context parallelism, or express it as scaled_dot_product_attention")

_CACHE_MODULE = "transformers.cache_utils"
CACHE_FIX = ("this is the cache transformers fills when use_cache is on, which would hold this rank's shard: "
             "build the model after calling upipe_compile.integrations.transformers.register(), or switch a model "
             "built before it with model.set_attn_implementation(register()) (either way it runs without a cache "
             "under context parallelism), or call it with use_cache=False")


@dataclass
class TokenMixing(RefusedOp):
    """One op that needs other ranks' tokens and that upipe did not rewrite."""

    refusal_kind = TOKEN_MIXING_OPS

    node: fx.Node
    op: str
    """The aten op that mixes (``aten.cumsum.default``, ...)."""
    why: str
    source_line: str
    reduction_line: str | None = None
    """Where the reduction over tokens was made, when that is what flows back."""

    @property
    def reason(self) -> str:
        where = f" (the reduction over tokens at {self.reduction_line})" if self.reduction_line else ""
        fix = CACHE_FIX if source_module(self.node) == _CACHE_MODULE else SEQUENCE_FIX
        return f"{self.op} {self.why}{where}; {fix}"
