"""The UPipe stage-loop op: SDPA semantics on sequence-sharded q, k, v.

Forward, per stage (see :mod:`upipe_compile.schedule` for which heads): all-to-all this
stage's query heads sequence->head (KV only when the stage starts a new KV group), run
attention over the full sequence for ``m`` heads per rank, all-to-all the output
head->sequence straight into the preallocated local output. One full-sequence buffer per
role lives from stage to stage (with one head and batch 1 the received tensor is that
buffer, no copy), so intermediate memory is O(U) heads, not O(H). By default the next
stage's input all-to-alls run during this stage's forward kernel (``prefetch``).

Backward owns its memory: autograd saves only the local q, k, v, out and each stage's
log-sum-exp; backward redoes each stage's all-to-alls, runs the kernel's backward, and sends
dq (per stage) and dk/dv (per KV group) back to their sequence shards.

``upipe::attention`` / ``upipe::attention_backward`` are ``torch.library`` custom ops with
fake kernels, so torch.compile treats the loop as one opaque node and never unrolls it
(unrolling would let autograd keep every stage's buffers alive; see docs/design.md).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from upipe_compile import collectives, kernels
from upipe_compile.device_constants import made_once
from upipe_compile.documents import Documents, documents_for
from upipe_compile.errors import UnsupportedAttention
from upipe_compile.schedule import StageSchedule, plan_stages, shape_problems


def schedule_for(q: torch.Tensor, k: torch.Tensor, world: int, heads_per_stage: int) -> StageSchedule:
    return plan_stages(q.shape[1], k.shape[1], world, heads_per_stage)


def _index(heads: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Head indices as a tensor on ``device``, made once."""
    return made_once(("head index", heads, device), lambda: torch.tensor(heads, dtype=torch.long, device=device))


def _stage_kv(buffers: dict, stage, device):
    """k and v for this stage's query heads in the layout the kernel takes: a slice when the
    slots already form plain GQA groups, else a gather (one copy of m heads)."""
    k_full, v_full = buffers["k"], buffers["v"]
    span = stage.kv_slot_range
    if span is not None:
        return k_full[:, span[0]:span[1]], v_full[:, span[0]:span[1]]
    slots = _index(stage.kv_slots, device)
    return k_full.index_select(1, slots), v_full.index_select(1, slots)


def _accumulate_stage_dkv(dkv_full: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, stage, device) -> None:
    span = stage.kv_slot_range
    if span is not None:
        dkv_full[0][:, span[0]:span[1]] += dk
        dkv_full[1][:, span[0]:span[1]] += dv
    else:
        slots = _index(stage.kv_slots, device)
        dkv_full[0].index_add_(1, slots, dk.to(dkv_full.dtype))
        dkv_full[1].index_add_(1, slots, dv.to(dkv_full.dtype))


PREFETCH_MODES = ("none", "forward", "both")
"""Which loops start the next stage's input all-to-alls before this stage's kernel runs:
``forward`` (the default) adds no peak memory for GQA models, whose backward loop holds
more (MHA, where every stage also prefetches K and V: one head-unit more); ``both`` also
overlaps backward, at the cost of the next stage's q/out/dout (and K/V at a KV-group
boundary) in flight during the kernel -- see benchmarks/results/op_memory.md."""


def check_prefetch(prefetch) -> None:
    if prefetch not in PREFETCH_MODES:
        raise UnsupportedAttention(f"prefetch={prefetch!r} is not one of {PREFETCH_MODES}")


class _Incoming:
    """A started sequence -> head all-to-all of one tensor: this rank's heads over the full
    sequence, which :meth:`finish` makes the stage buffer ``buffers[role]`` (reusing the
    previous one where the chunks need laying out). The send buffer is held until then, as
    the collective may still be reading it."""

    def __init__(self, x, head_index, world: int, group_name: str, buffers: dict, role: str):
        self.send = collectives.pack_heads(x, head_index, world)
        self.recv = collectives.start_all_to_all(self.send, group_name)
        self.buffers, self.role = buffers, role

    def finish(self) -> None:
        recv = collectives.wait(self.recv)
        self.send = self.recv = None
        self.buffers[self.role] = collectives.assemble_sequence(recv, self.buffers.get(self.role))


def _full_sequence_to_heads(full, head_index, world: int, group_name: str, dest: torch.Tensor, accumulate: bool) -> None:
    """Head -> sequence all-to-all: send ``full``'s sequence chunks home, into ``dest``'s heads."""
    recv = collectives.all_to_all(collectives.split_sequence(full, world), group_name)
    collectives.scatter_heads_back(recv, head_index, dest, accumulate)


def _stage_inputs(schedule, index: int, local_q_side: dict, local_kv: dict, buffers: dict, world: int,
                  group_name: str):
    """The all-to-alls stage ``index`` needs: K and V (``local_kv``) when it opens a KV
    group, then each of ``local_q_side`` (q; in backward also out, dout), each into the
    stage buffer of its role. A generator, each started as it is taken: one at a time (each
    finished before the next starts) holds one tensor's send/receive pair at once;
    ``list()`` starts them all."""
    stage = schedule.stages[index]
    if schedule.opens_kv_group(index):
        kv_index = _index(schedule.kv_groups[stage.kv_group], local_kv["k"].device)
        for role, local in local_kv.items():
            yield _Incoming(local, kv_index, world, group_name, buffers, role)
    q_index = _index(stage.q_heads, local_q_side["q"].device)
    for role, local in local_q_side.items():
        yield _Incoming(local, q_index, world, group_name, buffers, role)


class _InputPipeline:
    """Hands each stage its inputs. With ``prefetch``, the next stage's all-to-alls start
    right before this stage's kernel and land in the stage buffers right after it, so they
    run while it does; without, each stage's run just before it. Either way every rank
    starts and waits the same collectives in the same order."""

    def __init__(self, start, stages: int, prefetch: bool):
        self.start, self.stages, self.prefetch = start, stages, prefetch
        self.in_flight, self.landed = [], -1

    def before_kernel(self, index: int) -> None:
        """Stage ``index``'s inputs are in the stage buffers when this returns."""
        if self.landed != index:
            for exchange in self.start(index):
                exchange.finish()
        if self.prefetch and index + 1 < self.stages:
            self.in_flight = list(self.start(index + 1))

    def after_kernel(self, index: int) -> None:
        """The kernel is done with the buffers: land what was prefetched for the next stage
        (before this stage's output goes home, so the two never hold memory at once)."""
        for exchange in self.in_flight:
            exchange.finish()
        if self.in_flight:
            self.in_flight, self.landed = [], index + 1


def stage_loop_forward(q, k, v, is_causal: bool, scale: Optional[float], heads_per_stage: int, group_name: str,
                       prefetch: str = "forward", documents: Optional[Documents] = None):
    """The forward loop (called by the custom op; also directly by memory measurements,
    which run it under FakeTensorMode where the op itself would only run its fake kernel).
    ``documents``: packed-sequence boundaries over the full sequence (None: one sequence)."""
    group = collectives.group_from_name(group_name)
    world = group.size()
    if not is_fake(q):
        collectives.check_same_local_shape((q.shape[0], q.shape[1], k.shape[1], q.shape[2], q.shape[3]), group, q.device)
    schedule = schedule_for(q, k, world, heads_per_stage)
    batch, _, s_local, _ = q.shape

    out = q.new_empty(q.shape)
    lse = q.new_empty((len(schedule.stages), batch, schedule.q_per_rank, s_local * world), dtype=torch.float32)
    buffers = {}  # role -> the stage's tensor over the full sequence, reused stage to stage

    inputs = _InputPipeline(
        lambda index: _stage_inputs(schedule, index, {"q": q}, {"k": k, "v": v}, buffers, world, group_name),
        len(schedule.stages), prefetch in ("forward", "both"),
    )
    for index, stage in enumerate(schedule.stages):
        inputs.before_kernel(index)
        k_stage, v_stage = _stage_kv(buffers, stage, q.device)
        out_stage, lse_stage = kernels.forward(buffers["q"], k_stage, v_stage, is_causal, scale, documents)
        del k_stage, v_stage
        lse[index].copy_(lse_stage)
        del lse_stage
        inputs.after_kernel(index)
        _full_sequence_to_heads(out_stage, _index(stage.q_heads, q.device), world, group_name, out, accumulate=False)
        del out_stage
    return out, lse


def stage_loop_backward(dout, q, k, v, out, lse, is_causal: bool, scale: Optional[float], heads_per_stage: int,
                        group_name: str, prefetch: str = "forward", documents: Optional[Documents] = None):
    group = collectives.group_from_name(group_name)
    world = group.size()
    schedule = schedule_for(q, k, world, heads_per_stage)
    batch, _, s_local, dim = q.shape
    seq = s_local * world
    kv_per_rank = schedule.kv_per_rank

    dq = q.new_empty(q.shape)
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    # One buffer per role: the stage's q / out / dout over the full sequence, the group's
    # k / v and their gradient accumulators. dK/dV sum over the group's stages:
    # in fp32 when there is more than one, as a kernel sums a GQA group's heads internally.
    # A group of one stage that uses all its KV slots (MHA, Ulysses) needs no accumulator:
    # the kernel's dK/dV are the group's, sent home as they are.
    buffers = {}
    dkv_full = None
    if not schedule.stage_uses_whole_group:
        low_precision = q.dtype in (torch.float16, torch.bfloat16)
        accumulate_dtype = torch.float32 if low_precision and schedule.stages_per_group > 1 else q.dtype
        dkv_full = q.new_empty((2, batch, kv_per_rank, seq, dim), dtype=accumulate_dtype)

    def flush_group(group_index: int, group_dk: torch.Tensor, group_dv: torch.Tensor) -> None:
        kv_index = _index(schedule.kv_groups[group_index], q.device)
        for grad, dest in ((group_dk, dk), (group_dv, dv)):
            _full_sequence_to_heads(grad.to(q.dtype), kv_index, world, group_name, dest, accumulate=True)

    inputs = _InputPipeline(
        lambda index: _stage_inputs(schedule, index, {"q": q, "out": out, "dout": dout}, {"k": k, "v": v}, buffers,
                                    world, group_name),
        len(schedule.stages), prefetch == "both",
    )
    for index, stage in enumerate(schedule.stages):
        if schedule.opens_kv_group(index) and dkv_full is not None:
            dkv_full.zero_()
        inputs.before_kernel(index)
        k_stage, v_stage = _stage_kv(buffers, stage, q.device)
        dq_stage, dk_stage, dv_stage = kernels.backward(
            buffers["dout"], buffers["q"], k_stage, v_stage, buffers["out"], lse[index], is_causal, scale, documents
        )
        del k_stage, v_stage
        if dkv_full is not None:
            _accumulate_stage_dkv(dkv_full, dk_stage, dv_stage, stage, q.device)
            dk_stage, dv_stage = dkv_full[0], dkv_full[1]
        inputs.after_kernel(index)
        _full_sequence_to_heads(dq_stage, _index(stage.q_heads, q.device), world, group_name, dq, accumulate=False)
        del dq_stage
        if schedule.closes_kv_group(index):
            flush_group(stage.kv_group, dk_stage, dv_stage)
        del dk_stage, dv_stage
    return dq, dk, dv


# --- the custom ops ---------------------------------------------------------------------
# The first call per shape syncs with the host (the cross-rank shape check, head indices
# and kernel markers made once), so CUDA graphs must not capture the ops.
_OP_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("upipe::attention", mutates_args=(), tags=_OP_TAGS)
def attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    is_causal: bool, scale: Optional[float], heads_per_stage: int, world_size: int, group_name: str,
    prefetch: str = "forward", cu_seqlens: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_world(world_size, group_name)
    documents = _documents(cu_seqlens, q, group_name)
    return stage_loop_forward(q, k, v, is_causal, scale, heads_per_stage, group_name, prefetch, documents)


def _documents(cu_seqlens: Optional[torch.Tensor], q: torch.Tensor, group_name: str) -> Optional[Documents]:
    """Checked boundaries (see :mod:`upipe_compile.documents`: once per boundaries tensor,
    on every rank at once), or None for one sequence per batch row."""
    if cu_seqlens is None:
        return None
    group = collectives.group_from_name(group_name)
    return documents_for(cu_seqlens, q.shape[2] * group.size(), group, q.device)


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
def _attention_fake(q, k, v, is_causal, scale, heads_per_stage, world_size, group_name, prefetch="forward",
                    cu_seqlens=None):
    schedule = schedule_for(q, k, world_size, heads_per_stage)
    batch, _, s_local, _ = q.shape
    lse = q.new_empty((len(schedule.stages), batch, schedule.q_per_rank, s_local * world_size), dtype=torch.float32)
    return q.new_empty(q.shape), lse


@torch.library.custom_op("upipe::attention_backward", mutates_args=(), tags=_OP_TAGS)
def attention_backward_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    is_causal: bool, scale: Optional[float], heads_per_stage: int, world_size: int, group_name: str,
    prefetch: str = "forward", cu_seqlens: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_world(world_size, group_name)
    documents = _documents(cu_seqlens, q, group_name)
    return stage_loop_backward(dout, q, k, v, out, lse, is_causal, scale, heads_per_stage, group_name, prefetch,
                               documents)


@attention_backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, is_causal, scale, heads_per_stage, world_size, group_name,
                             prefetch="forward", cu_seqlens=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_OP_ARGUMENTS = 10  # q, k, v, is_causal, scale, heads_per_stage, world_size, group_name, prefetch, cu_seqlens


def _setup_context(ctx, inputs, output):
    q, k, v, *args = inputs
    args += [None] * (_OP_ARGUMENTS - 3 - len(args))  # prefetch / cu_seqlens left to their defaults
    args[-2] = "forward" if args[-2] is None else args[-2]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, args[-1])  # the boundaries are a tensor: saved, not captured
    ctx.args = tuple(args[:-1])


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = attention_backward_op(dout, q, k, v, out, lse, *ctx.args, cu_seqlens)
    return (dq, dk, dv) + (None,) * (_OP_ARGUMENTS - 3)


attention_op.register_autograd(_backward, setup_context=_setup_context)


# --- public entry point -----------------------------------------------------------------
def upipe_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
    cp_mesh=None, heads_per_stage: Optional[int] = None, prefetch: str = "forward",
    cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on sequence-sharded inputs.

    Rank r passes q ``[B, Hq, S/P, D]`` and k, v ``[B, Hkv, S/P, D]`` for tokens
    ``[r*S/P, (r+1)*S/P)`` and gets back the same shard of attention over the full
    sequence. ``heads_per_stage`` (U, a multiple of P; default P) sets how many query heads
    all ranks together compute per stage; U = Hq is plain Ulysses. ``prefetch`` is one of
    :data:`PREFETCH_MODES`.

    ``cu_seqlens`` (packed sequences): the cumulative document lengths over the *full*
    sequence, ``[0, len_0, len_0 + len_1, ..., S]`` (int32/int64, the same on every rank);
    attention then stays inside each document (causal within it when ``is_causal``).
    See docs/packed_sequences.md.
    """
    check_prefetch(prefetch)
    group = collectives.resolve_group(cp_mesh)
    world = group.size()
    heads_per_stage = world if heads_per_stage is None else heads_per_stage
    problems = shape_problems(q.shape, k.shape, v.shape, enable_gqa, world, heads_per_stage)
    if q.device.type == "cuda":
        problems += kernels.cuda_problems(q.dtype, q.shape[-1])
    if problems:
        raise UnsupportedAttention("upipe_attention: " + "; ".join(problems))
    if world == 1 and cu_seqlens is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    out, _ = attention_op(q, k, v, is_causal, scale, heads_per_stage, world, group.group_name, prefetch, cu_seqlens)
    return out
