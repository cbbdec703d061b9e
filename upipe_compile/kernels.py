"""Attention kernels that return the log-sum-exp, behind one interface.

``forward(q, k, v, is_causal, scale) -> (out, lse)`` and
``backward(dout, q, k, v, out, lse, is_causal, scale) -> (dq, dk, dv)`` with
q ``[B, Hq, S, D]``, k/v ``[B, Hkv, S, D]`` where ``Hkv`` divides ``Hq`` and query head
``h`` uses KV head ``h // (Hq // Hkv)`` (SDPA's ``enable_gqa`` rule); ``lse`` is
``[B, Hq, S]`` float32; dk/dv come back with k/v's head count.

The kernel is picked by device: CPU uses aten's flash kernel for CPU; CUDA uses
flash-attn when it is importable, else aten's CUDA flash kernel. No dropout, no mask: the
passes refuse those before a kernel is ever called.
"""

from __future__ import annotations

import functools
import inspect

import torch

from upipe_compile.errors import UnsupportedAttention

_aten = torch.ops.aten


def forward(q, k, v, is_causal: bool, scale: float | None):
    if q.device.type == "cpu":
        return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
    if q.device.type == "cuda":
        _check_cuda_dtype(q)
        if _flash_attn() is not None:
            return _flash_attn_forward(q, k, v, is_causal, scale)
        return _aten_cuda_forward(q, k, v, is_causal, scale)
    raise UnsupportedAttention(f"no UPipe attention kernel for device type {q.device.type!r} (cpu and cuda are supported)")


def backward(dout, q, k, v, out, lse, is_causal: bool, scale: float | None):
    if q.device.type == "cpu":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, is_causal, scale=scale
        )
    if q.device.type == "cuda":
        if _flash_attn() is not None:
            return _flash_attn_backward(dout, q, k, v, out, lse, is_causal, scale)
        return _aten_cuda_backward(dout, q, k, v, out, lse, is_causal, scale)
    raise UnsupportedAttention(f"no UPipe attention kernel for device type {q.device.type!r} (cpu and cuda are supported)")


def _check_cuda_dtype(q):
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise UnsupportedAttention(
            f"UPipe's CUDA kernels (flash-attn / aten flash) need fp16 or bf16 inputs, got {q.dtype}; "
            "run attention under torch.autocast or cast the model to bf16"
        )


# --- CUDA, flash-attn ------------------------------------------------------------------
@functools.cache
def _flash_attn():
    try:
        import flash_attn.flash_attn_interface as fa
    except ImportError:
        return None
    return fa


def _call_with_known_params(fn, **kwargs):
    """flash-attn renamed and added private parameters between 2.x releases
    (``window_size`` became ``window_size_left/right``, ``softcap`` appeared): pass only
    the ones this installed version takes."""
    params = inspect.signature(fn).parameters
    return fn(**{name: value for name, value in kwargs.items() if name in params})


def _flash_attn_forward(q, k, v, is_causal, scale):
    fa = _flash_attn()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # flash-attn wants [B, S, H, D]; it handles GQA itself.
    out, lse, *_ = fa.flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        dropout_p=0.0, softmax_scale=scale, causal=is_causal, return_attn_probs=True,
    )
    return out.transpose(1, 2), lse


def _flash_attn_backward(dout, q, k, v, out, lse, is_causal, scale):
    fa = _flash_attn()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
    _call_with_known_params(
        fa._flash_attn_backward,
        dout=dout.transpose(1, 2).contiguous(), q=qt, k=kt, v=vt,
        out=out.transpose(1, 2).contiguous(), softmax_lse=lse, dq=dq, dk=dk, dv=dv,
        dropout_p=0.0, softmax_scale=scale, causal=is_causal,
        window_size=(-1, -1), window_size_left=-1, window_size_right=-1, softcap=0.0,
        alibi_slopes=None, deterministic=False, rng_state=None,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# --- CUDA, aten flash ------------------------------------------------------------------
def _repeat_kv(q, k, v):
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def _sum_kv_groups(dk, kv_heads):
    if dk.shape[1] == kv_heads:
        return dk
    batch, heads, seq, dim = dk.shape
    return dk.view(batch, kv_heads, heads // kv_heads, seq, dim).sum(2)


def _aten_cuda_forward(q, k, v, is_causal, scale):
    k, v = _repeat_kv(q, k, v)
    out, lse, *_ = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
    return out, lse


@functools.cache
def _aten_cuda_dense_markers(device: torch.device, dtype: torch.dtype):
    """The cumulative-length and philox tensors aten's flash forward returns for dense
    inputs without dropout; its backward wants them back, and they carry no per-call data."""
    x = torch.zeros(1, 1, 1, 8, device=device, dtype=dtype)
    _, _, cum_q, cum_k, _, _, seed, offset, _ = _aten._scaled_dot_product_flash_attention(x, x, x, 0.0, False, False)
    return cum_q, cum_k, seed, offset


def _aten_cuda_backward(dout, q, k, v, out, lse, is_causal, scale):
    kv_heads = k.shape[1]
    k, v = _repeat_kv(q, k, v)
    cum_q, cum_k, seed, offset = _aten_cuda_dense_markers(q.device, q.dtype)
    seq = q.shape[2]
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, seq, seq, 0.0, is_causal, seed, offset, scale=scale
    )
    return dq, _sum_kv_groups(dk, kv_heads), _sum_kv_groups(dv, kv_heads)
