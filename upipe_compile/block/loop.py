"""The fused attention block's stage loops: projections, per-head ops, attention and the
output projection, one stage of heads at a time.

The plain op (:mod:`upipe_compile.attention.stage_loop`) takes the local q, k, v of all heads, so every
rank still holds them (and their gradients) for the whole layer. Here each stage projects
only its own heads from the block input ``x`` (weight rows of those heads), runs the
block's per-head ops on them (:class:`upipe_compile.block.region.BlockRegion`), exchanges and
attends exactly as the plain loop does, and adds its heads' share of the output projection
into the block output:

    per stage s (heads h_s; K/V heads when s opens a KV group):
        q_s = q_fn(x @ Wq[h_s]ᵀ (+ bq[h_s]))        local sequence, U heads
        all-to-all seq -> heads, attention, all-to-all heads -> seq
        y  += o_s @ Wo[:, h_s]ᵀ                      (+ bo once)

What backward needs is x, the weights and extras (the op's inputs), the local attention
output ``o`` of all heads (the kernel's backward reads it, and dWo is ``dyᵀ o``; keeping it
avoids recomputing attention) and one log-sum-exp per stage. Backward recomputes each
stage's projections and per-head ops and takes their gradients with ``torch.func.vjp``
(which records its own graph even inside a custom op's kernel, where autograd is off);
the projections' gradients are matrix products written into place.

Ring x all-to-all: the per-head ops (RoPE, QK-norm) run on the local tokens before the
all-to-all, with the position-dependent extras the caller computed for them (its
``global_positions``), so nothing here depends on the sequence layout; only each stage's
attention changes, to ring attention over the ring group (the plain loop's
:class:`~upipe_compile.attention.stage_loop.StageAttention`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from upipe_compile.attention import collectives
from upipe_compile.attention.alibi import kernel_slopes
from upipe_compile.attention.sinks import apply_sinks, sink_gradient
from upipe_compile.attention.stage_loop import (
    DEFAULT_PREFETCH, Incoming, InputPipeline, StageAttention, head_index, my_heads, prefetches, stage_kv,
)
from upipe_compile.block.region import BlockRegion
from upipe_compile.attention.document_boundaries import Documents
from upipe_compile.attention.schedule import StageSchedule, plan_stages


@dataclass
class BlockWeights:
    """The block's tensors: q/k/v projections ``[H * D, d]`` (biases ``[H * D]`` or None),
    output projection ``[d_out, Hq * D]`` (bias or None), and the per-head ops' extras."""

    wq: torch.Tensor
    bq: Optional[torch.Tensor]
    wk: torch.Tensor
    bk: Optional[torch.Tensor]
    wv: torch.Tensor
    bv: Optional[torch.Tensor]
    wo: torch.Tensor
    bo: Optional[torch.Tensor]
    extras: list

    def projection(self, role: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return {"q": (self.wq, self.bq), "k": (self.wk, self.bk), "v": (self.wv, self.bv)}[role]


def _stage_sinks(region: BlockRegion, weights: BlockWeights, stage, rank: int) -> Optional[torch.Tensor]:
    """This rank's heads' sink logits in ``stage`` (None: the block has no sinks)."""
    if region.sinks_extra < 0:
        return None
    sinks = weights.extras[region.sinks_extra]
    return sinks.index_select(0, head_index(my_heads(stage, rank), sinks.device))


def _stage_alibi(region: BlockRegion, weights: BlockWeights, stage, rank: int) -> Optional[torch.Tensor]:
    """This rank's heads' ALiBi slopes in ``stage`` (float32; None: the block has no ALiBi)."""
    if region.alibi_extra < 0:
        return None
    slopes = weights.extras[region.alibi_extra]
    return kernel_slopes(slopes.index_select(0, head_index(my_heads(stage, rank), slopes.device)),
                         weights.wq.device)


def block_schedule(region: BlockRegion, world: int, heads_per_stage: int) -> StageSchedule:
    return plan_stages(region.q_heads, region.kv_heads, world, heads_per_stage)


def _stage_attention(region: BlockRegion, ring_group_name: str) -> StageAttention:
    """The block's stage attention (the plain loop's: kernel, or ring attention over a ring).
    The per-head ops (RoPE) run on the local tokens before the all-to-all, with the caller's
    positions, so a ring needs nothing more here."""
    return StageAttention(region.is_causal, region.scale, region.window, region.softcap, ring_group_name)


def _rows(heads: torch.Tensor, per_head: int) -> torch.Tensor:
    """Weight rows (or output columns) of ``heads``, in that order: head h owns
    ``[h * per_head, (h + 1) * per_head)``."""
    return (heads[:, None] * per_head + torch.arange(per_head, device=heads.device)).reshape(-1)


def _projection_of(x, weights: BlockWeights, region: BlockRegion, role: str):
    """``(input, weight, bias, rows per head)`` of one role's projection."""
    weight, bias = weights.projection(role)
    return region.projection_input(role, x, weights.extras), weight, bias, weight.shape[0] // region.heads(role)


def _project(x, weights: BlockWeights, region: BlockRegion, role: str, heads: torch.Tensor) -> torch.Tensor:
    """The heads ``heads`` of one role on the local sequence, ``[B, n, s, D]``."""
    input_, weight, bias, per_head = _projection_of(x, weights, region, role)
    rows = _rows(heads, per_head)
    projected = F.linear(input_, weight.index_select(0, rows), None if bias is None else bias.index_select(0, rows))
    return region.head_fn(role)(projected, len(heads), *weights.extras)


def _send_layout(heads_first: torch.Tensor, world: int) -> torch.Tensor:
    """``[B, n, s, D]`` (heads in schedule order) as the all-to-all send buffer ``[P, n/P, B, s, D]``."""
    send = heads_first.transpose(0, 1).contiguous()
    return send.view(world, -1, *send.shape[1:])


def _heads_first(recv: torch.Tensor) -> torch.Tensor:
    """A received ``[P, m, B, s, D]`` (rows in schedule order) as ``[B, P*m, s, D]``."""
    world, m = recv.shape[:2]
    return recv.reshape(world * m, *recv.shape[2:]).transpose(0, 1)


def _output_columns(wo: torch.Tensor, heads: torch.Tensor, output_dim: int) -> torch.Tensor:
    return wo.index_select(1, _rows(heads, output_dim))


def _flat_heads(heads_first: torch.Tensor) -> torch.Tensor:
    """``[B, n, s, D]`` as the output projection's input ``[B, s, n * D]``."""
    batch, n, s, d = heads_first.shape
    return heads_first.transpose(1, 2).reshape(batch, s, n * d)


def block_forward(x, weights: BlockWeights, region: BlockRegion, heads_per_stage: int, group_name: str,
                  prefetch: str = DEFAULT_PREFETCH, documents: Optional[Documents] = None, keep_output: bool = True,
                  ring_group_name: str = ""):
    """``(y, o, lse)``: the block output ``[B, s, d_out]``, the local attention output of all
    heads ``[B, Hq, s, D]`` and the per-stage log-sum-exp (both kept for backward). With
    ``keep_output=False``, ``o`` is an empty tensor (backward recomputes each stage's).
    ``ring_group_name``: ring x all-to-all (``group_name`` is then the all-to-all group, and
    each stage's attention runs as ring attention over the ring group)."""
    group = collectives.group_from_name(group_name)
    world, rank = group.size(), group.rank()
    if not is_fake(x):
        collectives.check_same_local_shape(tuple(x.shape), group)
    schedule = block_schedule(region, world, heads_per_stage)
    batch, s_local = x.shape[:2]
    dim, device = region.head_dim, x.device
    attention = _stage_attention(region, ring_group_name)

    o = x.new_empty((batch, region.q_heads, s_local, dim) if keep_output else (0,),
                    dtype=region.attention_dtype or x.dtype)
    lse = x.new_empty(schedule.lse_shape(batch, s_local), dtype=torch.float32)
    # y sums the stages' shares in fp32 past a few stages (_activation_sum_dtype)
    y = x.new_zeros((batch, s_local, weights.wo.shape[0]), dtype=_activation_sum_dtype(x.dtype, len(schedule.stages)))
    buffers = {}

    def start(index):
        stage = schedule.stages[index]
        if schedule.opens_kv_group(index):
            kv_heads = head_index(schedule.kv_groups[stage.kv_group], device)
            for role in ("k", "v"):
                local = _project(x, weights, region, role, kv_heads)
                yield Incoming(_send_layout(local, world), group_name, buffers, role)
        local = _project(x, weights, region, "q", head_index(stage.q_heads, device))
        yield Incoming(_send_layout(local, world), group_name, buffers, "q")

    inputs = InputPipeline(start, len(schedule.stages), prefetches(prefetch, backward=False))
    for index, stage in enumerate(schedule.stages):
        inputs.before_kernel(index)
        k_stage, v_stage = stage_kv(buffers, stage, device)
        out_stage, lse_stage = attention.forward(buffers["q"], k_stage, v_stage, documents,
                                                 _stage_alibi(region, weights, stage, rank))
        del k_stage, v_stage
        if region.sinks_extra >= 0:
            out_stage, lse_stage = apply_sinks(out_stage, lse_stage, _stage_sinks(region, weights, stage, rank))
        lse[index].copy_(lse_stage)
        del lse_stage
        inputs.after_kernel(index)
        q_heads = head_index(stage.q_heads, device)
        recv = collectives.all_to_all(collectives.split_sequence(out_stage, world), group_name)
        del out_stage
        if keep_output:
            collectives.scatter_heads_back(recv, q_heads, o, accumulate=False)
        # y += o_s @ Wo[:, heads]ᵀ, in place: no y-sized temporary per stage
        _addmm_into(y.view(-1, y.shape[-1]), _flat_heads(_heads_first(recv)[..., :region.output_dim]).flatten(0, 1),
                    _output_columns(weights.wo, q_heads, region.output_dim).t())
        del recv
    if weights.bo is not None:
        y.add_(weights.bo)
    return y.to(x.dtype), o, lse


def _addmm_into(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``total += a @ b`` in place, in ``total``'s dtype. Where ``total`` is fp32 and the
    operands bf16/fp16: on CUDA one bf16 tensor-core GEMM whose epilogue adds into the fp32
    total (``addmm.dtype_out``, beta = 1), as fast as the bf16 add it replaces; elsewhere
    fp32 copies of the operands (the size of a stage's heads, not of ``total``)."""
    if a.dtype != b.dtype:  # attention output in a lower precision than the weights: as the model's cast
        a, b = a.to(total.dtype), b.to(total.dtype)
    if total.dtype == a.dtype:
        total.addmm_(a, b)
    elif total.is_cuda and _ADDMM_OUT_DTYPE is not None:
        _ADDMM_OUT_DTYPE(total, a, b, total.dtype, out=total)
    else:
        total.addmm_(a.to(total.dtype), b.to(total.dtype))


# aten::addmm.dtype_out (bf16 inputs, fp32 output), CUDA only; absent from older torches
_ADDMM_OUT_DTYPE = getattr(torch.ops.aten.addmm, "dtype_out", None)


class _Recomputed:
    """One role's heads recomputed from x for their gradients (after the stage's kernel, so
    nothing of them is held while it runs): through ``torch.func.vjp`` of the per-head ops,
    the way back from the local gradient to the projection's output, whose gradients for x
    and the weight rows are two matrix products written into place."""

    def __init__(self, x, weights: BlockWeights, region: BlockRegion, role: str, extras_need_grad: list[bool],
                 heads: torch.Tensor):
        input_, weight, bias, per_head = _projection_of(x, weights, region, role)
        extras, head_fn = weights.extras, region.head_fn(role)
        self.rows = _rows(heads, per_head)
        self.has_bias = bias is not None
        self.input_extra = region.projection_inputs["qkv".index(role)]
        self.x, self.w_rows = input_, weight.index_select(0, self.rows)
        projected = F.linear(input_, self.w_rows, None if bias is None else bias.index_select(0, self.rows))
        # An extra nobody needs the gradient of (the RoPE table) is closed over, not a primal:
        # its vjp would form a product as large as the stage's heads in fp32 / complex. So is a
        # projection input (its gradient is the matrix product below).
        self.differentiable = [need and i not in region.projection_inputs for i, need in enumerate(extras_need_grad)]
        n = len(heads)

        def per_head_ops(projected_, *diff_extras):
            diff = iter(diff_extras)
            return head_fn(projected_, n, *[next(diff) if d else e for e, d in zip(extras, self.differentiable)])

        local, self._vjp = torch.func.vjp(
            per_head_ops, projected, *[e for e, d in zip(extras, self.differentiable) if d])
        self.dtype = local.dtype
        del local, projected

    def add_gradients(self, grad_local, grads: "_Gradients", role: str) -> None:
        dprojected, *dextras = self._vjp(grad_local.to(self.dtype))
        self._vjp = None
        flat = dprojected.reshape(-1, dprojected.shape[-1])
        del dprojected
        # dx += dP @ W_rows, in place: no x-sized temporary per stage
        dx = grads.dx if self.input_extra < 0 else grads.dextras[self.input_extra]
        if dx is not None:
            _addmm_into(dx.view(-1, dx.shape[-1]), flat, self.w_rows)
        x_rows = self.x.reshape(-1, self.x.shape[-1]).to(flat.dtype)
        grads.dw[role].index_add_(0, self.rows, flat.t().mm(x_rows).to(grads.dw[role].dtype))
        if self.has_bias:
            grads.db[role].index_add_(0, self.rows, flat.sum(0, dtype=grads.db[role].dtype))
        diff = iter(dextras)
        for total, differentiable in zip(grads.dextras, self.differentiable):
            grad = next(diff) if differentiable else None
            if total is not None and grad is not None:
                total.add_(grad)


class _Gradients:
    """The block's gradients, accumulated stage by stage: the shared extras' (QK-norm
    weights, every stage adds) in fp32; dx (three shares a stage), dWq/k/v and their biases
    (a KV group's stages add into the same rows) in fp32 past a few stages
    (:func:`_activation_sum_dtype`), in the block's dtype below, where that is as accurate
    as the stock block and the peak stays where it was."""

    def __init__(self, x, weights: BlockWeights, extras_need_grad: list[bool], stages: int):
        self.dx = torch.zeros_like(x, dtype=_activation_sum_dtype(x.dtype, stages),
                                   memory_format=torch.contiguous_format)
        self.dw = {role: torch.zeros_like(w, dtype=_activation_sum_dtype(w.dtype, stages))
                   for role, w in (("q", weights.wq), ("k", weights.wk), ("v", weights.wv))}
        self.db = {role: None if b is None else torch.zeros_like(b, dtype=_activation_sum_dtype(b.dtype, stages))
                   for role, b in (("q", weights.bq), ("k", weights.bk), ("v", weights.bv))}
        # extras shared by all heads (QK-norm weights) sum over every stage: in fp32
        self.dextras = [torch.zeros_like(e, dtype=_accumulation_dtype(e.dtype), memory_format=torch.contiguous_format)
                        if need else None for e, need in zip(weights.extras, extras_need_grad)]
        self.dwo = torch.zeros_like(weights.wo)

    def add(self, role: str, recomputed: _Recomputed, grad_local) -> None:
        recomputed.add_gradients(grad_local, self, role)

    def result(self, x, weights: BlockWeights, dbo):
        """``block_backward``'s tuple, each gradient in its input's dtype."""
        cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        out = [cast(self.dx, x)]
        for role in ("q", "k", "v"):
            weight, bias = weights.projection(role)
            out += [cast(self.dw[role], weight), cast(self.db[role], bias)]
        return (*out, self.dwo, dbo, [cast(g, e) for g, e in zip(self.dextras, weights.extras)])


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# Stages up to which y, dx and dW are summed in the block's own bf16/fp16: their error stays at
# the stock (unfused) block's (measured 1.0-1.26x of it at 4 stages), and an fp32 sum of the
# x-sized ones would cost 2x a bf16 x at the long-context peak (U = P: Hq / P stages, 4 for
# Llama3-8B and Qwen3-32B). Past it each add's rounding grows the error (2.3x at 32 stages):
# fp32.
BF16_ACTIVATION_SUM_MAX_STAGES = 4


def _activation_sum_dtype(dtype: torch.dtype, stages: int) -> torch.dtype:
    return dtype if stages <= BF16_ACTIVATION_SUM_MAX_STAGES else _accumulation_dtype(dtype)


def _differentiable(t) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def extras_needing_grad(extras: list, requested: Optional[list[bool]] = None) -> list[bool]:
    """Which extras get a gradient: differentiable ones that autograd asks for
    (``requested``, from ``ctx.needs_input_grad``; None: every differentiable one)."""
    requested = [True] * len(extras) if requested is None else list(requested)
    return [_differentiable(e) and bool(r) for e, r in zip(extras, requested)]


def block_backward(dy, x, weights: BlockWeights, o, lse, region: BlockRegion, heads_per_stage: int,
                   group_name: str, prefetch: str = DEFAULT_PREFETCH, documents: Optional[Documents] = None,
                   extras_need_grad: Optional[list[bool]] = None, ring_group_name: str = ""):
    """Gradients ``(dx, dwq, dbq, dwk, dbk, dwv, dbv, dwo, dbo, [dextras])`` (None where
    the input was None, not differentiable, or not in ``extras_need_grad``). ``o``: the
    forward's local attention output, or None (``keep_output=False``): each stage then runs
    its attention forward again on the q/k/v it receives, and its output's trip home (the
    all-to-all the saved output's heads would have made the other way) gives dWo.

    Memory: what a stage sends is projected without a graph and dropped once sent; the
    stage's heads are projected again for their gradients after its kernel (projections
    cost little next to attention over the full sequence). Each stage's dK/dV go home and
    into the projections' gradients right away (the per-head ops' vjp is linear in the
    cotangent, so per-stage contributions sum to the group's), so no KV group's dK/dV is
    accumulated over the full sequence, and the stage buffers are released before the
    gradients are formed."""
    group = collectives.group_from_name(group_name)
    world, rank = group.size(), group.rank()
    schedule = block_schedule(region, world, heads_per_stage)
    batch, s_local = x.shape[:2]
    dim, output_dim, device = region.head_dim, region.output_dim, x.device
    attention = _stage_attention(region, ring_group_name)
    # Extras enter vjp as primals; those taking no gradient (integer positions, the RoPE
    # table) are closed over.
    extras_need_grad = extras_needing_grad(weights.extras, extras_need_grad)  # None: all that can
    grads = _Gradients(x, weights, extras_need_grad, len(schedule.stages))
    dy = dy.contiguous()
    buffers = {}

    def local_heads(role, heads):
        with torch.no_grad():
            return _project(x, weights, region, role, heads)

    def recompute(role, heads):
        return _Recomputed(x, weights, region, role, extras_need_grad, heads)

    def start(index):
        stage = schedule.stages[index]
        if schedule.opens_kv_group(index):
            kv_heads = head_index(schedule.kv_groups[stage.kv_group], device)
            for role in ("k", "v"):
                yield Incoming(_send_layout(local_heads(role, kv_heads), world), group_name, buffers, role)
        q_heads = head_index(stage.q_heads, device)
        yield Incoming(_send_layout(local_heads("q", q_heads), world), group_name, buffers, "q")
        if o is not None:
            yield Incoming.of_heads(o, q_heads, world, group_name, buffers, "out")
        dout_local = F.linear(dy, _output_columns(weights.wo, q_heads, output_dim).t())  # [B, s, U * Dv]
        dout_local = dout_local.view(batch, s_local, -1, output_dim)
        if output_dim != dim:  # v's padded columns: no gradient
            dout_local = F.pad(dout_local, (0, dim - output_dim))
        if region.attention_dtype is not None:  # as autograd casts the gradient back through o's cast
            dout_local = dout_local.to(region.attention_dtype)
        yield Incoming(_send_layout(dout_local.transpose(1, 2), world), group_name, buffers, "dout")

    def home(grad):
        """A stage's tensor over the full sequence ``[B, n, S, D]`` back on the local sequence."""
        return _heads_first(collectives.all_to_all(collectives.split_sequence(grad, world), group_name))

    def add_output_weight_grad(o_heads, q_heads):
        """dWo[:, heads] = dyᵀ o_heads, from the stage's local attention output ``[B, s, n * D]``."""
        dwo_cols = dy.flatten(0, 1).t().mm(o_heads.flatten(0, 1).to(dy.dtype))
        grads.dwo.view(grads.dwo.shape[0], -1, output_dim).index_add_(
            1, q_heads, dwo_cols.view(dwo_cols.shape[0], -1, output_dim).to(grads.dwo.dtype))

    inputs = InputPipeline(start, len(schedule.stages), prefetches(prefetch, backward=True))
    for index, stage in enumerate(schedule.stages):
        q_heads = head_index(stage.q_heads, device)
        if o is not None:  # dWo for this stage's columns, from the local attention output it sends
            add_output_weight_grad(_flat_heads(o.index_select(1, q_heads)[..., :output_dim]), q_heads)

        inputs.before_kernel(index)
        k_stage, v_stage = stage_kv(buffers, stage, device)
        sinks = _stage_sinks(region, weights, stage, rank)
        slopes = _stage_alibi(region, weights, stage, rank)
        if o is None:
            out_stage, lse_stage = attention.forward(buffers["q"], k_stage, v_stage, documents, slopes)
            if sinks is not None:
                out_stage, _ = apply_sinks(out_stage, lse_stage, sinks)
            del lse_stage
        else:
            out_stage = buffers["out"]
        dq_stage, dk_stage, dv_stage = attention.backward(
            buffers["dout"], buffers["q"], k_stage, v_stage, out_stage, lse[index], documents, slopes)
        del k_stage, v_stage
        dsinks = grads.dextras[region.sinks_extra] if sinks is not None else None
        if dsinks is not None:  # this rank's heads only: the ranks' gradients sum to the full one
            dsinks.index_add_(0, head_index(my_heads(stage, rank), device),
                              sink_gradient(buffers["dout"], out_stage, lse[index], sinks).to(dsinks.dtype))
        inputs.after_kernel(index)
        for role in ("q", "out", "dout"):  # refilled by the next stage (prefetched ones have landed)
            if inputs.landed != index + 1:
                buffers.pop(role, None)
        if schedule.closes_kv_group(index) and inputs.landed != index + 1:
            buffers.pop("k", None), buffers.pop("v", None)
        if o is None:  # the recomputed output's way home gives this stage's dWo columns
            add_output_weight_grad(_flat_heads(home(out_stage)[..., :output_dim]), q_heads)
        del out_stage
        # each gradient goes home and through its recomputed heads before the next is touched
        dq_home = home(dq_stage)
        del dq_stage
        grads.add("q", recompute("q", q_heads), dq_home)
        del dq_home
        kv_heads = head_index(schedule.kv_groups[stage.kv_group], device)
        dk_home = home(_group_layout(dk_stage, stage, schedule.kv_per_rank, device))
        del dk_stage
        grads.add("k", recompute("k", kv_heads), dk_home)
        del dk_home
        dv_home = home(_group_layout(dv_stage, stage, schedule.kv_per_rank, device))
        del dv_stage
        grads.add("v", recompute("v", kv_heads), dv_home)
        del dv_home

    dbo = None if weights.bo is None else dy.sum(dim=(0, 1)).to(weights.bo.dtype)
    return grads.result(x, weights, dbo)


def _group_layout(grad: torch.Tensor, stage, kv_per_rank: int, device) -> torch.Tensor:
    """A stage's dK (or dV) ``[B, m, S, D]`` for its KV slots, in the group's per-rank layout
    ``[B, kv_per_rank, S, D]`` (slots the stage did not read get zeros; repeated slots sum)."""
    if stage.kv_slot_range == (0, kv_per_rank) and grad.shape[1] == kv_per_rank:
        return grad
    full = grad.new_zeros((grad.shape[0], kv_per_rank, *grad.shape[2:]))
    span = stage.kv_slot_range
    if span is not None:
        full[:, span[0]:span[1]] += grad
    else:
        full.index_add_(1, head_index(stage.kv_slots, device), grad)
    return full
