"""The UPipe stage-loop op: SDPA semantics on sequence-sharded q, k, v.

Forward, per stage (see :mod:`upipe_compile.schedule` for which heads): all-to-all this
stage's query heads sequence->head (KV only when the stage starts a new KV group), run
attention over the full sequence for ``m`` heads per rank, all-to-all the output
head->sequence straight into the preallocated local output. The full-sequence stage
buffers are allocated once per call and reused by every stage, so intermediate memory is
O(U) heads, not O(H).

Backward owns its memory: autograd saves only the local q, k, v, out and each stage's
log-sum-exp; backward redoes each stage's all-to-alls, runs the kernel's backward, and sends
dq (per stage) and dk/dv (per KV group) back to their sequence shards.

``upipe::attention`` / ``upipe::attention_backward`` are ``torch.library`` custom ops with
fake kernels, so torch.compile treats the loop as one opaque node and never unrolls it
(unrolling would let autograd keep every stage's buffers alive; see ARCHITECTURE.md).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from upipe_compile import collectives, kernels
from upipe_compile.errors import UnsupportedAttention
from upipe_compile.schedule import StageSchedule, plan_stages, shape_problems


def schedule_for(q: torch.Tensor, k: torch.Tensor, world: int, heads_per_stage: int) -> StageSchedule:
    return plan_stages(q.shape[1], k.shape[1], world, heads_per_stage)


_index_cache: dict[tuple, torch.Tensor] = {}


def _index(heads: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Head indices as a tensor on ``device``, made once (a host-to-device copy per stage
    would stall the GPU). Under FakeTensorMode each mode needs its own, so no caching."""
    if torch._guards.detect_fake_mode() is not None:
        return torch.tensor(heads, dtype=torch.long, device=device)
    key = (heads, device)
    if key not in _index_cache:
        _index_cache[key] = torch.tensor(heads, dtype=torch.long, device=device)
    return _index_cache[key]


def _stage_kv(kv_full: torch.Tensor, stage, device):
    """k and v for this stage's query heads in the layout the kernel takes: a slice when the
    slots already form plain GQA groups, else a gather (one copy of m heads)."""
    span = stage.kv_slot_range
    if span is not None:
        return kv_full[0][:, span[0]:span[1]], kv_full[1][:, span[0]:span[1]]
    slots = _index(stage.kv_slots, device)
    return kv_full[0].index_select(1, slots), kv_full[1].index_select(1, slots)


def _accumulate_stage_dkv(dkv_full: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, stage, device) -> None:
    span = stage.kv_slot_range
    if span is not None:
        dkv_full[0][:, span[0]:span[1]] += dk
        dkv_full[1][:, span[0]:span[1]] += dv
    else:
        slots = _index(stage.kv_slots, device)
        dkv_full[0].index_add_(1, slots, dk.to(dkv_full.dtype))
        dkv_full[1].index_add_(1, slots, dv.to(dkv_full.dtype))


def _heads_to_full_sequence(x, head_index, world: int, group_name: str, into: torch.Tensor) -> None:
    """Sequence -> head all-to-all of one tensor: this rank's heads over the full sequence,
    written into the reusable buffer ``into``. One tensor per all-to-all, so a stage never
    holds more than one tensor's send and receive copies at once."""
    recv = collectives.all_to_all(collectives.pack_heads(x, head_index, world), group_name)
    collectives.assemble_sequence(recv, into)


def _full_sequence_to_heads(full, head_index, world: int, group_name: str, dest: torch.Tensor, accumulate: bool) -> None:
    """Head -> sequence all-to-all: send ``full``'s sequence chunks home, into ``dest``'s heads."""
    recv = collectives.all_to_all(collectives.split_sequence(full, world), group_name)
    collectives.scatter_heads_back(recv, head_index, dest, accumulate)


def stage_loop_forward(q, k, v, is_causal: bool, scale: Optional[float], heads_per_stage: int, group_name: str):
    """The forward loop (called by the custom op; also directly by memory measurements,
    which run it under FakeTensorMode where the op itself would only run its fake kernel)."""
    group = collectives.group_from_name(group_name)
    world = group.size()
    if not is_fake(q):
        collectives.check_same_local_shape((q.shape[0], q.shape[1], k.shape[1], q.shape[2], q.shape[3]), group, q.device)
    schedule = schedule_for(q, k, world, heads_per_stage)
    batch, _, s_local, dim = q.shape
    seq = s_local * world
    m, kv_per_rank = schedule.q_per_rank, schedule.kv_per_rank

    out = q.new_empty(q.shape)
    lse = q.new_empty((len(schedule.stages), batch, m, seq), dtype=torch.float32)
    q_full = q.new_empty((batch, m, seq, dim))
    kv_full = q.new_empty((2, batch, kv_per_rank, seq, dim))

    current_group = None
    for index, stage in enumerate(schedule.stages):
        if stage.kv_group != current_group:
            current_group = stage.kv_group
            kv_index = _index(schedule.kv_groups[current_group], q.device)
            _heads_to_full_sequence(k, kv_index, world, group_name, kv_full[0])
            _heads_to_full_sequence(v, kv_index, world, group_name, kv_full[1])
        q_index = _index(stage.q_heads, q.device)
        _heads_to_full_sequence(q, q_index, world, group_name, q_full)
        k_stage, v_stage = _stage_kv(kv_full, stage, q.device)
        out_stage, lse_stage = kernels.forward(q_full, k_stage, v_stage, is_causal, scale)
        lse[index].copy_(lse_stage)
        del lse_stage
        _full_sequence_to_heads(out_stage, q_index, world, group_name, out, accumulate=False)
        del out_stage
    return out, lse


def stage_loop_backward(dout, q, k, v, out, lse, is_causal: bool, scale: Optional[float], heads_per_stage: int, group_name: str):
    group = collectives.group_from_name(group_name)
    world = group.size()
    schedule = schedule_for(q, k, world, heads_per_stage)
    batch, _, s_local, dim = q.shape
    seq = s_local * world
    m, kv_per_rank = schedule.q_per_rank, schedule.kv_per_rank

    dq = q.new_empty(q.shape)
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    # One reusable buffer per role: the stage's q / out / dout over the full sequence,
    # the group's k / v and their gradient accumulators. dK/dV sum over the group's stages:
    # in fp32 when there is more than one, as a kernel sums a GQA group's heads internally.
    q_full, out_full, dout_full = q.new_empty((3, batch, m, seq, dim))
    kv_full = q.new_empty((2, batch, kv_per_rank, seq, dim))
    stages_per_group = len(schedule.stages) // len(schedule.kv_groups)
    low_precision = q.dtype in (torch.float16, torch.bfloat16)
    accumulate_dtype = torch.float32 if low_precision and stages_per_group > 1 else q.dtype
    dkv_full = q.new_empty((2, batch, kv_per_rank, seq, dim), dtype=accumulate_dtype)

    def flush_group(group_index: int) -> None:
        kv_index = _index(schedule.kv_groups[group_index], q.device)
        for t, dest in enumerate((dk, dv)):
            _full_sequence_to_heads(dkv_full[t].to(q.dtype), kv_index, world, group_name, dest, accumulate=True)

    current_group = None
    for index, stage in enumerate(schedule.stages):
        if stage.kv_group != current_group:
            if current_group is not None:
                flush_group(current_group)
            current_group = stage.kv_group
            kv_index = _index(schedule.kv_groups[current_group], q.device)
            _heads_to_full_sequence(k, kv_index, world, group_name, kv_full[0])
            _heads_to_full_sequence(v, kv_index, world, group_name, kv_full[1])
            dkv_full.zero_()
        q_index = _index(stage.q_heads, q.device)
        for local, full in ((q, q_full), (out, out_full), (dout, dout_full)):
            _heads_to_full_sequence(local, q_index, world, group_name, full)
        k_stage, v_stage = _stage_kv(kv_full, stage, q.device)
        dq_stage, dk_stage, dv_stage = kernels.backward(
            dout_full, q_full, k_stage, v_stage, out_full, lse[index], is_causal, scale
        )
        _accumulate_stage_dkv(dkv_full, dk_stage, dv_stage, stage, q.device)
        del dk_stage, dv_stage
        _full_sequence_to_heads(dq_stage, q_index, world, group_name, dq, accumulate=False)
        del dq_stage
    flush_group(current_group)
    return dq, dk, dv


# --- the custom ops ---------------------------------------------------------------------
@torch.library.custom_op("upipe::attention", mutates_args=())
def attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    is_causal: bool, scale: Optional[float], heads_per_stage: int, world_size: int, group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_world(world_size, group_name)
    return stage_loop_forward(q, k, v, is_causal, scale, heads_per_stage, group_name)


def _check_world(world_size: int, group_name: str) -> None:
    actual = collectives.group_from_name(group_name).size()
    if actual != world_size:
        raise UnsupportedAttention(
            f"this graph was compiled for {world_size} context-parallel ranks but group {group_name!r} has {actual}; "
            "recompile (torch._dynamo.reset()) for the new group"
        )


# P is an explicit argument (not read from the group) so that it is part of the graph, and
# so of every compile cache key: a graph compiled for P = 2 is never reused for P = 4.
@attention_op.register_fake
def _attention_fake(q, k, v, is_causal, scale, heads_per_stage, world_size, group_name):
    schedule = schedule_for(q, k, world_size, heads_per_stage)
    batch, _, s_local, _ = q.shape
    lse = q.new_empty((len(schedule.stages), batch, schedule.q_per_rank, s_local * world_size), dtype=torch.float32)
    return q.new_empty(q.shape), lse


@torch.library.custom_op("upipe::attention_backward", mutates_args=())
def attention_backward_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    is_causal: bool, scale: Optional[float], heads_per_stage: int, world_size: int, group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_world(world_size, group_name)
    return stage_loop_backward(dout, q, k, v, out, lse, is_causal, scale, heads_per_stage, group_name)


@attention_backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, is_causal, scale, heads_per_stage, world_size, group_name):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = tuple(args)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_backward_op(dout.contiguous(), q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


# --- public entry point -----------------------------------------------------------------
def upipe_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
    cp_mesh=None, heads_per_stage: Optional[int] = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on sequence-sharded inputs.

    Rank r passes q ``[B, Hq, S/P, D]`` and k, v ``[B, Hkv, S/P, D]`` for tokens
    ``[r*S/P, (r+1)*S/P)`` and gets back the same shard of attention over the full
    sequence. ``heads_per_stage`` (U, a multiple of P; default P) sets how many query heads
    all ranks together compute per stage; U = Hq is plain Ulysses.
    """
    group = collectives.resolve_group(cp_mesh)
    world = group.size()
    heads_per_stage = world if heads_per_stage is None else heads_per_stage
    problems = shape_problems(q.shape, k.shape, v.shape, enable_gqa, world, heads_per_stage)
    if problems:
        raise UnsupportedAttention("upipe_attention: " + "; ".join(problems))
    if world == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    out, _ = attention_op(q, k, v, is_causal, scale, heads_per_stage, world, group.group_name)
    return out
