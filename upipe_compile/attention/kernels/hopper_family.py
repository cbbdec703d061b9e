"""What FlashAttention-3 and -4 share (:mod:`.flash_attn3`, :mod:`.flash_attn4`): the device
check, the adapter around a forward/backward pair that returns the log-sum-exp, and the
buffers their backward allocates besides dq/dk/dv.

Both libraries take ``[B, S, H, D]`` (or packed ``[total, H, D]`` with ``cu_seqlens``) with
only ``stride(-1) == 1`` required, fewer KV heads natively, a sliding window and softcap in
forward and backward, and return the log-sum-exp as ``[B, H, S]`` float32 (packed ``[H,
total]``), which is the contract's layout as it is. Neither has ALiBi: refused."""

from __future__ import annotations

import torch

from upipe_compile.attention.kernels.contract import NO_WINDOW, refuse_unrunnable_variant
from upipe_compile.attention.kernels.flash_attn import _parameters
from upipe_compile.attention.kernels.varlen import VarlenKernels
from upipe_compile.attention.varlen_groups import ceil_div, round_up
from upipe_compile.errors import UnsupportedAttention


def cuda_capability() -> tuple[int, int] | None:
    """The current CUDA device's compute capability, or None without a usable GPU."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


class HopperFlashKernels(VarlenKernels):
    """A FlashAttention-3/4 interface behind the contract. Subclasses name the functions
    (``forward_name``/``backward_name``), the window's spelling (``_window``) and the
    keywords of each call (``_forward_values``/``_backward_values``). Every argument goes
    by keyword, and a keyword the installed function has no parameter for is refused with
    the function's parameter list, never dropped."""

    name = ""
    checked_on_device = False  # not yet run on a GPU: checked at first use
    package = ""  # what to pip install, for messages
    forward_name = backward_name = ""
    arches: tuple[int, ...] = ()  # the GPUs' major compute capabilities it runs on
    modules: tuple[str, ...] = ()  # where its interface is importable from, tried in order

    @classmethod
    def installed(cls):
        """An instance where its interface imports and this GPU is one it runs on, else None."""
        capability = cuda_capability()
        if capability is None or capability[0] not in cls.arches:
            return None
        interface = import_first(*cls.modules)
        if interface is None or not hasattr(interface, cls.forward_name):
            return None
        return cls(interface)

    def __init__(self, interface):
        self.interface = interface
        self._forward = getattr(interface, self.forward_name)
        self._backward = getattr(interface, self.backward_name)
        self._forward_params = [name for name, _ in _parameters(self._forward)]
        self._backward_params = [name for name, _ in _parameters(self._backward)]

    # --- what it runs ---------------------------------------------------------------------
    def variant_problems(self, window, softcap: float, alibi: bool = False) -> list[str]:
        problems = []
        if alibi:
            problems.append(
                f"ALiBi (alibi_slopes): {self.name} ({self.package}) has no ALiBi bias; install flash-attn 2.5 "
                "to 2.8 (pip install 'flash-attn>=2.5,<2.9'), which then runs the ALiBi calls"
            )
        checks = [(f"window={window}", self._window_names())] if window != NO_WINDOW else []
        if softcap:
            checks.append((f"softcap={softcap}", ("softcap",)))
        for variant, names in checks:
            missing = [what for what, params in ((self.forward_name, self._forward_params),
                                                 (self.backward_name, self._backward_params))
                       if not all(n in params for n in names)]
            if missing:
                problems.append(f"{variant}: this {self.package} has no {'/'.join(names)} parameter in "
                                f"{', '.join(missing)}; upgrade it (pip install -U {self.package})")
        return problems

    @staticmethod
    def input_problems(dtype: torch.dtype, head_dim: int) -> list[str]:
        problems = []
        if dtype not in (torch.float16, torch.bfloat16):
            problems.append(f"q is {dtype} on CUDA; FlashAttention-3/4 train in fp16 or bf16: run attention under "
                            "torch.autocast or cast the model to bf16")
        if head_dim % 8 or not 8 <= head_dim <= 256:
            problems.append(f"head_dim={head_dim}: FlashAttention-3/4 on Hopper need a multiple of 8 from 8 to 256; "
                            f"pad the model's head_dim (e.g. to {min(max(round_up(head_dim, 8), 8), 256)})")
        return problems

    # --- calls ------------------------------------------------------------------------------
    def forward(self, q, k, v, is_causal: bool, scale: float | None, window=NO_WINDOW, softcap: float = 0.0,
                alibi_slopes=None):
        refuse_unrunnable_variant(self, window, softcap, alibi_slopes)
        out, lse = self._run_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal, scale,
                                     window, softcap, None)
        return out.transpose(1, 2), lse

    def backward(self, dout, q, k, v, out, lse, is_causal: bool, scale: float | None, window=NO_WINDOW,
                 softcap: float = 0.0, alibi_slopes=None):
        refuse_unrunnable_variant(self, window, softcap, alibi_slopes)
        # written in place, allocated [B, S, H, D] as the kernels write them
        grads = [torch.empty_like(t.transpose(1, 2), memory_format=torch.contiguous_format) for t in (q, k, v)]
        self._run_backward([t.transpose(1, 2) for t in (dout, q, k, v, out)], lse, grads, is_causal, scale, window,
                           softcap, None)
        return tuple(g.transpose(1, 2) for g in grads)

    def _varlen_forward_row(self, q, k, v, documents, is_causal: bool, scale: float | None, window=NO_WINDOW,
                            softcap: float = 0.0, alibi_slopes=None):
        refuse_unrunnable_variant(self, window, softcap, alibi_slopes)
        return self._run_forward(q, k, v, is_causal, scale, window, softcap, documents)

    def _varlen_backward_row(self, dout, q, k, v, out, lse, documents, is_causal: bool, scale: float | None,
                             window=NO_WINDOW, softcap: float = 0.0, alibi_slopes=None):
        refuse_unrunnable_variant(self, window, softcap, alibi_slopes)
        grads = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]
        self._run_backward([dout, q, k, v, out], lse, grads, is_causal, scale, window, softcap, documents)
        return tuple(grads)

    def _run_forward(self, q, k, v, is_causal, scale, window, softcap, documents):
        values = self._forward_values(q, k, v, is_causal, _scale(q, scale), window, float(softcap))
        result = self._call(self._forward, self._forward_params, self.forward_name,
                            {**values, **_varlen_values(documents)})
        return result[0], result[1]  # every release: (out, lse, ...)

    def _run_backward(self, tensors, lse, grads, is_causal, scale, window, softcap, documents):
        values = self._backward_values(*tensors, lse, *grads, is_causal, _scale(tensors[1], scale), window,
                                       float(softcap), torch.are_deterministic_algorithms_enabled())
        self._call(self._backward, self._backward_params, self.backward_name, {**values, **_varlen_values(documents)})

    def _call(self, fn, params: list[str], what: str, values: dict):
        # a variant left off needs no parameter: the library's default is off too
        values = {name: value for name, value in values.items() if name in params or value not in _OFF.get(name, ())}
        unknown = [name for name in values if name not in params]
        if unknown:
            raise UnsupportedAttention(
                f"this {self.package}'s {what} has no parameter {unknown} (its parameters: {params}); "
                f"upipe-compile needs a release that has them: pip install -U {self.package}"
            )
        return fn(**values)

    def _window_names(self) -> tuple[str, ...]:
        return ("window_size_left", "window_size_right")


_OFF = {"softcap": (0.0, None), "window_size_left": (-1, None), "window_size_right": (-1, None)}
"""Each variant keyword's values that mean "off", in FA3's and FA4's spellings."""


def _scale(q, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def _varlen_values(documents) -> dict:
    """Packed documents' keywords (the same names in FA3 and FA4); none for dense calls."""
    if documents is None:
        return {}
    cu, longest = documents.cu_seqlens, documents.max_length
    return {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": longest, "max_seqlen_k": longest}


def import_first(*modules: str):
    """The first of ``modules`` that imports, or None (a broken install is no install: the
    next kernel of the registry then runs)."""
    import importlib

    for module in modules:
        try:
            return importlib.import_module(module)
        except (ImportError, OSError, RuntimeError):
            continue
    return None


def hopper_backward_workspace(batch: int, q_heads: int, kv_heads: int, seq: int, head_dim: int,
                              deterministic: bool, documents: int | None, head_dim_rounded: int,
                              always_semaphore: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The buffers of FlashAttention-3's ``mha_bwd`` (hopper/flash_api.cpp) and FA4's
    ``_flash_attn_bwd`` (flash_attn/cute/interface.py) on Hopper besides dq/dk/dv, for the
    causal tiles (kBlockM 64 for head_dim > 64, else 128; kBlockN 128 up to 128, 96 up to
    192, else 80): ``softmax_d`` (dP sum) and ``softmax_lse_log2`` fp32 per query row, the
    fp32 ``dq_accum``, with GQA fp32 ``dk_accum``/``dv_accum`` per KV head, and int32
    semaphores (FA3 always allocates dQ's; FA4 only when deterministic). Packed
    (``documents``, one varlen call): rows padded by one tile per document."""
    block_m = 128 if head_dim <= 64 else 64
    block_n = 128 if head_dim <= 128 else (96 if head_dim <= 192 else 80)
    if documents is None:
        lead, rows_q, rows_k = (batch,), round_up(seq, block_m), round_up(seq, block_n)
    else:
        lead = ()
        rows_q, rows_k = round_up(seq + documents * block_m, block_m), round_up(seq + documents * block_n, block_n)
    fp32 = torch.float32
    workspace = {
        "softmax_d": ((*lead, q_heads, rows_q), fp32),
        "softmax_lse_log2": ((*lead, q_heads, rows_q), fp32),
        "dq_accum": ((*lead, q_heads, rows_q * head_dim_rounded), fp32),
    }
    if kv_heads != q_heads:  # several query heads add into one KV head's dK/dV
        workspace["dk_accum"] = ((*lead, kv_heads, rows_k * head_dim_rounded), fp32)
        workspace["dv_accum"] = ((*lead, kv_heads, rows_k * head_dim_rounded), fp32)
    if always_semaphore or deterministic:
        workspace["dq_semaphore"] = ((ceil_div(rows_q, block_m), batch, q_heads), torch.int32)
    if deterministic and kv_heads != q_heads:
        workspace["dk_semaphore"] = ((ceil_div(rows_k, block_n), batch, kv_heads), torch.int32)
        workspace["dv_semaphore"] = ((ceil_div(rows_k, block_n), batch, kv_heads), torch.int32)
    return workspace
