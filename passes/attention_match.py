"""One SDPA call (or ``upipe::document_sdpa``) as a match: its arguments, every reason it cannot
run as UPipe in words a user can act on (``problems``), and its replacement by the stage-loop op
``upipe::attention`` (``replace``)."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

import upipe_compile.packed.document_sdpa  # noqa: F401  (registers upipe::document_sdpa)
from upipe_compile.attention.checks import AttentionCall, attention_problems
from upipe_compile.attention.kernels import NO_WINDOW
from upipe_compile.attention.ops import attention_op, op_arguments
from upipe_compile.attention.stage_loop import StageLoopSettings
from upipe_compile.passes.context import ATTENTION_CALLS, PassContext
from upipe_compile.passes.graph_utils import example, source_line

DOCUMENT_SDPA = torch.ops.upipe.document_sdpa.default
UPIPE_ATTENTION = attention_op._opoverload


@dataclass
class AttentionMatch:
    """One SDPA call and the arguments it was given (FX nodes or Python constants)."""

    refusal_kind = ATTENTION_CALLS

    graph_module: fx.GraphModule
    """The graph module that owns the node: the root, or a nested body (e.g. checkpointed)."""
    node: fx.Node
    query: fx.Node
    key: fx.Node
    value: fx.Node
    attn_mask: Any
    dropout_p: Any
    is_causal: Any
    scale: Any
    enable_gqa: Any
    cu_seqlens: Any = None
    """Document boundaries over the full sequence (``upipe::document_sdpa``); None for SDPA."""
    window_left: Any = -1
    """Sliding window (``upipe::document_sdpa`` only; flash-attn's counting, -1 = unbounded)."""
    window_right: Any = -1
    softcap: Any = 0.0
    sinks: Any = None
    """Per-query-head sink logits ``[Hq]`` (an FX node), or None."""
    alibi_slopes: Any = None
    """Per-query-head ALiBi slopes ``[Hq]`` (an FX node), or None."""

    @property
    def query_length(self) -> int | None:
        """The query's static length on this rank (None: unknown or symbolic)."""
        value = example(self.query)
        return int(value.shape[-2]) if isinstance(value, torch.Tensor) and isinstance(value.shape[-2], int) else None

    def problems(self, ctx: PassContext) -> list[str]:
        return unsupported_reasons(self, ctx.world, ctx.heads_per_stage)

    def replace(self, ctx: PassContext) -> None:
        """``upipe::attention`` before the SDPA node, its users handed the output, the node erased."""
        rewrite_attention(self, ctx.heads_per_stage, ctx.world, ctx.group_name, ctx.prefetch, ctx.ring_group_name)
        ctx.touch(self.graph_module)

    @property
    def source_line(self) -> str:
        return source_line(self.node)

    @property
    def returns_lse(self) -> bool:
        """``upipe::document_sdpa`` returns ``(out, lse)``; SDPA the output alone."""
        return self.node.target is DOCUMENT_SDPA

    @property
    def has_variant(self) -> bool:
        """A window, softcap, sinks or ALiBi: attention SDPA itself cannot express."""
        return ((self.window_left, self.window_right, self.softcap) != (-1, -1, 0.0) or self.sinks is not None
                or self.alibi_slopes is not None)


def unsupported_reasons(match: AttentionMatch, world: int, heads_per_stage: int) -> list[str]:
    """Empty when the call can run as UPipe on ``world`` ranks (over a ring too),
    else one line per problem: what the graph must fix at compile time here, the rest asked of
    :func:`upipe_compile.attention.checks.attention_problems` as every entry point does."""
    reasons = []
    if match.attn_mask is not None:
        reasons.append(
            "an attention-mask tensor is passed (attn_mask): a mask over the full sequence cannot be "
            "sharded with the heads; use is_causal=True for causal models and drop padding masks "
            "(pack or pad sequences to full length instead)"
        )
    if isinstance(match.dropout_p, fx.Node) or match.dropout_p != 0.0:
        reasons.append(
            f"attention dropout is on (dropout_p={match.dropout_p}): UPipe's kernels have no dropout; "
            "set the model's attention dropout to 0"
        )
    if not isinstance(match.is_causal, bool):
        reasons.append(f"is_causal must be a Python bool known at compile time, got {match.is_causal}")
    if match.scale is not None and not isinstance(match.scale, (int, float)):
        reasons.append(f"scale must be a Python number known at compile time, got {match.scale}")
    if not isinstance(match.enable_gqa, bool):
        reasons.append(f"enable_gqa must be a Python bool known at compile time, got {match.enable_gqa}")

    q, k, v = (example(x) for x in (match.query, match.key, match.value))
    window, softcap = (match.window_left, match.window_right), match.softcap
    if any(isinstance(x, fx.Node) for x in (*window, softcap)):
        reasons.append(f"window {window} and softcap {softcap} must be Python numbers known at compile time")
        window, softcap = NO_WINDOW, 0.0  # the call's other checks still run
    sinks = example(match.sinks) if isinstance(match.sinks, fx.Node) else None
    if match.sinks is not None and not isinstance(match.sinks, fx.Node):
        reasons.append(f"sinks must be a tensor of one logit per query head, got {match.sinks!r}")
    alibi_slopes = example(match.alibi_slopes) if isinstance(match.alibi_slopes, fx.Node) else None
    if match.alibi_slopes is not None and not isinstance(match.alibi_slopes, fx.Node):
        reasons.append(f"alibi_slopes must be a tensor of one slope per query head, got {match.alibi_slopes!r}")
    elif match.alibi_slopes is not None and not isinstance(alibi_slopes, torch.Tensor):
        reasons.append("the ALiBi slopes' shape is unknown in this graph (no example value)")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        reasons.append("the shapes of q, k, v are unknown in this graph (no example values)")
        return reasons
    call = AttentionCall.of(q, k, v, enable_gqa=match.enable_gqa is not False, window=window, softcap=softcap,
                            sinks=sinks, alibi_slopes=alibi_slopes)
    return reasons + attention_problems(call, world, heads_per_stage)


def rewrite_attention(match: AttentionMatch, heads_per_stage: int, world_size: int, group_name: str,
                      prefetch: str, ring_group_name: str = "") -> None:
    """Insert ``upipe::attention`` before the SDPA node, hand its users the output, erase it.
    The caller lints and recompiles the graph module once. ``ring_group_name``: ring x
    all-to-all (``group_name`` is then the all-to-all group)."""
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
