"""cuDNN attention through torch alone (``aten::_scaled_dot_product_cudnn_attention`` and its
backward): on sm90 the fastest kernel that needs no extra package.

Schemas (identical in torch 2.13, read with ``op.default._schema``, and in torch 2.8-2.11,
pytorch native_functions.yaml):

- ``_scaled_dot_product_cudnn_attention(Tensor query, Tensor key, Tensor value, Tensor?
  attn_bias, bool compute_log_sumexp, float dropout_p=0., bool is_causal=False, bool
  return_debug_mask=False, *, float? scale=None) -> (Tensor output, Tensor logsumexp, Tensor
  cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, Tensor philox_seed, Tensor
  philox_offset, Tensor debug_attn_mask)``; ``logsumexp`` is ``[B, H, S, 1]`` float32
  (contiguous on the dense path), the output has q's memory layout.
- ``_scaled_dot_product_cudnn_attention_backward(Tensor grad_out, Tensor query, Tensor key,
  Tensor value, Tensor out, Tensor logsumexp, Tensor philox_seed, Tensor philox_offset,
  Tensor attn_bias, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float
  dropout_p, bool is_causal, *, float? scale=None) -> (Tensor, Tensor, Tensor)``; the
  undefined tensors (bias, cumulative lengths) go in as None, as torch's autograd passes them.

What it takes: ``[B, H, S, D]`` with any strides but a contiguous last dimension (the stage
buffers' ``[B, S, H, D]`` views as they are), fewer KV heads natively (cuDNN SDPA's GQA;
torch's dispatcher accepts it since pytorch#150337), fp16/bf16, head_dim a multiple of 8 up
to 128 (256 on sm90 with cuDNN >= 9.10), at least 2 keys (a 1-key call, a one-token
document, is computed here: its softmax is 1). Causal is top-left aligned (SDPA's
convention), which for q and k of one length is the contract's.

Refused (no parameter in this aten entry): a sliding window, softcap, ALiBi; so also causal
attention between q and k of different lengths (the contract spells it as a window). Packed
documents run the dense kernel once per document (:class:`PerDocumentKernels`): exact, one
launch per document. (Newer torch also exposes ``_cudnn_attention_forward`` with
``cum_seq_q/k``, a varlen path; not used until it can be checked on a GPU.) cuDNN's backward
is not deterministic: under ``torch.use_deterministic_algorithms(True)`` (not warn-only) the
registry skips it, as SDPA's dispatcher does.
"""

from __future__ import annotations

import functools

import torch

from upipe_compile.attention.device_constants import made_once
from upipe_compile.attention.kernels import hopper_family
from upipe_compile.attention.kernels.contract import NO_WINDOW, refuse_unrunnable_variant
from upipe_compile.attention.kernels.per_document import PerDocumentKernels
from upipe_compile.attention.varlen_groups import round_up

_aten = torch.ops.aten

# Argument names this adapter passes, per op; checked on the installed torch's schemas.
_FORWARD_ARGS = ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
                 "return_debug_mask", "scale")
_BACKWARD_ARGS = ("grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset",
                  "attn_bias", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale")
_FIX = "install flash-attn (pip install 'flash-attn>=2.6') or FlashAttention-3/4, which then run these calls"


class CudnnKernels(PerDocumentKernels):
    """cuDNN's SDPA forward/backward with the log-sum-exp, on sm90 to sm121."""

    name = "cudnn"
    checked_on_device = False  # not yet run on a GPU: checked at first use

    @classmethod
    def installed(cls) -> "CudnnKernels | None":
        """An instance where cuDNN attention runs here (GPU sm90-sm121, cuDNN >= 9, torch's
        schemas as above, not disabled with ``torch.backends.cuda.enable_cudnn_sdp(False)``,
        no strict deterministic mode), else None."""
        capability = hopper_family.cuda_capability()
        if capability is None or not (9, 0) <= capability <= (12, 1):
            return None
        if not torch.backends.cudnn.is_available() or (torch.backends.cudnn.version() or 0) < 90000:
            return None
        if not torch.backends.cuda.cudnn_sdp_enabled() or not _schemas_match():
            return None
        if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
            return None
        return cls()

    def variant_problems(self, window, softcap: float, alibi: bool = False) -> list[str]:
        what = "cuDNN attention (aten::_scaled_dot_product_cudnn_attention, this machine's CUDA kernel)"
        problems = []
        if window != NO_WINDOW:
            problems.append(f"window={window}: {what} has no sliding window (nor causal attention between q and k "
                            f"of different lengths); {_FIX}")
        if softcap:
            problems.append(f"softcap={softcap}: {what} has no logit soft-capping; {_FIX}")
        if alibi:
            problems.append(f"ALiBi (alibi_slopes): {what} has no ALiBi bias; install flash-attn 2.5 to 2.8 "
                            "(pip install 'flash-attn>=2.5,<2.9')")
        return problems

    @staticmethod
    def input_problems(dtype: torch.dtype, head_dim: int) -> list[str]:
        problems = []
        if dtype not in (torch.float16, torch.bfloat16):
            problems.append(f"q is {dtype} on CUDA; cuDNN attention needs fp16 or bf16: run attention under "
                            "torch.autocast or cast the model to bf16")
        limit = _head_dim_limit()
        if head_dim % 8 or head_dim > limit:
            problems.append(f"head_dim={head_dim}: cuDNN attention needs a multiple of 8 that is at most {limit} "
                            f"here; pad the model's head_dim (e.g. to {min(round_up(head_dim, 8), limit)})")
        return problems

    @staticmethod
    def backward_workspace(batch, q_heads, kv_heads, seq, head_dim, dtype, deterministic, sms, documents=None):
        """cuDNN sizes its backward workspace itself (``get_workspace_size()``, allocated
        through torch's caching allocator) and does not document it. Measured on an H200
        (torch 2.11, cuDNN 9, benchmarks/results/gpu/gpu_rank_flagship_h200.md): 8.031 GiB in one
        allocation for 4 query heads over 1 KV head, 2M tokens, head_dim 128, bf16, which is
        exactly an fp32 dQ accumulator and fp32 row sums dO·O per query head plus, with GQA,
        dK and dV expanded to every query head in the input dtype (reduced to the KV heads
        after). Packed documents run per document, so the model's largest call is one document's."""
        fp32 = torch.float32
        workspace = {
            "softmax_sum": ((batch, q_heads, seq), fp32),
            "dq_accum": ((batch, q_heads, seq, head_dim), fp32),
        }
        if kv_heads != q_heads:
            workspace["dk_expanded"] = ((batch, q_heads, seq, head_dim), dtype)
            workspace["dv_expanded"] = ((batch, q_heads, seq, head_dim), dtype)
        return workspace

    def forward(self, q, k, v, is_causal: bool, scale: float | None, window=NO_WINDOW, softcap: float = 0.0,
                alibi_slopes=None):
        refuse_unrunnable_variant(self, window, softcap, alibi_slopes)
        if k.shape[2] == 1:
            return _one_key_forward(q, k, v, scale)
        out, lse, *_ = _aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, is_causal, False,
                                                                 scale=scale)
        return out, lse.reshape(q.shape[:3])  # [B, H, S, 1] -> the contract's [B, H, S]

    def backward(self, dout, q, k, v, out, lse, is_causal: bool, scale: float | None, window=NO_WINDOW,
                 softcap: float = 0.0, alibi_slopes=None):
        refuse_unrunnable_variant(self, window, softcap, alibi_slopes)
        if k.shape[2] == 1:
            return _one_key_backward(dout, q, k, v)
        seed, offset = _philox_markers(q.device, q.dtype)
        return _aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.unsqueeze(-1).contiguous(), seed, offset, None, None, None, q.shape[2],
            k.shape[2], 0.0, is_causal, scale=scale,
        )


def _one_key_forward(q, k, v, scale):
    """Attention over a single key (cuDNN refuses ``S_kv = 1``): every row's softmax is 1,
    so the output is that key's value and the log-sum-exp its score."""
    group = q.shape[1] // k.shape[1]
    k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    lse = (q.float() * k_rep.float()).sum(-1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    return v_rep.expand(q.shape[:3] + v.shape[3:]).to(q.dtype).contiguous(), lse


def _one_key_backward(dout, q, k, v):
    """The softmax of one key is constant: dq and dk are zero, dv sums dout over the rows
    and the query heads that share the KV head."""
    batch, kv_heads, _, dim = v.shape
    dv = dout.float().sum(2, keepdim=True).reshape(batch, kv_heads, -1, 1, dim).sum(2)
    return torch.zeros_like(q), torch.zeros_like(k), dv.to(v.dtype)


def _philox_markers(device, dtype):
    """The forward's dropout seed/offset, which the backward wants back (unused without
    dropout, but read on some GPUs); made once per device from a tiny forward."""

    def make():
        x = torch.zeros(1, 1, 2, 8, device=device, dtype=dtype)
        result = _aten._scaled_dot_product_cudnn_attention(x, x, x, None, True, 0.0, False, False)
        return result[6], result[7]

    return made_once(("cudnn philox markers", device, dtype), make)


@functools.cache
def _schemas_match() -> bool:
    """Whether this torch's cuDNN attention ops take the arguments this adapter passes, in order."""
    for name, wanted in (("_scaled_dot_product_cudnn_attention", _FORWARD_ARGS),
                         ("_scaled_dot_product_cudnn_attention_backward", _BACKWARD_ARGS)):
        op = getattr(_aten, name, None)
        if op is None or tuple(arg.name for arg in op.default._schema.arguments) != wanted:
            return False
    return True


@functools.cache
def _head_dim_limit() -> int:
    """cuDNN's head-dim limit here: 256 on sm90 with cuDNN >= 9.10, else 128 (torch's
    ``check_cudnn_tensor_shapes``)."""
    capability = hopper_family.cuda_capability()
    if capability == (9, 0) and (torch.backends.cudnn.version() or 0) >= 91000:
        return 256
    return 128
