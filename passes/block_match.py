"""A proven attention block (found by :mod:`upipe_compile.passes.find_block`) as a match: the
nodes it owns, and its replacement by one ``upipe::attention_block`` call. Blocks are found by
the ``replace`` pass, after the refusal: a block's attention has passed
:meth:`~upipe_compile.passes.attention_match.AttentionMatch.problems`, so a block has no problems
of its own, and one that cannot be fused is a :class:`NotFusable` whose attention keeps the plain op.

Before:

    q_lin = linear(x, Wq, bq); k_lin = ...; v_lin = ...      # or qkv = linear(x, Wqkv) + slices
    q = chain_q(q_lin, cos, sin); k = chain_k(k_lin, cos, sin); v = chain_v(v_lin)
    o = sdpa(q, k, v, is_causal=True, scale=...)
    y = linear(o.transpose(1, 2).reshape(B, s, Hq * D), Wo, bo)
    ... users of y ...

After:

    wq = Wqkv[0:a]; wk = Wqkv[a:b]; wv = Wqkv[b:c]           # fused projections only
    block = upipe.attention_block(x, wq, bq, wk, bk, wv, bv, Wo, bo, [cos, sin], cu_seqlens,
                                  *BlockSettings(region_id, heads_per_stage, ...).op_args())
    y = block[0]
    ... users of y ...

``region_id`` names the registered :class:`~upipe_compile.block.region.BlockRegion`, whose
head fns are the chains extracted as ``(projected, n, *extras) -> [B, n, s, D]``
(:func:`~upipe_compile.passes.head_separable.extract_head_fn`). The replaced nodes are erased.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from upipe_compile.block.ops import BlockSettings
from upipe_compile.block.region import BlockRegion, register_region
from upipe_compile.passes.attention_match import AttentionMatch
from upipe_compile.passes.context import PassContext
from upipe_compile.passes.graph_utils import example
from upipe_compile.passes.head_separable import extract_head_fn

ROLES = ("q", "k", "v")


@dataclass
class Projection:
    """Where one role's ``projected`` comes from: ``linear`` itself (``rows`` None) or the
    rows ``[a, b)`` of a fused projection, read through ``slice_nodes`` (a getitem or
    narrow; or split/chunk then getitem)."""

    linear: fx.Node
    weight: fx.Node
    bias: Optional[fx.Node]
    rows: Optional[tuple[int, int]] = None
    slice_nodes: list = field(default_factory=list)

    @property
    def value(self) -> fx.Node:
        """The node whose value is ``projected``."""
        return self.slice_nodes[-1] if self.slice_nodes else self.linear


@dataclass
class BlockMatch:
    """One fusable attention block, owning its nodes (found after the refusal, for attention
    that passed it: it is replaced, never refused)."""

    attention: AttentionMatch
    x: fx.Node
    projections: dict  # role -> Projection
    chains: dict  # role -> Chain
    extras: list  # tensor nodes the chains read from outside, graph order (shared by q, k, v)
    out_nodes: list  # sdpa output -> ... -> o_proj input
    out_linear: fx.Node
    wo: fx.Node
    bo: Optional[fx.Node]
    q_heads: int
    kv_heads: int
    head_dim: int
    value_dim: int
    """Output columns per head the output projection reads (< head_dim where v was padded)."""
    projection_inputs: tuple
    """Per role, what it projects: -1 the block input x, i ``extras[i]``."""

    @property
    def graph_module(self) -> fx.GraphModule:
        return self.attention.graph_module

    def replace(self, ctx: PassContext) -> None:
        rewrite_block(self, heads_per_stage=ctx.heads_per_stage, world_size=ctx.world, group_name=ctx.group_name,
                      prefetch=ctx.prefetch, recompute_attention_output=ctx.recompute_attention_output,
                      ring_group_name=ctx.ring_group_name)
        ctx.touch(self.graph_module)

    @property
    def source_line(self) -> str:
        return self.attention.source_line

    def nodes(self) -> set:
        """Every node the fused op replaces (projections, chains, SDPA, output side, o_proj)."""
        nodes = {self.attention.node, self.out_linear, *self.out_nodes}
        for role in ROLES:
            p = self.projections[role]
            nodes |= {p.linear, *p.slice_nodes, *self.chains[role].nodes}
        return nodes


@dataclass
class NotFusable:
    attention: AttentionMatch
    node: fx.Node
    reason: str

    def __str__(self) -> str:
        return self.reason


_META_KEYS = ("stack_trace", "nn_module_stack", "source_fn_stack")


def attention_block_target():
    return torch.ops.upipe.attention_block.default


def block_region(block: BlockMatch) -> BlockRegion:
    fns = {role: extract_head_fn(block.chains[role], block.extras, block.graph_module, f"{role}_head_fn")
           for role in ROLES}
    match = block.attention
    scale = None if match.scale is None else float(match.scale)
    return BlockRegion(block.q_heads, block.kv_heads, block.head_dim, fns["q"], fns["k"], fns["v"],
                       bool(match.is_causal), scale, match.source_line,
                       (int(match.window_left), int(match.window_right)), float(match.softcap),
                       -1 if match.sinks is None else block.extras.index(match.sinks),
                       0 if block.value_dim == block.head_dim else block.value_dim, block.projection_inputs,
                       _attention_dtype(block),
                       -1 if match.alibi_slopes is None else block.extras.index(match.alibi_slopes))


def _attention_dtype(block: BlockMatch):
    """q's dtype at attention, where it is not the block input's (None: the same)."""
    dtype = example(block.attention.query).dtype
    return None if dtype == example(block.x).dtype else dtype


def rewrite_block(block: BlockMatch, **settings) -> None:
    """Insert ``upipe::attention_block`` before the output projection, hand the projection's
    users item 0, erase the block's nodes. ``settings``: the fields of
    :class:`~upipe_compile.block.ops.BlockSettings` but the region id (the block's region is
    registered here, owned by its graph module). The caller lints and recompiles each touched
    graph module once."""
    region_id = register_region(block_region(block), owner=block.graph_module)
    settings = BlockSettings(region_id, **settings)
    graph = block.graph_module.graph
    anchor = block.out_linear
    with graph.inserting_before(anchor):
        tensors = []
        for role in ROLES:
            p = block.projections[role]
            if p.rows is None:
                tensors += [p.weight, p.bias]
                continue
            rows = slice(*p.rows)
            w = graph.call_function(operator.getitem, (p.weight, rows))
            b = None if p.bias is None else graph.call_function(operator.getitem, (p.bias, rows))
            for n in (w, b):
                if n is not None:
                    n.meta.update({k: v for k, v in p.linear.meta.items() if k in _META_KEYS})
            tensors += [w, b]
        op = graph.call_function(
            attention_block_target(),
            (block.x, *tensors, block.wo, block.bo, list(block.extras), block.attention.cu_seqlens,
             *settings.op_args()),
        )
        y = graph.call_function(operator.getitem, (op, 0))
    op.meta.update({k: v for k, v in block.attention.node.meta.items() if k in _META_KEYS})
    y.meta.update(anchor.meta)
    anchor.replace_all_uses_with(y)
    _erase_dead(graph, block.nodes())


def _erase_dead(graph: fx.Graph, nodes: set) -> None:
    for node in reversed(list(graph.nodes)):
        if node in nodes and not node.users:
            graph.erase_node(node)
