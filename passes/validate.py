"""Every reason an SDPA call cannot be rewritten into UPipe, in words a user can act on."""

from __future__ import annotations

import torch
import torch.fx as fx

from upipe_compile.attention.checks import AttentionCall, attention_problems
from upipe_compile.attention.kernels import NO_WINDOW
from upipe_compile.passes.find import AttentionMatch


def _example(arg):
    if isinstance(arg, fx.Node):
        return arg.meta.get("example_value", arg.meta.get("val"))
    return None


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

    q, k, v = (_example(x) for x in (match.query, match.key, match.value))
    window, softcap = (match.window_left, match.window_right), match.softcap
    if any(isinstance(x, fx.Node) for x in (*window, softcap)):
        reasons.append(f"window {window} and softcap {softcap} must be Python numbers known at compile time")
        window, softcap = NO_WINDOW, 0.0  # the call's other checks still run
    sinks = _example(match.sinks) if isinstance(match.sinks, fx.Node) else None
    if match.sinks is not None and not isinstance(match.sinks, fx.Node):
        reasons.append(f"sinks must be a tensor of one logit per query head, got {match.sinks!r}")
    alibi_slopes = _example(match.alibi_slopes) if isinstance(match.alibi_slopes, fx.Node) else None
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
