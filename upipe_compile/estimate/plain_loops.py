"""The long-context stack's loops, run for real in the estimate.

The tiled MLP and the chunked loss are custom ops (``upipe::tiled_swiglu``,
``upipe::linear_cross_entropy``) around plain loop functions. Under FakeTensorMode an op runs
only its fake kernel, so its per-tile / per-chunk buffers would never be allocated. While
:func:`plain_stack_loops` is active, the modules call autograd Functions that run those same
loop functions instead, saving for backward exactly what the ops' ``setup_context`` saves.
(Attention's stage loops are routed by parallelize itself: measurement.py.)
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from upipe_compile import chunked_loss, tiled_mlp


class TiledSwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, w3, tile_tokens):
        ctx.save_for_backward(x, w1, w2, w3)  # as tiled_mlp._setup_context
        ctx.tile_tokens = tile_tokens
        return tiled_mlp.tiled_swiglu_forward(x, w1, w2, w3, tile_tokens)

    @staticmethod
    def backward(ctx, grad_out):
        return (*tiled_mlp.tiled_swiglu_backward(grad_out.contiguous(), *ctx.saved_tensors, ctx.tile_tokens), None)


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens, ignore_index):
        loss, lse = chunked_loss.linear_cross_entropy_forward(hidden, weight, labels, chunk_tokens, ignore_index)
        ctx.save_for_backward(hidden, weight, labels, lse)  # as chunked_loss._setup_context
        ctx.args = (chunk_tokens, ignore_index)
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    def backward(ctx, grad_loss, _grad_lse):
        grad_hidden, grad_weight = chunked_loss.linear_cross_entropy_backward(grad_loss, *ctx.saved_tensors, *ctx.args)
        return grad_hidden, grad_weight, None, None, None


@contextmanager
def plain_stack_loops():
    """The stack modules call the Functions above instead of their custom ops."""
    originals = (tiled_mlp.tiled_swiglu_op, chunked_loss.linear_cross_entropy_op)
    tiled_mlp.tiled_swiglu_op = TiledSwiGLUFunction.apply
    chunked_loss.linear_cross_entropy_op = LinearCrossEntropyFunction.apply
    try:
        yield
    finally:
        tiled_mlp.tiled_swiglu_op, chunked_loss.linear_cross_entropy_op = originals
