"""Stand-ins for ``flash_attn.flash_attn_interface`` of each signature family, on CPU.

Each module has ``_flash_attn_forward`` / ``_flash_attn_backward`` and their variable-length
forms ``_flash_attn_varlen_forward`` / ``_flash_attn_varlen_backward`` with the parameters of
the released interface files (2.5.9, 2.6.3, 2.7.4 / 2.8.3) and their return forms; the
varlen log-sum-exp is padded per document ``[n, H, max_seqlen]`` in 2.5 and packed
``[H, total]`` from 2.6 on, as the released kernels allocate it. The window is
``window_size=(left, right)`` in 2.5/2.6 and ``window_size_left/right`` from 2.7 on;
``softcap`` exists from 2.6 on (2.5 has no such parameter). The bodies compute with
aten's CPU flash kernels on the ``[B, S, H, D]`` layout, or with the exact blocked kernel
(:mod:`upipe_compile.attention.blocked_kernel`) when a window or softcap is requested, with
flash's semantics (``causal`` also makes the window's right edge 0), and check what the
real kernels check: last-dimension-contiguous inputs, preallocated contiguous dq/dk/dv of
the right shapes, head_dim a multiple of 8, no dropout, int window edges >= -1, softcap
>= 0. Each module records the keyword values it was called with in ``calls``.

``alibi_slopes`` (every release: float32 ``[H]`` or ``[B, H]``) is applied as flash applies
it: ``-slope * |i + Sk - Sq - j|``, except where flash's ``params.is_causal`` holds (after its
clamps, no left edge and a right edge 0), where flash adds ``slope * j``: the same softmax, a
log-sum-exp larger by ``slope * (i + Sk - Sq)``, which the stand-ins return (and take back
in backward) as flash does, so an adapter that lets flash run that form is caught.
"""

from __future__ import annotations

import types
from typing import Optional

import torch

from upipe_compile.attention import blocked_kernel

_aten = torch.ops.aten


def _check(*tensors):
    for t in tensors:
        assert t.stride(-1) == 1, f"flash needs a contiguous last dimension, got strides {t.stride()}"
    assert tensors[0].shape[-1] % 8 == 0, f"head_dim {tensors[0].shape[-1]} is not a multiple of 8"


def _check_variant(window, softcap):
    left, right = window
    assert all(isinstance(edge, int) and edge >= -1 for edge in (left, right)), f"bad window {window}"
    assert isinstance(softcap, float) and softcap >= 0.0, f"bad softcap {softcap!r}"
    return (left, right) != (-1, -1) or softcap > 0.0


def _check_alibi(alibi_slopes, q):
    """Flash's checks of ``alibi_slopes``: float32 ``[H]`` or ``[B, H]``, last dim contiguous, on q's device."""
    if alibi_slopes is None:
        return
    batch, _, heads, _ = q.shape
    assert alibi_slopes.dtype == torch.float32, f"ALiBi slopes must be float32, got {alibi_slopes.dtype}"
    assert alibi_slopes.stride(-1) == 1 and alibi_slopes.device == q.device
    assert tuple(alibi_slopes.shape) in ((heads,), (batch, heads)), f"alibi_slopes {tuple(alibi_slopes.shape)}"


def _col_form_shift(alibi_slopes, causal, window, q_len, k_len, clamp_k):
    """``[B or 1, H, Sq]``: how much flash's log-sum-exp exceeds the true one (``slope * (i + Sk -
    Sq)`` where flash runs ALiBi in its causal form, see the module doc), or None (zero).
    ``clamp_k``: the key length flash clamps the window edges at (max_seqlen_k when varlen)."""
    if alibi_slopes is None:
        return None
    left, right = window
    if left >= clamp_k:
        left = -1
    if right >= clamp_k:
        right = -1
    if causal:
        right = 0
    if not (left < 0 and right == 0):
        return None
    slopes = alibi_slopes if alibi_slopes.dim() == 2 else alibi_slopes.unsqueeze(0)
    rows = torch.arange(q_len, dtype=torch.float32) + (k_len - q_len)
    return slopes[:, :, None] * rows


def _blocked_rows(fn, alibi_slopes, *args, **kwargs):
    """``fn`` (a blocked kernel) with ``[H]`` slopes, per batch row where they are ``[B, H]``."""
    if alibi_slopes is None or alibi_slopes.dim() == 1:
        return fn(*args, alibi_slopes=alibi_slopes, **kwargs)
    rows = [fn(*(a[b:b + 1] if isinstance(a, torch.Tensor) else a for a in args), alibi_slopes=alibi_slopes[b],
               **kwargs) for b in range(alibi_slopes.shape[0])]
    return tuple(torch.cat(parts) for parts in zip(*rows))


def _forward(q, k, v, dropout_p, softmax_scale, causal, window=(-1, -1), softcap=0.0, alibi_slopes=None,
             clamp_k=None):
    """q/k/v ``[B, S, H, D]`` -> out ``[B, S, H, D]`` (contiguous, as flash returns it), lse ``[B, H, S]``."""
    _check(q, k, v)
    _check_alibi(alibi_slopes, q)
    assert dropout_p == 0.0
    args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    if _check_variant(window, softcap) or alibi_slopes is not None:
        out, lse = _blocked_rows(blocked_kernel.forward, alibi_slopes, *args, causal, softmax_scale, window, softcap,
                                 block_rows=16)
        shift = _col_form_shift(alibi_slopes, causal, window, q.shape[1], k.shape[1], clamp_k or k.shape[1])
        if shift is not None:
            lse = lse + shift
    else:
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(*args, 0.0, causal, scale=softmax_scale)[:2]
    return out.transpose(1, 2).contiguous(), lse


def _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window=(-1, -1),
              softcap=0.0, alibi_slopes=None, clamp_k=None):
    _check(dout, q, k, v, out)
    _check_alibi(alibi_slopes, q)
    for grad, like in ((dq, q), (dk, k), (dv, v)):
        assert grad.is_contiguous() and grad.shape == like.shape, "dq/dk/dv must be preallocated like q/k/v"
    assert dropout_p == 0.0
    shift = _col_form_shift(alibi_slopes, causal, window, q.shape[1], k.shape[1], clamp_k or k.shape[1])
    args = (dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2),
            softmax_lse if shift is None else softmax_lse - shift)
    if _check_variant(window, softcap) or alibi_slopes is not None:
        grads = _blocked_rows(blocked_kernel.backward, alibi_slopes, *args, causal, softmax_scale, window, softcap,
                              block_rows=16)
    else:
        grads = _aten._scaled_dot_product_flash_attention_for_cpu_backward(*args, 0.0, causal, scale=softmax_scale)
    for dest, grad in zip((dq, dk, dv), grads):
        dest.copy_(grad.transpose(1, 2))
    batch, seq, heads, _ = q.shape
    return q.new_empty((batch, heads, -(-seq // 128) * 128), dtype=torch.float32)  # softmax_d


def _check_varlen(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    assert q.dim() == 3, f"varlen takes [total, H, D], got {tuple(q.shape)}"
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.device == q.device
    assert cu_seqlens_k is cu_seqlens_q or torch.equal(cu_seqlens_k, cu_seqlens_q)
    spans = list(zip(cu_seqlens_q.tolist()[:-1], cu_seqlens_q.tolist()[1:]))
    assert cu_seqlens_q[-1] == q.shape[0] and isinstance(max_seqlen_q, int) and max_seqlen_q == max_seqlen_k
    assert max_seqlen_q == max(b - a for a, b in spans)
    return spans


def _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                    causal, padded_lse: bool, window=(-1, -1), softcap=0.0, alibi_slopes=None):
    """Per document through ``_forward``: out ``[total, H, D]``, lse packed or padded."""
    spans = _check_varlen(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out = torch.empty_like(q)
    heads = q.shape[1]
    lse = (q.new_full((len(spans), heads, max_seqlen_q), float("nan"), dtype=torch.float32) if padded_lse
           else q.new_empty((heads, q.shape[0]), dtype=torch.float32))
    for i, (a, b) in enumerate(spans):
        out_doc, lse_doc = _forward(*(x[a:b].unsqueeze(0) for x in (q, k, v)), dropout_p, softmax_scale, causal,
                                    window, softcap, alibi_slopes, clamp_k=max_seqlen_k)
        out[a:b] = out_doc[0]
        if padded_lse:
            lse[i, :, : b - a] = lse_doc[0]
        else:
            lse[:, a:b] = lse_doc[0]
    return out, lse


def _varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, dropout_p, softmax_scale, causal, padded_lse: bool, window=(-1, -1), softcap=0.0,
                     alibi_slopes=None):
    spans = _check_varlen(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    heads = q.shape[1]
    expected = (len(spans), heads, max_seqlen_q) if padded_lse else (heads, q.shape[0])
    assert tuple(softmax_lse.shape) == expected, f"lse {tuple(softmax_lse.shape)}, this release wants {expected}"
    for i, (a, b) in enumerate(spans):
        lse_doc = softmax_lse[i, :, : b - a] if padded_lse else softmax_lse[:, a:b]
        grads = [x.new_empty((1, b - a, *x.shape[1:])) for x in (q, k, v)]
        _backward(*(x[a:b].unsqueeze(0) for x in (dout, q, k, v, out)), lse_doc.unsqueeze(0).contiguous(), *grads,
                  dropout_p, softmax_scale, causal, window, softcap, alibi_slopes, clamp_k=max_seqlen_k)
        for dest, grad in zip((dq, dk, dv), grads):
            dest[a:b] = grad[0]
    return q.new_empty((heads, q.shape[0] + 128 * len(spans)), dtype=torch.float32)  # softmax_d


def interface_2_5():
    """2.5.9: ``window_size`` a tuple, no ``softcap`` parameter at all."""
    calls = []

    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
        calls.append(dict(window_size=window_size, causal=causal, alibi_slopes=alibi_slopes,
                          return_softmax=return_softmax))
        assert not return_softmax
        out, lse = _forward(q, k, v, dropout_p, softmax_scale, causal, tuple(window_size), alibi_slopes=alibi_slopes)
        return out, q, k, v, out, lse, None, None

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size, alibi_slopes, deterministic, rng_state=None):
        calls.append(dict(window_size=window_size, causal=causal, alibi_slopes=alibi_slopes,
                          deterministic=deterministic, rng_state=rng_state))
        softmax_d = _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                              tuple(window_size), alibi_slopes=alibi_slopes)
        return dq, dk, dv, softmax_d

    def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                   softmax_scale, causal, window_size, alibi_slopes, return_softmax, block_table):
        calls.append(dict(varlen=True, window_size=window_size, causal=causal, alibi_slopes=alibi_slopes,
                          block_table=block_table))
        assert not return_softmax and block_table is None
        out, lse = _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                   softmax_scale, causal, padded_lse=True, window=tuple(window_size),
                                   alibi_slopes=alibi_slopes)
        return out, q, k, v, out, lse, None, None

    def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                    alibi_slopes, deterministic, rng_state=None):
        calls.append(dict(varlen=True, window_size=window_size, causal=causal, alibi_slopes=alibi_slopes,
                          deterministic=deterministic))
        softmax_d = _varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                     max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, padded_lse=True,
                                     window=tuple(window_size), alibi_slopes=alibi_slopes)
        return dq, dk, dv, softmax_d

    return _module("2.5.9", calls, _flash_attn_forward, _flash_attn_backward,
                   _flash_attn_varlen_forward, _flash_attn_varlen_backward)


def interface_2_6():
    """2.6.3: ``window_size`` a tuple, then ``softcap``."""
    calls = []

    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                            return_softmax):
        calls.append(dict(window_size=window_size, causal=causal, softcap=softcap, alibi_slopes=alibi_slopes,
                          return_softmax=return_softmax))
        assert not return_softmax
        out, lse = _forward(q, k, v, dropout_p, softmax_scale, causal, tuple(window_size), softcap, alibi_slopes)
        return out, q, k, v, out, lse, None, None

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size, softcap, alibi_slopes, deterministic, rng_state=None):
        calls.append(dict(window_size=window_size, causal=causal, softcap=softcap, alibi_slopes=alibi_slopes,
                          deterministic=deterministic))
        softmax_d = _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                              tuple(window_size), softcap, alibi_slopes)
        return dq, dk, dv, softmax_d

    def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                   softmax_scale, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                   return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None):
        calls.append(dict(varlen=True, window_size=window_size, causal=causal, softcap=softcap,
                          alibi_slopes=alibi_slopes))
        assert not return_softmax
        assert block_table is None and leftpad_k is None and seqused_k is None
        out, lse = _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                   softmax_scale, causal, padded_lse=False, window=tuple(window_size), softcap=softcap,
                                   alibi_slopes=alibi_slopes)
        return out, q, k, v, out, lse, None, None

    def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                    softcap, alibi_slopes, deterministic, rng_state=None):
        calls.append(dict(varlen=True, window_size=window_size, causal=causal, softcap=softcap,
                          alibi_slopes=alibi_slopes, deterministic=deterministic))
        softmax_d = _varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                     max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, padded_lse=False,
                                     window=tuple(window_size), softcap=softcap, alibi_slopes=alibi_slopes)
        return dq, dk, dv, softmax_d

    return _module("2.6.3", calls, _flash_attn_forward, _flash_attn_backward,
                   _flash_attn_varlen_forward, _flash_attn_varlen_backward)


_CALLS_2_7: list = []


@torch.library.custom_op("upipe_test_flash_2_7::_flash_attn_forward", mutates_args=())
def _flash_attn_forward_2_7(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float, causal: bool,
    window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
    return_softmax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _CALLS_2_7.append(dict(window_size_left=window_size_left, window_size_right=window_size_right, causal=causal,
                           softcap=softcap, alibi_slopes=alibi_slopes))
    out, lse = _forward(q, k, v, dropout_p, softmax_scale, causal, (window_size_left, window_size_right), softcap,
                        alibi_slopes)
    return out, lse, q.new_empty(0), torch.zeros(2, dtype=torch.int64)


@torch.library.custom_op("upipe_test_flash_2_7::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
def _flash_attn_backward_2_7(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor], dv: Optional[torch.Tensor],
    dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
    softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool, rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    _CALLS_2_7.append(dict(window_size_left=window_size_left, window_size_right=window_size_right, causal=causal,
                           softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                           rng_state=rng_state))
    return _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                     (window_size_left, window_size_right), softcap, alibi_slopes)


@torch.library.custom_op("upipe_test_flash_2_7::_flash_attn_varlen_forward", mutates_args=())
def _flash_attn_varlen_forward_2_7(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
    window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None, return_softmax: bool = False,
    block_table: Optional[torch.Tensor] = None, leftpad_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None, zero_tensors: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _CALLS_2_7.append(dict(varlen=True, window_size_left=window_size_left, window_size_right=window_size_right,
                           causal=causal, softcap=softcap, alibi_slopes=alibi_slopes, zero_tensors=zero_tensors))
    assert block_table is None and leftpad_k is None and seqused_k is None and not zero_tensors
    out, lse = _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, padded_lse=False, window=(window_size_left, window_size_right),
                               softcap=softcap, alibi_slopes=alibi_slopes)
    return out, lse, q.new_empty(0), torch.zeros(2, dtype=torch.int64)


@torch.library.custom_op("upipe_test_flash_2_7::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"))
def _flash_attn_varlen_backward_2_7(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor], dv: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
    dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
    softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool,
    rng_state: Optional[torch.Tensor] = None, zero_tensors: bool = False,
) -> torch.Tensor:
    _CALLS_2_7.append(dict(varlen=True, window_size_left=window_size_left, window_size_right=window_size_right,
                           causal=causal, softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic))
    return _varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, dropout_p, softmax_scale, causal, padded_lse=False,
                            window=(window_size_left, window_size_right), softcap=softcap, alibi_slopes=alibi_slopes)


def interface_2_7():
    """2.7 and 2.8 share this form: both functions are ``torch.library.custom_op`` objects
    taking ``window_size_left``, ``window_size_right``, ``softcap``."""
    _CALLS_2_7.clear()
    return _module("2.8.3", _CALLS_2_7, _flash_attn_forward_2_7, _flash_attn_backward_2_7,
                   _flash_attn_varlen_forward_2_7, _flash_attn_varlen_backward_2_7)


FAMILIES = {"2.5": interface_2_5, "2.6": interface_2_6, "2.7/2.8": interface_2_7}


def _module(version, calls, forward, backward, varlen_forward, varlen_backward):
    module = types.ModuleType(f"flash_attn_interface_standin_{version}")
    module._flash_attn_varlen_forward = varlen_forward
    module._flash_attn_varlen_backward = varlen_backward
    module.__version__ = version
    module.calls = calls
    module._flash_attn_forward = forward
    module._flash_attn_backward = backward
    return module


# --- Hopper kernels: cuDNN through aten, FlashAttention-3, FlashAttention-4 ------------------
#
# Each stand-in has its library's real signature (torch 2.13's aten schemas; flash-attention's
# hopper/flash_attn_interface.py; flash-attn-4 4.0.0b36's flash_attn/cute/interface.py),
# returns the real layouts, checks what the real kernels check, and computes with the
# helpers above (flash's semantics: a window aligned at the last query and key).

import contextlib  # noqa: E402


@contextlib.contextmanager
def cudnn_aten_standin():
    """CPU kernels for ``aten::_scaled_dot_product_cudnn_attention`` and its backward,
    registered on the real ops for the duration (so the dispatcher checks the arguments
    against torch's own schemas). Causal is top-left aligned, as cuDNN's dense path is; a
    single key is refused, as ``check_cudnn_tensor_shapes`` does. Yields the list of calls."""
    calls = []

    def check(q, k, v):
        assert q.dim() == k.dim() == v.dim() == 4, "cuDNN SDPA takes [B, H, S, D]"
        assert all(t.stride(-1) == 1 for t in (q, k, v)), "cuDNN needs a contiguous last dimension"
        assert q.shape[-1] % 8 == 0, f"head_dim {q.shape[-1]} is not a multiple of 8"
        assert q.shape[1] % k.shape[1] == 0 and k.shape[1] == v.shape[1]
        if k.shape[2] == 1:
            raise RuntimeError("cudnn SDPA does not support key/value sequence length 1.")

    def forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                return_debug_mask=False, *, scale=None):
        calls.append(dict(op="forward", is_causal=is_causal, scale=scale, attn_bias=attn_bias))
        check(query, key, value)
        assert attn_bias is None and dropout_p == 0.0 and compute_log_sumexp and not return_debug_mask
        out, lse = _forward(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), 0.0, scale, is_causal)
        seed, offset = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
        # out in q's memory layout (alloc_with_matching_layout); lse [B, H, S, 1], contiguous
        return (out.transpose(1, 2), lse.unsqueeze(-1).contiguous(), None, None, query.shape[2], key.shape[2], seed,
                offset, None)

    def backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q,
                 cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):
        calls.append(dict(op="backward", is_causal=is_causal, scale=scale))
        check(query, key, value)
        assert attn_bias is None and cum_seq_q is None and cum_seq_k is None and dropout_p == 0.0
        assert philox_seed is not None and philox_offset is not None, "the forward's seed/offset are read back"
        batch, heads, seq, _ = query.shape
        assert logsumexp.dtype == torch.float32 and logsumexp.shape == (batch, heads, seq, 1)
        assert logsumexp.is_contiguous(), "the dense path's stats are [B, H, S, 1] contiguous"
        assert (max_q, max_k) == (seq, key.shape[2]) and grad_out.stride(-1) == 1
        grads = [torch.empty_like(t.transpose(1, 2), memory_format=torch.contiguous_format)
                 for t in (query, key, value)]
        _backward(*(t.transpose(1, 2) for t in (grad_out, query, key, value, out)), logsumexp.squeeze(-1), *grads,
                  0.0, scale, is_causal)
        return tuple(g.transpose(1, 2) for g in grads)

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_dot_product_cudnn_attention", forward, "CPU")
    lib.impl("_scaled_dot_product_cudnn_attention_backward", backward, "CPU")
    try:
        yield calls
    finally:
        lib._destroy()


_CALLS_FA3: list = []


@torch.library.custom_op("upipe_test_fa3::_flash_attn_forward", mutates_args=())
def _fa3_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_new: Optional[torch.Tensor] = None,
    v_new: Optional[torch.Tensor] = None, qv: Optional[torch.Tensor] = None, out_: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
    cu_seqlens_k_new: Optional[torch.Tensor] = None, seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
    page_table: Optional[torch.Tensor] = None, kv_batch_idx: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None, rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None, seqlens_rotary: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None, k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None, causal: bool = False,
    window_size_left: int = -1, window_size_right: int = -1, attention_chunk: int = 0, softcap: float = 0.0,
    rotary_interleaved: bool = True, scheduler_metadata: Optional[torch.Tensor] = None, num_splits: int = 1,
    pack_gqa: Optional[bool] = None, sm_margin: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _CALLS_FA3.append(dict(op="forward", causal=causal, window=(window_size_left, window_size_right),
                           softcap=softcap, varlen=cu_seqlens_q is not None))
    window = (window_size_left, window_size_right)
    if cu_seqlens_q is None:
        out, lse = _forward(q, k, v, 0.0, softmax_scale, causal, window, softcap)
    else:
        out, lse = _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, softmax_scale,
                                   causal, padded_lse=False, window=window, softcap=softcap)
    return out, lse, q.new_empty(0), q.new_empty(0)


@torch.library.custom_op("upipe_test_fa3::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
def _fa3_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    softmax_lse: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None, sequed_q: Optional[torch.Tensor] = None,
    sequed_k: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
    dq: Optional[torch.Tensor] = None, dk: Optional[torch.Tensor] = None, dv: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None, is_causal: bool = False, window_size_left: int = -1,
    window_size_right: int = -1, softcap: float = 0.0, deterministic: bool = False, sm_margin: int = 0,
) -> torch.Tensor:
    _CALLS_FA3.append(dict(op="backward", causal=is_causal, window=(window_size_left, window_size_right),
                           softcap=softcap, deterministic=deterministic, varlen=cu_seqlens_q is not None))
    assert dq is not None and dk is not None and dv is not None, "a custom op returns only softmax_d: pass dq/dk/dv"
    window = (window_size_left, window_size_right)
    if cu_seqlens_q is None:
        return _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, 0.0, softmax_scale, is_causal, window, softcap)
    return _varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, 0.0, softmax_scale, is_causal, padded_lse=False, window=window,
                            softcap=softcap)


def flash_attn_3_interface():
    """``flash_attn_3.flash_attn_interface`` as built from flash-attention's ``hopper/``."""
    _CALLS_FA3.clear()
    module = types.ModuleType("flash_attn_3_interface_standin")
    module._flash_attn_forward, module._flash_attn_backward = _fa3_forward, _fa3_backward
    module.calls = _CALLS_FA3
    return module


def _fa4_window(left, right):
    """FA4's edges: None (unbounded) or >= 0; -1 is not its spelling (a one-sided -1 would run a
    window of -1), so a stand-in given one fails."""
    assert all(edge is None or (isinstance(edge, int) and edge >= 0) for edge in (left, right)), (left, right)
    return (-1 if left is None else left, -1 if right is None else right)


def flash_attn_4_interface():
    """``flash_attn.cute.interface`` of flash-attn-4 4.0.0b36."""
    calls = []

    def _flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                        max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None,
                        causal=False, softcap=None, window_size_left=None, window_size_right=None,
                        learnable_sink=None, tile_mn=None, mma_pv_is_rs=None, intra_wg_overlap=None, num_threads=384,
                        num_splits=1, pack_gqa=None, _arch=None, score_mod=None, mask_mod=None,
                        block_sparse_tensors=None, return_lse=False, out=None, lse=None, aux_tensors=None,
                        aux_scalars=None, q_descale=None, k_descale=None, v_descale=None, gather_kv_indices=None,
                        scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False,
                        gather_bwd_recompute_p=False):
        calls.append(dict(op="forward", causal=causal, window=(window_size_left, window_size_right), softcap=softcap,
                          return_lse=return_lse, varlen=cu_seqlens_q is not None))
        window = _fa4_window(window_size_left, window_size_right)
        softcap = 0.0 if softcap is None else softcap
        if cu_seqlens_q is None:
            out, lse = _forward(q, k, v, 0.0, softmax_scale, causal, window, softcap)
        else:
            out, lse = _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0,
                                       softmax_scale, causal, padded_lse=False, window=window, softcap=softcap)
        # lse is allocated only when asked for (or when an input requires grad)
        return out, (lse if return_lse else None), None, None, None

    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                        window_size_left=None, window_size_right=None, m_block_size=64, n_block_size=128,
                        num_threads=256, pack_gqa=False, num_stages_Q=2, num_stages_dO=2, SdP_swapAB=False,
                        dKV_swapAB=False, dQ_swapAB=False, AtomLayoutMSdP=2, AtomLayoutNdKV=2, AtomLayoutMdQ=2,
                        V_in_regs=False, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                        max_seqlen_q=None, max_seqlen_k=None, deterministic=False, dq=None, dk=None, dv=None,
                        score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None, aux_scalars=None,
                        block_sparse_tensors=None, dlse=None, learnable_sink=None):
        calls.append(dict(op="backward", causal=causal, window=(window_size_left, window_size_right),
                          softcap=softcap, deterministic=deterministic, varlen=cu_seqlens_q is not None))
        window = _fa4_window(window_size_left, window_size_right)
        dq = torch.empty_like(q) if dq is None else dq
        dk = torch.empty_like(k) if dk is None else dk
        dv = torch.empty_like(v) if dv is None else dv
        if cu_seqlens_q is None:
            assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]), "dense lse is [B, H, S]"
            _backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, softmax_scale, causal, window, softcap)
        else:
            _varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                             max_seqlen_k, 0.0, softmax_scale, causal, padded_lse=False, window=window,
                             softcap=softcap)
        return dq, dk, dv

    module = types.ModuleType("flash_attn_cute_interface_standin")
    module._flash_attn_fwd, module._flash_attn_bwd = _flash_attn_fwd, _flash_attn_bwd
    module.calls = calls
    return module
