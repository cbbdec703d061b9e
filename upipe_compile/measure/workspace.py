"""The CUDA attention kernels' backward workspace, which fake-tensor runs of the CPU kernels
do not allocate: the buffers flash's (and aten's) backward makes besides dq/dk/dv, how the
varlen backward is split into calls so that its per-document padding stays within the dense
kernel's, and :func:`modelled_cuda_kernel`, under which kernels running on fake tensors also
allocate it, so measured peaks are GPU peaks. Checked against an H100
(benchmarks/results/gpu/gpu_check.md, section 2)."""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import is_fake

from upipe_compile.attention import kernels
from upipe_compile.attention.varlen_groups import H100_SMS, ceil_div, round_up, varlen_backward_groups

def flash_backward_workspace(batch: int, q_heads: int, kv_heads: int, seq: int, head_dim: int, dtype: torch.dtype,
                             deterministic: bool, sms: int = H100_SMS,
                             documents: int | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The buffers flash's dense backward (flash-attn 2.x ``mha_bwd``, also vendored by aten)
    allocates besides dq/dk/dv: ``name -> (shape, dtype)``. With ``documents`` (packed
    sequences, one varlen call per batch row) those of ``mha_varlen_bwd``, whose per-row
    buffers are padded by 128 rows per document instead of rounding the sequence up."""
    dim_rounded = round_up(head_dim, 32 if head_dim <= 128 else 64)
    if documents is None:
        lead, rows, work_units = (batch,), round_up(seq, 128), batch
    else:
        lead, rows, work_units = (), seq + 128 * documents, documents
    splits = ceil_div(sms, work_units * q_heads) if deterministic else 1
    workspace = {
        "softmax_d": ((*lead, q_heads, rows), torch.float32),
        "dq_accum": ((splits, *lead, rows, q_heads, dim_rounded), torch.float32),
    }
    if kv_heads != q_heads:  # GQA: per-query-head dK/dV, summed into the KV heads at the end
        workspace["dk_expanded"] = ((*lead, seq, q_heads, head_dim), dtype)
        workspace["dv_expanded"] = ((*lead, seq, q_heads, head_dim), dtype)
    return workspace


def aten_flash_backward_workspace(batch, q_heads, kv_heads, seq, head_dim, dtype, deterministic, sms=H100_SMS,
                                  documents=None):
    """aten's flash backward: flash's workspace plus the ``[B, S, H, D]`` copies it makes of
    ``dout`` and ``out`` (the stage buffers are ``[B, H, S, D]``; per row when packed). With
    one head the transposed view is already contiguous and nothing is copied (measured on an
    H100: benchmarks/results/gpu/gpu_check.md, section 2)."""
    workspace = flash_backward_workspace(batch, q_heads, kv_heads, seq, head_dim, dtype, deterministic, sms, documents)
    if q_heads == 1 or seq == 1:
        return workspace
    rows = 1 if documents is not None else batch
    workspace["dout_contiguous"] = ((rows, seq, q_heads, head_dim), dtype)
    workspace["out_contiguous"] = ((rows, seq, q_heads, head_dim), dtype)
    return workspace


CUDA_BACKWARD_WORKSPACE = {"flash-attn": flash_backward_workspace, "aten-flash": aten_flash_backward_workspace}
"""Per CUDA kernel, its backward's workspace. The forwards allocate only out and lse (their
split-KV accumulators are used only when batch x heads x query blocks leaves SMs idle,
never at long context), so they need no entry."""

_modelled_kernel: str | None = None


@contextlib.contextmanager
def modelled_cuda_kernel(name: str = "flash-attn") -> Iterator[None]:
    """While active, kernels running on fake tensors also allocate (and free after the call)
    the workspace of CUDA kernel ``name``, so that a MemTracker counts it."""
    global _modelled_kernel
    if name not in CUDA_BACKWARD_WORKSPACE:
        raise ValueError(f"unknown CUDA kernel {name!r}; one of {sorted(CUDA_BACKWARD_WORKSPACE)}")
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
    count = None
    if documents is not None:
        calls = [(documents.bounds[last] - documents.bounds[first], last - first)
                 for first, last in varlen_backward_groups(documents, q_heads, deterministic)]
        shape_of = lambda call: CUDA_BACKWARD_WORKSPACE[_modelled_kernel](  # noqa: E731
            batch, q_heads, k.shape[1], call[0], head_dim, q.dtype, deterministic, documents=call[1])
        seq, count = max(calls, key=lambda call: sum(math.prod(sh) * dt.itemsize for sh, dt in shape_of(call).values()))
    shapes = CUDA_BACKWARD_WORKSPACE[_modelled_kernel](
        batch, q_heads, k.shape[1], seq, head_dim, q.dtype, deterministic, documents=count,
    )
    workspace = [q.new_empty(shape, dtype=dtype) for shape, dtype in shapes.values()]
    try:
        yield
    finally:
        del workspace
