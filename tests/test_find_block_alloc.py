"""Reading the row ranges of a fused qkv projection allocates nothing that grows with
the sequence. The projection's example value is a fake [1, 2**40, 96] tensor: a host index
tensor of that shape (the old ``arange(n).expand(shape).contiguous()``) is 768 TiB, which no
allocator grants, so the old code fails here at once instead of running."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from upipe_compile.passes.find_block import _fused
from upipe_compile.passes.head_separable import NotSeparable

S, N = 2**40, 96


def traced(slicing):
    """The graph of ``slicing(linear(x, w))`` with a huge fake example value on the linear."""
    gm = fx.symbolic_trace(lambda x, w: slicing(F.linear(x, w)))
    (linear,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is F.linear]
    with FakeTensorMode():
        linear.meta["example_value"] = torch.empty(1, S, N)
    return gm, linear


def slices_after(linear):
    """The slicing node under ``linear`` and, for split/chunk, the getitem of its first item."""
    (user,) = linear.users
    items = [u for u in user.users if u.target is operator.getitem]
    return [user] + items[:1]


@pytest.mark.parametrize("slicing, rows", [
    (lambda p: p.chunk(3, dim=-1)[0], (0, 32)),
    (lambda p: p.split(32, dim=2)[0], (0, 32)),
    (lambda p: p.narrow(-1, 32, 32), (32, 64)),
    (lambda p: p[..., 64:96], (64, 96)),
    (lambda p: p[:, :, 40:72], (40, 72)),
])
def test_fused_rows_of_a_huge_sequence(slicing, rows):
    _, linear = traced(slicing)
    assert _fused(linear, slices_after(linear)).rows == rows


@pytest.mark.parametrize("slicing, why", [
    (lambda p: p[:, 1:], "along a dim other than its last"),
    (lambda p: p.chunk(2, dim=1)[0], "along a dim other than its last"),
    (lambda p: p[..., ::2], "non-contiguous rows"),
])
def test_fused_refusals_of_a_huge_sequence(slicing, why):
    _, linear = traced(slicing)
    with pytest.raises(NotSeparable, match=why):
        _fused(linear, slices_after(linear))
