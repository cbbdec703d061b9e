"""What a GPU run holds that fake CPU tensors do not: the reserve outside torch's allocator.

(The attention kernels' CUDA workspaces are allocated during the fake run itself, by
``upipe_compile.measure.workspace.modelled_cuda_kernel``, which the estimate switches on.)
"""

from __future__ import annotations

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
