"""A mixture-of-experts layer over token tiles, each tile recomputed on its own in backward.

Under full activation checkpointing a MoE layer's backward recomputes the whole layer at once:
every routed copy of every local token (top-k of them a token) through the dispatch, the
experts' grouped matmuls and the combine, and holds all of it while the gradients flow back.
At Qwen3-30B-A3B's 92,160 tokens a rank (737,280 over 8 ranks, top-8 of 128 experts) that is
34 GiB, the largest thing in the step.

Token-choice routing is per token: the router's scores, its top-k, the experts' SwiGLU and the
weighted sum of a token's copies depend on that token alone. So the layer run on consecutive
tiles of the sequence, its outputs joined, is the layer run on the whole sequence. Each tile
runs under its own non-reentrant checkpoint (nested inside the block's): forward keeps only
the tile's input, backward recomputes and differentiates one tile at a time, so the routed
copies of one tile exist at the peak instead of the whole shard's.

With expert parallelism each tile's dispatch and combine are all-to-alls over the EP ranks:
every rank has the same number of tokens and so the same tiles, and runs them in the same
order forward and backward, so the collectives pair up.

The layer's load-balancing counts (``tokens_per_expert``) are the untiled layer's: each token
counted in the forward and, where activation checkpointing recomputes the block, once more
(torchtitan's bias update halves them then). The forward adds its counts twice instead, and
when the backward ends the counts are set back to what the forwards left: the recomputes,
left alone, would count some tiles twice and some three times, as checkpoint's early stop can
end the block's recompute at any tile. The recomputes themselves run the forward's ops and no
others, as selective AC requires.
torchtitan's debug round-robin routing numbers a call's tokens from 0, so it routes a tile as
the whole shard only when ``tile tokens x top_k`` is a multiple of the expert count.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from upipe_compile.stack.tiled_mlp import check_tile_tokens


def _known_moe_forwards() -> tuple:
    """MoE classes whose forward routes each token by itself (token-choice top-k, no
    sequence-level auxiliary loss, no capacity that drops tokens): torchtitan 0.3's."""
    try:
        from torchtitan.models.common.moe import MoE
    except ImportError:
        return ()
    return (MoE.forward,)


def moe_tiling_problem(module: nn.Module) -> str | None:
    """Why ``module``'s tokens cannot be run in tiles, or None."""
    if type(module).forward not in _known_moe_forwards():
        return (f"{type(module).__name__} is not a known token-choice MoE layer (torchtitan 0.3's MoE, whose "
                "tokens are routed one by one)")
    return None


def _in_backward() -> bool:
    """Whether this runs inside the autograd engine: a recompute of activation checkpointing."""
    return torch._C._current_graph_task_id() != -1


def _restore_counts_when_backward_ends(module: nn.Module) -> None:
    """From inside a recompute: once this backward is done, set the layer's routing counts back
    to what its forwards left (the recomputes count again, some tiles twice, some not at all:
    checkpoint's early stop can end a recompute at any tile). Nothing is computed here: a
    recompute under selective AC must run exactly the forward's ops."""
    task = torch._C._current_graph_task_id()
    if module.upipe_counts_restored_in == task:
        return
    module.upipe_counts_restored_in = task

    def restore():
        with torch.no_grad():
            module.tokens_per_expert_E.copy_(module.upipe_counts_after_forward)

    torch.autograd.Variable._execution_engine.queue_callback(restore)


@functools.cache
def _tiled_class(base: type) -> type:
    """``base`` with a forward over token tiles (one subclass per base class, as FSDP2 makes its own)."""

    def one_tile(self, x: torch.Tensor) -> torch.Tensor:
        if _in_backward():  # the tile's own recompute
            _restore_counts_when_backward_ends(self)
        with torch.profiler.record_function("upipe::moe_tile"):  # each run of a tile, recomputes included
            return base.forward(self, x.contiguous())  # (a tile of a batch of rows is strided)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _in_backward():  # the block's recompute
            _restore_counts_when_backward_ends(self)
            return self._upipe_tiles(x)
        counts = self.tokens_per_expert_E
        before = counts.clone()
        recomputed = self.upipe_block_recomputed and torch.is_grad_enabled()  # (no recompute without autograd)
        out = self._upipe_tiles(x)
        with torch.no_grad():
            if recomputed:  # what the block's recompute counts again
                counts.add_(counts - before)
            self.upipe_counts_after_forward = counts.clone()
        return out

    def tiles(self, x: torch.Tensor) -> torch.Tensor:
        tile = max(1, self.upipe_tile_tokens // x.shape[0])  # positions of each row of the batch
        if x.shape[1] <= tile:
            return base.forward(self, x)
        return torch.cat([checkpoint(one_tile, self, part, use_reentrant=False) for part in x.split(tile, dim=1)],
                         dim=1)

    def __reduce_ex__(self, protocol):
        # pickle names an object's class; this one is made at run time, so the object is rebuilt
        # from its base class, which pickle can name, and its state as usual
        return (_new_tiled, (base,), *object.__reduce_ex__(self, protocol)[2:])

    return type(f"TokenTiled{base.__name__}", (base,),
                {"forward": forward, "_upipe_tiles": tiles, "__reduce_ex__": __reduce_ex__, "__module__": __name__})


def _new_tiled(base: type) -> nn.Module:
    """An empty ``base`` with the tiled forward, for pickle to fill in."""
    module = base.__new__(base)
    module.__class__ = _tiled_class(base)
    return module


def tile_moe_tokens(module: nn.Module, tile_tokens: int, *, block_recomputed: bool = False) -> None:
    """Run ``module`` (a MoE layer with input ``[batch, tokens, dim]``) over tiles of
    ``tile_tokens`` tokens, in place: the module keeps its class's methods, parameters, buffers
    and state-dict keys (its class becomes a subclass with a tiled forward).
    ``block_recomputed``: activation checkpointing recomputes the block around it (settable
    later, as ``upipe_block_recomputed``, once the block is wrapped)."""
    problem = moe_tiling_problem(module)
    if problem:
        raise ValueError(f"cannot tile this MoE layer: {problem}")
    module.upipe_tile_tokens = check_tile_tokens(tile_tokens)
    module.upipe_block_recomputed = block_recomputed
    module.upipe_counts_restored_in = None  # the backward (graph task) that will restore the counts
    module.__class__ = _tiled_class(type(module))
