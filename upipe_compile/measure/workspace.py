"""The CUDA attention kernels' backward workspace, which fake-tensor runs of the CPU kernels
do not allocate: :func:`modelled_cuda_kernel`, under which kernels running on fake tensors
also allocate the buffers a CUDA kernel's backward makes besides dq/dk/dv (each kernel's
``backward_workspace``; a packed row's varlen backward split into calls as the kernel splits
it), so measured peaks are GPU peaks. Checked against an H100 and an H200
(benchmarks/results/gpu/gpu_check.md, section 2)."""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import is_fake

from upipe_compile.attention import kernels
from upipe_compile.attention.varlen_groups import H100_SMS, varlen_backward_groups


_modelled_kernel: str | None = None


@contextlib.contextmanager
def modelled_cuda_kernel(name: str = kernels.DEFAULT_CUDA_KERNEL) -> Iterator[None]:
    """While active, kernels running on fake tensors also allocate (and free after the call)
    the workspace of CUDA kernel ``name`` (one of :data:`kernels.CUDA_KERNELS`), so that a
    MemTracker counts it."""
    global _modelled_kernel
    if name not in kernels.CUDA_KERNELS:
        raise ValueError(f"unknown CUDA kernel {name!r}; one of {sorted(kernels.CUDA_KERNELS)}")
    previous, _modelled_kernel = _modelled_kernel, name
    hook = kernels.install_backward_workspace_hook(modelled_backward_workspace)  # the kernels call it
    try:
        yield
    finally:
        _modelled_kernel = previous
        kernels.install_backward_workspace_hook(hook)


@contextlib.contextmanager
def modelled_backward_workspace(q, k, documents=None) -> Iterator[None]:
    """Packed: the workspace of the largest of the row's grouped varlen calls (they run one
    after another, see :func:`varlen_backward_groups`)."""
    if _modelled_kernel is None or not is_fake(q):
        yield
        return
    batch, q_heads, seq, head_dim = q.shape
    deterministic = torch.are_deterministic_algorithms_enabled()
    workspace_of = kernels.CUDA_KERNELS[_modelled_kernel].backward_workspace
    count = None
    if documents is not None:
        calls = [(documents.bounds[last] - documents.bounds[first], last - first)
                 for first, last in varlen_backward_groups(documents, q_heads, deterministic)]
        shape_of = lambda call: workspace_of(  # noqa: E731
            batch, q_heads, k.shape[1], call[0], head_dim, q.dtype, deterministic, H100_SMS, documents=call[1])
        seq, count = max(calls, key=lambda call: sum(math.prod(sh) * dt.itemsize for sh, dt in shape_of(call).values()))
    shapes = workspace_of(batch, q_heads, k.shape[1], seq, head_dim, q.dtype, deterministic, H100_SMS, documents=count)
    workspace = [q.new_empty(shape, dtype=dtype) for shape, dtype in shapes.values()]
    try:
        yield
    finally:
        del workspace
