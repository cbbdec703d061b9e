"""upipe_compile.stack.chunked_loss: the chunked output projection + cross-entropy gives the plain
path's loss and gradients (of the hidden states and of the output weight), ignore_index
included, for any chunking; it swaps into torchtitan's model without changing its state dict."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from tests_support import relative_error
from upipe_compile.stack.chunked_loss import (
    IGNORE_INDEX, LazyLogits, LazyOutputProjection, lazy_logits_cross_entropy, linear_cross_entropy,
)


def plain_loss(hidden, weight, labels):
    """torchtitan 0.2.2's cross_entropy_loss on the logits of the output Linear."""
    pred = F.linear(hidden, weight)
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum",
                           ignore_index=IGNORE_INDEX)


def make_case(batch, seq, dim, vocab, ignored, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, dim, generator=gen).to(dtype)
    weight = (torch.randn(vocab, dim, generator=gen) / dim ** 0.5).to(dtype)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[torch.rand(batch, seq, generator=gen) < ignored] = IGNORE_INDEX
    return hidden, weight, labels


def loss_and_grads(fn, hidden, weight, labels, scale=0.37):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(hidden, weight, labels)
    (loss * scale).backward()  # a non-unit upstream gradient, as loss_sum / global_tokens gives
    return loss.detach(), hidden.grad, weight.grad


def summand_sizes(hidden, weight, labels, scale=0.37):
    """The gradients with every summand made positive (``|dlogits|ᵀ |h|`` and ``|dlogits| |W|``):
    what fp32 rounding is relative to when the true sums nearly cancel."""
    h, w = hidden.double().flatten(0, 1), weight.double()
    y = labels.flatten()
    kept = y != IGNORE_INDEX
    dlogits = torch.softmax(h @ w.t(), dim=-1)
    dlogits[kept, y[kept]] -= 1
    dlogits[~kept] = 0
    dlogits = (scale * dlogits).abs()
    return (dlogits @ w.abs()).view(hidden.shape), dlogits.t() @ h.abs()


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 3), seq=st.integers(1, 33), dim=st.integers(1, 12), vocab=st.integers(2, 40),
       chunk=st.integers(1, 40), ignored=st.sampled_from([0.0, 0.3, 1.0]), seed=st.integers(0, 2 ** 16))
def test_matches_plain_loss_and_gradients(batch, seq, dim, vocab, chunk, ignored, seed):
    hidden, weight, labels = make_case(batch, seq, dim, vocab, ignored, seed)
    ref = loss_and_grads(plain_loss, hidden, weight, labels)
    got = loss_and_grads(lambda h, w, y: linear_cross_entropy(h, w, y, chunk), hidden, weight, labels)
    assert got[0].dtype == torch.float32 and got[0].shape == ()
    sizes = (ref[0].abs(), *summand_sizes(hidden, weight, labels))
    for name, a, b, size in zip(("loss", "d hidden", "d weight"), got, ref, sizes):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if b.abs().max() == 0:  # everything ignored: zero loss, zero gradients
            assert a.abs().max() == 0, name
        else:
            # relative to the gradient, or to its summands where they nearly cancel
            error = (a.double() - b.double()).norm().item()
            assert error <= 1e-5 * max(b.double().norm().item(), size.norm().item()), (name, relative_error(a, b))


def test_bfloat16_close_to_plain():
    hidden, weight, labels = make_case(2, 96, 32, 300, 0.2, 0, torch.bfloat16)
    ref = loss_and_grads(plain_loss, hidden, weight, labels)
    got = loss_and_grads(lambda h, w, y: linear_cross_entropy(h, w, y, 40), hidden, weight, labels)
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype
        assert relative_error(a, b) < 1e-2


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_loss_matches_plain(backend):
    """As build_loss_fn compiles it when [compile] components has "loss"."""
    import functools

    hidden, weight, labels = make_case(2, 17, 8, 30, 0.2, 3)
    loss_fn = torch.compile(functools.partial(lazy_logits_cross_entropy, chunk_tokens=5), backend=backend)
    compiled = lambda h, w, y: loss_fn(LazyLogits(h, w), y)  # noqa: E731
    ref = loss_and_grads(plain_loss, hidden, weight, labels)
    got = loss_and_grads(compiled, hidden, weight, labels)
    for a, b in zip(got, ref):
        assert relative_error(a, b) <= 1e-5


def test_backward_recomputes_chunks_without_full_logits():
    """Nothing of size tokens x vocab is saved for backward: only hidden, weight, labels, lse."""
    hidden, weight, labels = make_case(1, 64, 8, 500, 0.0, 0)
    hidden.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        linear_cross_entropy(hidden, weight, labels, 16)
    assert (64, 500) not in saved and (1, 64, 500) not in saved
    assert sorted(saved) == sorted([(64, 8), (500, 8), (64,), (64,)])


def test_output_projection_swap_keeps_parameter_and_state_dict():
    model = nn.Sequential()
    model.output = nn.Linear(6, 11, bias=False)
    keys = list(model.state_dict())
    weight = model.output.weight
    model.output = LazyOutputProjection(model.output)
    assert list(model.state_dict()) == keys and model.output.weight is weight
    hidden = torch.randn(2, 3, 6)
    pred = model.output(hidden)
    assert isinstance(pred, LazyLogits) and torch.equal(pred.materialize(), F.linear(hidden, weight))


def test_bad_inputs_say_what_is_wrong():
    hidden, weight, labels = make_case(1, 4, 3, 5, 0.0, 0)
    for chunk in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="chunk_tokens must be a positive int"):
            linear_cross_entropy(hidden, weight, labels, chunk)
    with pytest.raises(ValueError, match="disagree"):
        linear_cross_entropy(hidden, weight, labels[:, :2], 2)
    with pytest.raises(TypeError, match="LazyLogits"):
        lazy_logits_cross_entropy(F.linear(hidden, weight), labels, 2)
    with pytest.raises(ValueError, match="bias-free"):
        LazyOutputProjection(nn.Linear(3, 5))
