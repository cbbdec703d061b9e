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
into ``softcap * tanh(s / softcap)`` before the softmax; 0 is off. Values are checked
here: :func:`variant_problems` (compile time) lists bad values and what the device's
kernel cannot run, and ``forward``/``backward`` raise ``UnsupportedAttention`` for the same
(:func:`check_variant` raises for bad values alone). A window that covers the whole
sequence is no window, and ``(-1, 0)`` is plain causal attention, so those run the dense
kernels.

Packed sequences: both take ``documents`` (:class:`upipe_compile.packed.documents.Documents`,
the checked boundaries of the full sequence); attention then stays inside each document
(a window is relative, so it applies within each document unchanged).
One document over the whole sequence runs the dense kernel, exactly as without boundaries.
CPU runs the dense kernel once per document on slices of the stage buffers; CUDA runs the
kernels' variable-length ("varlen") forms on each batch row. No mask is ever built.

The kernel is picked by device: CPU uses aten's flash kernel for CPU, and for a window or
softcap the exact blocked kernel of :mod:`upipe_compile.attention.blocked_kernel`; CUDA uses
flash-attn (2.5 to 2.8, :class:`FlashAttnKernels`; softcap needs 2.6+) when it is
importable, else aten's CUDA flash kernel (windows, no softcap). No dropout, no mask: the
passes refuse those before a kernel is ever called.

Under FakeTensorMode (memory measurement) the CPU kernels run, which allocate less than
the CUDA ones; :func:`upipe_compile.measure.workspace.modelled_cuda_kernel` makes them also
allocate the CUDA kernel's workspace, so measured peaks are GPU peaks.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import numbers
import sys
from typing import Callable

import torch
from torch._subclasses.fake_tensor import is_fake

from upipe_compile.attention.varlen_groups import round_up, varlen_backward_groups

from upipe_compile.attention import blocked_kernel
from upipe_compile.attention.device_constants import made_once
from upipe_compile.errors import UnsupportedAttention

_aten = torch.ops.aten

CUDA_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
NO_WINDOW = (-1, -1)


def cuda_problems(dtype: torch.dtype, head_dim: int) -> list[str]:
    """Why q of this dtype and head_dim cannot run on UPipe's CUDA kernels (empty: it can).
    Both flash-attn's and aten's flash backward need head_dim % 8 == 0 and <= 256 (only
    their public forward wrappers pad), so such head dims are refused, not padded."""
    problems = []
    if dtype not in CUDA_DTYPES:
        problems.append(
            f"q is {dtype} on CUDA; UPipe's CUDA kernels (flash-attn / aten flash) need fp16 or bf16: "
            "run attention under torch.autocast or cast the model to bf16"
        )
    if head_dim % 8 or head_dim > FLASH_MAX_HEAD_DIM:
        problems.append(
            f"head_dim={head_dim}: the CUDA flash kernels' backward needs a multiple of 8 that is at most "
            f"{FLASH_MAX_HEAD_DIM}; pad the model's head_dim (e.g. to {min(round_up(head_dim, 8), FLASH_MAX_HEAD_DIM)})"
        )
    return problems


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


def variant_problems(device_type: str, window=NO_WINDOW, softcap: float = 0.0) -> list[str]:
    """Why the attention kernel for ``device_type`` cannot run this window / softcap (empty:
    it can), bad values included. CPU runs every valid variant; CUDA asks the kernel it
    would use (flash-attn if importable, else aten's flash)."""
    problems = variant_value_problems(window, softcap)
    if problems:
        return problems
    window, softcap = check_variant(window, softcap)
    if device_type == "cuda":
        return _cuda_kernels().variant_problems(window, softcap)
    return []


def _effective(is_causal: bool, window: tuple[int, int], q_len: int, k_len: int) -> tuple[bool, tuple[int, int]]:
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


class PerDocumentKernels:
    """Packed sequences by running the dense kernel once per document on slices of the
    full-sequence buffers (written into full-size out/lse, dq/dk/dv): exact, including the
    log-sum-exp backward needs, and with no allocation beyond one document's outputs. A
    window is relative to the query, so it applies to each document's slice unchanged."""

    def forward_documents(self, q, k, v, documents, is_causal: bool, scale: float | None, window=NO_WINDOW,
                          softcap: float = 0.0):
        batch, heads, seq, _ = q.shape
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = q.new_empty((batch, heads, seq), dtype=torch.float32)
        for start, end in documents.spans:
            piece = slice(start, end)
            out_doc, lse_doc = self.forward(q[:, :, piece], k[:, :, piece], v[:, :, piece], is_causal, scale,
                                            window, softcap)
            out[:, :, piece].copy_(out_doc)
            lse[:, :, piece].copy_(lse_doc)
        return out, lse

    def backward_documents(self, dout, q, k, v, out, lse, documents, is_causal: bool, scale: float | None,
                           window=NO_WINDOW, softcap: float = 0.0):
        dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
        for start, end in documents.spans:
            piece = slice(start, end)
            grads = self.backward(
                dout[:, :, piece], q[:, :, piece], k[:, :, piece], v[:, :, piece], out[:, :, piece],
                lse[:, :, piece].contiguous(), is_causal, scale, window, softcap,
            )
            for dest, grad in zip((dq, dk, dv), grads):
                dest[:, :, piece].copy_(grad)
        return dq, dk, dv


class CpuKernels(PerDocumentKernels):
    """aten's flash kernel for CPU (takes GQA natively); with a window or softcap, the exact
    blocked kernel of :mod:`upipe_compile.attention.blocked_kernel` instead. On fake tensors
    (memory measurement) variants also run aten's kernel: the outputs are the same, and
    the blocked kernel's per-block scores are no model of a fused GPU kernel."""

    name = "aten-cpu"

    def variant_problems(self, window, softcap: float) -> list[str]:
        return []

    @staticmethod
    def _on_aten(q, window, softcap: float) -> bool:
        """Whether aten's kernel is exact here (no variant left), or only shapes matter (fake)."""
        return (window == NO_WINDOW and not softcap) or is_fake(q)

    def forward(self, q, k, v, is_causal: bool, scale: float | None, window=NO_WINDOW, softcap: float = 0.0):
        is_causal, window = _effective(is_causal, window, q.shape[2], k.shape[2])
        if self._on_aten(q, window, softcap):
            return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
        return blocked_kernel.forward(q, k, v, is_causal, scale, window, softcap)

    def backward(self, dout, q, k, v, out, lse, is_causal: bool, scale: float | None, window=NO_WINDOW,
                 softcap: float = 0.0):
        is_causal, window = _effective(is_causal, window, q.shape[2], k.shape[2])
        if self._on_aten(q, window, softcap):
            return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse, 0.0, is_causal, scale=scale
            )
        return blocked_kernel.backward(dout, q, k, v, out, lse, is_causal, scale, window, softcap)


class VarlenKernels:
    """Packed sequences through a CUDA kernel's variable-length form, one batch row at a
    time: the row's ``[H, S, D]`` stage buffers go in as ``[S, H, D]`` views (no copies)
    with the documents' ``cu_seqlens`` as both query and key boundaries. Subclasses give
    ``_varlen_forward_row`` / ``_varlen_backward_row``. Their log-sum-exp comes either
    packed ``[H, S]`` or padded per document ``[n, H, max_len]`` (flash-attn 2.5); the
    stage loop keeps it packed and pads it again for a backward that wants it so."""

    lse_padded: bool | None = None  # learned from the first forward

    def forward_documents(self, q, k, v, documents, is_causal: bool, scale: float | None, window=NO_WINDOW,
                          softcap: float = 0.0):
        batch, heads, seq, dim = q.shape
        lse = q.new_empty((batch, heads, seq), dtype=torch.float32)
        out = None if batch == 1 else q.new_empty((batch, seq, heads, dim))
        for row in range(batch):
            out_row, lse_row = self._varlen_forward_row(
                q[row].transpose(0, 1), k[row].transpose(0, 1), v[row].transpose(0, 1), documents, is_causal, scale,
                window, softcap,
            )
            self.lse_padded = lse_row.dim() == 3
            lse[row].copy_(_packed_lse(lse_row, documents) if self.lse_padded else lse_row)
            if out is None:
                out = out_row.unsqueeze(0)
            else:
                out[row].copy_(out_row)
        return out.transpose(1, 2), lse

    def backward_documents(self, dout, q, k, v, out, lse, documents, is_causal: bool, scale: float | None,
                           window=NO_WINDOW, softcap: float = 0.0):
        """One varlen call per group of documents (:func:`varlen_backward_groups`): each
        call's padded workspace stays within the dense kernel's, and documents do not
        interact, so each group's gradients are exact on their own."""
        batch, seq = q.shape[0], q.shape[2]
        grads = [torch.empty((batch, seq, t.shape[1], t.shape[3]), dtype=t.dtype, device=t.device) for t in (q, k, v)]
        groups = varlen_backward_groups(documents, q.shape[1], torch.are_deterministic_algorithms_enabled())
        for row in range(batch):
            tensors = [t[row].transpose(0, 1) for t in (dout, q, k, v, out)]  # [S, H, D] views
            for first, last in groups:
                start, end = documents.bounds[first], documents.bounds[last]
                group = documents.subset(first, last)
                lse_group = lse[row][:, start:end].contiguous()
                if self.lse_padded:
                    lse_group = _padded_lse(lse_group, group)
                results = self._varlen_backward_row(
                    *(t[start:end] for t in tensors), lse_group, group, is_causal, scale, window, softcap)
                for full, part in zip(grads, results):
                    full[row, start:end].copy_(part)
                del results
        return tuple(g.transpose(1, 2) for g in grads)


def _packed_lse(padded: torch.Tensor, documents) -> torch.Tensor:
    """``[n, H, max_len]`` (document i's rows first) as ``[H, S]``."""
    packed = padded.new_empty((padded.shape[1], documents.bounds[-1]))
    for i, (start, end) in enumerate(documents.spans):
        packed[:, start:end].copy_(padded[i, :, : end - start])
    return packed


def _padded_lse(packed: torch.Tensor, documents) -> torch.Tensor:
    padded = packed.new_zeros((len(documents.spans), packed.shape[0], documents.max_length))
    for i, (start, end) in enumerate(documents.spans):
        padded[i, :, : end - start].copy_(packed[:, start:end])
    return padded


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
    markers. aten's flash has no softcap: that needs flash-attn >= 2.6."""

    name = "aten-flash"

    def variant_problems(self, window, softcap: float) -> list[str]:
        problems = []
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

    def _check(self, window, softcap: float) -> None:
        problems = self.variant_problems(window, softcap)
        if problems:
            raise UnsupportedAttention("; ".join(problems))

    def forward(self, q, k, v, is_causal: bool, scale: float | None, window=NO_WINDOW, softcap: float = 0.0):
        self._check(window, softcap)
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
                 softcap: float = 0.0):
        self._check(window, softcap)
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
                            softcap: float = 0.0):
        self._check(window, softcap)
        cu, longest = documents.cu_seqlens, documents.max_length
        out, lse, *_ = _aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, is_causal, False,
                                                      scale=scale, **_aten_window(window))
        return out, lse

    def _varlen_backward_row(self, dout, q, k, v, out, lse, documents, is_causal: bool, scale: float | None,
                             window=NO_WINDOW, softcap: float = 0.0):
        self._check(window, softcap)
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

    The kernels need only ``stride(-1) == 1``, so the ``[B, H, S, D]`` stage buffers are
    passed as ``[B, S, H, D]`` views, without copies; GQA is native.
    """

    name = "flash-attn"

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

    def variant_problems(self, window, softcap: float) -> list[str]:
        if window == NO_WINDOW and not softcap:
            return []
        return self._variant_gaps(
            [("_flash_attn_forward", self._forward_params), ("_flash_attn_backward", self._backward_params),
             ("_flash_attn_varlen_forward", self._varlen_forward_params),
             ("_flash_attn_varlen_backward", self._varlen_backward_params)], window, softcap)

    def _variant_gaps(self, functions, window, softcap: float) -> list[str]:
        """Per requested variant, the functions (``(name, parameters)``; None: absent) that
        have no parameter for it."""
        no_window, no_softcap = [], []
        for what, params in functions:
            if params is None:
                continue
            names = {name for name, _ in params}
            if window != NO_WINDOW and "window_size" not in names and not (
                    {"window_size_left", "window_size_right"} <= names):
                no_window.append(what)
            if softcap and "softcap" not in names:
                no_softcap.append(what)
        version = _flash_attn_version(self.interface)
        gaps = []
        if no_window:
            gaps.append(f"window={window}: the installed flash-attn {version} has no window_size parameter in "
                        f"{', '.join(no_window)}; install flash-attn 2.5 to 2.8 (pip install 'flash-attn>=2.5,<2.9')")
        if no_softcap:
            gaps.append(f"softcap={softcap}: the installed flash-attn {version} has no softcap parameter in "
                        f"{', '.join(no_softcap)} (logit soft-capping came in flash-attn 2.6); upgrade to "
                        "flash-attn >= 2.6 (pip install -U 'flash-attn>=2.6')")
        return gaps

    def _run(self, fn, params, values: dict, what: str, window, softcap: float):
        """``_call``, after refusing a requested window/softcap ``fn`` has no parameter for."""
        gaps = self._variant_gaps([(what, params)], window, softcap)
        if gaps:
            raise UnsupportedAttention("; ".join(gaps))
        return _call(fn, params, values, what)

    def forward(self, q, k, v, is_causal: bool, scale: float | None, window=NO_WINDOW, softcap: float = 0.0):
        values = self._common(q, is_causal, scale, window, softcap)
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
                 softcap: float = 0.0):
        # flash writes dq/dk/dv in place; allocated [B, S, H, D] as it wants them.
        dq, dk, dv = (torch.empty_like(t.transpose(1, 2), memory_format=torch.contiguous_format) for t in (q, k, v))
        values = self._common(q, is_causal, scale, window, softcap)
        values.update(
            dout=dout.transpose(1, 2), q=q.transpose(1, 2), k=k.transpose(1, 2), v=v.transpose(1, 2),
            out=out.transpose(1, 2), softmax_lse=lse, dq=dq, dk=dk, dv=dv,
            deterministic=torch.are_deterministic_algorithms_enabled(), rng_state=None,
        )
        self._run(self._backward, self._backward_params, values, "_flash_attn_backward", window, softcap)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    def _varlen_forward_row(self, q, k, v, documents, is_causal: bool, scale: float | None, window=NO_WINDOW,
                            softcap: float = 0.0):
        values = self._common(q, is_causal, scale, window, softcap)
        values.update(q=q, k=k, v=v, return_softmax=False, **self._varlen_values(documents))
        result = self._run(self._require(self._varlen_forward), self._varlen_forward_params, values,
                           "_flash_attn_varlen_forward", window, softcap)
        # the same return forms as the dense forward (8 values in 2.5/2.6, 4 in 2.7+)
        return (result[0], result[5]) if len(result) == 8 else (result[0], result[1])

    def _varlen_backward_row(self, dout, q, k, v, out, lse, documents, is_causal: bool, scale: float | None,
                             window=NO_WINDOW, softcap: float = 0.0):
        dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
        values = self._common(q, is_causal, scale, window, softcap)
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
    def _common(q, is_causal, scale, window=NO_WINDOW, softcap: float = 0.0) -> dict:
        left, right = window
        return {
            "dropout_p": 0.0,
            "softmax_scale": q.shape[-1] ** -0.5 if scale is None else scale,
            "causal": is_causal,
            "window_size": (left, right),
            "window_size_left": left,
            "window_size_right": right,
            "softcap": float(softcap),
            "alibi_slopes": None,
        }


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


@functools.cache
def _cuda_kernels():
    interface = _flash_attn_interface()
    return AtenCudaKernels() if interface is None else FlashAttnKernels(interface)


_CPU = CpuKernels()


def kernels_for(q: torch.Tensor):
    """The kernel pair for ``q``'s device (refusing what the CUDA kernels cannot take)."""
    if q.device.type == "cpu":
        return _CPU
    if q.device.type == "cuda":
        problems = cuda_problems(q.dtype, q.shape[-1])
        if problems:
            raise UnsupportedAttention("; ".join(problems))
        return _cuda_kernels()
    raise UnsupportedAttention(f"no UPipe attention kernel for device type {q.device.type!r} (cpu and cuda are supported)")


def forward(q, k, v, is_causal: bool, scale: float | None, documents=None, window=NO_WINDOW, softcap: float = 0.0):
    """(out, lse); with ``documents`` (more than one) attention stays inside each."""
    kernel, is_causal, window, softcap = _prepared(q, k, is_causal, window, softcap)
    if documents is None or documents.is_single:
        return kernel.forward(q, k, v, is_causal, scale, window, softcap)
    return kernel.forward_documents(q, k, v, documents, is_causal, scale, window, softcap)


def backward(dout, q, k, v, out, lse, is_causal: bool, scale: float | None, documents=None, window=NO_WINDOW,
             softcap: float = 0.0):
    kernel, is_causal, window, softcap = _prepared(q, k, is_causal, window, softcap)
    packed = documents is not None and not documents.is_single
    with _backward_workspace(q, k, documents if packed else None):
        if not packed:
            return kernel.backward(dout, q, k, v, out, lse, is_causal, scale, window, softcap)
        return kernel.backward_documents(dout, q, k, v, out, lse, documents, is_causal, scale, window, softcap)


def _prepared(q, k, is_causal: bool, window, softcap):
    """The kernel for ``q`` and the checked variant in its plainest form (see :func:`_effective`),
    refusing what that kernel cannot run."""
    kernel = kernels_for(q)
    window, softcap = check_variant(window, softcap)
    is_causal, window = _effective(is_causal, window, q.shape[2], k.shape[2])
    problems = kernel.variant_problems(window, softcap)
    if problems:
        raise UnsupportedAttention("; ".join(problems))
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
