"""What every attention kernel takes and gives: the :class:`AttentionKernel` protocol, and
the window / softcap values each call is checked and simplified with before a kernel sees
it. Shapes and conventions are those of :mod:`upipe_compile.attention.kernels`.

ALiBi: ``alibi_slopes`` is None or the call's query heads' slopes ``[Hq]`` (float32, on q's
device); query ``i`` and key ``j`` get ``-slope * |i + (Sk - Sq) - j|`` added to their score
after the softcap, and the log-sum-exp a kernel returns includes it (the true one: a kernel
whose library counts the bias differently corrects it). A kernel that cannot apply it says
so in :meth:`AttentionKernel.variant_problems` (``alibi=True``)."""

from __future__ import annotations

import math
import numbers
from typing import Optional, Protocol

import torch

from upipe_compile.errors import UnsupportedAttention

NO_WINDOW = (-1, -1)

Workspace = dict[str, tuple[tuple[int, ...], torch.dtype]]
"""A backward's buffers besides dq/dk/dv: ``name -> (shape, dtype)``."""


class AttentionKernel(Protocol):
    """One attention kernel (forward and backward with the log-sum-exp), as the stage loops,
    the ring and the refusals use it. ``forward``/``backward`` take one sequence (q and k may
    differ in length: a ring's chunk pair); ``*_documents`` take packed documents (q and k of
    one length). Window and softcap arrive checked and in their plainest form
    (:func:`effective`)."""

    name: str
    """Its name in :data:`upipe_compile.attention.kernels.CUDA_KERNELS` (``aten-cpu`` on CPU)."""

    checked_on_device: bool
    """Whether it has been checked on a GPU (benchmarks/kernel_check.py); a kernel that has not
    runs a small forward and backward against float64 before its first use, and is passed over
    if it disagrees."""

    def forward(self, q, k, v, is_causal: bool, scale: Optional[float], window=NO_WINDOW, softcap: float = 0.0,
                alibi_slopes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(self, dout, q, k, v, out, lse, is_causal: bool, scale: Optional[float], window=NO_WINDOW,
                 softcap: float = 0.0,
                 alibi_slopes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def forward_documents(self, q, k, v, documents, is_causal: bool, scale: Optional[float], window=NO_WINDOW,
                          softcap: float = 0.0,
                          alibi_slopes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward_documents(self, dout, q, k, v, out, lse, documents, is_causal: bool, scale: Optional[float],
                           window=NO_WINDOW, softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def variant_problems(self, window, softcap: float, alibi: bool = False) -> list[str]:
        """Why it cannot run this (valid) window / softcap, with ALiBi where ``alibi``; empty when it can."""
        ...

    @staticmethod
    def input_problems(dtype: torch.dtype, head_dim: int) -> list[str]:
        """Why it cannot take q of this dtype and head dim; empty when it can."""
        ...

    @staticmethod
    def backward_workspace(batch: int, q_heads: int, kv_heads: int, seq: int, head_dim: int, dtype: torch.dtype,
                           deterministic: bool, sms: int, documents: Optional[int] = None) -> Workspace:
        """Its backward's buffers besides dq/dk/dv (``documents``: a packed row's count), the
        memory model's view of it (:mod:`upipe_compile.measure.workspace`)."""
        ...


def variant_value_problems(window, softcap) -> list[str]:
    """Why ``window`` / ``softcap`` are not valid values (empty: they are)."""
    problems = []
    edges = tuple(window) if isinstance(window, (tuple, list)) else None
    if edges is None or len(edges) != 2 or not all(_is_int(e) and e >= -1 for e in edges):
        problems.append(f"window={window!r}: must be (left, right), each an int >= -1 (-1: unbounded on that side)")
    if not (isinstance(softcap, numbers.Real) and not isinstance(softcap, bool)
            and math.isfinite(softcap) and softcap >= 0):
        problems.append(f"softcap={softcap!r}: must be a finite number >= 0 (0: off)")
    return problems


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_variant(window, softcap) -> tuple[tuple[int, int], float]:
    """``(window, softcap)`` as ``((int, int), float)``, raising UnsupportedAttention for bad values."""
    problems = variant_value_problems(window, softcap)
    if problems:
        raise UnsupportedAttention("; ".join(problems))
    return (int(window[0]), int(window[1])), float(softcap)


def effective(is_causal: bool, window: tuple[int, int], q_len: int, k_len: int) -> tuple[bool, tuple[int, int]]:
    """The same attention in its plainest form: a left edge at least ``k_len - 1`` away, or a
    right one at least ``q_len - 1``, bounds nothing; causal attention's right edge is 0
    (``(-1, 0)`` is plain causal, window ``(-1, -1)``), so windows that restrict nothing run
    the dense kernels. Unequal lengths keep causal as the window's right edge 0, since aten's
    CPU kernel aligns a causal mask to the first query, not the last."""
    if is_causal:
        window = (window[0], 0)
    left, right = window
    left, right = (-1 if left >= k_len - 1 else left), (-1 if right >= q_len - 1 else right)
    if q_len != k_len:
        return False, (left, right)
    is_causal = is_causal or (left, right) == (-1, 0)
    if is_causal:
        right = -1 if left == -1 else 0
    return is_causal, (left, right)


def refuse_unrunnable_variant(kernel: AttentionKernel, window, softcap: float, alibi_slopes=None) -> None:
    """Raise :class:`UnsupportedAttention` with ``kernel``'s reasons where it cannot run this
    (checked) window / softcap / ALiBi: what each kernel's forward and backward call first."""
    problems = kernel.variant_problems(window, softcap, alibi_slopes is not None)
    if problems:
        raise UnsupportedAttention("; ".join(problems))
