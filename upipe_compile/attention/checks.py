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
from upipe_compile.attention.schedule import shape_problems


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
    alibi_slopes: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **rest) -> "AttentionCall":
        return cls(tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, q.device.type, **rest)


def per_head_problems(name: str, value, q_heads: int, each: str) -> list[str]:
    """Why ``value`` cannot be one floating-point ``each`` per query head (sinks' logits,
    ALiBi's slopes); empty when it can, or is None."""
    if value is None:
        return []
    if not isinstance(value, torch.Tensor):
        return [f"{name} must be a tensor of one {each} per query head, got {type(value).__name__}"]
    problems = []
    if tuple(value.shape) != (q_heads,):
        problems.append(f"{name} must have shape [{q_heads}] (one {each} per query head), got {list(value.shape)}")
    if not value.dtype.is_floating_point:
        problems.append(f"{name} must be a floating-point tensor, got {value.dtype}")
    return problems


def attention_problems(call: AttentionCall, world: int, heads_per_stage: int) -> list[str]:
    """Why UPipe cannot run ``call`` on ``world`` all-to-all ranks with ``heads_per_stage``
    (over a ring too: it runs every call the stage loop runs); empty when it can."""
    problems = shape_problems(call.q_shape, call.k_shape, call.v_shape, call.enable_gqa, world, heads_per_stage)
    if len(call.q_shape) == 4:
        problems += per_head_problems("sinks", call.sinks, int(call.q_shape[1]), "logit")
        problems += per_head_problems("alibi_slopes", call.alibi_slopes, int(call.q_shape[1]), "slope")
        if isinstance(call.alibi_slopes, torch.Tensor) and call.alibi_slopes.requires_grad:
            problems.append("alibi_slopes requires grad: upipe applies ALiBi with fixed slopes and gives them no "
                            "gradient (ALiBi's slopes are not trained); pass alibi_slopes.detach()")
        if call.device_type == "cuda":  # at the width both are padded to (head_dims.py)
            problems += cuda_problems(call.dtype, max(int(call.q_shape[-1]), int(call.v_shape[-1])))
    problems += variant_problems(call.device_type, call.window, call.softcap, call.alibi_slopes is not None)
    return problems
