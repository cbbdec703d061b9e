"""What a GPU run holds that fake CPU tensors do not: the reserve outside torch's allocator,
and the measured ratio between a device's peak and the estimate's while that gap is open.

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


CUBLAS_WORKSPACES_GIB = 4 * 32 / 1024
"""cuBLAS's and cuBLASLt's workspaces, 32 MiB each on Hopper (torch's default
``CUBLAS_WORKSPACE_CONFIG`` there), for the forward's thread and autograd's device thread (one
handle each): taken from the caching allocator, so counted by ``max_memory_allocated``."""

DEVICE_RATIO = 1.39
"""A CUDA step's peak over the estimate's, for what the step holds beyond its persistent state
(sharded parameters and gradients, optimizer state, model buffers: counted exactly). Measured
on one H200 (torch 2.11, one rank of the 8-GPU Llama3-8B job with 1 of its 32 layers): with
aten's flash kernel 1.16-1.34 at 256K-1M tokens (benchmarks/results/gpu/gpu_rank_h200.md); with
cuDNN, the kernel a Hopper GPU runs first, 1.20 and 1.38 for UPipe at 1M and 2M and 1.30-1.31
for Ulysses (benchmarks/results/gpu/gpu_rank_flagship_h200.md, cuDNN's workspace modelled as
measured). The largest, rounded up. docs/estimate.md, "On the device"."""


def device_peak_gib(peak_gib: float, persistent_gib: float, ratio: float = DEVICE_RATIO) -> float:
    """The device peak expected of a step whose estimated peak is ``peak_gib``, ``persistent_gib``
    of it the persistent state that the ratio does not scale."""
    return persistent_gib + ratio * (peak_gib - persistent_gib)
