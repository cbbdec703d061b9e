"""The UPipe stage loops: SDPA semantics on sequence-sharded q, k, v, one stage of heads at
a time. Plain functions of tensors and a :class:`StageLoopSettings`
(no torch.library, no FX), so the custom ops (:mod:`upipe_compile.attention.ops`), the eager
memory measurements and the fused block's loops (:mod:`upipe_compile.block.loop`, which
reuses the exchange helpers and :class:`StageAttention` here) all run the same code.

Forward, per stage (see :mod:`upipe_compile.attention.schedule` for which heads): all-to-all this
stage's query heads sequence->head (KV only when the stage starts a new KV group), run
attention over the full sequence for ``m`` heads per rank, all-to-all the output
head->sequence straight into the preallocated local output. Over a ring x all-to-all mesh
the "full sequence" is this ring rank's zigzag share and the attention is ring attention
(:class:`StageAttention`). One full-sequence buffer per
role lives from stage to stage (with one head and batch 1 the received tensor is that
buffer, no copy), so intermediate memory is O(U) heads, not O(H). By default the next
stage's input all-to-alls run during this stage's forward kernel (``prefetch``).

Backward owns its memory: autograd saves only the local q, k, v, out and each stage's
log-sum-exp; backward redoes each stage's all-to-alls, runs the kernel's backward, and sends
dq (per stage) and dk/dv (per KV group) back to their sequence shards.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Callable, Iterator, Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from upipe_compile.attention import collectives, kernels, ring
from upipe_compile.attention.alibi import kernel_slopes
from upipe_compile.attention.device_constants import made_once
from upipe_compile.attention.document_boundaries import Documents
from upipe_compile.attention.schedule import Stage, StageSchedule, plan_stages
from upipe_compile.attention.sinks import apply_sinks, sink_gradient

PREFETCH_MODES = ("none", "forward", "both")
DEFAULT_PREFETCH = "forward"
"""Which loops start the next stage's input all-to-alls before this stage's kernel runs:
``forward`` (the default) adds no peak memory for GQA models, whose backward loop holds
more (MHA, where every stage also prefetches K and V: one head-unit more); ``both`` also
overlaps backward, at the cost of the next stage's q/out/dout (and K/V at a KV-group
boundary) in flight during the kernel -- see benchmarks/results/op_memory.md."""


def prefetches(prefetch: str, backward: bool) -> bool:
    """Whether the forward (or backward) stage loop starts the next stage's all-to-alls
    before this stage's kernel, under ``prefetch``."""
    return prefetch == "both" if backward else prefetch in ("forward", "both")


@dataclass(frozen=True)
class StageLoopSettings:
    """The settings of one stage-loop attention call (``upipe::attention``). The custom op
    takes them as scalar arguments (torch.library needs those), in this order:
    :meth:`op_args` gives them, :meth:`from_op_args` builds the record back. Not validated
    here: :func:`upipe_compile.upipe_attention` and :class:`~upipe_compile.options.UPipeOptions`
    check them."""

    is_causal: bool
    scale: Optional[float]
    heads_per_stage: int
    """U: query heads per stage across all ranks."""
    world_size: int
    """P, the context-parallel size the call was made (or compiled) for."""
    group_name: str
    """The process group of the context-parallel ranks."""
    prefetch: str = DEFAULT_PREFETCH
    """One of :data:`PREFETCH_MODES`."""
    window_left: int = -1
    """Sliding window, as flash-attn counts it: query i sees keys [i - left, i + right] of
    the full sequence (global positions); -1 = unbounded on that side."""
    window_right: int = -1
    softcap: float = 0.0
    """Attention-logit softcap: scores become ``softcap * tanh(scores / softcap)``; 0 = off."""
    ring_group_name: str = ""
    """Ring x all-to-all: the ring group over which each stage's attention runs as ring
    attention (:mod:`upipe_compile.attention.ring`); ``group_name`` is then the all-to-all
    group and ``world_size`` its size A. Empty: no ring."""

    def op_args(self) -> tuple:
        """The op's scalar arguments, in its schema's order."""
        return astuple(self)

    @classmethod
    def from_op_args(cls, is_causal: bool, scale: Optional[float], heads_per_stage: int, world_size: int,
                     group_name: str, prefetch: str = DEFAULT_PREFETCH, window_left: int = -1, window_right: int = -1,
                     softcap: float = 0.0, ring_group_name: str = "") -> "StageLoopSettings":
        return cls(is_causal, scale, heads_per_stage, world_size, group_name, prefetch, window_left, window_right,
                   softcap, ring_group_name)

    @property
    def window(self) -> tuple[int, int]:
        return (self.window_left, self.window_right)


def schedule_for(q: torch.Tensor, k: torch.Tensor, world: int, heads_per_stage: int) -> StageSchedule:
    return plan_stages(q.shape[1], k.shape[1], world, heads_per_stage)


def head_index(heads: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Head indices as a tensor on ``device``, made once."""
    return made_once(("head index", heads, device), lambda: torch.tensor(heads, dtype=torch.long, device=device))


def my_heads(stage: Stage, rank: int) -> tuple[int, ...]:
    """The query heads this rank computes in ``stage`` (its ``m`` of the stage's ``U``)."""
    m = len(stage.kv_slots)
    return stage.q_heads[rank * m:(rank + 1) * m]


def stage_head_values(per_head: Optional[torch.Tensor], stage: Stage, rank: int) -> Optional[torch.Tensor]:
    """This rank's heads' entries in ``stage`` of a per-query-head tensor ``[Hq]`` (sink
    logits, ALiBi slopes), in the order of its query heads in the stage buffers (None: None)."""
    if per_head is None:
        return None
    return per_head.index_select(0, head_index(my_heads(stage, rank), per_head.device))



def stage_kv(buffers: dict, stage: Stage, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v for this stage's query heads in the layout the kernel takes: a slice when the
    slots already form plain GQA groups, else a gather (one copy of m heads)."""
    k_full, v_full = buffers["k"], buffers["v"]
    span = stage.kv_slot_range
    if span is not None:
        return k_full[:, span[0]:span[1]], v_full[:, span[0]:span[1]]
    slots = head_index(stage.kv_slots, device)
    return k_full.index_select(1, slots), v_full.index_select(1, slots)


def accumulate_stage_dkv(dkv_full: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, stage: Stage,
                         device: torch.device) -> None:
    """Add a stage's dK, dV (its KV slots) into the KV group's accumulators ``dkv_full``
    ``[2, B, kv heads per rank, S, D]``."""
    span = stage.kv_slot_range
    if span is not None:
        dkv_full[0][:, span[0]:span[1]] += dk
        dkv_full[1][:, span[0]:span[1]] += dv
    else:
        slots = head_index(stage.kv_slots, device)
        dkv_full[0].index_add_(1, slots, dk.to(dkv_full.dtype))
        dkv_full[1].index_add_(1, slots, dv.to(dkv_full.dtype))


class Incoming:
    """A started sequence -> head all-to-all of one send buffer (``[P, heads/P, B, s, D]``:
    this rank's shard of the heads each rank receives), which :meth:`finish` makes the stage
    buffer ``buffers[role]``, this rank's heads over the full sequence (reusing the previous
    one where the chunks need laying out). The send buffer is held until then, as the
    collective may still be reading it. The plain loop packs the send buffer from local
    heads (:meth:`of_heads`); the fused block's stages compute theirs."""

    def __init__(self, send: torch.Tensor, group_name: str, buffers: dict, role: str):
        self.send, self.buffers, self.role = send, buffers, role
        self.recv = collectives.start_all_to_all(send, group_name)

    @classmethod
    def of_heads(cls, x: torch.Tensor, heads: torch.Tensor, world: int, group_name: str, buffers: dict,
                 role: str) -> "Incoming":
        """The all-to-all of local tensor ``x``'s ``heads``."""
        return cls(collectives.pack_heads(x, heads, world), group_name, buffers, role)

    def finish(self) -> None:
        recv = collectives.wait(self.recv)
        self.send = self.recv = None
        self.buffers[self.role] = collectives.assemble_sequence(recv, self.buffers.get(self.role))


def full_sequence_to_heads(full: torch.Tensor, heads: torch.Tensor, world: int, group_name: str, dest: torch.Tensor,
                           accumulate: bool) -> None:
    """Head -> sequence all-to-all: send ``full``'s sequence chunks home, into ``dest``'s heads."""
    recv = collectives.all_to_all(collectives.split_sequence(full, world), group_name)
    collectives.scatter_heads_back(recv, heads, dest, accumulate)


@dataclass(frozen=True)
class StageAttention:
    """How each stage's attention runs, shared by the plain loops here and the fused block's
    (:mod:`upipe_compile.block.loop`): the kernel over the full sequence the stage buffers
    hold, or, with ``ring_group_name``, ring attention over that ring group (the buffers then
    hold this ring rank's zigzag share of the sequence)."""

    is_causal: bool
    scale: Optional[float]
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    ring_group_name: str = ""

    def _ring_group(self):
        return collectives.group_from_name(self.ring_group_name) if self.ring_group_name else None

    def forward(self, q, k, v, documents: Optional[Documents],
                alibi_slopes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of a stage's heads over the sequence its buffers hold; ``alibi_slopes``:
        those heads' ALiBi slopes (:func:`stage_head_values`), or None."""
        ring_group = self._ring_group()
        if ring_group is not None:
            return ring.ring_forward(q, k, v, self.is_causal, self.scale, ring_group, self.softcap, self.window,
                                     _several(documents), alibi_slopes)
        return kernels.forward(q, k, v, self.is_causal, self.scale, documents, window=self.window,
                               softcap=self.softcap, alibi_slopes=alibi_slopes)

    def backward(self, dout, q, k, v, out, lse, documents: Optional[Documents],
                 alibi_slopes: Optional[torch.Tensor] = None) -> tuple:
        """``(dq, dk, dv)`` of a stage, from its output and log-sum-exp."""
        ring_group = self._ring_group()
        if ring_group is not None:
            return ring.ring_backward(dout, q, k, v, out, lse, self.is_causal, self.scale, ring_group, self.softcap,
                                      self.window, _several(documents), alibi_slopes)
        return kernels.backward(dout, q, k, v, out, lse, self.is_causal, self.scale, documents,
                                window=self.window, softcap=self.softcap, alibi_slopes=alibi_slopes)


def _several(documents: Optional[Documents]) -> Optional[Documents]:
    """Packed documents, or None where there is one sequence."""
    return None if documents is None or documents.is_single else documents


def stage_attention(settings: StageLoopSettings) -> StageAttention:
    """The plain op's stage attention from its settings."""
    return StageAttention(settings.is_causal, settings.scale, settings.window, settings.softcap,
                          settings.ring_group_name)


def stage_inputs(schedule: StageSchedule, index: int, local_q_side: dict, local_kv: dict, buffers: dict, world: int,
                 group_name: str) -> Iterator[Incoming]:
    """The all-to-alls stage ``index`` needs: K and V (``local_kv``) when it opens a KV
    group, then each of ``local_q_side`` (q; in backward also out, dout), each into the
    stage buffer of its role. A generator, each started as it is taken: one at a time (each
    finished before the next starts) holds one tensor's send/receive pair at once;
    ``list()`` starts them all."""
    stage = schedule.stages[index]
    if schedule.opens_kv_group(index):
        kv_index = head_index(schedule.kv_groups[stage.kv_group], local_kv["k"].device)
        for role, local in local_kv.items():
            yield Incoming.of_heads(local, kv_index, world, group_name, buffers, role)
    q_index = head_index(stage.q_heads, local_q_side["q"].device)
    for role, local in local_q_side.items():
        yield Incoming.of_heads(local, q_index, world, group_name, buffers, role)


class InputPipeline:
    """Hands each stage its inputs. With ``prefetch``, the next stage's all-to-alls start
    right before this stage's kernel and land in the stage buffers right after it, so they
    run while it does; without, each stage's run just before it. Either way every rank
    starts and waits the same collectives in the same order. ``start(index)`` gives stage
    ``index``'s exchanges (objects with ``finish()``), each started as it is taken."""

    def __init__(self, start: Callable[[int], Iterator], stages: int, prefetch: bool):
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


def stage_loop_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, settings: StageLoopSettings,
                       documents: Optional[Documents] = None, sinks: Optional[torch.Tensor] = None,
                       alibi_slopes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward loop: ``(out, lse)``, lse ``[stages, B, U/P, S]`` (called by the custom op;
    also directly by memory measurements, which run it under FakeTensorMode where the op
    itself would only run its fake kernel). ``documents``: packed-sequence boundaries over
    the full sequence (None: one sequence). ``sinks`` ``[Hq]``: per-head sink logits
    (:mod:`upipe_compile.attention.sinks`); the saved lse then includes them. ``alibi_slopes``
    ``[Hq]``: ALiBi's per-head slopes (:mod:`upipe_compile.attention.alibi`), each stage's
    kernel taking its heads' (the saved lse includes the bias)."""
    group_name = settings.group_name
    group = collectives.group_from_name(group_name)
    world = group.size()
    slopes = kernel_slopes(alibi_slopes, q.device)
    if not is_fake(q):
        collectives.check_same_local_shape((q.shape[0], q.shape[1], k.shape[1], q.shape[2], q.shape[3]), group)
    schedule = schedule_for(q, k, world, settings.heads_per_stage)
    batch, _, s_local, _ = q.shape
    attention = stage_attention(settings)

    out = q.new_empty(q.shape)
    lse = q.new_empty(schedule.lse_shape(batch, s_local), dtype=torch.float32)
    buffers = {}  # role -> the stage's tensor over the full sequence, reused stage to stage

    inputs = InputPipeline(
        lambda index: stage_inputs(schedule, index, {"q": q}, {"k": k, "v": v}, buffers, world, group_name),
        len(schedule.stages), prefetches(settings.prefetch, backward=False),
    )
    for index, stage in enumerate(schedule.stages):
        inputs.before_kernel(index)
        k_stage, v_stage = stage_kv(buffers, stage, q.device)
        out_stage, lse_stage = attention.forward(buffers["q"], k_stage, v_stage, documents,
                                                 stage_head_values(slopes, stage, group.rank()))
        del k_stage, v_stage
        if sinks is not None:
            out_stage, lse_stage = apply_sinks(out_stage, lse_stage, stage_head_values(sinks, stage, group.rank()))
        lse[index].copy_(lse_stage)
        del lse_stage
        inputs.after_kernel(index)
        full_sequence_to_heads(out_stage, head_index(stage.q_heads, q.device), world, group_name, out, accumulate=False)
        del out_stage
    return out, lse


def stage_loop_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, settings: StageLoopSettings, documents: Optional[Documents] = None,
                        sinks: Optional[torch.Tensor] = None, alibi_slopes: Optional[torch.Tensor] = None) -> tuple:
    """The backward loop: ``(dq, dk, dv, dsinks)`` from what the forward saved (q, k, v, out,
    lse). ``dsinks`` (None without sinks) holds this rank's heads' sink gradients, zero
    elsewhere: each head's is complete on the rank that computed it, so the ranks' sum (the
    usual reduction of a replicated parameter's gradient) is the gradient."""
    group_name = settings.group_name
    group = collectives.group_from_name(group_name)
    world = group.size()
    schedule = schedule_for(q, k, world, settings.heads_per_stage)
    batch, _, s_local, dim = q.shape
    seq = s_local * world
    kv_per_rank = schedule.kv_per_rank
    attention = stage_attention(settings)
    slopes = kernel_slopes(alibi_slopes, q.device)

    dq = q.new_empty(q.shape)
    dsinks = None if sinks is None else torch.zeros(sinks.shape, dtype=torch.float32, device=sinks.device)
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
        kv_index = head_index(schedule.kv_groups[group_index], q.device)
        for grad, dest in ((group_dk, dk), (group_dv, dv)):
            full_sequence_to_heads(grad.to(q.dtype), kv_index, world, group_name, dest, accumulate=True)

    inputs = InputPipeline(
        lambda index: stage_inputs(schedule, index, {"q": q, "out": out, "dout": dout}, {"k": k, "v": v}, buffers,
                                   world, group_name),
        len(schedule.stages), prefetches(settings.prefetch, backward=True),
    )
    for index, stage in enumerate(schedule.stages):
        if schedule.opens_kv_group(index) and dkv_full is not None:
            dkv_full.zero_()
        inputs.before_kernel(index)
        k_stage, v_stage = stage_kv(buffers, stage, q.device)
        dq_stage, dk_stage, dv_stage = attention.backward(
            buffers["dout"], buffers["q"], k_stage, v_stage, buffers["out"], lse[index], documents,
            stage_head_values(slopes, stage, group.rank()))
        del k_stage, v_stage
        if sinks is not None:
            heads = head_index(my_heads(stage, group.rank()), q.device)
            dsinks.index_add_(0, heads, sink_gradient(buffers["dout"], buffers["out"], lse[index],
                                                      sinks.index_select(0, heads)))
        if dkv_full is not None:
            accumulate_stage_dkv(dkv_full, dk_stage, dv_stage, stage, q.device)
            dk_stage, dv_stage = dkv_full[0], dkv_full[1]
        inputs.after_kernel(index)
        full_sequence_to_heads(dq_stage, head_index(stage.q_heads, q.device), world, group_name, dq, accumulate=False)
        del dq_stage
        if schedule.closes_kv_group(index):
            flush_group(stage.kv_group, dk_stage, dv_stage)
        del dk_stage, dv_stage
    return dq, dk, dv, None if dsinks is None else dsinks.to(sinks.dtype)
