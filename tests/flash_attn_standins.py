"""Stand-ins for ``flash_attn.flash_attn_interface`` of each signature family, on CPU.

Each module has ``_flash_attn_forward`` / ``_flash_attn_backward`` with the parameters of
the released interface files (2.5.9, 2.6.3, 2.7.4 / 2.8.3) and their return forms. The
bodies compute with aten's CPU flash kernels on the ``[B, S, H, D]`` layout and check what
the real kernels check: last-dimension-contiguous inputs, preallocated contiguous
dq/dk/dv of the right shapes, head_dim a multiple of 8, no dropout. Each module records
the keyword values it was called with in ``calls``.
"""

from __future__ import annotations

import types
from typing import Optional

import torch

_aten = torch.ops.aten


def _check(*tensors):
    for t in tensors:
        assert t.stride(-1) == 1, f"flash needs a contiguous last dimension, got strides {t.stride()}"
    assert tensors[0].shape[-1] % 8 == 0, f"head_dim {tensors[0].shape[-1]} is not a multiple of 8"


def _forward(q, k, v, dropout_p, softmax_scale, causal):
    """q/k/v ``[B, S, H, D]`` -> out ``[B, S, H, D]`` (contiguous, as flash returns it), lse ``[B, H, S]``."""
    _check(q, k, v)
    assert dropout_p == 0.0
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=softmax_scale
    )[:2]
    return out.transpose(1, 2).contiguous(), lse


def _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal):
    _check(dout, q, k, v, out)
    for grad, like in ((dq, q), (dk, k), (dv, v)):
        assert grad.is_contiguous() and grad.shape == like.shape, "dq/dk/dv must be preallocated like q/k/v"
    assert dropout_p == 0.0
    grads = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2),
        softmax_lse, 0.0, causal, scale=softmax_scale,
    )
    for dest, grad in zip((dq, dk, dv), grads):
        dest.copy_(grad.transpose(1, 2))
    batch, seq, heads, _ = q.shape
    return q.new_empty((batch, heads, -(-seq // 128) * 128), dtype=torch.float32)  # softmax_d


def interface_2_5():
    calls = []

    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
        calls.append(dict(window_size=window_size, alibi_slopes=alibi_slopes, return_softmax=return_softmax))
        assert window_size == (-1, -1) and alibi_slopes is None and not return_softmax
        out, lse = _forward(q, k, v, dropout_p, softmax_scale, causal)
        return out, q, k, v, out, lse, None, None

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size, alibi_slopes, deterministic, rng_state=None):
        calls.append(dict(window_size=window_size, deterministic=deterministic, rng_state=rng_state))
        assert window_size == (-1, -1) and alibi_slopes is None
        softmax_d = _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal)
        return dq, dk, dv, softmax_d

    return _module("2.5.9", calls, _flash_attn_forward, _flash_attn_backward)


def interface_2_6():
    calls = []

    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                            return_softmax):
        calls.append(dict(window_size=window_size, softcap=softcap, return_softmax=return_softmax))
        assert window_size == (-1, -1) and softcap == 0.0 and alibi_slopes is None and not return_softmax
        out, lse = _forward(q, k, v, dropout_p, softmax_scale, causal)
        return out, q, k, v, out, lse, None, None

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size, softcap, alibi_slopes, deterministic, rng_state=None):
        calls.append(dict(window_size=window_size, softcap=softcap, deterministic=deterministic))
        assert window_size == (-1, -1) and softcap == 0.0 and alibi_slopes is None
        softmax_d = _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal)
        return dq, dk, dv, softmax_d

    return _module("2.6.3", calls, _flash_attn_forward, _flash_attn_backward)


_CALLS_2_7: list = []


@torch.library.custom_op("upipe_test_flash_2_7::_flash_attn_forward", mutates_args=())
def _flash_attn_forward_2_7(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float, causal: bool,
    window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
    return_softmax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _CALLS_2_7.append(dict(window_size_left=window_size_left, window_size_right=window_size_right, softcap=softcap))
    assert (window_size_left, window_size_right, softcap) == (-1, -1, 0.0) and alibi_slopes is None
    out, lse = _forward(q, k, v, dropout_p, softmax_scale, causal)
    return out, lse, q.new_empty(0), torch.zeros(2, dtype=torch.int64)


@torch.library.custom_op("upipe_test_flash_2_7::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
def _flash_attn_backward_2_7(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor], dv: Optional[torch.Tensor],
    dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
    softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool, rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    _CALLS_2_7.append(dict(window_size_left=window_size_left, deterministic=deterministic, rng_state=rng_state))
    assert (window_size_left, window_size_right, softcap) == (-1, -1, 0.0) and alibi_slopes is None
    return _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal)


def interface_2_7():
    """2.7 and 2.8 share this form: both functions are ``torch.library.custom_op`` objects."""
    _CALLS_2_7.clear()
    return _module("2.8.3", _CALLS_2_7, _flash_attn_forward_2_7, _flash_attn_backward_2_7)


FAMILIES = {"2.5": interface_2_5, "2.6": interface_2_6, "2.7/2.8": interface_2_7}


def _module(version, calls, forward, backward):
    module = types.ModuleType(f"flash_attn_interface_standin_{version}")
    module.__version__ = version
    module.calls = calls
    module._flash_attn_forward = forward
    module._flash_attn_backward = backward
    return module
