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

Packed sequences: both take ``documents`` (:class:`upipe_compile.attention.document_boundaries.Documents`,
the checked boundaries of the full sequence); attention then stays inside each document
(a window is relative, so it applies within each document unchanged).
One document over the whole sequence runs the dense kernel, exactly as without boundaries.
CPU runs the dense kernel once per document on slices of the stage buffers; CUDA runs the
kernels' variable-length ("varlen") forms on each batch row. No mask is ever built.

The kernel is picked by device: CPU uses aten's flash kernel for CPU, and for a window,
softcap or ALiBi the exact blocked kernel of :mod:`upipe_compile.attention.blocked_kernel`; CUDA
uses the first of :data:`CUDA_KERNELS` that is installed and runs on this GPU:
FlashAttention-3 (sm90, :class:`FlashAttn3Kernels`), FlashAttention-4 (sm90-sm110,
:class:`FlashAttn4Kernels`), cuDNN attention through torch (sm90-sm121, :class:`CudnnKernels`:
no window, softcap or ALiBi), flash-attn 2.5 to 2.8 (:class:`FlashAttnKernels`; softcap needs
2.6+; ALiBi through its ``alibi_slopes``), else aten's CUDA flash kernel (windows; no softcap,
no ALiBi). FA3/FA4 take windows and softcap, not ALiBi. No dropout, no mask: the
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
from upipe_compile.attention.kernels.cudnn import CudnnKernels
from upipe_compile.attention.kernels.flash_attn import FlashAttnKernels
from upipe_compile.attention.kernels.flash_attn3 import FlashAttn3Kernels
from upipe_compile.attention.kernels.flash_attn4 import FlashAttn4Kernels
from upipe_compile.attention.kernels.varlen import VarlenKernels
from upipe_compile.errors import UnsupportedAttention

__all__ = [
    "CUDA_KERNELS", "NO_WINDOW", "AtenCudaKernels", "AttentionKernel", "CpuKernels", "CudnnKernels",
    "FlashAttn3Kernels", "FlashAttn4Kernels", "FlashAttnKernels",
    "VarlenKernels", "backward", "check_variant", "cuda_kernel", "cuda_problems", "forward",
    "install_backward_workspace_hook", "kernels_for", "variant_problems", "variant_value_problems",
]

CUDA_KERNELS: dict[str, type] = {
    "flash-attn-3": FlashAttn3Kernels,  # Hopper's own kernel, compiled ahead (no JIT on first use)
    "flash-attn-4": FlashAttn4Kernels,  # the same algorithm in CuTe DSL; also Blackwell's
    "cudnn": CudnnKernels,  # in every CUDA torch, but no window/softcap/ALiBi and no varlen form
    "flash-attn": FlashAttnKernels,
    "aten-flash": AtenCudaKernels,  # always there: the last resort
}
"""The CUDA kernels by name, the preferred (fastest) first: :func:`cuda_kernel` runs the first
whose ``installed()`` says it is installed and usable on this GPU, and the memory model
(``--cuda-kernel``) can model any of them."""

# Not the first entry: the estimate models what most GPU nodes run, and FA3/FA4/cuDNN are
# picked only where installed on sm90+, while flash-attn 2 is the common install (and the
# workspace model checked on an H100 and an H200). Pick another with --cuda-kernel.
DEFAULT_CUDA_KERNEL = "flash-attn"
"""The kernel the estimates model by default."""


@functools.cache
def _installed(name: str) -> AttentionKernel | None:
    """``CUDA_KERNELS[name]`` where installed and usable here, and past its first-use check
    (:func:`_first_use_check`) if it has not been checked on a device yet; else None."""
    kernel = CUDA_KERNELS[name].installed()
    if kernel is not None and not kernel.checked_on_device and not _first_use_check(kernel):
        return None
    return kernel


@functools.cache
def _cuda_kernels() -> AttentionKernel:
    """The first of :data:`CUDA_KERNELS` that is installed and usable here (aten's always is)."""
    for name in CUDA_KERNELS:
        installed = _installed(name)
        if installed is not None:
            return installed
    raise UnsupportedAttention(f"no CUDA attention kernel is installed (known: {sorted(CUDA_KERNELS)})")


def cuda_kernel() -> AttentionKernel:
    """The CUDA kernel this machine prefers (a call it cannot run goes to the next, :func:`_cuda_candidates`)."""
    return _cuda_kernels()


def _cuda_candidates() -> list[AttentionKernel]:
    """The preferred kernel, then every installed one after it in :data:`CUDA_KERNELS` order:
    a call the faster kernel cannot run (cuDNN and a sliding window, FA3 and ALiBi) runs on the
    next that can, rather than being refused."""
    first = _cuda_kernels()
    names = list(CUDA_KERNELS)
    later = names[names.index(first.name) + 1:] if first.name in names else []
    return [first, *(k for k in map(_installed, later) if k is not None)]


def _first_that(problems_of) -> tuple[AttentionKernel | None, list[str]]:
    """The first candidate with no problems, or (None, the preferred kernel's problems)."""
    candidates = _cuda_candidates()
    for kernel in candidates:
        if not problems_of(kernel):
            return kernel, []
    return None, problems_of(candidates[0])


def _first_use_check(kernel: AttentionKernel) -> bool:
    """A kernel not yet checked on a device runs one small causal GQA forward and backward
    against float64 attention before its first use; a wrong output, log-sum-exp or gradient
    (an adapter that misreads its library) or any error drops it, with a warning, for the
    next kernel in line."""
    import warnings

    from torch.utils._python_dispatch import _disable_current_modes

    try:
        with _disable_current_modes(), torch.enable_grad():
            problem = _compare_with_float64(kernel)
    except Exception as error:  # noqa: BLE001 - any failure means: do not use it
        problem = f"{type(error).__name__}: {error}"
    if problem:
        warnings.warn(f"upipe: the {kernel.name} attention kernel failed its first-use check ({problem}); "
                      "using the next installed kernel", stacklevel=2)
    return not problem


def _compare_with_float64(kernel: AttentionKernel, device: str = "cuda") -> str:
    """What is wrong with ``kernel``'s causal GQA attention (4 query heads on 2 KV heads, 256
    tokens, head dim 128, bf16) against float64; empty when nothing is."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(1, heads, 256, 128, device=device, generator=gen, dtype=torch.bfloat16)
                     for heads in (4, 2, 2, 4))
    out, lse = kernel.forward(q, k, v, True, None)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, True, None)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    scores = (ref[0] @ ref[1].repeat_interleave(2, 1).transpose(-1, -2)) / 128 ** 0.5
    scores = scores.masked_fill(torch.ones(256, 256, dtype=torch.bool, device=device).triu(1), float("-inf"))
    ref_out = scores.softmax(-1) @ ref[2].repeat_interleave(2, 1)
    ref_out.backward(dout.double())
    checks = {"out": (out, ref_out), "lse": (lse, scores.logsumexp(-1)),
              **{name: (got, t.grad) for name, got, t in zip(("dq", "dk", "dv"), (dq, dk, dv), ref)}}
    for name, (got, want) in checks.items():
        want = want.detach()
        if tuple(got.shape) != tuple(want.shape):
            return f"{name} has shape {list(got.shape)}, expected {list(want.shape)}"
        error = (got.double() - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
        if not error < 0.05:  # bf16 gives ~1e-2 here; a misread layout gives O(1)
            return f"{name} is off by {error:.3g} of its largest value"
    return ""


_CPU = CpuKernels()


def cuda_problems(dtype: torch.dtype, head_dim: int) -> list[str]:
    """Why q of this dtype and head_dim cannot run on any of this machine's CUDA kernels (empty: one can)."""
    return _first_that(lambda kernel: kernel.input_problems(dtype, head_dim))[1]


def variant_problems(device_type: str, window=NO_WINDOW, softcap: float = 0.0, alibi: bool = False) -> list[str]:
    """Why the attention kernel for ``device_type`` cannot run this window / softcap (with
    ALiBi where ``alibi``) (empty: it can), bad values included. CPU runs every valid variant;
    CUDA asks the kernels installed (:func:`_cuda_candidates`): empty when one can."""
    problems = variant_value_problems(window, softcap)
    if problems:
        return problems
    window, softcap = check_variant(window, softcap)
    if device_type == "cuda":
        return _first_that(lambda kernel: kernel.variant_problems(window, softcap, alibi))[1]
    return []


def kernels_for(q: torch.Tensor, window=NO_WINDOW, softcap: float = 0.0, alibi: bool = False) -> AttentionKernel:
    """The kernel for ``q``'s device: on CUDA the first installed that takes q's dtype and head
    dim and this (checked) variant, refusing what none can."""
    if q.device.type == "cpu":
        return _CPU
    if q.device.type == "cuda":
        kernel, problems = _first_that(lambda k: k.input_problems(q.dtype, q.shape[-1])
                                       + k.variant_problems(window, softcap, alibi))
        if kernel is None:
            raise UnsupportedAttention("; ".join(problems))
        return kernel
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
    window, softcap = check_variant(window, softcap)
    is_causal, window = effective(is_causal, window, q.shape[2], k.shape[2])
    kernel = kernels_for(q, window, softcap, alibi_slopes is not None)
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

