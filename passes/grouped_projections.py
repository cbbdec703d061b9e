"""A fused q/k/v projection laid out per KV group, as the one linear per role it is:

    qkv = linear(x, Wqkv)                          # [B, s, G * r * D], r = heads per group + 2
    t = qkv.view(B, s, -1, r, D)                   # [B, s, G, r, D]
    xq, xk, xv = split(t, [hpk, 1, 1], dim=-2)
    q = xq.reshape(B, s, -1, D)                    # [B, s, G * hpk, D]   (k, v: [B, s, G, D])
->
    q = linear(x, Wqkv[rows_q], bqkv[rows_q]).view(B, s, G * hpk, D)     (k, v likewise)

torchtitan 0.3 builds q, k and v this way (``FusedQKVLinear``). The attention-block fusion
reads a projection's heads as blocks of consecutive rows; here a head's rows sit inside its
group's, so each role's rows (``rows_q``: head after head, in the order the model reads
them) are found by running the reshapes and splits on row numbers and gathered from the
weight. The values are the same (each is the same rows' product with x), and autograd takes
the gradient of the gathered rows back into the fused weight.

Only this shape is rewritten: one linear whose only user is a view that splits its last dim
into three or more, then reshapes, splits and slices only, each role ending in a view of
``[B, s, heads, D]``, and nothing else reading the values in between.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx

from upipe_compile.passes.graph_utils import example, rewrite_nodes, shape_of
from upipe_compile.passes.head_separable import LINEAR_TARGETS

_MOVES = {"view", "reshape", "contiguous", "split", "chunk", "narrow", "squeeze", "unsqueeze", "transpose",
          "flatten"}
_MOVE_FUNCTIONS = {torch.split, torch.chunk, torch.narrow, torch.reshape, operator.getitem}


def split_grouped_projections(gm: fx.GraphModule) -> int:
    """Rewrite every such projection in ``gm`` and its nested graph modules; returns how many."""
    return rewrite_nodes(gm, lambda module, node: node.op == "call_function" and node.target in LINEAR_TARGETS
                         and _rewrite(module, node))


def _is_move(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target in _MOVES) or \
        (node.op == "call_function" and node.target in _MOVE_FUNCTIONS)


def _roles(linear: fx.Node):
    """``(moves, ends)``: the reshapes/splits after ``linear`` and the ``[B, s, n, D]`` views
    that end them (graph order), or None where the shape is not the one this pass reads."""
    shape = shape_of(linear)
    users = list(linear.users)
    if shape is None or len(users) != 1 or not _is_move(users[0]) or users[0].target not in ("view", "reshape"):
        return None
    first = shape_of(users[0])
    if first is None or len(first) < len(shape) + 2 or tuple(first[:2]) != tuple(shape[:2]):
        return None
    lead = tuple(shape[:2])
    moves, ends, stack = [], [], [users[0]]
    while stack:
        node = stack.pop()
        if not _keeps_tokens(node, lead):
            return None
        moves.append(node)
        out = shape_of(node) if not isinstance(example(node), (tuple, list)) else None
        if out is not None and len(out) == 4 and tuple(out[:2]) == lead:
            ends.append(node)
            continue
        for user in node.users:
            if not _is_move(user):
                return None  # a value between the projection and a role's heads is read otherwise
            stack.append(user)
    if len(ends) < 2:
        return None
    order = {n: i for i, n in enumerate(linear.graph.nodes)}
    return sorted(moves, key=order.__getitem__), sorted(ends, key=order.__getitem__)


_DIM_ARGUMENTS = {"transpose": (1, 2), "unsqueeze": (1,), "narrow": (1,), "split": (2,), "chunk": (2,),
                  torch.narrow: (1,), torch.split: (2,), torch.chunk: (2,)}


def _keeps_tokens(node: fx.Node, lead: tuple) -> bool:
    """The move leaves the leading ``(B, s)`` dims alone (so running it on one token's row
    numbers gives every token's)."""
    value = example(node)
    for item in (value if isinstance(value, (tuple, list)) else [value]):
        if not isinstance(item, torch.Tensor) or tuple(item.shape[:2]) != lead:
            return False
    if node.target is operator.getitem and isinstance(example(node.args[0]), torch.Tensor):
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        return index[:2] == (slice(None), slice(None))
    if node.target in ("squeeze", "flatten"):
        return len(node.args) > 1 and all(isinstance(d, int) and d % example(node.args[0]).dim() >= 2
                                          for d in node.args[1:])
    ndim = example(node.args[0]).dim() if isinstance(example(node.args[0]), torch.Tensor) else 0
    for position in _DIM_ARGUMENTS.get(node.target, ()):
        dim = node.args[position] if len(node.args) > position else node.kwargs.get("dim", 0)
        if not isinstance(dim, int) or dim % max(ndim, 1) < 2:
            return False
    return True


def _row_numbers(linear: fx.Node, moves: list, ends: list):
    """Each end's weight rows ``[n, D]``: the moves run on the row numbers with the leading
    ``(B, s)`` taken as ``(1, 1)`` (nothing here grows with the sequence)."""
    lead = tuple(shape_of(linear)[:2])
    values = {linear: torch.arange(shape_of(linear)[-1]).view(1, 1, -1)}

    def value(a):
        if isinstance(a, fx.Node):
            return values[a]
        if isinstance(a, (tuple, list)):
            return type(a)(value(x) for x in a)
        return a

    for node in moves:
        args, kwargs = [value(a) for a in node.args], {k: value(v) for k, v in node.kwargs.items()}
        if node.target in ("view", "reshape") or node.target is torch.reshape:
            sizes = list(args[1]) if len(args) == 2 and isinstance(args[1], (tuple, list)) else list(args[1:])
            if tuple(sizes[:2]) != lead:
                return None
            args = [args[0], (1, 1, *sizes[2:])]
        if node.op == "call_method":
            values[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            values[node] = node.target(*args, **kwargs)
    rows = [values[end].reshape(values[end].shape[2], values[end].shape[3]) for end in ends]
    taken = torch.cat([r.reshape(-1) for r in rows])
    if taken.unique().numel() != taken.numel():
        return None  # a row read twice: not a partition into roles
    return rows


def _rewrite(gm: fx.GraphModule, linear: fx.Node) -> bool:
    roles = _roles(linear)
    if roles is None:
        return False
    moves, ends = roles
    try:
        rows = _row_numbers(linear, moves, ends)
    except (RuntimeError, IndexError, TypeError, ValueError):
        return False
    if rows is None:
        return False
    x, weight = linear.args[0], linear.args[1]
    bias = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
    graph = gm.graph
    device = example(weight).device
    for end, end_rows in zip(ends, rows):
        with graph.inserting_before(end):
            # the row numbers as a constant of the graph (a few thousand ints)
            table = graph.call_function(torch.tensor, (end_rows.reshape(-1).tolist(),),
                                        {"dtype": torch.long, "device": device})
            w = graph.call_function(torch.index_select, (weight, 0, table))
            b = None if bias is None else graph.call_function(torch.index_select, (bias, 0, table))
            projected = graph.call_function(linear.target, (x, w, b))
            heads = graph.call_method("view", (projected, tuple(shape_of(end))))
        for new in (w, b, projected, heads):
            if new is not None:
                new.meta.update({k: v for k, v in linear.meta.items() if k in ("stack_trace", "nn_module_stack")})
        with example(weight).fake_mode if hasattr(example(weight), "fake_mode") else contextlib.nullcontext():
            table.meta["example_value"] = torch.empty(end_rows.numel(), dtype=torch.long, device=device)
        w.meta["example_value"] = example(weight).new_empty((end_rows.numel(), example(weight).shape[1]))
        if b is not None:
            b.meta["example_value"] = example(bias).new_empty((end_rows.numel(),))
        projected.meta["example_value"] = example(linear).new_empty((*shape_of(linear)[:-1], end_rows.numel()))
        heads.meta.update(end.meta)
        end.replace_all_uses_with(heads)
    for node in reversed([linear, *moves]):  # the fused projection and its reshapes, now unread
        if not node.users:
            graph.erase_node(node)
    return True
