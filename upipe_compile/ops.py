"""The compiler contract: ``upipe::attention`` / ``upipe::attention_backward``.

They are ``torch.library`` custom ops with fake kernels, so torch.compile treats the stage
loop (:mod:`upipe_compile.stage_loop`) as one opaque node and never unrolls it (unrolling
would let autograd keep every stage's buffers alive; see docs/design.md). The ops take the
settings as scalar arguments (torch.library needs those); :func:`op_arguments` and
:func:`parse_op_arguments` turn a :class:`~upipe_compile.options.StageLoopSettings` into them
and back. What autograd saves and how backward replays it is defined once
(:func:`save_for_backward`, :func:`replay_backward`) and shared by the op's autograd and the
eager autograd.Function that memory measurements run under FakeTensorMode (where the op
would only run its fake kernel).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Optional

import torch

from upipe_compile import collectives
from upipe_compile.documents import Documents, documents_for
from upipe_compile.errors import UnsupportedAttention
from upipe_compile.options import StageLoopSettings
from upipe_compile.stage_loop import schedule_for, stage_loop_backward, stage_loop_forward

# The first call per shape syncs with the host (the cross-rank shape check, head indices
# and kernel markers made once), so CUDA graphs must not capture the ops.
OP_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def op_arguments(q, k, v, settings: StageLoopSettings, cu_seqlens=None) -> tuple:
    """``upipe::attention``'s arguments (tensors or FX nodes), the boundaries left out when None."""
    return (q, k, v, *settings.op_args()) + (() if cu_seqlens is None else (cu_seqlens,))


def parse_op_arguments(args) -> tuple:
    """``(q, k, v, settings, cu_seqlens)`` from ``upipe::attention``'s arguments as given
    (trailing defaults may be left out)."""
    q, k, v, *rest = args
    scalars = len(fields(StageLoopSettings))
    cu_seqlens = rest[scalars] if len(rest) > scalars else None
    return q, k, v, StageLoopSettings.from_op_args(*rest[:scalars]), cu_seqlens


def documents_of(cu_seqlens: Optional[torch.Tensor], q: torch.Tensor, group_name: str) -> Optional[Documents]:
    """Checked boundaries (see :mod:`upipe_compile.documents`: once per boundaries tensor,
    on every rank at once), or None for one sequence per batch row."""
    if cu_seqlens is None:
        return None
    group = collectives.group_from_name(group_name)
    return documents_for(cu_seqlens, q.shape[2] * group.size(), group, q.device)


def check_world(world_size: int, group_name: str) -> None:
    actual = collectives.group_from_name(group_name).size()
    if actual != world_size:
        raise UnsupportedAttention(
            f"this graph was compiled for {world_size} context-parallel ranks but group {group_name!r} has {actual}; "
            "recompile (torch._dynamo.reset()) for the new group"
        )


# P (world_size) is an explicit argument (not read from the group) so that it is part of
# the graph, and so of every compile cache key: a graph compiled for P = 2 is never reused
# for P = 4.
@torch.library.custom_op("upipe::attention", mutates_args=(), tags=OP_TAGS)
def attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    is_causal: bool, scale: Optional[float], heads_per_stage: int, world_size: int, group_name: str,
    prefetch: str = "forward", cu_seqlens: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    settings = StageLoopSettings.from_op_args(is_causal, scale, heads_per_stage, world_size, group_name, prefetch)
    check_world(world_size, group_name)
    return stage_loop_forward(q, k, v, settings, documents_of(cu_seqlens, q, group_name))


@attention_op.register_fake
def _attention_fake(q, k, v, is_causal, scale, heads_per_stage, world_size, group_name, prefetch="forward",
                    cu_seqlens=None):
    schedule = schedule_for(q, k, world_size, heads_per_stage)
    batch, _, s_local, _ = q.shape
    lse = q.new_empty((len(schedule.stages), batch, schedule.q_per_rank, s_local * world_size), dtype=torch.float32)
    return q.new_empty(q.shape), lse


@torch.library.custom_op("upipe::attention_backward", mutates_args=(), tags=OP_TAGS)
def attention_backward_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    is_causal: bool, scale: Optional[float], heads_per_stage: int, world_size: int, group_name: str,
    prefetch: str = "forward", cu_seqlens: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    settings = StageLoopSettings.from_op_args(is_causal, scale, heads_per_stage, world_size, group_name, prefetch)
    check_world(world_size, group_name)
    return stage_loop_backward(dout, q, k, v, out, lse, settings, documents_of(cu_seqlens, q, group_name))


@attention_backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, is_causal, scale, heads_per_stage, world_size, group_name,
                             prefetch="forward", cu_seqlens=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# --- what autograd saves and how backward replays it (shared by the op and its twin) ----
def save_for_backward(ctx, inputs: tuple, outputs: tuple) -> None:
    """Save what backward needs: the local q, k, v, out and the per-stage LSE (and the
    boundaries: a tensor, saved, not captured). ``inputs``: the op's arguments
    (:func:`op_arguments`); ``outputs``: ``(out, lse)``."""
    q, k, v, settings, cu_seqlens = parse_op_arguments(inputs)
    out, lse = outputs
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.settings = settings


def replay_backward(ctx, dout: torch.Tensor, *, eager: bool = False) -> tuple:
    """``(dq, dk, dv)`` from what :func:`save_for_backward` saved: through
    ``upipe::attention_backward``, or with ``eager`` the backward loop itself."""
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    settings = ctx.settings
    if eager:
        return stage_loop_backward(dout, q, k, v, out, lse, settings, documents_of(cu_seqlens, q, settings.group_name))
    return attention_backward_op(dout, q, k, v, out, lse, *settings.op_args(), cu_seqlens)


_OP_ARGUMENTS = 10  # q, k, v, the six settings, cu_seqlens


def _setup_context(ctx, inputs, output):
    save_for_backward(ctx, inputs, output)


def _backward(ctx, dout, _dlse):
    return replay_backward(ctx, dout) + (None,) * (_OP_ARGUMENTS - 3)


attention_op.register_autograd(_backward, setup_context=_setup_context)
