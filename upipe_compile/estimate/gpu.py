"""What a GPU run holds that fake CPU tensors do not: kernel workspaces, and a reserve.

``gpu_kernel_workspace`` is the one place the estimate switches on the GPU workspace model
of the attention kernels. Until ``upipe_compile.kernels`` models its CUDA workspaces under
fake mode itself, this stub does it: while active, each backward kernel call on fake
tensors also allocates (and frees when it returns) what the CUDA path allocates and the CPU
kernel does not, so the memory tracker counts it at the right moment:

- flash-attn's fp32 dq accumulator ``[B, S_round, Hq, D]`` (S rounded up to 128) and
  ``softmax_d`` ``[B, Hq, S_round]`` fp32;
- dK/dV expanded to the query heads ``[B, S, Hq, D]`` each, when Hkv < Hq;
- kernels.py's contiguous ``[B, S, H, D]`` copies of q, k, v, out and dout for flash-attn.

When the kernels.py workspace model lands, replace the body with switching that on.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import is_fake

from upipe_compile import kernels

GIB = 1 << 30

RESERVE_FIXED_GIB = 2.5
"""Outside torch's allocator on every rank: the CUDA context (~0.5 GiB on H100), NCCL's
communicator buffers for an 8-rank node (~1 GiB with default channels), cuBLAS/cuDNN
workspaces and the flash-attn/NCCL streams' scratch (~1 GiB)."""

RESERVE_FRACTION = 0.05
"""Caching-allocator fragmentation, as a fraction of the peak tensor memory: block rounding
and segments that cannot be reused for tensors of other sizes (PYTORCH_CUDA_ALLOC_CONF
expandable_segments:True keeps it near this)."""


def budget_gib(gpu_gib: float) -> float:
    """The largest estimated peak that fits a GPU of ``gpu_gib``: the peak plus its
    fragmentation share plus the fixed reserve must not exceed the GPU."""
    return (gpu_gib - RESERVE_FIXED_GIB) / (1 + RESERVE_FRACTION)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def backward_workspace_shapes(dout, q, k, v, out) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Tensors flash-attn's backward path (kernels._flash_attn_backward) allocates beyond its
    outputs dq, dk, dv, for q ``[B, Hq, S, D]`` and k, v ``[B, Hkv, S, D]``."""
    batch, q_heads, seq, dim = q.shape
    kv_heads = k.shape[1]
    seq_round = _round_up(seq, 128)
    shapes = [((batch, seq_round, q_heads, dim), torch.float32), ((batch, q_heads, seq_round), torch.float32)]
    if kv_heads < q_heads:
        shapes += [((batch, seq, q_heads, dim), q.dtype)] * 2
    shapes += [((batch, seq, t.shape[1], dim), t.dtype) for t in (q, k, v, out, dout)]
    return shapes


@contextmanager
def gpu_kernel_workspace():
    """Count the CUDA attention kernels' workspaces in fake-tensor runs (see module doc)."""
    original = kernels.backward

    def backward_with_workspace(dout, q, k, v, out, lse, is_causal, scale):
        if not is_fake(q):
            return original(dout, q, k, v, out, lse, is_causal, scale)
        workspace = [q.new_empty(shape, dtype=dtype) for shape, dtype in backward_workspace_shapes(dout, q, k, v, out)]
        grads = original(dout, q, k, v, out, lse, is_causal, scale)
        del workspace
        return grads

    kernels.backward = backward_with_workspace
    try:
        yield
    finally:
        kernels.backward = original
