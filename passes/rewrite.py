"""Replace a validated SDPA node by the UPipe stage-loop op."""

from __future__ import annotations

import operator

from upipe_compile.attention.ops import attention_op, op_arguments
from upipe_compile.options import StageLoopSettings
from upipe_compile.passes.find import AttentionMatch

UPIPE_ATTENTION = attention_op._opoverload


def rewrite_attention(match: AttentionMatch, heads_per_stage: int, world_size: int, group_name: str,
                      prefetch: str, ring_group_name: str = "") -> None:
    """Insert ``upipe::attention`` before the SDPA node, hand its users the output, erase it.
    The caller lints and recompiles each touched graph module once. ``ring_group_name``:
    ring x all-to-all (``group_name`` is then the all-to-all group)."""
    graph, node = match.graph_module.graph, match.node
    scale = None if match.scale is None else float(match.scale)
    settings = StageLoopSettings(match.is_causal, scale, heads_per_stage, world_size, group_name, prefetch,
                                 int(match.window_left), int(match.window_right), float(match.softcap),
                                 ring_group_name)
    with graph.inserting_before(node):
        op = graph.call_function(UPIPE_ATTENTION, op_arguments(match.query, match.key, match.value, settings,
                                                               match.cu_seqlens, match.sinks))
        # SDPA returns the output; document_sdpa returns (out, lse) like the op, and its
        # users take item 0 (its lse is for its own backward only).
        out = op if match.returns_lse else graph.call_function(operator.getitem, (op, 0))
    op.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack", "source_fn_stack")})
    if out is not op:
        out.meta.update(node.meta)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
