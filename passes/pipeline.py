"""The upipe backend's graph passes, in order, each ``(gm, ctx) -> None`` over one shared
:class:`~upipe_compile.passes.context.PassContext`. After each pass every graph module of ``gm``
is linted; with the logger ``upipe_compile.passes.pipeline`` at DEBUG the graph is printed
before and after each pass.

1. ``split_grouped_projections``, ``concatenate_filled_buffers`` (with ``fuse_projections``):
   put projections into the form the block finder reads.
2. ``varlen_as_document_sdpa``: torch's varlen attention as attention over packed documents.
3. ``find_attention``, ``find_mixers``, ``find_refused_attention``, ``find_token_mixing``: the
   matches, and the ops upipe refuses (flex and hand-written attention, other token mixing).
4. ``refuse``: every match's problems in one :class:`~upipe_compile.errors.UnsupportedAttention`.
5. ``replace``: each attention block fused where it is head-separable (else the SDPA call
   alone), each mixer as a stage loop; touched graph modules recompiled.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch.fx as fx

from upipe_compile.errors import UnsupportedAttention
from upipe_compile.passes.block_match import BlockMatch
from upipe_compile.passes.context import REFUSAL_KINDS, PassContext, Refusal
from upipe_compile.passes.filled_buffers import concatenate_filled_buffers
from upipe_compile.passes.find import find_attention
from upipe_compile.passes.find_block import find_block
from upipe_compile.passes.find_unsupported import UnsupportedMatch, find_unsupported_attention
from upipe_compile.passes.graph_utils import function_of, graph_modules
from upipe_compile.passes.grouped_projections import split_grouped_projections
from upipe_compile.passes.mixer_match import find_mixers
from upipe_compile.passes.token_mixing import find_token_mixing
from upipe_compile.passes.varlen import varlen_as_document_sdpa

log = logging.getLogger(__name__)


def _split_grouped_projections(gm: fx.GraphModule, ctx: PassContext) -> None:
    if ctx.fuse_projections:  # a q/k/v projection laid out per KV group (torchtitan 0.3's wqkv)
        split_grouped_projections(gm)


def _concatenate_filled_buffers(gm: fx.GraphModule, ctx: PassContext) -> None:
    if ctx.fuse_projections:  # keys built by slice copies (DeepSeek-V3) as the cat they are
        concatenate_filled_buffers(gm)


def _varlen_as_document_sdpa(gm: fx.GraphModule, ctx: PassContext) -> None:
    ctx.refused += varlen_as_document_sdpa(gm)


def _find_attention(gm: fx.GraphModule, ctx: PassContext) -> None:
    ctx.attention = find_attention(gm)


def _find_mixers(gm: fx.GraphModule, ctx: PassContext) -> None:
    ctx.mixers = find_mixers(gm)  # head-separable mixers (short convs, the gated delta rule)


def _find_refused_attention(gm: fx.GraphModule, ctx: PassContext) -> None:
    # flex_attention and hand-written attention would see the local shard only
    ctx.refused += find_unsupported_attention(gm)


def _find_token_mixing(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Any other op that mixes tokens across the sharded sequence (the parts of refused
    attention are not named twice), and the outputs' sequence dimensions."""
    rewritten = {match.node for match in ctx.attention} | {match.node for match in ctx.mixers}
    lengths = {n for n in (match.query_length for match in ctx.attention) if n}
    attention = [item for item in ctx.refused if isinstance(item, UnsupportedMatch)]
    known = {node for item in attention for node in (item.node, item.scores, item.output) if node is not None}
    functions = {function_of(item.source_line) for item in attention}
    flow = find_token_mixing(gm, rewritten.__contains__, lengths, ctx.cut_lengths)
    ctx.refused += [item for item in flow.mixing
                    if item.node not in known and function_of(item.source_line) not in functions]
    ctx.output_dims, ctx.output_routing = flow.output_dims, flow.routing


def _refuse(gm: fx.GraphModule, ctx: PassContext) -> None:
    """One refusal naming every call upipe cannot run, each with its source line and reasons."""
    found = {kind: [] for kind in REFUSAL_KINDS}
    for match in _in_refusal_order(ctx):
        if problems := match.problems(ctx):
            found[match.refusal_kind].append(f"  {match.source_line}\n" + "".join(f"    - {p}\n" for p in problems))
    if any(found.values()):
        what = " and ".join(f"{len(entries)} {kind}" for kind, entries in found.items() if entries)
        raise UnsupportedAttention(f"upipe cannot run {what} with context parallelism over {ctx.ranks()}:\n"
                                   + "".join(entry for entries in found.values() for entry in entries))


def _in_refusal_order(ctx: PassContext) -> list:
    """Varlen refusals, then the SDPA calls, flex and hand-written attention, mixers, token mixing."""
    varlen = [item for item in ctx.refused if isinstance(item, Refusal)]
    others = [item for item in ctx.refused if not isinstance(item, Refusal)]
    return [*varlen, *ctx.attention, *others, *ctx.mixers]


def _replace(gm: fx.GraphModule, ctx: PassContext) -> None:
    for match in ctx.attention:
        block = find_block(match) if ctx.fuse_projections else None
        if isinstance(block, BlockMatch):
            block.replace(ctx)
            ctx.fused_blocks += 1
            log.info("upipe: fused attention block at %s (%d q / %d kv heads of %d)", match.source_line,
                     block.q_heads, block.kv_heads, block.head_dim)
            continue
        if block is not None:
            log.info("upipe: attention block at %s not fused: %s", match.source_line, block.reason)
        match.replace(ctx)
    for mixer in ctx.mixers:
        mixer.replace(ctx)
    for module in ctx.touched.values():
        module.recompile()
    log.info("upipe: rewrote %d attention call(s) (%d fused blocks) and %d mixer(s), P=%d, heads_per_stage=%d",
             len(ctx.attention), ctx.fused_blocks, len(ctx.mixers), ctx.world, ctx.heads_per_stage)


PASSES: list[tuple[str, Callable[[fx.GraphModule, PassContext], None]]] = [
    ("split_grouped_projections", _split_grouped_projections),
    ("concatenate_filled_buffers", _concatenate_filled_buffers),
    ("varlen_as_document_sdpa", _varlen_as_document_sdpa),
    ("find_attention", _find_attention),
    ("find_mixers", _find_mixers),
    ("find_refused_attention", _find_refused_attention),
    ("find_token_mixing", _find_token_mixing),
    ("refuse", _refuse),
    ("replace", _replace),
]


def run_passes(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Every pass of :data:`PASSES` in order, each graph module linted after each one."""
    dump = log.isEnabledFor(logging.DEBUG)
    for name, run in PASSES:
        if dump:
            log.debug("upipe: graph before %s:\n%s", name, gm.print_readable(print_output=False))
        run(gm, ctx)
        for module in graph_modules(gm):
            module.graph.lint()
        if dump:
            log.debug("upipe: graph after %s:\n%s", name, gm.print_readable(print_output=False))
    return gm
