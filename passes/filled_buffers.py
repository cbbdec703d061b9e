"""A buffer filled by copies into slices of its last dim, then read whole, as the concatenation
of what was copied in:

    buf = t.new_empty((B, H, s, 24))                 buf = torch.cat([k_nope, k_rot], -1)
    buf[..., :16].copy_(k_nope)             ->
    buf[..., 16:].copy_(k_rot)
    sdpa(q, buf, v)                                  sdpa(q, buf, v)

transformers' DeepSeek-V3 (MLA) builds its keys this way. The attention-block fusion proves
chains of functional ops, and a cat is one; the copies are side effects it cannot follow.
Only an exact equivalent is rewritten: the copies cover the last dim once, each source already
has its slice's shape and dtype, and nothing reads the buffer before the last copy.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from upipe_compile.passes.graph_utils import example, rewrite_nodes


def concatenate_filled_buffers(gm: fx.GraphModule) -> int:
    """Rewrite every such buffer in ``gm`` and the graph modules nested in it; returns how many."""
    return rewrite_nodes(gm, lambda module, node: _is_empty(node) and _rewrite(module.graph, node))


def _is_empty(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target == "new_empty") or \
        (node.op == "call_function" and node.target is torch.empty)


def _last_dim_span(node: fx.Node, width: int):
    """``[a, b)`` for ``buf[..., a:b]`` (or every leading dim whole), else None."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    *lead, last = index
    ndim = len(example(node.args[0]).shape)
    if not (lead == [Ellipsis] or (len(lead) == ndim - 1 and all(i == slice(None) for i in lead))):
        return None
    if not isinstance(last, slice) or last.step not in (None, 1):
        return None
    start, stop = last.start or 0, width if last.stop is None else last.stop
    if not (isinstance(start, int) and isinstance(stop, int)):
        return None
    start, stop = (start + width if start < 0 else start), (stop + width if stop < 0 else min(stop, width))
    return (start, stop) if 0 <= start < stop else None


def _copy_into(slice_node: fx.Node):
    """The ``slice.copy_(source)`` whose result nobody reads, if that is the slice's one use."""
    users = list(slice_node.users)
    if len(users) != 1:
        return None
    copy = users[0]
    if copy.op == "call_method" and copy.target == "copy_" and copy.args[0] is slice_node and not copy.users:
        return copy
    return None


def _rewrite(graph: fx.Graph, buffer: fx.Node) -> bool:
    value = example(buffer)
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    width = value.shape[-1]
    order = {n: i for i, n in enumerate(graph.nodes)}
    pieces, readers = [], []
    for user in buffer.users:
        span = _last_dim_span(user, width)
        copy = _copy_into(user) if span is not None else None
        if copy is None:
            readers.append(user)
            continue
        source = copy.args[1]
        piece, written = example(source), example(user)
        if not (isinstance(piece, torch.Tensor) and isinstance(written, torch.Tensor)
                and piece.shape == written.shape and piece.dtype == written.dtype):
            return False
        pieces.append((span, user, copy, source))
    pieces.sort(key=lambda p: p[0])
    spans = [p[0] for p in pieces]
    if not pieces or spans[0][0] != 0 or spans[-1][1] != width or \
            any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
        return False
    last_copy = max((p[2] for p in pieces), key=order.__getitem__)
    if any(order[r] < order[last_copy] for r in readers):
        return False
    with graph.inserting_after(last_copy):
        cat = graph.call_function(torch.cat, ([p[3] for p in pieces], -1))
    cat.meta.update(buffer.meta)
    for reader in readers:
        reader.replace_input_with(buffer, cat)
    for _, slice_node, copy, _ in pieces:
        graph.erase_node(copy)
        graph.erase_node(slice_node)
    graph.erase_node(buffer)
    return True
