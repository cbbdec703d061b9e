"""flash-attn 2.5 to 2.8: the CUDA kernel when it is installed (``pip install flash-attn``)."""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Callable

import torch

from upipe_compile.attention.kernels.contract import NO_WINDOW
from upipe_compile.attention.kernels.flash_family import flash_backward_workspace, flash_input_problems
from upipe_compile.attention.kernels.varlen import VarlenKernels
from upipe_compile.errors import UnsupportedAttention


class FlashAttnKernels(VarlenKernels):
    """flash-attn's private ``_flash_attn_forward`` / ``_flash_attn_backward`` from a module
    with the API of ``flash_attn.flash_attn_interface``, for releases 2.5 through 2.8.

    The releases differ in their parameters: 2.5 takes ``window_size`` as a tuple, 2.6 adds
    ``softcap``, 2.7+ takes ``window_size_left/right`` and wraps both functions in
    ``torch.library.custom_op`` (so ``inspect.signature`` shows only ``*args, **kwargs``:
    the names come from the op schema). Arguments are passed positionally in the installed
    version's order; a parameter this adapter does not know and that has no default is
    refused with the version's parameter list, never silently dropped. Likewise a window or
    softcap the installed functions have no parameter for (softcap in 2.5) is refused,
    naming the release that has it, rather than left out.

    ALiBi goes in as ``alibi_slopes`` (float32 ``[Hq]``; every release from 2.5 has it). Under
    causal attention (flash's ``params.is_causal``: no left edge within the keys, right edge
    0) flash adds ``slope * j`` instead of ``-slope * |i + Sk - Sq - j|``: the same softmax,
    but a log-sum-exp larger by ``slope * (i + Sk - Sq)``, which the stage loop's sinks and
    ring merges would read, and whose fp32 scores grow with the position. So a causal call
    with ALiBi goes in as the same mask spelled as a window, ``(Sk - 1, 0)`` without
    ``causal``, which flash runs on its local path with the ``|i - j|`` bias.

    The kernels need only ``stride(-1) == 1``, so the ``[B, H, S, D]`` stage buffers are
    passed as ``[B, S, H, D]`` views, without copies; GQA is native.
    """

    name = "flash-attn"
    checked_on_device = True  # by benchmarks/kernel_check.py on an H100 and an H200
    input_problems = staticmethod(flash_input_problems)
    backward_workspace = staticmethod(flash_backward_workspace)

    @classmethod
    def installed(cls) -> "FlashAttnKernels | None":
        """The kernel over the installed flash-attn, or None when it is not installed."""
        interface = _flash_attn_interface()
        return None if interface is None else cls(interface)

    def __init__(self, interface):
        self.interface = interface
        self._forward = interface._flash_attn_forward
        self._backward = interface._flash_attn_backward
        self._forward_params = _parameters(self._forward)
        self._backward_params = _parameters(self._backward)
        # The varlen pair (packed sequences) differs across releases exactly as the dense one.
        self._varlen_forward = getattr(interface, "_flash_attn_varlen_forward", None)
        self._varlen_backward = getattr(interface, "_flash_attn_varlen_backward", None)
        self._varlen_forward_params = None if self._varlen_forward is None else _parameters(self._varlen_forward)
        self._varlen_backward_params = None if self._varlen_backward is None else _parameters(self._varlen_backward)

    def variant_problems(self, window, softcap: float, alibi: bool = False) -> list[str]:
        if window == NO_WINDOW and not softcap and not alibi:
            return []
        return self._variant_gaps(
            [("_flash_attn_forward", self._forward_params), ("_flash_attn_backward", self._backward_params),
             ("_flash_attn_varlen_forward", self._varlen_forward_params),
             ("_flash_attn_varlen_backward", self._varlen_backward_params)], window, softcap, alibi)

    def _variant_gaps(self, functions, window, softcap: float, alibi: bool = False) -> list[str]:
        """Per requested variant, the functions (``(name, parameters)``; None: absent) that
        have no parameter for it."""
        no_window, no_softcap, no_alibi = [], [], []
        for what, params in functions:
            if params is None:
                continue
            names = {name for name, _ in params}
            if window != NO_WINDOW and "window_size" not in names and not (
                    {"window_size_left", "window_size_right"} <= names):
                no_window.append(what)
            if softcap and "softcap" not in names:
                no_softcap.append(what)
            if alibi and "alibi_slopes" not in names:
                no_alibi.append(what)
        version = _flash_attn_version(self.interface)
        gaps = []
        if no_window:
            gaps.append(f"window={window}: the installed flash-attn {version} has no window_size parameter in "
                        f"{', '.join(no_window)}; install flash-attn 2.5 to 2.8 (pip install 'flash-attn>=2.5,<2.9')")
        if no_softcap:
            gaps.append(f"softcap={softcap}: the installed flash-attn {version} has no softcap parameter in "
                        f"{', '.join(no_softcap)} (logit soft-capping came in flash-attn 2.6); upgrade to "
                        "flash-attn >= 2.6 (pip install -U 'flash-attn>=2.6')")
        if no_alibi:
            gaps.append(f"ALiBi (alibi_slopes): the installed flash-attn {version} has no alibi_slopes parameter in "
                        f"{', '.join(no_alibi)}; install flash-attn 2.5 to 2.8 (pip install 'flash-attn>=2.5,<2.9')")
        return gaps

    def _run(self, fn, params, values: dict, what: str, window, softcap: float):
        """``_call``, after refusing a requested window/softcap/ALiBi ``fn`` has no parameter for."""
        gaps = self._variant_gaps([(what, params)], window, softcap, values.get("alibi_slopes") is not None)
        if gaps:
            raise UnsupportedAttention("; ".join(gaps))
        return _call(fn, params, values, what)

    def forward(self, q, k, v, is_causal: bool, scale: float | None, window=NO_WINDOW, softcap: float = 0.0,
                alibi_slopes=None):
        values = self._common(q, is_causal, scale, window, softcap, alibi_slopes, k.shape[2])
        values.update(q=q.transpose(1, 2), k=k.transpose(1, 2), v=v.transpose(1, 2), return_softmax=False)
        result = self._run(self._forward, self._forward_params, values, "_flash_attn_forward", window, softcap)
        # 2.5/2.6: (out, q, k, v, out_padded, lse, S_dmask, rng_state); 2.7+: (out, lse, S_dmask, rng_state)
        if len(result) == 8:
            out, lse = result[0], result[5]
        elif len(result) == 4:
            out, lse = result[0], result[1]
        else:
            raise UnsupportedAttention(
                f"flash-attn's _flash_attn_forward returned {len(result)} values; upipe-compile knows the "
                "8-value (2.5, 2.6) and 4-value (2.7, 2.8) forms"
            )
        return out.transpose(1, 2), lse

    def backward(self, dout, q, k, v, out, lse, is_causal: bool, scale: float | None, window=NO_WINDOW,
                 softcap: float = 0.0, alibi_slopes=None):
        # flash writes dq/dk/dv in place; allocated [B, S, H, D] as it wants them.
        dq, dk, dv = (torch.empty_like(t.transpose(1, 2), memory_format=torch.contiguous_format) for t in (q, k, v))
        values = self._common(q, is_causal, scale, window, softcap, alibi_slopes, k.shape[2])
        values.update(
            dout=dout.transpose(1, 2), q=q.transpose(1, 2), k=k.transpose(1, 2), v=v.transpose(1, 2),
            out=out.transpose(1, 2), softmax_lse=lse, dq=dq, dk=dk, dv=dv,
            deterministic=torch.are_deterministic_algorithms_enabled(), rng_state=None,
        )
        self._run(self._backward, self._backward_params, values, "_flash_attn_backward", window, softcap)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    def _varlen_forward_row(self, q, k, v, documents, is_causal: bool, scale: float | None, window=NO_WINDOW,
                            softcap: float = 0.0, alibi_slopes=None):
        values = self._common(q, is_causal, scale, window, softcap, alibi_slopes, documents.max_length)
        values.update(q=q, k=k, v=v, return_softmax=False, **self._varlen_values(documents))
        result = self._run(self._require(self._varlen_forward), self._varlen_forward_params, values,
                           "_flash_attn_varlen_forward", window, softcap)
        # the same return forms as the dense forward (8 values in 2.5/2.6, 4 in 2.7+)
        return (result[0], result[5]) if len(result) == 8 else (result[0], result[1])

    def _varlen_backward_row(self, dout, q, k, v, out, lse, documents, is_causal: bool, scale: float | None,
                             window=NO_WINDOW, softcap: float = 0.0, alibi_slopes=None):
        dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
        values = self._common(q, is_causal, scale, window, softcap, alibi_slopes, documents.max_length)
        values.update(
            dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
            deterministic=torch.are_deterministic_algorithms_enabled(), rng_state=None,
            **self._varlen_values(documents),
        )
        self._run(self._require(self._varlen_backward), self._varlen_backward_params, values,
                  "_flash_attn_varlen_backward", window, softcap)
        return dq, dk, dv

    @staticmethod
    def _varlen_values(documents) -> dict:
        cu, longest = documents.cu_seqlens, documents.max_length
        return {
            "cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": longest, "max_seqlen_k": longest,
            "block_table": None, "leftpad_k": None, "seqused_k": None, "zero_tensors": False,
        }

    def _require(self, fn):
        if fn is None:
            raise UnsupportedAttention(
                "this flash-attn has no _flash_attn_varlen_forward/_backward, which packed sequences "
                "(cu_seqlens) need; flash-attn 2.5 to 2.8 have them"
            )
        return fn

    @staticmethod
    def _common(q, is_causal, scale, window=NO_WINDOW, softcap: float = 0.0, alibi_slopes=None,
                k_len: int | None = None) -> dict:
        """The arguments every call shares; ``k_len``: the keys' length as flash sees it (the
        longest document's in varlen calls), for ALiBi's causal spelling."""
        if alibi_slopes is not None:
            is_causal, window = _alibi_window(is_causal, window, k_len)
        left, right = window
        return {
            "dropout_p": 0.0,
            "softmax_scale": q.shape[-1] ** -0.5 if scale is None else scale,
            "causal": is_causal,
            "window_size": (left, right),
            "window_size_left": left,
            "window_size_right": right,
            "softcap": float(softcap),
            "alibi_slopes": alibi_slopes,
        }


def _alibi_window(is_causal: bool, window, k_len: int) -> tuple[bool, tuple[int, int]]:
    """``(causal, window)`` for a call with ALiBi that flash never runs as causal: where flash
    would set ``params.is_causal`` (a left edge clamped away at ``k_len`` or absent, and a right
    edge 0), the same mask as the window ``(k_len - 1, 0)`` without ``causal``, so that flash
    applies ``-slope * |i + Sk - Sq - j|`` (its local path) rather than ``slope * j``."""
    left, right = window
    if left >= k_len:
        left = -1
    if is_causal:
        right = 0
    if left < 0 and right == 0:
        return False, (k_len - 1, 0)
    return is_causal, tuple(window)


def _flash_attn_version(interface) -> str:
    """The installed flash-attn's version (the package's; a stand-in module may carry its own)."""
    version = getattr(interface, "__version__", None)
    if version is None:
        package = sys.modules.get(interface.__name__.partition(".")[0])
        version = getattr(package, "__version__", None)
    return version or "(unknown version)"


def _parameters(fn: Callable) -> list[tuple[str, bool]]:
    """``(name, has_default)`` of each parameter, in order: from the op schema for
    ``torch.library`` ops (flash-attn >= 2.7), else from the Python signature."""
    schema = None
    if isinstance(fn, torch._library.custom_ops.CustomOpDef):
        schema = fn._opoverload._schema
    elif isinstance(fn, torch._ops.OpOverloadPacket):
        schema = fn.default._schema
    elif isinstance(fn, torch._ops.OpOverload):
        schema = fn._schema
    if schema is not None:
        return [(arg.name, arg.has_default_value()) for arg in schema.arguments]
    return [(p.name, p.default is not inspect.Parameter.empty) for p in inspect.signature(fn).parameters.values()]


def _call(fn: Callable, params: list[tuple[str, bool]], values: dict, what: str):
    """``fn`` with each of its parameters from ``values``: positionally while every one is
    known; an unknown one that has a default keeps it, and those after it go by keyword."""
    args, kwargs, skipped = [], {}, False
    for name, has_default in params:
        if name not in values:
            if not has_default:
                raise UnsupportedAttention(
                    f"this flash-attn's {what} takes a parameter {name!r} that upipe-compile does not know "
                    f"(its parameters: {[p for p, _ in params]}); flash-attn 2.5 to 2.8 are supported"
                )
            skipped = True
        elif skipped:
            kwargs[name] = values[name]
        else:
            args.append(values[name])
    return fn(*args, **kwargs)


@functools.cache
def _flash_attn_interface():
    try:
        import flash_attn.flash_attn_interface as interface
    except ImportError:
        return None
    return interface

