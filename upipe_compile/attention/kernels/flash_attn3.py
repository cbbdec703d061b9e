"""FlashAttention-3 (the Hopper build of flash-attention, ``hopper/``): the fastest CUDA kernel
on sm90 when it is installed.

Install: there is no wheel on PyPI; it is built from the flash-attention repository's
``hopper/`` directory (``cd hopper && python setup.py install``, package ``flash_attn_3``:
the extension ``flash_attn_3._C`` and ``flash_attn_3.flash_attn_interface``; older builds
install a top-level ``flash_attn_interface``). The build needs nvcc >= 12.3, ninja and
packaging, and torch at the version it runs with; at run time it needs nothing but torch.
For a GPU machine without a package index, build the wheel elsewhere on the same torch and
CUDA (``python setup.py bdist_wheel``) and copy it over.

Signatures used (``hopper/flash_attn_interface.py``; both ``torch.library.custom_op``, so
their names come from the op schema):

- ``_flash_attn_forward(q, k, v, k_new=None, v_new=None, qv=None, out_=None,
  cu_seqlens_q=None, cu_seqlens_k=None, cu_seqlens_k_new=None, seqused_q=None,
  seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, page_table=None, ...,
  softmax_scale=None, causal=False, window_size_left=-1, window_size_right=-1,
  attention_chunk=0, softcap=0.0, ...) -> (out, softmax_lse, out_accum, softmax_lse_accum)``;
  ``softmax_lse`` is ``[B, H, S]`` float32, packed ``[H, total]`` with ``cu_seqlens_q``.
- ``_flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None,
  cu_seqlens_k=None, sequed_q=None, sequed_k=None, max_seqlen_q=None, max_seqlen_k=None,
  dq=None, dk=None, dv=None, softmax_scale=None, is_causal=False, window_size_left=-1,
  window_size_right=-1, softcap=0.0, deterministic=False, sm_margin=0) -> softmax_d``,
  writing dq/dk/dv in place (``mutates_args``).

Supported: causal, GQA (native), windows (-1 unbounded, as the contract), softcap, packed
documents (``cu_seqlens``, one varlen call per batch row), deterministic backward. Refused:
ALiBi (no such parameter). Sinks need no kernel support (applied from the log-sum-exp
above the kernel), so its ``learnable_sink``-free interface is enough.
"""

from __future__ import annotations

from upipe_compile.attention.kernels.hopper_family import HopperFlashKernels, hopper_backward_workspace


class FlashAttn3Kernels(HopperFlashKernels):
    """FlashAttention-3's private forward/backward pair, sm90 only (its kernels are built for
    Hopper; elsewhere the registry's next kernel runs)."""

    name = "flash-attn-3"
    package = "flash_attn_3 (flash-attention's hopper/ build)"
    forward_name, backward_name = "_flash_attn_forward", "_flash_attn_backward"

    arches = (9,)
    modules = ("flash_attn_3.flash_attn_interface", "flash_attn_interface")

    def _forward_values(self, q, k, v, is_causal, scale, window, softcap) -> dict:
        return {"q": q, "k": k, "v": v, "softmax_scale": scale, "causal": is_causal,
                "window_size_left": window[0], "window_size_right": window[1], "softcap": softcap}

    def _backward_values(self, dout, q, k, v, out, lse, dq, dk, dv, is_causal, scale, window, softcap,
                         deterministic) -> dict:
        return {"dout": dout, "q": q, "k": k, "v": v, "out": out, "softmax_lse": lse, "dq": dq, "dk": dk, "dv": dv,
                "softmax_scale": scale, "is_causal": is_causal, "window_size_left": window[0],
                "window_size_right": window[1], "softcap": softcap, "deterministic": deterministic}

    @staticmethod
    def backward_workspace(batch, q_heads, kv_heads, seq, head_dim, dtype, deterministic, sms, documents=None):
        """``mha_bwd``'s buffers (:func:`hopper_backward_workspace`); head dims round up to
        FA3's compiled ones (64, 96, 128, 192, 256)."""
        rounded = next(d for d in (64, 96, 128, 192, 256) if head_dim <= d) if head_dim <= 256 else head_dim
        return hopper_backward_workspace(batch, q_heads, kv_heads, seq, head_dim, deterministic, documents, rounded,
                                         always_semaphore=True)

