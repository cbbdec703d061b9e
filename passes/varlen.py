"""torch's ``varlen_attn`` (``torch.nn.attention.varlen``; torchtitan 0.3's "varlen"
attention) as the ``upipe::document_sdpa`` call it is, so that the passes after it rewrite it
like any attention over packed documents (plain op or fused block):

    out, lse, rng = torch_attn._varlen_attn(q [T, Hq, D], k, v, cu, cu, max, max, causal,
                                            scale, [left, right], gqa, None, None, None)
->
    res = upipe.document_sdpa(q.unsqueeze(0).transpose(1, 2), k..., v..., cu, causal, scale,
                              left, right, 0.0, None)
    out = res[0].transpose(1, 2).squeeze(0)

The T tokens must be one packed row (this rank's shard of it, in upipe's layout) and ``cu``
the documents of the whole row, as ``document_sdpa`` takes them. A call that cannot be
rewritten exactly is refused with the reason: a batch of rows flattened into T (their shards
would interleave), keys with other documents than the queries, its log-sum-exp or RNG state
used, a paged KV cache.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from upipe_compile.passes.attention_match import DOCUMENT_SDPA
from upipe_compile.passes.context import Refusal
from upipe_compile.passes.graph_utils import rewrite_nodes, shape_of, source_line

_ARGUMENTS = ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal", "scale",
              "window_size", "enable_gqa", "seqused_k", "block_table", "num_splits")
_DEFAULTS = {"is_causal": False, "scale": None, "window_size": None, "enable_gqa": False, "seqused_k": None,
             "block_table": None, "num_splits": None}
# ops that only reshape or move the tokens of one tensor: walked back to find the row q came from
_SHAPE_METHODS = {"view", "reshape", "transpose", "contiguous", "flatten", "permute", "unsqueeze", "squeeze",
                  "to", "clone", "type_as", "float", "bfloat16", "half"}
_SHAPE_FUNCTIONS = {torch.reshape, torch.transpose, torch.flatten, torch.permute, torch.unsqueeze, torch.squeeze}


def _varlen_targets() -> tuple:
    """The op as graphs hold it (registered when torch.nn.attention.varlen is imported)."""
    try:
        import torch.nn.attention.varlen  # noqa: F401
        packet = torch.ops.torch_attn._varlen_attn
    except (ImportError, AttributeError):  # a torch without varlen_attn
        return ()
    return (packet, packet.default)


def _is_varlen(node: fx.Node, targets: tuple) -> bool:
    return node.op == "call_function" and node.target in targets


def varlen_as_document_sdpa(gm: fx.GraphModule) -> list[Refusal]:
    """Rewrite every ``varlen_attn`` call in ``gm`` and its nested graph modules; returns one
    refusal (source line and reasons) per call that cannot be."""
    refusals, targets = [], _varlen_targets()

    def rewrite(module: fx.GraphModule, node: fx.Node) -> bool:
        if not _is_varlen(node, targets):
            return False
        arguments = dict(_DEFAULTS, **dict(zip(_ARGUMENTS, node.args)), **node.kwargs)
        reasons = _problems(node, arguments)
        if reasons:
            refusals.append(Refusal(source_line(node), reasons))
            return False
        _rewrite(module.graph, node, arguments)
        return True

    rewrite_nodes(gm, rewrite)
    return refusals


def _problems(node: fx.Node, a: dict) -> list[str]:
    problems = []
    if a["cu_seq_k"] is not a["cu_seq_q"]:
        problems.append("varlen_attn's keys are given other documents than its queries (cu_seq_k is not cu_seq_q): "
                        "upipe runs self-attention over one packed row")
    if a["seqused_k"] is not None or a["block_table"] is not None or a["num_splits"] not in (None, 1):
        problems.append("varlen_attn with seqused_k / block_table / num_splits (a paged KV cache, inference only) "
                        "has no context-parallel form in upipe")
    for item in node.users:
        if item.target is operator.getitem and item.args[1] != 0 and item.users:
            problems.append(f"the graph uses varlen_attn's {'log-sum-exp' if item.args[1] == 1 else 'RNG state'} "
                            "(return_aux), which upipe's attention does not hand out; use its output alone")
    shapes = [shape_of(a[name]) for name in ("query", "key", "value")]
    if any(s is None or len(s) != 3 for s in shapes):
        problems.append(f"varlen_attn's q, k, v are not [tokens, heads, head_dim] of known shape ({shapes})")
    elif not _one_row(a["query"]):
        problems.append(f"varlen_attn's {shapes[0][0]} query tokens could not be traced back to one packed row "
                        "[1, tokens, ...]: upipe shards the sequence of one row, and a batch of rows flattened "
                        "into one token dim would interleave their shards; pack each batch into one row "
                        "(local batch size 1)")
    return problems


def _one_row(node: fx.Node) -> bool:
    """``node``'s tokens come, through reshapes and moves only, from a tensor ``[1, tokens, ...]``."""
    numel = shape_of(node)
    numel = None if numel is None else torch.Size(numel).numel()
    while isinstance(node, fx.Node):
        shape = shape_of(node)
        if shape is not None and len(shape) >= 3 and shape[0] == 1 and torch.Size(shape).numel() == numel:
            return True
        moves = (node.op == "call_method" and node.target in _SHAPE_METHODS) or \
            (node.op == "call_function" and node.target in _SHAPE_FUNCTIONS)
        if not moves:
            return False
        node = node.args[0]
    return False


def _node(graph: fx.Graph, kind: str, target, args: tuple) -> fx.Node:
    """A new node with its example value (the passes after this one read shapes from it)."""
    node = graph.call_method(target, args) if kind == "method" else graph.call_function(target, args)
    values = tuple(a.meta.get("example_value", a.meta.get("val")) if isinstance(a, fx.Node) else a for a in args)
    # Without autograd: the backend may run inside an eager activation checkpoint, whose hooks
    # would count these compile-time tensors as saved by the forward.
    with torch.no_grad():
        node.meta["example_value"] = getattr(values[0], target)(*values[1:]) if kind == "method" else target(*values)
    return node


def _heads_first(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """``[T, H, D]`` -> ``[1, H, T, D]``."""
    return _node(graph, "method", "transpose", (_node(graph, "method", "unsqueeze", (node, 0)), 1, 2))


def _rewrite(graph: fx.Graph, node: fx.Node, a: dict) -> None:
    left, right = (-1, -1) if a["window_size"] is None else (int(a["window_size"][0]), int(a["window_size"][1]))
    # flash-attn's (left, 0) is causal within a window of left keys back (transformers' spelling: both sides)
    is_causal = bool(a["is_causal"]) or right == 0
    window = (left, left) if is_causal else (left, right)
    scale: Optional[float] = None if a["scale"] is None else float(a["scale"])
    with graph.inserting_before(node):
        q, k, v = (_heads_first(graph, a[name]) for name in ("query", "key", "value"))
        result = _node(graph, "function", DOCUMENT_SDPA, (q, k, v, a["cu_seq_q"], is_causal, scale, *window, 0.0,
                                                          None))
        out = _node(graph, "function", operator.getitem, (result, 0))
        out = _node(graph, "method", "squeeze", (_node(graph, "method", "transpose", (out, 1, 2)), 0))
    for new in (result, out):
        new.meta.update({key: value for key, value in node.meta.items()
                         if key in ("stack_trace", "nn_module_stack", "source_fn_stack")})
    for item in list(node.users):
        if item.target is operator.getitem and item.args[1] == 0:
            item.replace_all_uses_with(out)
        graph.erase_node(item)  # the others are unused (refused otherwise)
    graph.erase_node(node)
