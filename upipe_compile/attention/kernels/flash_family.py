"""What flash-attn and aten's CUDA flash kernel (aten vendors flash-attn 2) share: the
dtypes and head dims their backward takes, and the buffers their backward allocates besides
dq/dk/dv (checked against an H100 and an H200: benchmarks/results/gpu/, section 2)."""

from __future__ import annotations

import torch

from upipe_compile.attention.varlen_groups import ceil_div, round_up

CUDA_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


def flash_input_problems(dtype: torch.dtype, head_dim: int) -> list[str]:
    """Why q of this dtype and head_dim cannot run on the flash kernels (empty: it can).
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


def flash_backward_workspace(batch: int, q_heads: int, kv_heads: int, seq: int, head_dim: int, dtype: torch.dtype,
                             deterministic: bool, sms: int,
                             documents: int | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The buffers flash's dense backward (flash-attn 2.x ``mha_bwd``, also vendored by aten)
    allocates besides dq/dk/dv: ``name -> (shape, dtype)``. With ``documents`` (packed
    sequences, one varlen call per batch row) those of ``mha_varlen_bwd``, whose per-row
    buffers are padded by 128 rows per document instead of rounding the sequence up."""
    dim_rounded = round_up(head_dim, 32 if head_dim <= 128 else 64)
    if documents is None:
        lead, rows, work_units = (batch,), round_up(seq, 128), batch
    else:
        lead, rows, work_units = (), seq + 128 * documents, documents
    splits = ceil_div(sms, work_units * q_heads) if deterministic else 1
    workspace = {
        "softmax_d": ((*lead, q_heads, rows), torch.float32),
        "dq_accum": ((splits, *lead, rows, q_heads, dim_rounded), torch.float32),
    }
    if kv_heads != q_heads:  # GQA: per-query-head dK/dV, summed into the KV heads at the end
        workspace["dk_expanded"] = ((*lead, seq, q_heads, head_dim), dtype)
        workspace["dv_expanded"] = ((*lead, seq, q_heads, head_dim), dtype)
    return workspace
