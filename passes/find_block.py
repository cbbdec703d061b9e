"""Find the whole attention block around each SDPA call: projections, per-head chains,
output projection, in the style of torch/_inductor/fx_passes/micro_pipeline_tp.py (a
dataclass per match that owns its nodes).

Before (one block, any graph module, nested checkpoint bodies included):

    q_lin = linear(x, Wq, bq?)        # or qkv = linear(x, Wqkv); q_lin = qkv[..., :a]; ...
    k_lin = linear(x, Wk, bk?)
    v_lin = linear(x, Wv, bv?)
    q = <head-separable chain>(q_lin, *extras)      # [B, Hq, s, D]
    k = <head-separable chain>(k_lin, *extras)      # [B, Hkv, s, D]
    v = <head-separable chain>(v_lin, *extras)
    o = sdpa(q, k, v, is_causal=..., scale=...)
    o2 = o.transpose(1, 2)[.contiguous()].reshape(B, s, Hq * D)[.contiguous()]
    y = linear(o2, Wo, bo?)

What this pass returns for it: a :class:`BlockMatch` (the nodes above, the three proven
chains and their shared extras), or the reason the block cannot be fused, naming the node
that blocked it. :meth:`BlockMatch.replace <upipe_compile.passes.block_match.BlockMatch.replace>`
turns a match into one ``upipe::attention_block`` call.
"""

from __future__ import annotations

import math
import operator
from typing import Union

import torch
import torch.fx as fx

from upipe_compile.passes.attention_match import AttentionMatch
from upipe_compile.passes.block_match import ROLES, BlockMatch, NotFusable, Projection
from upipe_compile.passes.graph_utils import shape_of, source_line
from upipe_compile.passes.head_separable import LINEAR_TARGETS, NotSeparable, prove_chain

def _linear_args(node: fx.Node):
    """(input, weight, bias) of a linear call, positional or keyword."""
    def arg(i, name):
        return node.args[i] if len(node.args) > i else node.kwargs.get(name)

    return arg(0, "input"), arg(1, "weight"), arg(2, "bias")


def is_linear(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in LINEAR_TARGETS


_SLICE_METHODS = {"narrow", "split", "chunk", "tensor_split", "split_with_sizes"}
_SLICE_FUNCTIONS = {torch.narrow, torch.split, torch.chunk, torch.tensor_split}


def _is_slicing_of(node: fx.Node, source: fx.Node) -> bool:
    if node.op == "call_method" and node.target in _SLICE_METHODS | {"__getitem__"}:
        return node.args[0] is source
    if node.op == "call_function" and (node.target in _SLICE_FUNCTIONS or node.target is operator.getitem):
        return node.args[0] is source
    return False


def _find_projection(sdpa_input: fx.Node) -> Projection:
    """The projection an SDPA input is computed from: the latest linear among its ancestors
    (earlier ones are upstream of x), read whole or through one slicing of a fused qkv."""
    ancestors = _ancestors_of(sdpa_input)
    order = {n: i for i, n in enumerate(sdpa_input.graph.nodes)}
    linears = [n for n in ancestors if is_linear(n)]
    if not linears:
        raise NotSeparable(sdpa_input, "no linear projection found upstream of this SDPA input")
    linear = max(linears, key=order.__getitem__)
    users = [u for u in linear.users if u in ancestors]
    if len(users) == 1 and _is_slicing_of(users[0], linear):
        user = users[0]
        if user.target is operator.getitem or user.target in ("narrow", torch.narrow):
            return _fused(linear, [user])  # qkv[..., a:b], qkv.narrow(-1, a, n)
        items = [g for g in user.users if g in ancestors]
        if len(items) == 1 and items[0].target is operator.getitem:  # qkv.split(...)[i], qkv.chunk(3, -1)[i]
            return _fused(linear, [user, items[0]])
        raise NotSeparable(user, "slices a fused projection in a way the fusion does not cover")
    _, w, b = _linear_args(linear)
    return Projection(linear, w, b)


def _fused(linear: fx.Node, slices: list) -> Projection:
    """Rows of ``linear``'s weight that ``slices`` (applied in order) read, found by running
    them on the row indices. The full [B, s, n] shape runs only on a meta tensor (the shape
    check); the indices run with the leading dims at 1, so nothing here grows with s (a
    materialized [B, s, n] index tensor was 60 GiB at 655K tokens, n = 12288)."""
    _, w, b = _linear_args(linear)
    shape = shape_of(linear)

    def run(value):
        for s in slices:
            args = [value if a is (s.args[0]) else a for a in s.args]
            if s.op == "call_method":
                value = getattr(value, s.target)(*args[1:], **s.kwargs)
            else:
                value = s.target(*args, **s.kwargs)
        return value

    value = run(torch.empty(shape, dtype=torch.long, device="meta"))
    if not isinstance(value, torch.Tensor) or tuple(value.shape[:-1]) != tuple(shape[:-1]):
        raise NotSeparable(slices[-1], "slices a fused projection along a dim other than its last")
    # Every row of the index tensor is the same, and the slices keep the leading dims whole:
    # one row gives the same answer as all of them.
    try:
        value = run(torch.arange(shape[-1]).view(*(1,) * (len(shape) - 1), shape[-1]))
    except (IndexError, RuntimeError):  # e.g. an index tensor along a leading dim
        raise NotSeparable(slices[-1], "slices a fused projection in a way the fusion does not cover") from None
    taken = value.reshape(-1, value.shape[-1])[0]
    a, b_ = int(taken[0]), int(taken[-1]) + 1
    if not torch.equal(taken, torch.arange(a, b_)):
        raise NotSeparable(slices[-1], "reads non-contiguous rows of a fused projection")
    return Projection(linear, w, b, (a, b_), list(slices))


def _output_side(match: AttentionMatch, q_heads: int, head_dim: int):
    """sdpa out -> [identity reshape] -> [out[..., :Dv], where v was padded] -> transpose(1, 2)
    -> [contiguous] -> reshape/view (B, s, Hq * Dv) -> [contiguous] -> linear(Wo, bo?).
    Returns ``(out_nodes, o_proj node, Wo, bo, Dv)``."""
    value_dim = head_dim
    batch, seq = shape_of(match.query)[0], shape_of(match.query)[2]
    node = match.node
    dead = []
    if match.returns_lse:  # document_sdpa returns (out, lse); users take item 0
        # (an unused ``lse`` item may remain, e.g. in checkpoint bodies: it goes with the block)
        dead = [u for u in node.users if u.target is operator.getitem and u.args[1] != 0 and not u.users]
        users = [u for u in node.users if u not in dead]
        if len(users) != 1 or users[0].target is not operator.getitem or users[0].args[1] != 0:
            raise NotSeparable(node, "its (out, lse) result is used other than by taking out")
        node = users[0]
    out_nodes = dead + ([node] if node is not match.node else [])
    state = "bhsd"
    while True:
        users = list(node.users)
        if len(users) != 1:
            raise NotSeparable(node, f"the attention output is used by {len(users)} nodes, not only by the output "
                                     "projection's reshape")
        user = users[0]
        if is_linear(user):
            x, wo, bo = _linear_args(user)
            if x is not node or state != "merged":
                raise NotSeparable(user, "the output projection does not read [B, s, heads * head_dim] of the "
                                         "attention output")
            if wo is node or bo is node:
                raise NotSeparable(user, "the output projection's weight depends on attention")
            return out_nodes, user, wo, bo, value_dim
        in_shape, out_shape = shape_of(node), shape_of(user)
        method = user.target if user.op == "call_method" else None
        if method == "contiguous" or (method in ("view", "reshape") and in_shape == out_shape):
            pass
        elif state == "bhsd" and value_dim == head_dim and _cuts_head_dim(user):
            value_dim = out_shape[-1]  # padded value columns cut away: out[..., :Dv]
        elif method == "transpose" or (user.op == "call_function" and user.target is torch.transpose):
            dims = sorted(d % len(in_shape) for d in user.args[1:3])
            if state != "bhsd" or dims != [1, 2]:
                raise NotSeparable(user, "the attention output is transposed other than (1, 2)")
            state = "bshd"
        elif state == "bshd" and method in ("squeeze", "unsqueeze") and user.args[1:] == (0,):
            pass  # the batch dim of one row dropped or added back (varlen_attn's [tokens, heads, dim])
        elif state == "bshd" and method in ("view", "reshape") and out_shape == (batch, seq, q_heads, value_dim):
            pass  # [tokens, heads, dim] back to [B, s, heads, dim]
        elif method in _CASTS:
            pass  # a dtype cast: the op returns the output projection in x's dtype
        elif state == "bshd" and method == "flatten" and user.args[1:] == (2,) and \
                out_shape == (batch, seq, q_heads * value_dim):
            state = "merged"
        elif method in ("view", "reshape") or (user.op == "call_function" and user.target is torch.reshape):
            if state != "bshd" or out_shape != (batch, seq, q_heads * value_dim):
                raise NotSeparable(user, f"the attention output is reshaped {in_shape} -> {out_shape}, not to "
                                         "[B, s, heads * head_dim] after transpose(1, 2)")
            state = "merged"
        else:
            raise NotSeparable(user, "an op between attention and the output projection that the fusion does not "
                                     "cover")
        out_nodes.append(user)
        node = user


_CASTS = {"to", "float", "bfloat16", "half", "type_as"}


def _cuts_head_dim(node: fx.Node) -> bool:
    """``out[..., :n]`` (or ``out[:, :, :, :n]``): the first columns of each head."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return False
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    *lead, last = index
    whole_lead = lead == [Ellipsis] or (len(lead) == 3 and all(i == slice(None) for i in lead))
    return whole_lead and isinstance(last, slice) and last.start in (None, 0) and last.step in (None, 1) \
        and isinstance(last.stop, int)


def find_block(match: AttentionMatch) -> Union[BlockMatch, NotFusable]:
    """The fusable block around ``match``, or why there is none (naming the node)."""
    try:
        return _find_block(match)
    except NotSeparable as e:
        return NotFusable(match, e.node, str(e))


def _find_block(match: AttentionMatch) -> BlockMatch:
    shapes = [shape_of(n) for n in (match.query, match.key, match.value)]
    if any(s is None or len(s) != 4 for s in shapes):
        raise NotSeparable(match.node, "q, k, v are not 4-D tensors of known shape")
    q_heads, kv_heads, head_dim = shapes[0][1], shapes[1][1], shapes[0][3]
    if shapes[2][1] != kv_heads or shapes[1][3] != head_dim or shapes[2][3] != head_dim:
        raise NotSeparable(match.node, f"q, k, v shapes {shapes} are not [B, H, s, D] with one head_dim")
    inputs = dict(zip(ROLES, (match.query, match.key, match.value)))
    heads = {"q": q_heads, "k": kv_heads, "v": kv_heads}
    projections = {role: _find_projection(inputs[role]) for role in ROLES}
    # q's projection input is the block's x; k and v may project another head-shared tensor
    # (MLA: the normalised KV latent), which the op takes as an extra
    x = _linear_args(projections["q"].linear)[0]
    role_inputs = {role: _linear_args(p.linear)[0] for role, p in projections.items()}
    tokens = math.prod(shape_of(x)[:-1]) if shape_of(x) is not None else None
    for role, p in projections.items():
        shape = shape_of(role_inputs[role])
        if shape is None or math.prod(shape[:-1]) != tokens:
            raise NotSeparable(p.linear, f"projects {role_inputs[role].name}, whose tokens are not the block input "
                                         f"x's ({shape} against {shape_of(x)})")
        if any(n is p.linear or (n is not None and p.linear in _ancestors_of(n)) for n in (p.weight, p.bias)):
            raise NotSeparable(p.linear, "the projection's weight depends on its own output")
        if p.rows is not None and (p.rows[1] - p.rows[0]) % heads[role]:
            raise NotSeparable(p.value, f"reads rows [{p.rows[0]}, {p.rows[1]}) of a fused projection: not "
                                        f"{heads[role]} whole heads")
    chains = {role: prove_chain(projections[role].value, inputs[role], heads[role], head_dim) for role in ROLES}
    if any(e in role_inputs.values() for role in ROLES for e in chains[role].externals):
        raise NotSeparable(chains["q"].output, "a per-head chain reads a projection's input (the block input x) "
                                               "itself")
    extras: list[fx.Node] = []
    for role in ROLES:
        for e in chains[role].externals:
            if e not in extras:
                extras.append(e)
    for role in ("k", "v"):
        if role_inputs[role] is not x and role_inputs[role] not in extras:
            extras.append(role_inputs[role])
    order = {n: i for i, n in enumerate(match.graph_module.graph.nodes)}
    extras.sort(key=order.__getitem__)
    if match.sinks is not None:  # per-head logits: the op slices them with each stage's heads
        if match.sinks is x or match.sinks in _ancestors_of(match.query):
            raise NotSeparable(match.sinks, "the attention sinks depend on the block's own projections")
        if match.sinks not in extras:
            extras.append(match.sinks)
    if match.alibi_slopes is not None:  # per-head slopes: sliced like the sinks
        if match.alibi_slopes is x or match.alibi_slopes in _ancestors_of(match.query):
            raise NotSeparable(match.alibi_slopes, "the ALiBi slopes depend on the block's own projections")
        if match.alibi_slopes not in extras:
            extras.append(match.alibi_slopes)
    out_nodes, out_linear, wo, bo, value_dim = _output_side(match, q_heads, head_dim)
    projection_inputs = tuple(-1 if role_inputs[role] is x else extras.index(role_inputs[role]) for role in ROLES)
    block = BlockMatch(match, x, projections, chains, extras, out_nodes, out_linear, wo, bo, q_heads, kv_heads,
                       head_dim, value_dim, projection_inputs)
    _check_closed(block)
    return block


def _ancestors_of(node: fx.Node) -> set:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _check_closed(block: BlockMatch) -> None:
    """Every value the fused op replaces is used only inside the block (else the full
    projections would still be computed next to it)."""
    nodes = block.nodes()
    for node in nodes:
        if node is block.out_linear:
            continue
        for user in node.users:
            if user not in nodes:
                raise NotSeparable(node, f"its value is also used outside the attention block (by {user.name} at "
                                         f"{source_line(user)})")
