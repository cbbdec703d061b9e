"""FlashAttention-4 (PyPI ``flash-attn-4``, module ``flash_attn.cute``; CuTe DSL kernels
compiled just in time): the CUDA kernel on Blackwell, and on Hopper when FlashAttention-3 is
not installed.

Install: ``pip install flash-attn-4`` (pure Python wheel, 4.0.0b36 read here). Its
dependencies, all wheels on PyPI: ``nvidia-cutlass-dsl>=4.6.2`` (which pulls
``nvidia-cutlass-dsl-libs-base`` and ``nvidia-cutlass-dsl-libs-cu12``; ``-cu13`` with the
``cu13`` extra), ``quack-kernels>=0.5.3``, ``apache-tvm-ffi>=0.1.11,<0.2``,
``torch-c-dlpack-ext``, ``einops``, ``typing_extensions``. For a GPU machine with no package
index: ``pip download flash-attn-4 -d wheels/`` on a machine with one and the same Python,
then ``pip install --no-index --find-links wheels/ flash-attn-4``. No CUDA toolkit is needed
(the DSL ships its compiler); each new shape compiles once (seconds) on first use.

Signatures used (``flash_attn/cute/interface.py``, plain Python functions):

- ``_flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
  seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, ..., softmax_scale=None,
  causal=False, softcap=None, window_size_left=None, window_size_right=None,
  learnable_sink=None, ..., return_lse=False, ...) -> (out, lse, ...)`` (4 values in earlier
  betas, 5 in 4.0.0b36); ``lse`` is ``[B, H, S]`` float32, packed ``[H, total]`` with
  ``cu_seqlens_q``. A window edge is None when unbounded.
- ``_flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False,
  softcap=0.0, window_size_left=None, window_size_right=None, ..., cu_seqlens_q=None,
  cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
  deterministic=False, dq=None, dk=None, dv=None, ..., learnable_sink=None) -> (dq, dk, dv)``.

Supported: causal, GQA (native), windows, softcap, packed documents (``cu_seqlens``),
deterministic backward. Refused: ALiBi (no such parameter; a ``score_mod`` could express it,
not done here). Its ``learnable_sink`` is not used: the stage loop applies sinks from the
log-sum-exp for every kernel alike. Its backward needs sm90+ (``assert arch // 10 in [9, 10,
11, 12]``); sm120's backward has no deterministic mode, so this adapter takes sm90 to sm110.
"""

from __future__ import annotations

from upipe_compile.attention.kernels.hopper_family import HopperFlashKernels, hopper_backward_workspace
from upipe_compile.attention.varlen_groups import round_up

_ARCHES = (9, 10, 11)


def _edge(edge: int):
    return None if edge < 0 else edge  # FA4 spells an unbounded edge None


class FlashAttn4Kernels(HopperFlashKernels):
    """FlashAttention-4's private ``_flash_attn_fwd`` / ``_flash_attn_bwd``."""

    name = "flash-attn-4"
    package = "flash-attn-4"
    forward_name, backward_name = "_flash_attn_fwd", "_flash_attn_bwd"

    arches = _ARCHES
    modules = ("flash_attn.cute.interface",)

    def _forward_values(self, q, k, v, is_causal, scale, window, softcap) -> dict:
        return {"q": q, "k": k, "v": v, "softmax_scale": scale, "causal": is_causal, "softcap": softcap or None,
                "window_size_left": _edge(window[0]), "window_size_right": _edge(window[1]), "return_lse": True}

    def _backward_values(self, dout, q, k, v, out, lse, dq, dk, dv, is_causal, scale, window, softcap,
                         deterministic) -> dict:
        return {"q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": lse, "dq": dq, "dk": dk, "dv": dv,
                "softmax_scale": scale, "causal": is_causal, "softcap": softcap,
                "window_size_left": _edge(window[0]), "window_size_right": _edge(window[1]),
                "deterministic": deterministic}

    @staticmethod
    def backward_workspace(batch, q_heads, kv_heads, seq, head_dim, dtype, deterministic, sms, documents=None):
        """``_flash_attn_bwd``'s buffers on Hopper (:func:`hopper_backward_workspace`); head
        dims round up to 32 (64 above 128, where its sm90 tiles swap dK/dV's MMA)."""
        rounded = round_up(head_dim, 64 if head_dim > 128 else 32)
        return hopper_backward_workspace(batch, q_heads, kv_heads, seq, head_dim, deterministic, documents, rounded,
                                         always_semaphore=False)
