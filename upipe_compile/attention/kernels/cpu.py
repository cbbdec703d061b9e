"""The CPU kernel: aten's flash kernel for CPU, and the exact blocked kernel for what it lacks
(a window, softcap, ALiBi)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from upipe_compile.attention import blocked_kernel
from upipe_compile.attention.kernels.contract import NO_WINDOW, effective
from upipe_compile.attention.kernels.per_document import PerDocumentKernels

_aten = torch.ops.aten


class CpuKernels(PerDocumentKernels):
    """aten's flash kernel for CPU (takes GQA natively); with a window, softcap or ALiBi, the exact
    blocked kernel of :mod:`upipe_compile.attention.blocked_kernel` instead. On fake tensors
    (memory measurement) variants also run aten's kernel: the outputs are the same, and
    the blocked kernel's per-block scores are no model of a fused GPU kernel."""

    name = "aten-cpu"
    checked_on_device = True  # the reference every test compares with

    def variant_problems(self, window, softcap: float, alibi: bool = False) -> list[str]:
        return []

    @staticmethod
    def _on_aten(q, window, softcap: float, alibi_slopes) -> bool:
        """Whether aten's kernel is exact here (no variant left), or only shapes matter (fake)."""
        return (window == NO_WINDOW and not softcap and alibi_slopes is None) or is_fake(q)

    def forward(self, q, k, v, is_causal: bool, scale: float | None, window=NO_WINDOW, softcap: float = 0.0,
                alibi_slopes=None):
        is_causal, window = effective(is_causal, window, q.shape[2], k.shape[2])
        if self._on_aten(q, window, softcap, alibi_slopes):
            return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
        return blocked_kernel.forward(q, k, v, is_causal, scale, window, softcap, alibi_slopes=alibi_slopes)

    def backward(self, dout, q, k, v, out, lse, is_causal: bool, scale: float | None, window=NO_WINDOW,
                 softcap: float = 0.0, alibi_slopes=None):
        is_causal, window = effective(is_causal, window, q.shape[2], k.shape[2])
        if self._on_aten(q, window, softcap, alibi_slopes):
            return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse, 0.0, is_causal, scale=scale
            )
        return blocked_kernel.backward(dout, q, k, v, out, lse, is_causal, scale, window, softcap,
                                       alibi_slopes=alibi_slopes)

    @staticmethod
    def input_problems(dtype: torch.dtype, head_dim: int) -> list[str]:
        return []

    @staticmethod
    def backward_workspace(batch, q_heads, kv_heads, seq, head_dim, dtype, deterministic, sms, documents=None):
        return {}  # the blocked kernel's per-block scores are no GPU's: not modelled
