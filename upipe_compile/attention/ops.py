"""The compiler contract: ``upipe::attention`` / ``upipe::attention_backward``.

They are ``torch.library`` custom ops with fake kernels, so torch.compile treats the stage
loop (:mod:`upipe_compile.attention.stage_loop`) as one opaque node and never unrolls it (unrolling
would let autograd keep every stage's buffers alive; see docs/design.md). The ops take the
settings as scalar arguments (torch.library needs those); :func:`op_arguments` and
:func:`parse_op_arguments` turn a :class:`~upipe_compile.attention.stage_loop.StageLoopSettings` into them
and back. What autograd saves and how backward replays it is defined once
(:func:`save_for_backward`, :func:`replay_backward`) and shared by the op's autograd and the
eager autograd.Function that memory measurements run under FakeTensorMode (where the op
would only run its fake kernel).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Optional

import torch

from upipe_compile.attention import collectives, op_outputs
from upipe_compile.attention.document_boundaries import documents_of
from upipe_compile.errors import UnsupportedAttention
from upipe_compile.attention.stage_loop import (
    DEFAULT_PREFETCH, StageLoopSettings, schedule_for, stage_loop_backward, stage_loop_forward,
)

# The first call per shape syncs with the host (the cross-rank shape check, head indices
# and kernel markers made once), so CUDA graphs must not capture the ops.
OP_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def op_arguments(q, k, v, settings: StageLoopSettings, boundaries_or_positions=None, sinks=None,
                 alibi_slopes=None) -> tuple:
    """``upipe::attention``'s arguments (tensors or FX nodes), trailing Nones left out."""
    optional = (boundaries_or_positions, sinks, alibi_slopes)
    while optional and optional[-1] is None:
        optional = optional[:-1]
    return (q, k, v, *settings.op_args(), *optional)


def parse_op_arguments(args) -> tuple:
    """``(q, k, v, settings, boundaries_or_positions, sinks, alibi_slopes)`` from
    ``upipe::attention``'s arguments as given (trailing defaults may be left out)."""
    q, k, v, *rest = args
    scalars = len(fields(StageLoopSettings))
    optional = list(rest[scalars:]) + [None, None, None]
    return q, k, v, StageLoopSettings.from_op_args(*rest[:scalars]), optional[0], optional[1], optional[2]


def check_world(world_size: int, group_name: str) -> None:
    actual = collectives.group_from_name(group_name).size()
    if actual != world_size:
        raise UnsupportedAttention(
            f"this graph was compiled for {world_size} context-parallel ranks but group {group_name!r} has {actual}; "
            "recompile (torch._dynamo.reset()) for the new group"
        )


# P (world_size) is an explicit argument (not read from the group) so that it is part of
# the graph, and so of every compile cache key: a graph compiled for P = 2 is never reused
# for P = 4. ``cu_seqlens`` carries packed documents' boundaries (1-D) or 2-D position ids,
# read at run time (documents where they restart): see attention/document_boundaries.py.
# ``sinks`` and ``alibi_slopes`` are per-query-head tensors ``[Hq]`` (attention/sinks.py,
# attention/alibi.py).
@torch.library.custom_op("upipe::attention", mutates_args=(), tags=OP_TAGS)
def attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    is_causal: bool, scale: Optional[float], heads_per_stage: int, world_size: int, group_name: str,
    prefetch: str = DEFAULT_PREFETCH, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
    ring_group_name: str = "", cu_seqlens: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    settings = StageLoopSettings.from_op_args(is_causal, scale, heads_per_stage, world_size, group_name, prefetch,
                                              window_left, window_right, softcap, ring_group_name)
    check_world(world_size, group_name)
    documents = documents_of(cu_seqlens, q.shape[2], group_name, q.device, ring_group_name)
    out, lse = stage_loop_forward(q, k, v, settings, documents, sinks, alibi_slopes)
    op_outputs.report(out, lse)
    return out, lse


@attention_op.register_fake
def _attention_fake(q, k, v, is_causal, scale, heads_per_stage, world_size, group_name, prefetch=DEFAULT_PREFETCH,
                    window_left=-1, window_right=-1, softcap=0.0, ring_group_name="", cu_seqlens=None, sinks=None,
                    alibi_slopes=None):
    schedule = schedule_for(q, k, world_size, heads_per_stage)
    batch, _, s_local, _ = q.shape
    lse = q.new_empty(schedule.lse_shape(batch, s_local), dtype=torch.float32)
    out = q.new_empty(q.shape)
    op_outputs.report(out, lse)
    return out, lse


@torch.library.custom_op("upipe::attention_backward", mutates_args=(), tags=OP_TAGS)
def attention_backward_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    is_causal: bool, scale: Optional[float], heads_per_stage: int, world_size: int, group_name: str,
    prefetch: str = DEFAULT_PREFETCH, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
    ring_group_name: str = "", cu_seqlens: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dsinks)``; dsinks is empty without sinks (an op returns fixed outputs)."""
    settings = StageLoopSettings.from_op_args(is_causal, scale, heads_per_stage, world_size, group_name, prefetch,
                                              window_left, window_right, softcap, ring_group_name)
    check_world(world_size, group_name)
    documents = documents_of(cu_seqlens, q.shape[2], group_name, q.device, ring_group_name)
    dq, dk, dv, dsinks = stage_loop_backward(dout, q, k, v, out, lse, settings, documents, sinks, alibi_slopes)
    return dq, dk, dv, q.new_empty((0,)) if dsinks is None else dsinks


@attention_backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, is_causal, scale, heads_per_stage, world_size, group_name,
                             prefetch=DEFAULT_PREFETCH, window_left=-1, window_right=-1, softcap=0.0,
                             ring_group_name="", cu_seqlens=None, sinks=None, alibi_slopes=None):
    dsinks = q.new_empty((0,)) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


# --- what autograd saves and how backward replays it (shared by the op and its twin) ----
def save_for_backward(ctx, inputs: tuple, outputs: tuple) -> None:
    """Save what backward needs: the local q, k, v, out and the per-stage LSE (and the
    boundaries, sinks and ALiBi slopes: tensors, saved, not captured). ``inputs``: the op's
    arguments (:func:`op_arguments`); ``outputs``: ``(out, lse)``."""
    q, k, v, settings, boundaries_or_positions, sinks, alibi_slopes = parse_op_arguments(inputs)
    out, lse = outputs
    ctx.save_for_backward(q, k, v, out, lse, boundaries_or_positions, sinks, alibi_slopes)
    ctx.settings = settings


def replay_backward(ctx, dout: torch.Tensor, *, eager: bool = False) -> tuple:
    """``(dq, dk, dv, dsinks)`` from what :func:`save_for_backward` saved (dsinks None
    without sinks): through ``upipe::attention_backward``, or with ``eager`` the backward
    loop itself."""
    q, k, v, out, lse, boundaries_or_positions, sinks, alibi_slopes = ctx.saved_tensors
    settings = ctx.settings
    if eager:
        documents = documents_of(boundaries_or_positions, q.shape[2], settings.group_name, q.device,
                                 settings.ring_group_name)
        return stage_loop_backward(dout, q, k, v, out, lse, settings, documents, sinks, alibi_slopes)
    dq, dk, dv, dsinks = attention_backward_op(dout, q, k, v, out, lse, *settings.op_args(), boundaries_or_positions,
                                               sinks, alibi_slopes)
    return dq, dk, dv, None if sinks is None else dsinks


_OP_SCALARS = len(fields(StageLoopSettings))


def _setup_context(ctx, inputs, output):
    save_for_backward(ctx, inputs, output)


def _backward(ctx, dout, _dlse):
    dq, dk, dv, dsinks = replay_backward(ctx, dout)
    return (dq, dk, dv) + (None,) * _OP_SCALARS + (None, dsinks, None)  # the ALiBi slopes take no gradient


attention_op.register_autograd(_backward, setup_context=_setup_context)
