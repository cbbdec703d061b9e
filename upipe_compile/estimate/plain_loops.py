"""What the estimate runs in place of ops whose fake-CPU allocations are not a GPU's.

RMSNorm: on CPU, ``F.rms_norm`` decomposes into fp32 ops (an fp32 copy of the input, its
square, the scaled product: three activation-sized fp32 tensors, as many again in backward).
On the GPU the job runs it fused (torch's CUDA ``_fused_rms_norm`` kernel in eager, one
fused kernel under inductor): output and an fp32 ``rstd`` per row; backward, the input's
gradient. While :func:`fused_rms_norm` is active, fake-tensor RMSNorms allocate that.

RoPE (e.g. torchtitan's Llama3 ``apply_rotary_emb``): eager, it makes fp32 copies of q and
k, their complex products and the casts back (about five q-sized bf16 units beyond q); the
compiled block fuses it into one kernel that writes the rotated q and k (and in backward
their gradients): :class:`FusedRoPEFunction` allocates that. Which model's RoPE it stands in
for is the job source's to say (the torchtitan integration's ``release_022/estimate.fused_rope``,
handed to step.py's ``kernel_models``).

Embedding backward: on CPU ``embedding_dense_backward`` adds each token's gradient row into
the ``[V, D]`` weight gradient. CUDA's kernel (aten/src/ATen/native/cuda/EmbeddingBackwardKernel.cu,
torch 2.11 to 2.14) sorts the token ids and sums rows per id in two passes, through an fp32
buffer of ``n / 10 + min(n, V)`` rows of ``D`` (n tokens, ``NROWS_PER_THREAD`` = 10; sized
before it knows how many ids are distinct) beside the gradient, plus int64 index buffers.
Llama3-8B at 131,072 tokens per rank: 2.16 GiB; at 655,360: 2.96 GiB. While
:func:`cuda_embedding_backward` is active, fake-tensor embeddings' backward allocates that.

The long-context stack's loops:

The tiled MLP and the chunked loss are custom ops (``upipe::tiled_swiglu``,
``upipe::linear_cross_entropy``) around plain loop functions. Under FakeTensorMode an op runs
only its fake kernel, so its per-tile / per-chunk buffers would never be allocated. While
:func:`plain_stack_loops` is active, the modules call autograd Functions that run those same
loop functions instead, saving for backward exactly what the ops' ``setup_context`` saves.
(Attention's stage loops are routed by parallelize itself: measurement.py.)
"""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from upipe_compile.stack import chunked_loss, tiled_mlp


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


class FusedRMSNormFunction(torch.autograd.Function):
    """The allocations of a fused RMSNorm kernel, on fake tensors (no values are computed)."""

    @staticmethod
    def forward(ctx, x, normalized_dims: int, weight):
        rstd = x.new_empty((*x.shape[:-normalized_dims], *([1] * normalized_dims)), dtype=torch.float32)
        ctx.save_for_backward(x, weight, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, _ = ctx.saved_tensors
        return torch.empty_like(x), None, None if weight is None else torch.empty_like(weight)


@contextmanager
def fused_rms_norm():
    """Fake-tensor RMSNorms allocate what the fused GPU kernel does (see the module doc).
    ``F.rms_norm`` itself is swapped, not intercepted by a mode: torch function modes are not
    active where autograd runs activation checkpointing's recompute."""
    original = F.rms_norm

    def rms_norm(input, normalized_shape, weight=None, eps=None):
        if torch.compiler.is_compiling() or not is_fake(input):  # traced: the fusion pass reads the real op
            return original(input, normalized_shape, weight, eps)
        return FusedRMSNormFunction.apply(input, len(normalized_shape), weight)

    with mock.patch.object(F, "rms_norm", rms_norm):
        yield


class FusedRoPEFunction(torch.autograd.Function):
    """The allocations of a fused RoPE kernel, on fake tensors (no values are computed)."""

    @staticmethod
    def forward(ctx, xq, xk):
        return torch.empty_like(xq), torch.empty_like(xk)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        return torch.empty_like(grad_q), torch.empty_like(grad_k)


EMBEDDING_ROWS_PER_THREAD = 10
"""CUDA embedding backward's ``NROWS_PER_THREAD``: rows summed per partial segment."""


class CudaEmbeddingFunction(torch.autograd.Function):
    """``F.embedding`` whose backward allocates what CUDA's ``embedding_dense_backward`` does
    (see the module doc), on fake tensors."""

    @staticmethod
    def forward(ctx, weight, indices):
        ctx.save_for_backward(indices)
        ctx.weight_shape = weight.shape
        return torch.embedding(weight, indices)

    @staticmethod
    def backward(ctx, grad_out):
        (indices,) = ctx.saved_tensors
        vocab, dim = ctx.weight_shape
        n = indices.numel()
        segments = min(n, vocab)
        partials = n // EMBEDDING_ROWS_PER_THREAD + segments
        grad_weight = grad_out.new_zeros((vocab, dim))
        # sorted and original ids, segment offsets; partials per segment and their offsets;
        # partial segment offsets: int64 each
        index_buffers = indices.new_empty(3 * n + 2 * segments + partials, dtype=torch.int64)
        per_segment = grad_out.new_empty((partials, dim), dtype=torch.float32)
        del index_buffers, per_segment
        return grad_weight, None


@contextmanager
def cuda_embedding_backward():
    """Fake-tensor embeddings' backward allocates what CUDA's kernel does (module doc). Swapped
    like ``F.rms_norm`` above, for the same reason."""
    original = F.embedding

    def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
                  sparse=False):
        plain = padding_idx is None and max_norm is None and not scale_grad_by_freq and not sparse
        if torch.compiler.is_compiling() or not is_fake(weight) or not plain or not weight.requires_grad:
            return original(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
        return CudaEmbeddingFunction.apply(weight, input)

    with mock.patch.object(F, "embedding", embedding):
        yield
