"""What an attention call must be for UPipe to run it exactly: the one list every entry point
asks (the backend's pass, ``upipe_attention``, ``upipe_attention_block``, ``document_sdpa``,
the memory measurement), so that the same call gets the same answer everywhere.

Each entry point adds only what is its own to check: the pass, that the graph's arguments
are known at compile time; the public functions, their option values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from upipe_compile.attention.kernels import NO_WINDOW, cuda_problems, variant_problems
from upipe_compile.attention.ring import ring_problems
from upipe_compile.attention.schedule import shape_problems
from upipe_compile.attention.sinks import check_sinks


@dataclass(frozen=True)
class AttentionCall:
    """One attention call as the checks see it: q ``[B, Hq, S, D]``, k/v ``[B, Hkv, S, D]``."""

    q_shape: tuple
    k_shape: tuple
    v_shape: tuple
    dtype: torch.dtype
    device_type: str
    enable_gqa: bool = True
    window: tuple = NO_WINDOW
    softcap: float = 0.0
    sinks: Optional[torch.Tensor] = None
    documents: bool = False
    """Packed documents' boundaries (1-D ``cu_seqlens``) are given; 2-D position ids are read at
    run time (documents only where they restart)."""

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **rest) -> "AttentionCall":
        return cls(tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, q.device.type, **rest)


def boundaries_given(cu_seqlens) -> bool:
    """Whether packed documents' boundaries are given (``cu_seqlens``, or a graph's argument
    whose value is unknown). 2-D position ids are not: they are read at run time, documents
    where they restart, one sequence where they count through (the layout's own positions
    under a ring, which are not monotonic on a rank)."""
    return cu_seqlens is not None and not (isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 2)


def attention_problems(call: AttentionCall, world: int, heads_per_stage: int, ring: bool = False) -> list[str]:
    """Why UPipe cannot run ``call`` on ``world`` all-to-all ranks with ``heads_per_stage``
    (over a ring too where ``ring``); empty when it can."""
    problems = shape_problems(call.q_shape, call.k_shape, call.v_shape, call.enable_gqa, world, heads_per_stage)
    if len(call.q_shape) == 4:
        problems += check_sinks(call.sinks, int(call.q_shape[1]))
        if call.device_type == "cuda":  # at the width both are padded to (head_dims.py)
            problems += cuda_problems(call.dtype, max(int(call.q_shape[-1]), int(call.v_shape[-1])))
    problems += variant_problems(call.device_type, call.window, call.softcap)
    if ring:
        problems += ring_problems(call.documents, call.window, call.softcap)
    return problems
