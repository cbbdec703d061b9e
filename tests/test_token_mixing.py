"""Ops that mix tokens across the sharded sequence are refused at compile time, naming their
line; ops that keep each token on its own are not.

Under context parallelism every op but the rewritten attention runs on this rank's shard.
The backend follows the sequence dimension through the graph (DTensor's sharding
propagation, op by op) and refuses, with the source line, each op that would need other
ranks' tokens: a cumsum or a convolution over the sequence, a token shift, causal linear
attention, a mean over tokens fed back into every token. A loss, an aux loss, an MoE router
with its top-k dispatch, and RoPE from position ids are accepted.

Single process on a FAKE process group of P = 2 ranks: refusals happen before anything runs.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.exc import BackendCompilerFailed

import upipe_compile
from upipe_compile import UnsupportedAttention

WORLD = 2
THIS_FILE = os.path.basename(__file__)
D, S = 32, 16  # features; full sequence length (8 tokens a rank)


def compile_and_run(model, *inputs, group):
    compiled = torch.compile(model, backend="upipe", options={"cp_mesh": group, "inner_backend": "eager"})
    return compiled(*inputs)


def refusal(model, *inputs, group) -> str:
    with pytest.raises(BackendCompilerFailed) as info:
        compile_and_run(model, *inputs, group=group)
    inner = info.value.inner_exception
    assert type(inner) is UnsupportedAttention, repr(inner)
    return str(inner)


def line_of(cls, text: str) -> str:
    """``file:line`` of the line of ``cls``'s source that contains ``text``."""
    lines, start = inspect.getsourcelines(cls)
    (line,) = [start + i for i, code in enumerate(lines) if text in code]
    return f"{THIS_FILE}:{line} in "


def shard(t: torch.Tensor, group) -> torch.Tensor:
    return upipe_compile.shard_sequence(t, group, dim=1)


# --- token mixers, each written as users write them -----------------------------------------
class Cumsum(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        return self.proj(x).cumsum(dim=1)  # mixes: running sum over the sequence


class ShortConv(nn.Module):
    """LFM2 / Mamba style depthwise causal conv over the sequence."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(D, D, kernel_size=4, groups=D, padding=3)

    def forward(self, x):
        y = self.conv(x.transpose(1, 2))[..., : x.shape[1]]  # mixes: a window of previous tokens
        return y.transpose(1, 2)


class MeanPoolFeedback(nn.Module):
    def forward(self, x):
        pooled = x.mean(dim=1, keepdim=True)
        return x - pooled  # mixes: a mean over tokens back into every token


class TokenShift(nn.Module):
    """RWKV's time shift: each token sees the previous one."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Parameter(torch.rand(D))

    def forward(self, x):
        previous = F.pad(x, (0, 0, 1, -1))  # mixes: the previous token
        return x * self.mix + previous * (1 - self.mix)


class CausalLinearAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        q, k, v = F.elu(self.q(x)) + 1, F.elu(self.k(x)) + 1, self.v(x)
        state = torch.einsum("bsd,bse->bsde", k, v).cumsum(dim=1)  # mixes: the prefix state
        return torch.einsum("bsd,bsde->bse", q, state)


MIXERS = [
    (Cumsum, "cumsum(dim=1)", "aten.cumsum"),
    (ShortConv, "self.conv(x.transpose(1, 2))", "aten.convolution"),
    (MeanPoolFeedback, "return x - pooled", "sum or mean over the sequence"),
    (TokenShift, "F.pad(x, (0, 0, 1, -1))", "aten.constant_pad_nd"),
    (CausalLinearAttention, ".cumsum(dim=1)", "aten.cumsum"),
]


@pytest.mark.parametrize("cls, code, what", MIXERS, ids=[m[0].__name__ for m in MIXERS])
def test_token_mixer_is_refused_with_its_line(world, cls, code, what):
    torch.manual_seed(0)
    message = refusal(cls(), shard(torch.randn(2, S, D), world), group=world)
    assert "op(s) that mix tokens across the sharded sequence" in message, message
    assert line_of(cls, code) in message and code in message, message
    assert what in message, message
    assert "run this layer without context parallelism" in message


def test_mean_pool_names_the_reduction_line(world):
    message = refusal(MeanPoolFeedback(), shard(torch.randn(2, S, D), world), group=world)
    reduction = message.split("the reduction over tokens at ")[1]
    assert line_of(MeanPoolFeedback, "pooled = x.mean") in reduction.split(")")[0], message


class AttentionThenConv(nn.Module):
    """A hybrid layer pair: attention (rewritten) then a conv over the sequence (refused)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out, self.mixer = nn.Linear(D, 3 * D), nn.Linear(D, D), ShortConv()

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, D // 4).permute(2, 0, 3, 1, 4)
        h = x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, D))
        return h + self.mixer(h)


def test_unmarked_input_is_followed_from_the_attention_query_length(world):
    """No shard_sequence mark: the attention call's query length tells the sequence dim."""
    message = refusal(AttentionThenConv(), torch.randn(2, S // WORLD, D), group=world)
    assert line_of(ShortConv, "self.conv(x.transpose(1, 2))") in message, message
    assert "attention call(s)" not in message  # the attention itself is rewritten, not refused


def test_graph_split_from_its_attention_still_checked(world):
    """A conv layer compiled on its own (as after a graph break): no attention in its graph,
    its input an intermediate tensor, but the shard length is known from shard_sequence."""
    shard(torch.randn(2, S, D), world)  # this rank's shard length: 8
    message = refusal(ShortConv(), torch.randn(2, S // WORLD, D), group=world)
    assert line_of(ShortConv, "self.conv(x.transpose(1, 2))") in message, message


# --- per-token ops that are not refused ----------------------------------------------------
class RouterLayer(nn.Module):
    """A mixture-of-experts layer (softmax router, top-k over experts, sort-based dispatch,
    scatter back), an aux load-balancing loss, RoPE from position ids, attention, and a loss
    over the shard."""

    def __init__(self, experts=4, vocab=50):
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.router, self.experts = nn.Linear(D, experts), nn.Parameter(torch.randn(experts, D, D) / D**0.5)
        self.head = nn.Linear(D, vocab)

    def forward(self, x, positions, labels):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, D // 4).permute(2, 0, 3, 1, 4)
        angles = positions[:, None, :, None].float() * torch.arange(1, D // 8 + 1).float()  # RoPE from positions
        cos, sin = angles.cos(), angles.sin()
        half = D // 8
        q = torch.cat([q[..., :half] * cos - q[..., half:] * sin, q[..., half:] * cos + q[..., :half] * sin], -1)
        h = x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, D))
        tokens = h.reshape(-1, D)
        probs = self.router(tokens).softmax(dim=-1)
        weights, chosen = probs.topk(2, dim=-1)
        flat = chosen.reshape(-1)
        order = flat.argsort()  # dispatch: this shard's (token, expert) pairs grouped by expert
        rows = tokens[order // 2]
        expert_out = torch.bmm(rows.unsqueeze(1), self.experts[flat[order]]).squeeze(1)
        combined = torch.zeros_like(tokens).index_add_(0, order // 2, expert_out * weights.reshape(-1)[order, None])
        h = h + combined.view(b, s, D)
        aux = (probs.mean(dim=0) * F.one_hot(chosen[:, 0], probs.shape[-1]).float().mean(dim=0)).sum()
        logits = self.head(h)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        return logits, loss + 0.01 * aux


def test_router_aux_loss_loss_and_rope_are_accepted(world):
    torch.manual_seed(0)
    x = shard(torch.randn(2, S, D), world)
    positions = upipe_compile.global_positions(S // WORLD, world).expand(2, -1)
    labels = shard(torch.randint(0, 50, (2, S)), world)
    logits, loss = compile_and_run(RouterLayer(), x, positions, labels, group=world)
    assert logits.shape == (2, S // WORLD, 50) and loss.dim() == 0


class PerTokenOnly(nn.Module):
    """Norms over features, an MLP, a per-token sum over heads and head_dim, a pad of the
    features (as MLA's head dim is padded), in a checkpoint."""

    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.RMSNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        def block(x):
            h = F.pad(self.down(F.silu(self.up(self.norm(x)))), (0, 8))[..., :D]
            return h + h.view(*h.shape[:2], 4, D // 4).sum(dim=(2, 3)).unsqueeze(-1)

        return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)


def test_per_token_ops_in_a_checkpoint_are_accepted(world):
    x = shard(torch.randn(2, S, D, requires_grad=True), world)
    compile_and_run(PerTokenOnly(), x, group=world).sum().backward()


class RoPEFromPositions(nn.Module):
    """RoPE rows computed from each token's position (polar form of position x frequency:
    elementwise, DTensor has no rule for it), applied to complex pairs of the features."""

    def forward(self, x, positions):
        angles = torch.outer(positions.reshape(-1), torch.linspace(0.1, 1.0, D // 2)).float()
        rows = torch.polar(torch.ones_like(angles), angles).view(*positions.shape, D // 2)
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], D // 2, 2))
        return torch.view_as_real(pairs * rows).flatten(-2) + x


def test_rope_rows_from_positions_are_accepted(world):
    positions = shard(torch.arange(S).expand(2, -1), world)  # as torchtitan 0.3's are sharded
    out = compile_and_run(RoPEFromPositions(), shard(torch.randn(2, S, D), world), positions, group=world)
    assert out.shape == (2, S // WORLD, D)


def test_mixer_inside_a_checkpoint_is_refused(world):
    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.mixer = Cumsum()

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.mixer, x, use_reentrant=False)

    message = refusal(Checkpointed(), shard(torch.randn(2, S, D, requires_grad=True), world), group=world)
    assert line_of(Cumsum, "cumsum(dim=1)") in message, message


def test_dynamic_shapes_are_checked_too(world):
    """A recompile with a symbolic sequence length (dynamic=True) is walked at its traced sizes."""
    torch._dynamo.reset()
    x = shard(torch.randn(2, S, D), world)
    compiled = torch.compile(Cumsum(), backend="upipe", dynamic=True,
                             options={"cp_mesh": world, "inner_backend": "eager"})
    with pytest.raises(BackendCompilerFailed) as info:
        compiled(x)
    assert line_of(Cumsum, "cumsum(dim=1)") in str(info.value.inner_exception)


def test_dynamic_shapes_per_token_ops_are_accepted(world):
    """Accepted, and the same as the eager module (outputs and gradients) at two shard
    lengths: the graph has no attention, so each token's result is computed on the shard."""
    torch.manual_seed(0)
    model = PerTokenOnly()
    compiled = torch.compile(model, backend="upipe", dynamic=True, options={"cp_mesh": world, "inner_backend": "eager"})
    for length in (S, 2 * S):
        x = shard(torch.randn(2, length, D), world)
        dy = torch.randn(2, length // WORLD, D)
        results = []
        for run in (compiled, model):
            model.zero_grad()
            xr = x.clone().requires_grad_()
            y = run(xr)
            y.backward(dy)
            results.append((y.detach(), xr.grad, *(p.grad.clone() for p in model.parameters())))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want)


class PositionsFromTheMask(nn.Module):
    """Positions counted over the shard's own mask (each rank would start at 0), then RoPE."""

    def forward(self, x, mask):
        positions = mask.long().cumsum(dim=1) - 1  # mixes: a count over the sequence
        angles = positions[..., None].float() * torch.arange(1, D // 2 + 1).float()
        return torch.cat([x[..., : D // 2] * angles.cos(), x[..., D // 2:] * angles.sin()], dim=-1)


def test_integer_positions_counted_over_the_shard_are_refused(world):
    x, mask = shard(torch.randn(2, S, D), world), shard(torch.ones(2, S, dtype=torch.long), world)
    message = refusal(PositionsFromTheMask(), x, mask, group=world)
    assert line_of(PositionsFromTheMask, "mask.long().cumsum(dim=1)") in message, message


class GroupedExperts(nn.Module):
    """JetMoE's dispatch: expert ids sorted into a routing table, the expert sizes read on the
    host (a graph break), the tokens gathered by expert, one projection per expert's group
    (split by the sizes, concatenated back), the results added back to their own tokens. With
    ``then`` set, something else is done with the gathered rows instead."""

    def __init__(self, then: str | None = None, experts=4):
        super().__init__()
        self.router, self.weight = nn.Linear(D, experts), nn.Parameter(torch.randn(experts, D, D) / D**0.5)
        self.then = then

    def forward(self, x):
        b, s, _ = x.shape
        tokens = x.reshape(-1, D)
        top = self.router(tokens).topk(2, dim=-1).indices.flatten()
        sizes = torch.bincount(top, minlength=self.weight.shape[0]).tolist()  # a graph break
        order = top.sort(0).indices
        rows = tokens[order.div(2, rounding_mode="trunc")]
        if self.then == "cumsum":
            return rows.cumsum(dim=0)  # mixes: a running sum over the gathered rows
        if self.then == "pool":
            return x + rows.sum(dim=0)  # mixes: a sum over the rows back into every token
        out = torch.cat([F.linear(group, self.weight[i]) for i, group in enumerate(rows.split(sizes, dim=0))])
        combined = torch.zeros_like(tokens).index_add(0, order.div(2, rounding_mode="trunc"), out)
        return x + combined.view(b, s, D)


def test_expert_dispatch_across_a_graph_break_is_accepted(world):
    """The routing table crosses the graph break marked as one: the gather by it, the groups'
    split, projections and concatenation, and the put-back keep each token's rows its own."""
    out = compile_and_run(GroupedExperts(), shard(torch.randn(2, S, D), world), group=world)
    assert out.shape == (2, S // WORLD, D)


@pytest.mark.parametrize("then, code, what", [("cumsum", "rows.cumsum(dim=0)", "aten.cumsum"),
                                              ("pool", "x + rows.sum(dim=0)", "sum or mean over the sequence")])
def test_gathered_rows_not_put_back_per_token_are_refused(world, then, code, what):
    message = refusal(GroupedExperts(then), shard(torch.randn(2, S, D), world), group=world)
    assert line_of(GroupedExperts, code) in message and what in message, message


def test_hand_sharded_graph_without_attention_warns_once(world, caplog):
    """Inputs sharded by hand (not through shard_sequence), no attention in the graph: the
    check cannot see the sequence, so a cumsum over it would run unchecked. One warning per
    graph names shard_sequence."""
    x = torch.randn(2, 5, D)  # a length shard_sequence never cut in this process
    with caplog.at_level("WARNING", logger="upipe_compile.passes.token_mixing"):
        compile_and_run(Cumsum(), x, group=world)
        compile_and_run(Cumsum(), x, group=world)  # cached: no second compile, no second warning
    warnings = [r.getMessage() for r in caplog.records if "shard_sequence" in r.getMessage()]
    assert len(warnings) == 1 and "cannot tell which dimension is the sequence" in warnings[0], warnings


def test_marked_graph_without_attention_does_not_warn(world, caplog):
    with caplog.at_level("WARNING", logger="upipe_compile.passes.token_mixing"):
        compile_and_run(PerTokenOnly(), shard(torch.randn(2, S, D), world), group=world)
    assert not [r for r in caplog.records if "shard_sequence" in r.getMessage()]


def test_graph_break_carries_the_sequence_dim(world):
    """The graph after a graph break takes the first graph's outputs, marked with their
    sequence dimension: there a conv over the tokens of a ``[B, D, S]`` tensor is refused,
    which no guess from sizes would find (dimension 1 is not the shard length)."""

    class BreakThenConv(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.conv = nn.Linear(D, 3 * D), nn.Conv1d(D, D, 3, padding=1)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, 4, D // 4).permute(2, 0, 3, 1, 4)
            h = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(0, 1, 3, 2).reshape(b, D, s)
            torch._dynamo.graph_break()
            return self.conv(h)  # mixes: over the sequence, in a graph with no attention

    message = refusal(BreakThenConv(), shard(torch.randn(2, S, D), world), group=world)
    assert line_of(BreakThenConv, "return self.conv(h)") in message, message


def _conv_reference(x, weight, bias=None, activation=None):
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x.shape[1])
    return out[..., : x.shape[-1]]


class RoutedConv(nn.Module):
    """A depthwise causal conv called through upipe::head_mixer, as register() routes them."""

    def __init__(self, channels):
        super().__init__()
        from upipe_compile.mixers.registry import register_mixer

        register_mixer("tests.conv", "causal_conv1d", _conv_reference)
        self.weight = nn.Parameter(torch.randn(channels, 4))

    def forward(self, x):
        from upipe_compile.mixers.registry import encode

        return torch.ops.upipe.head_mixer("tests.conv", [x.transpose(1, 2), self.weight],
                                          encode({"absent": [2]})).transpose(1, 2)


def test_mixer_whose_channels_p_does_not_divide_is_refused(world):
    message = refusal(RoutedConv(3), shard(torch.randn(1, S, 3), world), group=world)
    assert "1 mixer call(s)" in message and "not divisible by P=2" in message, message
    assert line_of(RoutedConv, "torch.ops.upipe.head_mixer(") in message, message


def test_routed_mixer_is_rewritten_into_its_stage_loop(world):
    graphs = []

    def capture(gm, example_inputs):
        out = upipe_compile.upipe_backend(gm, example_inputs, options={"cp_mesh": world, "inner_backend": "eager"})
        graphs.append(gm)
        return out

    torch.compile(RoutedConv(8), backend=capture, fullgraph=True)(shard(torch.randn(1, S, 8), world))
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert "upipe.head_mixer_loop.default" in targets and "upipe.head_mixer" not in targets, targets
