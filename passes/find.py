"""Locate every scaled_dot_product_attention call in an FX graph, nested bodies included,
and every ``upipe::document_sdpa`` (SDPA within packed documents, see
:mod:`upipe_compile.packed.document_sdpa`), which carries its boundaries as ``cu_seqlens``."""

from __future__ import annotations

import inspect
from typing import Iterator

import torch
import torch.fx as fx
import torch.nn.functional as F

from upipe_compile.passes.attention_match import DOCUMENT_SDPA, AttentionMatch
from upipe_compile.passes.graph_utils import graph_modules

# Dynamo records F.scaled_dot_product_attention (the same object as
# torch._C._nn.scaled_dot_product_attention); graphs traced below Dynamo carry the aten op.
SDPA_TARGETS = (
    F.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
)

# SDPA's Python signature, so positional and keyword spellings normalise alike.
def _sdpa_signature(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    pass


SDPA_SIGNATURE = inspect.signature(_sdpa_signature)


def _document_sdpa_signature(q, k, v, cu_seqlens, is_causal, scale, window_left=-1, window_right=-1, softcap=0.0,
                             sinks=None, alibi_slopes=None):
    pass


_DOCUMENT_SIGNATURE = inspect.signature(_document_sdpa_signature)


def find_attention(gm: fx.GraphModule) -> list[AttentionMatch]:
    """Every SDPA call in ``gm`` and in the graph modules nested in it, in graph order."""
    return [match for module in graph_modules(gm) for match in _matches_in(module)]


def _matches_in(gm: fx.GraphModule) -> Iterator[AttentionMatch]:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in SDPA_TARGETS:
            bound = SDPA_SIGNATURE.bind(*node.args, **node.kwargs)
            bound.apply_defaults()
            yield AttentionMatch(graph_module=gm, node=node, **bound.arguments)
        elif node.op == "call_function" and node.target is DOCUMENT_SDPA:
            bound = _DOCUMENT_SIGNATURE.bind(*node.args, **node.kwargs)
            bound.apply_defaults()
            args = bound.arguments
            yield AttentionMatch(
                graph_module=gm, node=node, query=args["q"], key=args["k"], value=args["v"], attn_mask=None,
                dropout_p=0.0, is_causal=args["is_causal"], scale=args["scale"], enable_gqa=True,
                cu_seqlens=args["cu_seqlens"], window_left=args["window_left"], window_right=args["window_right"],
                softcap=args["softcap"], sinks=args["sinks"], alibi_slopes=args["alibi_slopes"],
            )
