"""Ops that mix tokens across the sharded sequence and that upipe does not rewrite.

Under context parallelism each rank holds one shard of the sequence. Attention is rewritten
into UPipe; every other op runs on the shard as it is. That is exact for ops that treat each
token on its own (projections, norms over features, RoPE from the shard's positions, MoE
routing) and silently wrong for ops that make one token's value depend on another's along the
sharded dimension: a convolution or a cumulative op over the sequence (Mamba's conv and scan,
a token shift, linear attention), a product contracting it, sorting or indexing across it, or
a reduction over it that flows back into per-token values.

:func:`find_token_mixing` follows the sequence dimension through the graph with torch's own
knowledge of each op: DTensor's sharding propagation. The graph runs once on fake tensors
under a dispatch mode; each tensor that holds tokens carries a placement on a 2-rank
stand-in mesh: ``Shard(d)`` (dimension ``d`` runs along the sequence) or ``Partial`` (a sum or
mean over tokens). For every aten op with such an input, the propagator is asked what the op
needs of its inputs:

- a ``Shard(d)`` input it cannot keep sharded (it must be all-gathered first): the op needs
  other ranks' tokens -- refused;
- a ``Partial`` input it must reduce first (``x - x.mean(seq)``): a reduction over tokens
  flows back into per-token values -- refused, naming the reduction's line too;
- otherwise the output's placement is recorded and followed.

A ``Partial`` that reaches the graph's outputs (a loss, an aux loss, a metric) is fine: the
training loop sums it over ranks. Ops with no sharding rule in torch that get a token input
are refused as "cannot tell" rather than guessed. Shapes are the shard's own (the stand-in
mesh is only asked about placements), so the graph's own size arguments stay consistent.

MoE routing: a sort of integer token data (expert ids) makes a routing table, and rows moved
by one (gathered, scattered, grouped-matmul'd) stay tokens; rows gathered in routing order may
be split into their experts' groups, projected group by group and concatenated back (JetMoE);
a routing table that a graph break hands to the next graph stays one there. Other mixing of
integer token data (positions counted over the shard's mask) is refused, and so is any op
that mixes the gathered rows (a running sum, a sum fed back). Ops whose results reach no
output are ignored.

Seeds: the inputs ``shard_sequence`` / ``global_positions`` made and the outputs of earlier
compiled graphs (their dimension is recorded on the tensor: :mod:`upipe_compile.sequence_marks`), the
activation inputs with the graph's attention query length in one dimension, and only where
nothing is marked and there is no attention, ``[B, S, ...]`` inputs of a length
``shard_sequence`` cut. The attention and mixer calls upipe rewrites are not asked: their
output holds the same tokens as their first input; upipe's other ops keep their tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Shard
from torch.utils._pytree import tree_flatten

from upipe_compile.passes.graph_utils import source_line
from upipe_compile.passes.token_mixing_refusal import TokenMixing
from upipe_compile.passes.token_placement import Seeds, SequenceTracker, marked_dim
from upipe_compile.passes.token_walk import Walker

log = logging.getLogger(__name__)

def _live_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value reaches a graph output or an op with side effects, in ``gm`` and its
    nested bodies (a body's output counts as reached)."""
    live: set[fx.Node] = set()
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        stack = [n for n in module.graph.nodes if n.op == "output" or (n.op != "placeholder" and n.is_impure())]
        while stack:
            node = stack.pop()
            if node not in live:
                live.add(node)
                stack.extend(node.all_input_nodes)
    return live


@dataclass
class TokenFlow:
    """What the walk found: the ops that mix tokens, and the sequence dimension of each graph
    output (None: holds no tokens), which the backend marks on the outputs at run time so that
    the graph after a graph break starts from them."""

    mixing: list[TokenMixing]
    output_dims: list[int | None]
    routing: list[bool] = field(default_factory=list)
    """Which outputs are routing tables (token-derived expert ids), not token values."""


def find_token_mixing(gm: fx.GraphModule, exempt: Callable[[fx.Node], bool],
                      local_lengths: set[int], cut_lengths: frozenset = frozenset()) -> TokenFlow:
    """Every op in ``gm`` (nested bodies included) that mixes tokens along the sharded sequence
    dimension, one per source line. ``exempt(node)``: the calls upipe rewrites (their outputs
    keep the query's placement). Seeds: inputs marked by ``shard_sequence``,
    ``global_positions`` or an earlier graph's outputs; other activation inputs at their first
    dimension after the batch with one of ``local_lengths`` (the attention calls' query
    lengths); with neither, 3-D inputs ``[B, S, ...]`` of one of ``cut_lengths`` (the lengths
    ``shard_sequence`` cut over the group)."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    values = [_value(node) for node in placeholders]
    fake_mode = torch._guards.detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    if fake_mode is None:
        log.info("upipe: token-mixing check skipped (the graph carries no fake values)")
        return TokenFlow([], [])
    if any(_is_symbolic(v) for v in values):
        # dynamic shapes: walk the graph at the sizes it was traced with, in a fresh fake mode
        fake_mode = torch._subclasses.fake_tensor.FakeTensorMode()
        with fake_mode:
            values = [_concrete(v) for v in values]
    marked = any(marked_dim(node) is not None for node in placeholders)
    seeds = Seeds(frozenset(local_lengths), frozenset() if marked else cut_lengths, exempt,
                   _live_nodes(gm))
    tracker = SequenceTracker(seeds)
    outputs: list = []
    # no autograd: an enclosing checkpoint (the compile runs inside its forward) must not see
    # tensors saved by this walk
    with torch.no_grad(), fake_mode, tracker:
        inputs = [tracker.seed(node, v) for node, v in zip(placeholders, values)]
        if not marked and not local_lengths and not any(tracker.get(v) is not None for v in inputs):
            log.warning("upipe: %s has no input marked as this rank's shard of the sequence and no attention, so "
                        "the check for ops that mix tokens across ranks cannot tell which dimension is the "
                        "sequence and checks nothing: make its inputs with upipe_compile.shard_sequence (or "
                        "global_positions), or compile it without context parallelism",
                        _graph_name(gm))
        try:
            outputs = tree_flatten(Walker(gm, tracker).run(*inputs))[0]
        except Exception as error:  # never silent: what cannot be followed is refused
            tracker.found_failure(error)
    unique: dict[str, TokenMixing] = {}
    for found in seeds.found:
        unique.setdefault(found.source_line, found)
    dims = [p.dim if isinstance(p := tracker.get(t), Shard) else None for t in outputs]
    routing = [isinstance(t, torch.Tensor) and t in tracker.routing for t in outputs]
    return TokenFlow(list(unique.values()), dims, routing)


def _graph_name(gm: fx.GraphModule) -> str:
    """The first source line the graph was traced from, for messages."""
    node = next((n for n in gm.graph.nodes if n.op == "call_function" and n.meta.get("stack_trace")), None)
    return f"the graph from {source_line(node)}" if node is not None else "a graph"


def _value(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _is_symbolic(v: Any) -> bool:
    if isinstance(v, torch.SymInt):
        return True
    return isinstance(v, torch.Tensor) and any(not isinstance(s, int) for s in (*v.shape, *v.stride()))


def _hint(x: Any) -> Any:
    if not isinstance(x, torch.SymInt):
        return x
    shape_env = x.node.shape_env
    hint = getattr(shape_env, "optimization_hint", None) or shape_env.size_hint  # newer torch renamed it
    return hint(x.node.expr)


def _concrete(v: Any) -> Any:
    """A symbolic size, or a tensor of symbolic shape, at the sizes it was traced with."""
    if not isinstance(v, torch.Tensor):
        return int(_hint(v)) if isinstance(v, torch.SymInt) else v
    return torch.empty_strided([int(_hint(s)) for s in v.shape], [int(_hint(s)) for s in v.stride()],
                               dtype=v.dtype, device=v.device)


