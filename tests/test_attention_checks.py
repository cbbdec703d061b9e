"""One list of checks for an attention call: upipe_attention, upipe_attention_block,
document_sdpa and the compile-time pass refuse the same bad call with the same reason. On a
fake process group of P = 2 ranks (each refusal happens before anything is exchanged)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import upipe_compile
from upipe_compile import UnsupportedAttention
from upipe_compile.attention.checks import AttentionCall, attention_problems
from upipe_compile.block.ops import upipe_attention_block
from upipe_compile.block.region import BlockRegion
from upipe_compile.packed.document_sdpa import document_sdpa
from upipe_compile.passes import find_attention, unsupported_reasons

WORLD = 2
B, S_LOCAL, D = 1, 4, 8


def _heads(x, n):
    return x.unflatten(-1, (n, D)).transpose(1, 2)


# each: (q heads, kv heads, window, sinks shape, the reason every entry point must give)
BAD_CALLS = {
    "sinks of the wrong length": (4, 2, (-1, -1), (3,), "sinks must have shape [4]"),
    "a window edge below -1": (4, 2, (-2, 0), None, "window=(-2, 0)"),
}


def _qkv(q_heads, kv_heads):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(B, q_heads, S_LOCAL, D, generator=gen), torch.randn(B, kv_heads, S_LOCAL, D, generator=gen),
            torch.randn(B, kv_heads, S_LOCAL, D, generator=gen))


def _refusal(fn) -> str:
    with pytest.raises(UnsupportedAttention) as info:
        fn()
    return str(info.value)


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_every_entry_point_gives_the_same_reason(world, case):
    q_heads, kv_heads, window, sinks_shape, reason = BAD_CALLS[case]
    q, k, v = _qkv(q_heads, kv_heads)
    sinks = None if sinks_shape is None else torch.zeros(sinks_shape)
    variant = {"window": window, "sinks": sinks}

    messages = {
        "upipe_attention": _refusal(lambda: upipe_compile.upipe_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                                          **variant)),
        "document_sdpa": _refusal(lambda: document_sdpa(q, k, v, None, is_causal=True, enable_gqa=True, **variant)),
    }
    hidden = q_heads * D
    region = BlockRegion(q_heads, kv_heads, D, lambda p, n: _heads(p, n), lambda p, n: _heads(p, n),
                         lambda p, n: _heads(p, n), True, None, window=window, sinks_extra=-1 if sinks is None else 0)
    weights = [torch.randn(hidden, hidden), None, torch.randn(kv_heads * D, hidden), None,
               torch.randn(kv_heads * D, hidden), None, torch.randn(hidden, hidden), None]
    messages["upipe_attention_block"] = _refusal(lambda: upipe_attention_block(
        torch.randn(B, S_LOCAL, hidden), *weights, [] if sinks is None else [sinks], region))

    def model(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    gm = torch.fx.symbolic_trace(model)
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), (q, k, v)):
        node.meta["example_value"] = value
    (match,) = find_attention(gm)
    match.window_left, match.window_right = window
    match.sinks = None if sinks is None else _placeholder_with(gm, sinks)
    messages["the compile-time pass"] = "; ".join(unsupported_reasons(match, WORLD, WORLD))

    for entry, message in messages.items():
        assert reason in message, f"{entry}: {message}"


def _placeholder_with(gm, value):
    node = gm.graph.placeholder("sinks")
    node.meta["example_value"] = value
    return node


def test_the_checks_are_those_of_each_part():
    """Shapes, sinks, variants and CUDA dtypes, asked in one place."""
    good = AttentionCall((1, 4, 8, 64), (1, 2, 8, 64), (1, 2, 8, 64), torch.bfloat16, "cuda", window=(4, 0))
    assert attention_problems(good, 2, 2) == []
    fp32 = AttentionCall((1, 4, 8, 64), (1, 2, 8, 64), (1, 2, 8, 64), torch.float32, "cuda")
    assert any("fp16 or bf16" in p for p in attention_problems(fp32, 2, 2))
    assert attention_problems(AttentionCall((1, 4, 8, 64), (1, 2, 8, 64), (1, 2, 8, 64), torch.float32, "cpu"),
                              2, 2) == []
    odd = AttentionCall((1, 3, 8, 64), (1, 3, 8, 64), (1, 3, 8, 64), torch.float32, "cpu")
    assert attention_problems(odd, 2, 2)
