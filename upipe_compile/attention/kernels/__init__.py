"""Attention kernels that return the log-sum-exp, behind one interface.

``forward(q, k, v, is_causal, scale, documents=None, window=(-1, -1), softcap=0.0) -> (out, lse)``
and ``backward(dout, q, k, v, out, lse, is_causal, scale, documents=None, window=(-1, -1),
softcap=0.0) -> (dq, dk, dv)`` with q ``[B, Hq, S, D]``, k/v ``[B, Hkv, S, D]`` where ``Hkv``
divides ``Hq`` and query head ``h`` uses KV head ``h // (Hq // Hkv)`` (SDPA's ``enable_gqa``
rule); ``lse`` is ``[B, Hq, S]`` float32; dk/dv come back with k/v's head count. Every
kernel here takes fewer KV heads natively, so K/V are never repeated.

Variants (flash-attn's conventions): ``window=(left, right)`` lets query ``i`` see keys
``j`` with ``i - left <= j <= i + right``, -1 leaving that side unbounded; with
``is_causal`` the right edge is also 0. Without ``documents`` q may be shorter or longer
than k (a ring's chunk pair): the window and causal edge are then aligned to the last query
and the last key, ``i + (Sk - Sq) - left <= j <= i + (Sk - Sq) + right``, as flash-attn does. ``softcap > 0`` turns the scaled scores ``s``
into ``softcap * tanh(s / softcap)`` before the softmax; 0 is off. ``alibi_slopes`` (None,
or float32 ``[Hq]``: the call's query heads' ALiBi slopes) adds ``-slope * |i + (Sk - Sq) - j|``
to each score after the softcap (:mod:`upipe_compile.attention.alibi`). Values are checked
here: :func:`variant_problems` (compile time) lists bad values and what the device's
kernel cannot run, and ``forward``/``backward`` raise ``UnsupportedAttention`` for the same
(:func:`check_variant` raises for bad values alone). A window that covers the whole
sequence is no window, and ``(-1, 0)`` is plain causal attention, so those run the dense
kernels.

Packed sequences: both take ``documents`` (:class:`upipe_compile.packed.documents.Documents`,
the checked boundaries of the full sequence); attention then stays inside each document
(a window is relative, so it applies within each document unchanged).
One document over the whole sequence runs the dense kernel, exactly as without boundaries.
CPU runs the dense kernel once per document on slices of the stage buffers; CUDA runs the
kernels' variable-length ("varlen") forms on each batch row. No mask is ever built.

The kernel is picked by device: CPU uses aten's flash kernel for CPU, and for a window,
softcap or ALiBi the exact blocked kernel of :mod:`upipe_compile.attention.blocked_kernel`; CUDA
uses flash-attn (2.5 to 2.8, :class:`FlashAttnKernels`; softcap needs 2.6+; ALiBi through its
``alibi_slopes``) when it is importable, else aten's CUDA flash kernel (windows; no softcap,
no ALiBi). No dropout, no mask: the
passes refuse those before a kernel is ever called.

Under FakeTensorMode (memory measurement) the CPU kernels run, which allocate less than
the CUDA ones; :func:`upipe_compile.measure.workspace.modelled_cuda_kernel` makes them also
allocate the CUDA kernel's workspace, so measured peaks are GPU peaks.

The contract every kernel meets is :class:`~upipe_compile.attention.kernels.contract.AttentionKernel`
(forward/backward with the LSE, the packed-documents pair, the variants and inputs it cannot
take, its backward workspace). A kernel is one module of this package; a CUDA kernel is
also named in :data:`CUDA_KERNELS`, in order of preference, and :func:`cuda_kernel` picks the
first one installed. The refusals (:func:`cuda_problems`, :func:`variant_problems`) and the
memory model ask the kernel, never its name.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from upipe_compile.attention.kernels.aten_cuda import AtenCudaKernels
from upipe_compile.attention.kernels.contract import (
    NO_WINDOW, AttentionKernel, check_variant, effective, variant_value_problems,
)
from upipe_compile.attention.kernels.cpu import CpuKernels
from upipe_compile.attention.kernels.flash_attn import FlashAttnKernels
from upipe_compile.attention.kernels.varlen import VarlenKernels
from upipe_compile.errors import UnsupportedAttention

__all__ = [
    "CUDA_KERNELS", "NO_WINDOW", "AtenCudaKernels", "AttentionKernel", "CpuKernels", "FlashAttnKernels",
    "VarlenKernels", "backward", "check_variant", "cuda_kernel", "cuda_problems", "forward",
    "install_backward_workspace_hook", "kernels_for", "variant_problems", "variant_value_problems",
]

CUDA_KERNELS: dict[str, type] = {"flash-attn": FlashAttnKernels, "aten-flash": AtenCudaKernels}
"""The CUDA kernels by name, the preferred first: :func:`cuda_kernel` runs the first one
installed, and the memory model (``--cuda-kernel``) can model any of them."""

DEFAULT_CUDA_KERNEL = next(iter(CUDA_KERNELS))
"""The kernel a GPU node runs once everything is installed: what the estimates model by default."""


@functools.cache
def _cuda_kernels() -> AttentionKernel:
    """The first of :data:`CUDA_KERNELS` that is installed (aten's always is)."""
    for kernel in CUDA_KERNELS.values():
        installed = kernel.installed()
        if installed is not None:
            return installed
    raise UnsupportedAttention(f"no CUDA attention kernel is installed (known: {sorted(CUDA_KERNELS)})")


def cuda_kernel() -> AttentionKernel:
    """The CUDA kernel this machine runs."""
    return _cuda_kernels()


_CPU = CpuKernels()


def cuda_problems(dtype: torch.dtype, head_dim: int) -> list[str]:
    """Why q of this dtype and head_dim cannot run on this machine's CUDA kernel (empty: it can)."""
    return _cuda_kernels().input_problems(dtype, head_dim)


def variant_problems(device_type: str, window=NO_WINDOW, softcap: float = 0.0, alibi: bool = False) -> list[str]:
    """Why the attention kernel for ``device_type`` cannot run this window / softcap (with
    ALiBi where ``alibi``) (empty: it can), bad values included. CPU runs every valid variant;
    CUDA asks the kernel it would use (:func:`cuda_kernel`)."""
    problems = variant_value_problems(window, softcap)
    if problems:
        return problems
    window, softcap = check_variant(window, softcap)
    if device_type == "cuda":
        return _cuda_kernels().variant_problems(window, softcap, alibi)
    return []


def kernels_for(q: torch.Tensor) -> AttentionKernel:
    """The kernel for ``q``'s device (refusing what the CUDA kernel cannot take)."""
    if q.device.type == "cpu":
        return _CPU
    if q.device.type == "cuda":
        problems = cuda_problems(q.dtype, q.shape[-1])
        if problems:
            raise UnsupportedAttention("; ".join(problems))
        return _cuda_kernels()
    raise UnsupportedAttention(f"no UPipe attention kernel for device type {q.device.type!r} (cpu and cuda are supported)")


def forward(q, k, v, is_causal: bool, scale: float | None, documents=None, window=NO_WINDOW, softcap: float = 0.0,
            alibi_slopes=None):
    """(out, lse); with ``documents`` (more than one) attention stays inside each."""
    kernel, is_causal, window, softcap = _prepared(q, k, is_causal, window, softcap, alibi_slopes)
    if documents is None or documents.is_single:
        return kernel.forward(q, k, v, is_causal, scale, window, softcap, alibi_slopes)
    return kernel.forward_documents(q, k, v, documents, is_causal, scale, window, softcap, alibi_slopes)


def backward(dout, q, k, v, out, lse, is_causal: bool, scale: float | None, documents=None, window=NO_WINDOW,
             softcap: float = 0.0, alibi_slopes=None):
    kernel, is_causal, window, softcap = _prepared(q, k, is_causal, window, softcap, alibi_slopes)
    packed = documents is not None and not documents.is_single
    with _backward_workspace(q, k, documents if packed else None):
        if not packed:
            return kernel.backward(dout, q, k, v, out, lse, is_causal, scale, window, softcap, alibi_slopes)
        return kernel.backward_documents(dout, q, k, v, out, lse, documents, is_causal, scale, window, softcap,
                                         alibi_slopes)


def _prepared(q, k, is_causal: bool, window, softcap, alibi_slopes=None):
    """The kernel for ``q`` and the checked variant in its plainest form (see :func:`_effective`),
    refusing what that kernel cannot run."""
    kernel = kernels_for(q)
    window, softcap = check_variant(window, softcap)
    is_causal, window = effective(is_causal, window, q.shape[2], k.shape[2])
    problems = kernel.variant_problems(window, softcap, alibi_slopes is not None)
    if problems:
        raise UnsupportedAttention("; ".join(problems))
    if alibi_slopes is not None and tuple(alibi_slopes.shape) != (q.shape[1],):
        raise UnsupportedAttention(f"alibi_slopes of shape {list(alibi_slopes.shape)} for a call of {q.shape[1]} "
                                   "query heads: one slope per query head")
    return kernel, is_causal, window, softcap


# A measurement (upipe_compile.measure.workspace.modelled_cuda_kernel) installs a hook that
# allocates a CUDA kernel's backward workspace around each backward on fake tensors; no hook,
# nothing happens. Installed from above, so the kernels import nothing of the measurement.
_workspace_hook = None


def install_backward_workspace_hook(hook):
    """Install ``hook(q, k, documents)`` (a context manager factory, or None); returns the previous one."""
    global _workspace_hook
    previous, _workspace_hook = _workspace_hook, hook
    return previous


def _backward_workspace(q, k, documents):
    return contextlib.nullcontext() if _workspace_hook is None else _workspace_hook(q, k, documents)

