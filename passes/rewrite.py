"""Replace a validated SDPA node by the UPipe stage-loop op."""

from __future__ import annotations

import operator

import torch.nn.functional as F

from upipe_compile.attention.ops import attention_op, op_arguments
from upipe_compile.attention.stage_loop import StageLoopSettings
from upipe_compile.passes.find import AttentionMatch

UPIPE_ATTENTION = attention_op._opoverload


def rewrite_attention(match: AttentionMatch, heads_per_stage: int, world_size: int, group_name: str,
                      prefetch: str, ring_group_name: str = "") -> None:
    """Insert ``upipe::attention`` before the SDPA node, hand its users the output, erase it.
    The caller lints and recompiles each touched graph module once. ``ring_group_name``:
    ring x all-to-all (``group_name`` is then the all-to-all group)."""
    graph, node = match.graph_module.graph, match.node
    scale = None if match.scale is None else float(match.scale)
    with graph.inserting_before(node):
        q, k, v, scale, value_dim = _one_head_dim(graph, match, scale)
        settings = StageLoopSettings(match.is_causal, scale, heads_per_stage, world_size, group_name, prefetch,
                                     int(match.window_left), int(match.window_right), float(match.softcap),
                                     ring_group_name)
        op = graph.call_function(UPIPE_ATTENTION, op_arguments(q, k, v, settings, match.cu_seqlens, match.sinks,
                                                                match.alibi_slopes))
        # SDPA returns the output; document_sdpa returns (out, lse) like the op, and its
        # users take item 0 (its lse is for its own backward only; it pads head dims itself).
        out = op if match.returns_lse else graph.call_function(operator.getitem, (op, 0))
        if value_dim is not None and not match.returns_lse:
            out = graph.call_function(operator.getitem, (out, (Ellipsis, slice(None, value_dim))))
    op.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack", "source_fn_stack")})
    if out is not op:
        out.meta.update(node.meta)
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _one_head_dim(graph, match: AttentionMatch, scale):
    """q, k, v nodes with one head dim (MLA's v padded, or q and k: attention/head_dims.py),
    the scale made explicit where padding q/k would change its default, and the value head
    dim to cut the output back to (None: nothing padded)."""
    q, k, v = match.query, match.key, match.value
    examples = [n.meta.get("example_value", n.meta.get("val")) for n in (q, k, v)]
    qk_dim, value_dim = examples[0].shape[-1], examples[2].shape[-1]
    if qk_dim == value_dim:
        return q, k, v, scale, None

    def padded(node, example, width):
        pad = graph.call_function(F.pad, (node, (0, width - example.shape[-1])))
        pad.meta["example_value"] = F.pad(example, (0, width - example.shape[-1]))
        return pad

    scale = float(qk_dim ** -0.5) if scale is None else scale
    if value_dim < qk_dim:
        return q, k, padded(v, examples[2], qk_dim), scale, value_dim
    return padded(q, examples[0], value_dim), padded(k, examples[1], value_dim), v, scale, value_dim
