"""Attention kernels that return the log-sum-exp, behind one interface.

``forward(q, k, v, is_causal, scale) -> (out, lse)`` and
``backward(dout, q, k, v, out, lse, is_causal, scale) -> (dq, dk, dv)`` with
q ``[B, Hq, S, D]``, k/v ``[B, Hkv, S, D]`` where ``Hkv`` divides ``Hq`` and query head
``h`` uses KV head ``h // (Hq // Hkv)`` (SDPA's ``enable_gqa`` rule); ``lse`` is
``[B, Hq, S]`` float32; dk/dv come back with k/v's head count. Every kernel here takes
fewer KV heads natively, so K/V are never repeated.

Packed sequences: both take ``documents`` (:class:`upipe_compile.documents.Documents`,
the checked boundaries of the full sequence); attention then stays inside each document.
One document over the whole sequence runs the dense kernel, exactly as without boundaries.
CPU runs the dense kernel once per document on slices of the stage buffers; CUDA runs the
kernels' variable-length ("varlen") forms on each batch row. No mask is ever built.

The kernel is picked by device: CPU uses aten's flash kernel for CPU; CUDA uses
flash-attn (2.5 to 2.8, :class:`FlashAttnKernels`) when it is importable, else aten's CUDA
flash kernel. No dropout, no mask: the passes refuse those before a kernel is ever called.

Under FakeTensorMode (memory measurement) the CPU kernels run, which allocate less than
the CUDA ones; :func:`modelled_cuda_kernel` makes them also allocate the CUDA kernel's
workspace (:data:`CUDA_BACKWARD_WORKSPACE`), so measured peaks are GPU peaks.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from typing import Callable, Iterator

import torch
from torch._subclasses.fake_tensor import is_fake

from upipe_compile.device_constants import made_once
from upipe_compile.errors import UnsupportedAttention

_aten = torch.ops.aten

CUDA_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


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
            f"{FLASH_MAX_HEAD_DIM}; pad the model's head_dim (e.g. to {min(_round_up(head_dim, 8), FLASH_MAX_HEAD_DIM)})"
        )
    return problems


class PerDocumentKernels:
    """Packed sequences by running the dense kernel once per document on slices of the
    full-sequence buffers (written into full-size out/lse, dq/dk/dv): exact, including the
    log-sum-exp backward needs, and with no allocation beyond one document's outputs."""

    def forward_documents(self, q, k, v, documents, is_causal: bool, scale: float | None):
        batch, heads, seq, _ = q.shape
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = q.new_empty((batch, heads, seq), dtype=torch.float32)
        for start, end in documents.spans:
            piece = slice(start, end)
            out_doc, lse_doc = self.forward(q[:, :, piece], k[:, :, piece], v[:, :, piece], is_causal, scale)
            out[:, :, piece].copy_(out_doc)
            lse[:, :, piece].copy_(lse_doc)
        return out, lse

    def backward_documents(self, dout, q, k, v, out, lse, documents, is_causal: bool, scale: float | None):
        dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
        for start, end in documents.spans:
            piece = slice(start, end)
            grads = self.backward(
                dout[:, :, piece], q[:, :, piece], k[:, :, piece], v[:, :, piece], out[:, :, piece],
                lse[:, :, piece].contiguous(), is_causal, scale,
            )
            for dest, grad in zip((dq, dk, dv), grads):
                dest[:, :, piece].copy_(grad)
        return dq, dk, dv


class CpuKernels(PerDocumentKernels):
    """aten's flash kernel for CPU (takes GQA natively)."""

    name = "aten-cpu"

    def forward(self, q, k, v, is_causal: bool, scale: float | None):
        return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)

    def backward(self, dout, q, k, v, out, lse, is_causal: bool, scale: float | None):
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, is_causal, scale=scale
        )


class VarlenKernels:
    """Packed sequences through a CUDA kernel's variable-length form, one batch row at a
    time: the row's ``[H, S, D]`` stage buffers go in as ``[S, H, D]`` views (no copies)
    with the documents' ``cu_seqlens`` as both query and key boundaries. Subclasses give
    ``_varlen_forward_row`` / ``_varlen_backward_row``. Their log-sum-exp comes either
    packed ``[H, S]`` or padded per document ``[n, H, max_len]`` (flash-attn 2.5); the
    stage loop keeps it packed and pads it again for a backward that wants it so."""

    lse_padded: bool | None = None  # learned from the first forward

    def forward_documents(self, q, k, v, documents, is_causal: bool, scale: float | None):
        batch, heads, seq, dim = q.shape
        lse = q.new_empty((batch, heads, seq), dtype=torch.float32)
        out = None if batch == 1 else q.new_empty((batch, seq, heads, dim))
        for row in range(batch):
            out_row, lse_row = self._varlen_forward_row(
                q[row].transpose(0, 1), k[row].transpose(0, 1), v[row].transpose(0, 1), documents, is_causal, scale
            )
            self.lse_padded = lse_row.dim() == 3
            lse[row].copy_(_packed_lse(lse_row, documents) if self.lse_padded else lse_row)
            if out is None:
                out = out_row.unsqueeze(0)
            else:
                out[row].copy_(out_row)
        return out.transpose(1, 2), lse

    def backward_documents(self, dout, q, k, v, out, lse, documents, is_causal: bool, scale: float | None):
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
                    *(t[start:end] for t in tensors), lse_group, group, is_causal, scale)
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
    ``torch.use_deterministic_algorithms``."""

    name = "aten-flash"

    def forward(self, q, k, v, is_causal: bool, scale: float | None):
        out, lse, *_ = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, is_causal: bool, scale: float | None):
        cum_q, cum_k, seed, offset = _aten_cuda_dense_markers(q.device, q.dtype)
        seq = q.shape[2]
        return _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, seq, seq, 0.0, is_causal, seed, offset, scale=scale
        )


    def _varlen_forward_row(self, q, k, v, documents, is_causal: bool, scale: float | None):
        cu, longest = documents.cu_seqlens, documents.max_length
        out, lse, *_ = _aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, is_causal, False,
                                                      scale=scale)
        return out, lse

    def _varlen_backward_row(self, dout, q, k, v, out, lse, documents, is_causal: bool, scale: float | None):
        _, _, seed, offset = _aten_cuda_dense_markers(q.device, q.dtype)
        cu, longest = documents.cu_seqlens, documents.max_length
        return _aten._flash_attention_backward(
            dout, q, k, v, out, lse, cu, cu, longest, longest, 0.0, is_causal, seed, offset, scale=scale
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
    refused with the version's parameter list, never silently dropped.

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

    def forward(self, q, k, v, is_causal: bool, scale: float | None):
        values = self._common(q, is_causal, scale)
        values.update(q=q.transpose(1, 2), k=k.transpose(1, 2), v=v.transpose(1, 2), return_softmax=False)
        result = _call(self._forward, self._forward_params, values, "_flash_attn_forward")
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

    def backward(self, dout, q, k, v, out, lse, is_causal: bool, scale: float | None):
        # flash writes dq/dk/dv in place; allocated [B, S, H, D] as it wants them.
        dq, dk, dv = (torch.empty_like(t.transpose(1, 2), memory_format=torch.contiguous_format) for t in (q, k, v))
        values = self._common(q, is_causal, scale)
        values.update(
            dout=dout.transpose(1, 2), q=q.transpose(1, 2), k=k.transpose(1, 2), v=v.transpose(1, 2),
            out=out.transpose(1, 2), softmax_lse=lse, dq=dq, dk=dk, dv=dv,
            deterministic=torch.are_deterministic_algorithms_enabled(), rng_state=None,
        )
        _call(self._backward, self._backward_params, values, "_flash_attn_backward")
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    def _varlen_forward_row(self, q, k, v, documents, is_causal: bool, scale: float | None):
        values = self._common(q, is_causal, scale)
        values.update(q=q, k=k, v=v, return_softmax=False, **self._varlen_values(documents))
        result = _call(self._require(self._varlen_forward), self._varlen_forward_params, values,
                       "_flash_attn_varlen_forward")
        # the same return forms as the dense forward (8 values in 2.5/2.6, 4 in 2.7+)
        return (result[0], result[5]) if len(result) == 8 else (result[0], result[1])

    def _varlen_backward_row(self, dout, q, k, v, out, lse, documents, is_causal: bool, scale: float | None):
        dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
        values = self._common(q, is_causal, scale)
        values.update(
            dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
            deterministic=torch.are_deterministic_algorithms_enabled(), rng_state=None,
            **self._varlen_values(documents),
        )
        _call(self._require(self._varlen_backward), self._varlen_backward_params, values,
              "_flash_attn_varlen_backward")
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
    def _common(q, is_causal, scale) -> dict:
        return {
            "dropout_p": 0.0,
            "softmax_scale": q.shape[-1] ** -0.5 if scale is None else scale,
            "causal": is_causal,
            "window_size": (-1, -1),
            "window_size_left": -1,
            "window_size_right": -1,
            "softcap": 0.0,
            "alibi_slopes": None,
        }


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


def forward(q, k, v, is_causal: bool, scale: float | None, documents=None):
    """(out, lse); with ``documents`` (more than one) attention stays inside each."""
    kernel = kernels_for(q)
    if documents is None or documents.is_single:
        return kernel.forward(q, k, v, is_causal, scale)
    return kernel.forward_documents(q, k, v, documents, is_causal, scale)


def backward(dout, q, k, v, out, lse, is_causal: bool, scale: float | None, documents=None):
    kernel = kernels_for(q)
    packed = documents is not None and not documents.is_single
    with _modelled_backward_workspace(q, k, documents if packed else None):
        if not packed:
            return kernel.backward(dout, q, k, v, out, lse, is_causal, scale)
        return kernel.backward_documents(dout, q, k, v, out, lse, documents, is_causal, scale)


# --- what CUDA kernels allocate beyond their outputs, for fake-tensor measurements ------
H100_SMS = 132
"""Streaming multiprocessors of an H100 SXM: flash's deterministic backward keeps one dq
accumulator per split, and it splits until every SM has work."""


def _ceil_div(x: int, y: int) -> int:
    return -(-x // y)


def _round_up(x: int, multiple: int) -> int:
    return _ceil_div(x, multiple) * multiple


def varlen_backward_groups(documents, q_heads: int, deterministic: bool, sms: int = H100_SMS) -> list[tuple[int, int]]:
    """Documents ``[first, last)`` per varlen backward call. flash's varlen backward pads its
    fp32 ``dq_accum`` and ``softmax_d`` by 128 rows per document (``mha_varlen_bwd``): over a
    1M-token row of 1000 documents, 12% more than the dense kernel's. Documents are taken in
    order while a call's padded rows (times its deterministic splits) stay within the dense
    kernel's for the whole row; a document that alone exceeds it is a call of its own."""
    seq = documents.bounds[-1]

    def size(tokens: int, count: int) -> int:
        splits = _ceil_div(sms, count * q_heads) if deterministic else 1
        return splits * (tokens + 128 * count)

    dense = size(_round_up(seq, 128) - 128, 1)  # the dense kernel's rows x splits (batch 1)
    groups, first = [], 0
    for last in range(1, len(documents.spans) + 1):
        tokens = documents.bounds[last] - documents.bounds[first]
        if last - first > 1 and size(tokens, last - first) > dense:
            groups.append((first, last - 1))
            first = last - 1
    groups.append((first, len(documents.spans)))
    return groups


def flash_backward_workspace(batch: int, q_heads: int, kv_heads: int, seq: int, head_dim: int, dtype: torch.dtype,
                             deterministic: bool, sms: int = H100_SMS,
                             documents: int | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The buffers flash's dense backward (flash-attn 2.x ``mha_bwd``, also vendored by aten)
    allocates besides dq/dk/dv: ``name -> (shape, dtype)``. With ``documents`` (packed
    sequences, one varlen call per batch row) those of ``mha_varlen_bwd``, whose per-row
    buffers are padded by 128 rows per document instead of rounding the sequence up."""
    dim_rounded = _round_up(head_dim, 32 if head_dim <= 128 else 64)
    if documents is None:
        lead, rows, work_units = (batch,), _round_up(seq, 128), batch
    else:
        lead, rows, work_units = (), seq + 128 * documents, documents
    splits = _ceil_div(sms, work_units * q_heads) if deterministic else 1
    workspace = {
        "softmax_d": ((*lead, q_heads, rows), torch.float32),
        "dq_accum": ((splits, *lead, rows, q_heads, dim_rounded), torch.float32),
    }
    if kv_heads != q_heads:  # GQA: per-query-head dK/dV, summed into the KV heads at the end
        workspace["dk_expanded"] = ((*lead, seq, q_heads, head_dim), dtype)
        workspace["dv_expanded"] = ((*lead, seq, q_heads, head_dim), dtype)
    return workspace


def aten_flash_backward_workspace(batch, q_heads, kv_heads, seq, head_dim, dtype, deterministic, sms=H100_SMS,
                                  documents=None):
    """aten's flash backward: flash's workspace plus the ``[B, S, H, D]`` copies it makes of
    ``dout`` and ``out`` (the stage buffers are ``[B, H, S, D]``; per row when packed)."""
    workspace = flash_backward_workspace(batch, q_heads, kv_heads, seq, head_dim, dtype, deterministic, sms, documents)
    rows = 1 if documents is not None else batch
    workspace["dout_contiguous"] = ((rows, seq, q_heads, head_dim), dtype)
    workspace["out_contiguous"] = ((rows, seq, q_heads, head_dim), dtype)
    return workspace


CUDA_BACKWARD_WORKSPACE = {"flash-attn": flash_backward_workspace, "aten-flash": aten_flash_backward_workspace}
"""Per CUDA kernel, its backward's workspace. The forwards allocate only out and lse (their
split-KV accumulators are used only when batch x heads x query blocks leaves SMs idle,
never at long context), so they need no entry."""

_modelled_kernel: str | None = None


@contextlib.contextmanager
def modelled_cuda_kernel(name: str = "flash-attn") -> Iterator[None]:
    """While active, kernels running on fake tensors also allocate (and free after the call)
    the workspace of CUDA kernel ``name``, so that a MemTracker counts it."""
    global _modelled_kernel
    if name not in CUDA_BACKWARD_WORKSPACE:
        raise ValueError(f"unknown CUDA kernel {name!r}; one of {sorted(CUDA_BACKWARD_WORKSPACE)}")
    previous, _modelled_kernel = _modelled_kernel, name
    try:
        yield
    finally:
        _modelled_kernel = previous


@contextlib.contextmanager
def _modelled_backward_workspace(q, k, documents=None) -> Iterator[None]:
    """Packed: the workspace of the largest of the row's grouped varlen calls (they run one
    after another, see :func:`varlen_backward_groups`)."""
    if _modelled_kernel is None or not is_fake(q):
        yield
        return
    batch, q_heads, seq, head_dim = q.shape
    deterministic = torch.are_deterministic_algorithms_enabled()
    count = None
    if documents is not None:
        calls = [(documents.bounds[last] - documents.bounds[first], last - first)
                 for first, last in varlen_backward_groups(documents, q_heads, deterministic)]
        shape_of = lambda call: CUDA_BACKWARD_WORKSPACE[_modelled_kernel](  # noqa: E731
            batch, q_heads, k.shape[1], call[0], head_dim, q.dtype, deterministic, documents=call[1])
        seq, count = max(calls, key=lambda call: sum(math.prod(sh) * dt.itemsize for sh, dt in shape_of(call).values()))
    shapes = CUDA_BACKWARD_WORKSPACE[_modelled_kernel](
        batch, q_heads, k.shape[1], seq, head_dim, q.dtype, deterministic, documents=count,
    )
    workspace = [q.new_empty(shape, dtype=dtype) for shape, dtype in shapes.values()]
    try:
        yield
    finally:
        del workspace
