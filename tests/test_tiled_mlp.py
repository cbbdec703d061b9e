"""upipe_compile.stack.tiled_mlp: the sequence-tiled SwiGLU gives the plain FeedForward's output and
gradients (input and all three weights) for any tiling, eagerly and inside a torch.compile'd,
activation-checkpointed block; it swaps into torchtitan's Llama3 FeedForward in place."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from tests_support import relative_error
from upipe_compile.stack.tiled_mlp import SequenceTiledSwiGLU, swiglu


def plain_swiglu(x, w1, w2, w3):  # torchtitan's FeedForward.forward
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def make_case(batch, seq, dim, hidden, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, dim, generator=gen).to(dtype)
    w1 = (torch.randn(hidden, dim, generator=gen) / dim ** 0.5).to(dtype)
    w2 = (torch.randn(dim, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w3 = (torch.randn(hidden, dim, generator=gen) / dim ** 0.5).to(dtype)
    grad = torch.randn(batch, seq, dim, generator=gen).to(dtype)
    return (x, w1, w2, w3), grad


def output_and_grads(fn, inputs, grad):
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return (out.detach(), *(t.grad for t in leaves))


NAMES = ("out", "dx", "dw1", "dw2", "dw3")


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 3), seq=st.integers(1, 33), dim=st.integers(1, 12), hidden=st.integers(1, 24),
       tile=st.integers(1, 40), seed=st.integers(0, 2 ** 16))
def test_matches_plain_swiglu(batch, seq, dim, hidden, tile, seed):
    inputs, grad = make_case(batch, seq, dim, hidden, seed)
    ref = output_and_grads(plain_swiglu, inputs, grad)
    got = output_and_grads(lambda *a: swiglu(*a, tile), inputs, grad)
    for name, a, b in zip(NAMES, got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert relative_error(a, b) <= 1e-5, (name, relative_error(a, b))


def test_bfloat16_close_to_plain():
    inputs, grad = make_case(2, 50, 32, 96, 0, torch.bfloat16)
    ref = output_and_grads(plain_swiglu, inputs, grad)
    got = output_and_grads(lambda *a: swiglu(*a, 16), inputs, grad)
    for name, a, b in zip(NAMES, got, ref):
        assert a.dtype == b.dtype, name
        assert relative_error(a, b) < 1e-2, name


def test_forward_saves_only_input_and_weights():
    (x, w1, w2, w3), _ = make_case(1, 64, 8, 40, 0)
    x.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        swiglu(x, w1, w2, w3, 16)
    assert sorted(saved) == sorted([(64, 8), (40, 8), (8, 40), (40, 8)])  # no [64, 40] intermediate


def llama3_feed_forward(dim=16, hidden=64):
    from torchtitan.models.llama3.model.model import FeedForward

    torch.manual_seed(0)
    ff = FeedForward(dim=dim, hidden_dim=hidden, multiple_of=8, ffn_dim_multiplier=None)
    with torch.no_grad():
        ff.init_weights(0.02)
    return ff


class Block(nn.Module):
    """A residual block around a feed-forward, as torchtitan's TransformerBlock uses it."""

    def __init__(self, feed_forward):
        super().__init__()
        self.norm = nn.RMSNorm(feed_forward.w1.in_features)
        self.feed_forward = feed_forward

    def forward(self, x):
        return x + self.feed_forward(self.norm(x))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_checkpointed_block_matches_plain(backend):
    ff = llama3_feed_forward()
    plain = Block(ff)
    tiled = Block(SequenceTiledSwiGLU(llama3_feed_forward(), tile_tokens=7))
    tiled.load_state_dict(plain.state_dict())
    compiled = torch.compile(checkpoint_wrapper(tiled), backend=backend, fullgraph=True)
    x = torch.randn(2, 19, 16)
    grad = torch.randn(2, 19, 16)
    results = []
    for model in (plain, compiled):
        xi = x.clone().requires_grad_()
        out = model(xi)
        out.backward(grad)
        results.append((out.detach(), xi.grad, *(p.grad for p in model.parameters())))
    assert len(results[0]) == len(results[1]) == 2 + 4
    for a, b in zip(results[1], results[0]):
        assert relative_error(a, b) <= 1e-5


def test_swap_keeps_parameters_state_dict_and_init():
    ff = llama3_feed_forward()
    parent = Block(ff)
    keys = list(parent.state_dict())
    params = list(ff.parameters())
    parent.feed_forward = SequenceTiledSwiGLU(ff, tile_tokens=5)
    assert list(parent.state_dict()) == keys
    assert all(a is b for a, b in zip(parent.feed_forward.parameters(), params))
    with torch.no_grad():
        parent.feed_forward.init_weights(0.02)  # the replaced class's own init
    assert parent.feed_forward.w2.weight.std() < 0.05


def test_bad_inputs_say_what_is_wrong():
    ff = llama3_feed_forward()
    for tile in (0, -3, 1.5, False):
        with pytest.raises(ValueError, match="tile_tokens must be a positive int"):
            SequenceTiledSwiGLU(ff, tile)

    class GeluMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2, self.w3 = nn.Linear(4, 8), nn.Linear(8, 4), nn.Linear(4, 8)

        def forward(self, x):
            return self.w2(F.gelu(self.w1(x)))

    with pytest.raises(ValueError, match="GeluMLP is not a known SwiGLU feed-forward"):
        SequenceTiledSwiGLU(GeluMLP(), 4)
