"""The fused attention block as a compiler-opaque op, and its eager twin.

``upipe::attention_block`` runs :func:`upipe_compile.block.loop.block_forward`; its autograd
saves x, the weights, the extras, the local attention output (unless the settings say to
recompute it) and the per-stage LSE, and its backward op runs :func:`~upipe_compile.block.loop.block_backward`. What is saved and how
backward replays it is defined once (:func:`_save`, :func:`_replay`) and shared by the
custom op and :class:`BlockFunction`, the autograd.Function that memory measurements run
under FakeTensorMode (where the custom op would run only its fake kernel).

The region (head fns, head counts) is not a tensor, so the op takes its registry id
(:func:`upipe_compile.block.region.register_region`). The op's scalar arguments are the
fields of :class:`BlockSettings`, in its order; the op bodies make the record of them once
and it travels whole from there.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Optional

import torch
from torch import Tensor

from upipe_compile.attention import collectives, op_outputs
from upipe_compile.attention.ops import OP_TAGS, check_world
from upipe_compile.attention.stage_loop import DEFAULT_PREFETCH
from upipe_compile.attention.checks import AttentionCall, attention_problems
from upipe_compile.block.loop import BlockWeights, block_backward, block_forward, block_schedule, extras_needing_grad
from upipe_compile.block.region import BlockRegion, region_by_id, register_region
from upipe_compile.attention.document_boundaries import documents_of
from upipe_compile.errors import UnsupportedAttention
from upipe_compile.options import DEFAULT_RECOMPUTE_ATTENTION_OUTPUT, option_problems, resolved_heads_per_stage


@dataclass(frozen=True)
class BlockSettings:
    """The settings of one fused attention-block call (``upipe::attention_block``), passed
    to the op as scalar arguments in this order (:meth:`op_args`, :meth:`from_op_args`)."""

    region_id: int
    """The block's registered :class:`~upipe_compile.block.region.BlockRegion`."""
    heads_per_stage: int
    world_size: int
    group_name: str
    prefetch: str = DEFAULT_PREFETCH
    recompute_attention_output: bool = False
    """Keep no attention output for backward; each stage's attention forward runs again there."""
    ring_group_name: str = ""
    """Ring x all-to-all, as :attr:`~upipe_compile.attention.stage_loop.StageLoopSettings.ring_group_name`:
    each stage's attention runs as ring attention over this group; ``group_name``/``world_size``
    are the all-to-all's. Empty: no ring."""

    def op_args(self) -> tuple:
        return astuple(self)

    @classmethod
    def from_op_args(cls, region_id: int, heads_per_stage: int, world_size: int, group_name: str,
                     prefetch: str = DEFAULT_PREFETCH, recompute_attention_output: bool = False,
                     ring_group_name: str = "") -> "BlockSettings":
        return cls(region_id, heads_per_stage, world_size, group_name, prefetch, recompute_attention_output,
                   ring_group_name)


# --- the settings as the block loops' arguments ---------------------------------------------
def _loop_arguments(settings: BlockSettings, x: Tensor, boundaries_or_positions: Optional[Tensor]) -> dict:
    """The block loops' arguments besides the tensors: the one place the record is taken
    apart. The loops take the region itself, not its id: they never see the registry, and
    the compiled op and its eager twin (each compile registers its own id) call them alike."""
    return dict(region=region_by_id(settings.region_id), heads_per_stage=settings.heads_per_stage,
                group_name=settings.group_name, prefetch=settings.prefetch,
                documents=documents_of(boundaries_or_positions, x.shape[1], settings.group_name, x.device,
                                       settings.ring_group_name),
                ring_group_name=settings.ring_group_name)


def _run_forward(x, weights: BlockWeights, settings: BlockSettings, boundaries_or_positions) -> tuple:
    """:func:`~upipe_compile.block.loop.block_forward`'s ``(y, o, lse)`` under ``settings``."""
    return block_forward(x, weights, keep_output=not settings.recompute_attention_output,
                         **_loop_arguments(settings, x, boundaries_or_positions))


def _run_backward(dy, x, weights: BlockWeights, o, lse, settings: BlockSettings, boundaries_or_positions,
                  extras_need_grad: list[bool]) -> tuple:
    """:func:`~upipe_compile.block.loop.block_backward`'s gradients under ``settings`` (``o``
    is not read where the settings recompute it)."""
    return block_backward(dy, x, weights, None if settings.recompute_attention_output else o, lse,
                          extras_need_grad=extras_need_grad, **_loop_arguments(settings, x, boundaries_or_positions))


@torch.library.custom_op("upipe::attention_block", mutates_args=(), tags=OP_TAGS)
def attention_block_op(
    x: Tensor, wq: Tensor, bq: Optional[Tensor], wk: Tensor, bk: Optional[Tensor], wv: Tensor,
    bv: Optional[Tensor], wo: Tensor, bo: Optional[Tensor], extras: list[Tensor], cu_seqlens: Optional[Tensor],
    region_id: int, heads_per_stage: int, world_size: int, group_name: str, prefetch: str,
    recompute_attention_output: bool, ring_group_name: str = "",
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, o, lse)``. ``cu_seqlens`` is either the documents' boundaries ``[n + 1]`` or, 2-D,
    this rank's position ids (:func:`~upipe_compile.attention.document_boundaries.documents_for`); the
    schema keeps the public name."""
    settings = BlockSettings.from_op_args(region_id, heads_per_stage, world_size, group_name, prefetch,
                                          recompute_attention_output, ring_group_name)
    check_world(world_size, group_name)
    outputs = _run_forward(x, BlockWeights(wq, bq, wk, bk, wv, bv, wo, bo, list(extras)), settings, cu_seqlens)
    op_outputs.report(*outputs)
    return outputs


@attention_block_op.register_fake
def _attention_block_fake(x, wq, bq, wk, bk, wv, bv, wo, bo, extras, cu_seqlens, region_id, heads_per_stage,
                          world_size, group_name, prefetch, recompute_attention_output, ring_group_name=""):
    region = region_by_id(region_id)
    schedule = block_schedule(region, world_size, heads_per_stage)
    batch, s_local, _ = x.shape
    y = x.new_empty((batch, s_local, wo.shape[0]))
    o = x.new_empty((0,) if recompute_attention_output else (batch, region.q_heads, s_local, region.head_dim),
                    dtype=region.attention_dtype or x.dtype)
    lse = x.new_empty(schedule.lse_shape(batch, s_local), dtype=torch.float32)
    op_outputs.report(y, o, lse)
    return y, o, lse


def _gradient_list(grads, weights: BlockWeights) -> list[Tensor]:
    """Backward's gradients as the flat list a custom op can return: dx, dwq, dwk, dwv,
    dwo, then the bias gradients of the biases that exist, then one per extra (an empty
    tensor for extras that take or need no gradient)."""
    dx, dwq, dbq, dwk, dbk, dwv, dbv, dwo, dbo, dextras = grads
    biases = [g for g, b in ((dbq, weights.bq), (dbk, weights.bk), (dbv, weights.bv), (dbo, weights.bo)) if b is not None]
    extras = [g if g is not None else e.new_empty(0) for g, e in zip(dextras, weights.extras)]
    return [dx, dwq, dwk, dwv, dwo] + biases + extras


def _from_gradient_list(flat: list, weights: BlockWeights, extras_need_grad: list[bool]) -> tuple:
    """Inverse of :func:`_gradient_list`, in the op's input order (x, wq, bq, ..., bo, extras)."""
    dx, dwq, dwk, dwv, dwo, *rest = flat
    rest = list(rest)
    dbq, dbk, dbv, dbo = (rest.pop(0) if b is not None else None for b in (weights.bq, weights.bk, weights.bv, weights.bo))
    dextras = [g if need else None for g, need in zip(rest, extras_need_grad)]
    return dx, dwq, dbq, dwk, dbk, dwv, dbv, dwo, dbo, dextras


@torch.library.custom_op("upipe::attention_block_backward", mutates_args=(), tags=OP_TAGS)
def attention_block_backward_op(
    dy: Tensor, x: Tensor, wq: Tensor, bq: Optional[Tensor], wk: Tensor, bk: Optional[Tensor], wv: Tensor,
    bv: Optional[Tensor], wo: Tensor, bo: Optional[Tensor], extras: list[Tensor], o: Tensor, lse: Tensor,
    cu_seqlens: Optional[Tensor], extras_need_grad: list[bool], region_id: int, heads_per_stage: int,
    world_size: int, group_name: str, prefetch: str, recompute_attention_output: bool, ring_group_name: str = "",
) -> list[Tensor]:
    """The block's gradients as :func:`_gradient_list` flattens them; ``cu_seqlens`` as in
    :func:`attention_block_op`."""
    settings = BlockSettings.from_op_args(region_id, heads_per_stage, world_size, group_name, prefetch,
                                          recompute_attention_output, ring_group_name)
    check_world(world_size, group_name)
    weights = BlockWeights(wq, bq, wk, bk, wv, bv, wo, bo, list(extras))
    return _gradient_list(_run_backward(dy, x, weights, o, lse, settings, cu_seqlens, list(extras_need_grad)), weights)


@attention_block_backward_op.register_fake
def _attention_block_backward_fake(dy, x, wq, bq, wk, bk, wv, bv, wo, bo, extras, o, lse, cu_seqlens, extras_need_grad,
                                   region_id, heads_per_stage, world_size, group_name, prefetch,
                                   recompute_attention_output, ring_group_name=""):
    weights = BlockWeights(wq, bq, wk, bk, wv, bv, wo, bo, list(extras))
    like = lambda t: None if t is None else torch.empty_like(t)  # noqa: E731
    dextras = [torch.empty_like(e) if need else None
               for e, need in zip(extras, extras_needing_grad(list(extras), extras_need_grad))]
    grads = (like(x), like(wq), like(bq), like(wk), like(bk), like(wv), like(bv), like(wo), like(bo), dextras)
    return _gradient_list(grads, weights)


# --- what autograd saves and how backward replays it (shared by the op and its twin) ----
_TENSOR_INPUTS = 9  # x, wq, bq, wk, bk, wv, bv, wo, bo


def _save(ctx, tensors: tuple, extras: list, o, lse, settings: BlockSettings, boundaries_or_positions) -> None:
    """``tensors``: (x, wq, bq, wk, bk, wv, bv, wo, bo); ``o`` is empty when the settings
    recompute it."""
    ctx.save_for_backward(*tensors, o, lse, boundaries_or_positions, *extras)
    ctx.settings = settings
    # the registry holds a region only while someone does: an eager caller may drop its own
    # before backward looks it up by id
    ctx.region = region_by_id(settings.region_id)


def _saved(ctx):
    saved = ctx.saved_tensors
    tensors, (o, lse, boundaries_or_positions), extras = saved[:_TENSOR_INPUTS], \
        saved[_TENSOR_INPUTS:_TENSOR_INPUTS + 3], list(saved[_TENSOR_INPUTS + 3:])
    return tensors, extras, o, lse, boundaries_or_positions


def _replay(ctx, dy, run_backward, extras_requested) -> tuple:
    """Gradients in the op's input order; ``run_backward(dy, tensors, extras, o, lse,
    settings, boundaries_or_positions, extras_need_grad)`` returns them as
    :func:`block_backward` does. ``extras_requested``: which extras autograd wants a gradient
    for (``needs_input_grad``)."""
    tensors, extras, o, lse, boundaries_or_positions = _saved(ctx)
    need = extras_needing_grad(extras, extras_requested)
    return run_backward(dy, tensors, extras, o, lse, ctx.settings, boundaries_or_positions, need)


def _backward_through_op(dy, tensors, extras, o, lse, settings, boundaries_or_positions, extras_need_grad):
    flat = attention_block_backward_op(dy, *tensors, extras, o, lse, boundaries_or_positions, extras_need_grad,
                                       *settings.op_args())
    return _from_gradient_list(flat, BlockWeights(*tensors[1:], extras), extras_need_grad)


def _backward_eagerly(dy, tensors, extras, o, lse, settings, boundaries_or_positions, extras_need_grad):
    return _run_backward(dy, tensors[0], BlockWeights(*tensors[1:], extras), o, lse, settings,
                         boundaries_or_positions, extras_need_grad)


def _setup_context(ctx, inputs, output):
    x, wq, bq, wk, bk, wv, bv, wo, bo, extras, boundaries_or_positions, *scalars = inputs
    _, o, lse = output
    _save(ctx, (x, wq, bq, wk, bk, wv, bv, wo, bo), list(extras), o, lse, BlockSettings.from_op_args(*scalars),
          boundaries_or_positions)


def _op_backward(ctx, dy, _do, _dlse):
    # for a list input, needs_input_grad holds a list of bools (the op's inputs: extras is 10th)
    dx, dwq, dbq, dwk, dbk, dwv, dbv, dwo, dbo, dextras = _replay(ctx, dy, _backward_through_op,
                                                                   ctx.needs_input_grad[9])
    # One None per scalar argument the call passed: the dispatcher drops trailing arguments
    # equal to their defaults (ring_group_name=""), and the tensor-list wrapper wants exactly
    # the call's structure back (needs_input_grad has it).
    scalars = len(ctx.needs_input_grad) - 11  # x, 8 weights, extras, cu_seqlens
    return (dx, dwq, dbq, dwk, dbk, dwv, dbv, dwo, dbo, dextras, None) + (None,) * scalars


attention_block_op.register_autograd(_op_backward, setup_context=_setup_context)


class BlockFunction(torch.autograd.Function):
    """The op's forward and backward run eagerly (for fake-tensor memory measurements),
    saving and replaying exactly as the op does."""

    @staticmethod
    def forward(ctx, x, wq, bq, wk, bk, wv, bv, wo, bo, settings: BlockSettings, boundaries_or_positions, *extras):
        y, o, lse = _run_forward(x, BlockWeights(wq, bq, wk, bk, wv, bv, wo, bo, list(extras)), settings,
                                 boundaries_or_positions)
        _save(ctx, (x, wq, bq, wk, bk, wv, bv, wo, bo), list(extras), o, lse, settings, boundaries_or_positions)
        return y

    @staticmethod
    def backward(ctx, dy):
        dx, dwq, dbq, dwk, dbk, dwv, dbv, dwo, dbo, dextras = _replay(ctx, dy, _backward_eagerly,
                                                                       ctx.needs_input_grad[11:])
        return (dx, dwq, dbq, dwk, dbk, dwv, dbv, dwo, dbo, None, None, *dextras)


def block_problems(region: BlockRegion, x: Tensor, extras, world: int, heads_per_stage: int) -> list[str]:
    """The block's attention call, asked as every entry point asks it."""
    batch, s_local = x.shape[0], x.shape[1]
    q_shape = (batch, region.q_heads, s_local, region.head_dim)
    k_shape = (batch, region.kv_heads, s_local, region.head_dim)
    sinks = extras[region.sinks_extra] if region.sinks_extra >= 0 else None
    alibi_slopes = extras[region.alibi_extra] if region.alibi_extra >= 0 else None
    call = AttentionCall(q_shape, k_shape, k_shape, x.dtype, x.device.type, window=region.window,
                         softcap=region.softcap, sinks=sinks, alibi_slopes=alibi_slopes)
    return attention_problems(call, world, heads_per_stage)


def upipe_attention_block(x, wq, bq, wk, bk, wv, bv, wo, bo, extras, region: BlockRegion, *, cp_mesh=None,
                          heads_per_stage: Optional[int] = None, prefetch: str = DEFAULT_PREFETCH,
                          recompute_attention_output: bool = DEFAULT_RECOMPUTE_ATTENTION_OUTPUT,
                          cu_seqlens: Optional[Tensor] = None,
                          eager: bool = False) -> Tensor:
    """A whole attention block on this rank's sequence shard ``x [B, S/P, d]``: for each
    role, ``region.head_fn(role)(x @ W_roleᵀ + b_role, n, *extras)``, attention over the
    full sequence, and the output projection ``wo``/``bo`` (see
    :mod:`upipe_compile.block.region`). ``recompute_attention_output=True`` keeps no
    attention output for backward (each stage's attention forward runs again there: less
    memory, more compute). ``eager=True`` runs the loops as an
    autograd.Function instead of the custom op (for fake-tensor memory measurements).
    ``cp_mesh`` may be a ("cp_ring", "cp_a2a") mesh: ``x`` is then this rank's shard as
    :func:`upipe_compile.shard_sequence` lays it out, U counts the all-to-all ranks and each
    stage's attention is ring attention."""
    group, ring_group = collectives.resolve_groups(cp_mesh)
    world = group.size()
    problems = option_problems(world=world, heads_per_stage=heads_per_stage, prefetch=prefetch,
                               recompute_attention_output=recompute_attention_output)
    if problems:
        raise UnsupportedAttention("upipe_attention_block: " + "; ".join(problems))
    heads_per_stage = resolved_heads_per_stage(heads_per_stage, world)
    problems = block_problems(region, x, extras, world, heads_per_stage)
    if problems:
        raise UnsupportedAttention("upipe_attention_block: " + "; ".join(problems))
    settings = BlockSettings(register_region(region), heads_per_stage, world, group.group_name, prefetch,
                             recompute_attention_output, "" if ring_group is None else ring_group.group_name)
    if eager:
        return BlockFunction.apply(x, wq, bq, wk, bk, wv, bv, wo, bo, settings, cu_seqlens, *extras)
    y, _, _ = attention_block_op(x, wq, bq, wk, bk, wv, bv, wo, bo, list(extras), cu_seqlens, *settings.op_args())
    return y
