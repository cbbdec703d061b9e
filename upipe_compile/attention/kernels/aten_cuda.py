"""aten's CUDA flash kernel: the CUDA kernel when flash-attn is not installed."""

from __future__ import annotations

import functools

import torch

from upipe_compile.attention.device_constants import made_once
from upipe_compile.attention.kernels.contract import NO_WINDOW, refuse_unrunnable_variant
from upipe_compile.attention.kernels.flash_family import flash_backward_workspace, flash_input_problems
from upipe_compile.attention.kernels.varlen import VarlenKernels

_aten = torch.ops.aten


class AtenCudaKernels(VarlenKernels):
    """aten's CUDA flash kernel, the fallback without flash-attn. Its forward takes the
    ``[B, H, S, D]`` views as they are (only ``stride(-1) == 1`` is needed) and fewer KV
    heads natively (flash's ``num_heads % num_heads_k == 0`` rule); its backward copies
    ``dout``/``out`` to the ``[B, S, H, D]`` layout itself, and honours
    ``torch.use_deterministic_algorithms``.

    Windows go through ``aten::_flash_attention_forward/_backward`` and their keyword
    ``window_size_left/right`` (in torch's schemas since before 2.7, so in 2.11 to 2.13;
    still checked on the installed schemas, never dropped), dense as torch's own SDPA calls
    them: ``[B, S, H, D]`` views, no cumulative lengths (None) and the forward's philox
    markers. aten's flash has no softcap: that needs flash-attn >= 2.6. Nor ALiBi: its forward
    takes ``alibi_slopes`` but ``aten::_flash_attention_backward`` does not, so the gradients
    would miss the bias; refused, naming flash-attn."""

    name = "aten-flash"
    checked_on_device = True  # by benchmarks/kernel_check.py on an H100 and an H200
    input_problems = staticmethod(flash_input_problems)

    @classmethod
    def installed(cls) -> "AtenCudaKernels":
        return cls()  # part of every CUDA build of torch

    @staticmethod
    def backward_workspace(batch, q_heads, kv_heads, seq, head_dim, dtype, deterministic, sms, documents=None):
        """flash's workspace plus the ``[B, S, H, D]`` copies aten's backward makes of
        ``dout`` and ``out`` (the stage buffers are ``[B, H, S, D]``; per row when packed).
        With one head the transposed view is already contiguous and nothing is copied
        (measured on an H100: benchmarks/results/gpu/gpu_check.md, section 2)."""
        workspace = flash_backward_workspace(batch, q_heads, kv_heads, seq, head_dim, dtype, deterministic, sms,
                                             documents)
        if q_heads == 1 or seq == 1:
            return workspace
        rows = 1 if documents is not None else batch
        workspace["dout_contiguous"] = ((rows, seq, q_heads, head_dim), dtype)
        workspace["out_contiguous"] = ((rows, seq, q_heads, head_dim), dtype)
        return workspace

    def variant_problems(self, window, softcap: float, alibi: bool = False) -> list[str]:
        problems = []
        if alibi:
            problems.append(
                "ALiBi (alibi_slopes): aten's CUDA flash kernel (used because flash-attn is not installed) cannot "
                "apply it in backward (aten::_flash_attention_backward takes no alibi_slopes); install flash-attn "
                "2.5 to 2.8 (pip install 'flash-attn>=2.5,<2.9')"
            )
        if softcap:
            problems.append(
                f"softcap={softcap}: aten's CUDA flash kernel (used because flash-attn is not installed) has no "
                "logit soft-capping; install flash-attn >= 2.6 (pip install 'flash-attn>=2.6')"
            )
        if window != NO_WINDOW and not _aten_flash_takes_window():
            problems.append(
                f"window={window}: this torch {torch.__version__}'s aten::_flash_attention_forward/_backward take no "
                "window_size_left/right (sliding window); install flash-attn >= 2.5 (pip install flash-attn)"
            )
        return problems

    def forward(self, q, k, v, is_causal: bool, scale: float | None, window=NO_WINDOW, softcap: float = 0.0,
                alibi_slopes=None):
        refuse_unrunnable_variant(self, window, softcap, alibi_slopes)
        if window == NO_WINDOW:
            out, lse, *_ = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
            return out, lse
        out, lse, *_ = _aten._flash_attention_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, q.shape[2], k.shape[2], 0.0,
            is_causal, False,
            scale=scale, **_aten_window(window),
        )
        return out.transpose(1, 2), lse

    def backward(self, dout, q, k, v, out, lse, is_causal: bool, scale: float | None, window=NO_WINDOW,
                 softcap: float = 0.0, alibi_slopes=None):
        refuse_unrunnable_variant(self, window, softcap, alibi_slopes)
        cum_q, cum_k, seed, offset = _aten_cuda_dense_markers(q.device, q.dtype)
        q_len, k_len = q.shape[2], k.shape[2]
        if window == NO_WINDOW:
            return _aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse, cum_q, cum_k, q_len, k_len, 0.0, is_causal, seed, offset, scale=scale
            )
        grads = _aten._flash_attention_backward(
            *(t.transpose(1, 2) for t in (dout, q, k, v, out)), lse, cum_q, cum_k, q_len, k_len, 0.0, is_causal,
            seed, offset, scale=scale, **_aten_window(window),
        )
        return tuple(g.transpose(1, 2) for g in grads)

    def _varlen_forward_row(self, q, k, v, documents, is_causal: bool, scale: float | None, window=NO_WINDOW,
                            softcap: float = 0.0, alibi_slopes=None):
        refuse_unrunnable_variant(self, window, softcap, alibi_slopes)
        cu, longest = documents.cu_seqlens, documents.max_length
        out, lse, *_ = _aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, is_causal, False,
                                                      scale=scale, **_aten_window(window))
        return out, lse

    def _varlen_backward_row(self, dout, q, k, v, out, lse, documents, is_causal: bool, scale: float | None,
                             window=NO_WINDOW, softcap: float = 0.0, alibi_slopes=None):
        refuse_unrunnable_variant(self, window, softcap, alibi_slopes)
        _, _, seed, offset = _aten_cuda_dense_markers(q.device, q.dtype)
        cu, longest = documents.cu_seqlens, documents.max_length
        return _aten._flash_attention_backward(
            dout, q, k, v, out, lse, cu, cu, longest, longest, 0.0, is_causal, seed, offset, scale=scale,
            **_aten_window(window),
        )


def _aten_window(window) -> dict:
    """The window keywords for aten's flash ops; none without a window, so a torch whose
    schema lacks them still runs dense attention."""
    return {} if window == NO_WINDOW else {"window_size_left": window[0], "window_size_right": window[1]}


@functools.cache
def _aten_flash_takes_window() -> bool:
    names = ("window_size_left", "window_size_right")
    return all(
        all(name in {arg.name for arg in op.default._schema.arguments} for name in names)
        for op in (_aten._flash_attention_forward, _aten._flash_attention_backward)
    )


def _aten_cuda_dense_markers(device: torch.device, dtype: torch.dtype):
    """The cumulative-length and philox tensors aten's flash forward returns for dense
    inputs without dropout; its backward wants them back, and they carry no per-call data.
    Made once per device and dtype."""

    def make():
        x = torch.zeros(1, 1, 1, 8, device=device, dtype=dtype)
        _, _, cum_q, cum_k, _, _, seed, offset, _ = _aten._scaled_dot_product_flash_attention(x, x, x, 0.0, False, False)
        return cum_q, cum_k, seed, offset

    return made_once(("aten flash dense markers", device, dtype), make)

