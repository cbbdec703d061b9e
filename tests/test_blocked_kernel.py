"""The exact blocked CPU kernel for sliding windows and soft-capping
(upipe_compile.attention.blocked_kernel), against autograd on the full math in float64, directly
and through kernels.forward/backward (dense routing, packed documents, value checks)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from tests_support import TOLERANCE, relative_error
from upipe_compile import UnsupportedAttention
from upipe_compile.attention import blocked_kernel, kernels
from upipe_compile.attention.document_boundaries import Documents

SETTINGS = dict(deadline=None, max_examples=60)


def visible(seq: int, is_causal: bool, window) -> torch.Tensor:
    """``[S, S]`` bool: query i may see key j (flash-attn's window rule, causal adds j <= i)."""
    i, j = torch.arange(seq).unsqueeze(-1), torch.arange(seq)
    left, right = window
    mask = torch.ones(seq, seq, dtype=torch.bool)
    if is_causal:
        mask &= j <= i
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    return mask


def reference(q, k, v, dout, is_causal, scale, window, softcap):
    """(out, lse, dq, dk, dv) by autograd in float64 on the whole score matrix: SDPA with an
    explicit boolean mask without a cap, the soft-capped math otherwise."""
    q, k, v = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    seq, scale = q.shape[2], q.shape[-1] ** -0.5 if scale is None else scale
    mask = visible(seq, is_causal, window)
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if softcap:
        out = scores.softmax(-1) @ v.repeat_interleave(group, 1)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    out.backward(dout.double())
    return out.detach(), scores.detach().logsumexp(-1), q.grad, k.grad, v.grad


def close(actual, expected, tolerance, scale: float = 0.0) -> bool:
    """Relative error below ``tolerance``, measured against the larger of the reference and
    ``scale`` (a gradient that cancels to nearly zero -- dq over two keys -- is judged against
    the size of what cancelled, 1e-2 of the upstream gradient's norm); where the reference is
    zero up to float64 rounding (rows that see a single key have dq = 0) the kernel's rounding
    must stay small (aten's dense kernel leaves ~1e-6 from rowsum(dO * O) on O(1) inputs)."""
    if expected.norm() < 1e-9:
        return actual.double().abs().max().item() < 1e-4
    error = (actual.double() - expected.double()).norm().item()
    return error < tolerance * max(expected.double().norm().item(), scale)


def edges(seq: int):
    """A window edge: unbounded, 0, small, or beyond the sequence."""
    return st.one_of(st.just(-1), st.just(0), st.integers(1, 6), st.integers(seq, seq + 8))


@contextlib.contextmanager
def block_rows(rows: int):
    previous, blocked_kernel.BLOCK_ROWS = blocked_kernel.BLOCK_ROWS, rows
    try:
        yield
    finally:
        blocked_kernel.BLOCK_ROWS = previous


def randn(gen, batch, heads, seq, dim, dtype, layout_bshd=False):
    x = torch.randn(batch, heads, seq, dim, generator=gen).to(dtype)
    # the stage loop's layout: a [B, H, S, D] view of [B, S, H, D] storage
    return x.transpose(1, 2).contiguous().transpose(1, 2) if layout_bshd else x


@settings(**SETTINGS)
@given(
    batch=st.integers(1, 2), kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 4]),
    seq=st.integers(1, 70), head_dim=st.sampled_from([8, 16, 32]), is_causal=st.booleans(),
    scale=st.one_of(st.none(), st.floats(0.05, 2.0)), softcap=st.one_of(st.just(0.0), st.floats(0.5, 50.0)),
    dtype=st.sampled_from(["float32", "bfloat16"]), rows=st.sampled_from([5, 16, 256]),
    layout_bshd=st.booleans(), seed=st.integers(0, 2**16), data=st.data(),
)
def test_blocked_kernel_equals_full_math(batch, kv_heads, group, seq, head_dim, is_causal, scale, softcap, dtype,
                                         rows, layout_bshd, seed, data):
    window = (data.draw(edges(seq), label="left"), data.draw(edges(seq), label="right"))
    gen = torch.Generator().manual_seed(seed)
    torch_dtype = getattr(torch, dtype)
    q, dout = (randn(gen, batch, kv_heads * group, seq, head_dim, torch_dtype, layout_bshd) for _ in range(2))
    k, v = (randn(gen, batch, kv_heads, seq, head_dim, torch_dtype, layout_bshd) for _ in range(2))

    out, lse = blocked_kernel.forward(q, k, v, is_causal, scale, window, softcap, block_rows=rows)
    grads = blocked_kernel.backward(dout, q, k, v, out, lse, is_causal, scale, window, softcap, block_rows=rows)

    expected = reference(q, k, v, dout, is_causal, scale, window, softcap)
    assert out.dtype == torch_dtype and lse.dtype == torch.float32 and lse.shape == (batch, kv_heads * group, seq)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape] and all(g.dtype == torch_dtype for g in grads)
    assert relative_error(lse, expected[1]) < 1e-5
    for name, actual, wanted in zip(("out", "dq", "dk", "dv"), (out, *grads), expected[:1] + expected[2:]):
        assert close(actual, wanted, TOLERANCE[dtype], 1e-2 * dout.double().norm().item()), \
            f"{name}: {relative_error(actual, wanted):.2e}"


def test_each_block_reads_only_the_keys_it_can_see(monkeypatch):
    """Memory stays block x visible keys: a window of 3 on 1000 tokens never forms a score
    block wider than the block's rows plus the window, forward or backward."""
    widths = []
    real_scores = blocked_kernel._scores

    def spy(qb, kb, *args):
        widths.append(kb.shape[-2])
        return real_scores(qb, kb, *args)

    monkeypatch.setattr(blocked_kernel, "_scores", spy)
    q = torch.randn(1, 2, 1000, 8)
    out, lse = blocked_kernel.forward(q, q, q, True, None, (3, -1), 0.0, block_rows=64)
    blocked_kernel.backward(q, q, q, q, out, lse, True, None, (3, -1), 0.0, block_rows=64)
    assert len(widths) == 2 * 16 and max(widths) == 64 + 3


def test_rows_that_see_no_key_give_zero_and_no_nan(monkeypatch):
    """No valid window leaves a row empty, but if masking ever does, the row's out is 0,
    its lse -inf, and the gradients are finite (that row contributes nothing)."""
    real_hidden = blocked_kernel._hidden

    def also_row_two(rows, keys, shift, is_causal, window, device):
        hidden = real_hidden(rows, keys, shift, is_causal, window, device)
        if hidden is None:
            hidden = torch.zeros(rows.stop - rows.start, keys.stop - keys.start, dtype=torch.bool)
        if rows.start <= 2 < rows.stop:
            hidden[2 - rows.start] = True
        return hidden

    monkeypatch.setattr(blocked_kernel, "_hidden", also_row_two)
    q, k, v, dout = (torch.randn(1, 2, 9, 8) for _ in range(4))
    out, lse = blocked_kernel.forward(q, k, v, True, None, (4, 0), 5.0, block_rows=4)
    dq, dk, dv = blocked_kernel.backward(dout, q, k, v, out, lse, True, None, (4, 0), 5.0, block_rows=4)
    assert (out[:, :, 2] == 0).all() and (lse[:, :, 2] == float("-inf")).all()
    assert all(torch.isfinite(t).all() for t in (out[:, :, 3:], dq, dk, dv))
    assert (dq[:, :, 2] == 0).all()


# --- through kernels.forward / backward --------------------------------------------------


def test_dense_variants_stay_on_aten(monkeypatch):
    """No window, a window covering the sequence, and (-1, 0) (= causal) run aten's CPU
    kernel; a real window or a softcap runs the blocked kernel."""
    calls = []
    real = blocked_kernel.forward
    monkeypatch.setattr(blocked_kernel, "forward", lambda *a, **kw: calls.append(a[5:7]) or real(*a, **kw))
    q = torch.randn(1, 2, 20, 8)
    causal_out, _ = kernels.forward(q, q, q, True, None)
    for window, is_causal in (((-1, -1), False), ((19, 30), False), ((-1, 0), False), ((-1, 7), True)):
        out, _ = kernels.forward(q, q, q, is_causal, None, window=window)
        if window in ((-1, 0), (-1, 7)):
            torch.testing.assert_close(out, causal_out)
    assert calls == []
    kernels.forward(q, q, q, True, None, window=(3, 0))
    kernels.forward(q, q, q, False, None, softcap=20.0)
    assert calls == [((3, 0), 0.0), ((-1, -1), 20.0)]


@settings(deadline=None, max_examples=30)
@given(
    batch=st.integers(1, 2), kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 2]), seq=st.integers(1, 40),
    is_causal=st.booleans(), softcap=st.one_of(st.just(0.0), st.floats(0.5, 50.0)),
    dtype=st.sampled_from(["float32", "bfloat16"]), data=st.data(),
)
def test_documents_with_window_and_softcap_equal_per_document_reference(batch, kv_heads, group, seq, is_causal,
                                                                        softcap, dtype, data):
    """Packed documents on CPU (one kernel call per document) with a window and softcap
    equal the full math run on each document alone."""
    window = (data.draw(edges(seq), label="left"), data.draw(edges(seq), label="right"))
    cuts = sorted(data.draw(st.sets(st.integers(1, seq - 1), max_size=seq - 1))) if seq > 1 else []
    bounds = (0, *cuts, seq)
    documents = Documents.from_bounds(bounds, "cpu")
    gen = torch.Generator().manual_seed(seq)
    torch_dtype = getattr(torch, dtype)
    q, dout = (randn(gen, batch, kv_heads * group, seq, 16, torch_dtype, True) for _ in range(2))
    k, v = (randn(gen, batch, kv_heads, seq, 16, torch_dtype, True) for _ in range(2))
    with block_rows(4):
        out, lse = kernels.forward(q, k, v, is_causal, None, documents, window=window, softcap=softcap)
        grads = kernels.backward(dout, q, k, v, out, lse, is_causal, None, documents, window=window, softcap=softcap)

    pieces = [reference(*(t[:, :, a:b] for t in (q, k, v, dout)), is_causal, None, window, softcap)
              for a, b in zip(bounds[:-1], bounds[1:])]
    expected = [torch.cat(parts, dim=2) for parts in zip(*pieces)]
    assert relative_error(lse, expected[1]) < 1e-4  # dense documents run aten's kernel: bf16 products
    for name, actual, wanted in zip(("out", "dq", "dk", "dv"), (out, *grads), expected[:1] + expected[2:]):
        assert close(actual, wanted, TOLERANCE[dtype], 1e-2 * dout.double().norm().item()), \
            f"{name}: {relative_error(actual, wanted):.2e}"


def test_fake_tensors_take_the_dense_kernel_with_variants(monkeypatch):
    """Memory measurement runs on fake tensors: the variants' outputs have the dense
    kernel's shapes, and the blocked kernel's scores would be no model of a GPU kernel."""
    monkeypatch.setattr(blocked_kernel, "forward", None)
    monkeypatch.setattr(blocked_kernel, "backward", None)
    with FakeTensorMode():
        q, k = torch.empty(1, 4, 4096, 64), torch.empty(1, 2, 4096, 64)
        out, lse = kernels.forward(q, k, k, True, None, window=(128, 0), softcap=30.0)
        dq, dk, dv = kernels.backward(q, q, k, k, out, lse, True, None, window=(128, 0), softcap=30.0)
    assert out.shape == q.shape and lse.shape == (1, 4, 4096) and dk.shape == dv.shape == k.shape


@pytest.mark.parametrize("window, softcap, expected", [
    ((-2, 0), 0.0, "int >= -1"), ((1.5, 0), 0.0, "int >= -1"), ((3,), 0.0, "(left, right)"),
    ((True, 0), 0.0, "int >= -1"), (5, 0.0, "(left, right)"), ((-1, -1), -1.0, ">= 0"),
    ((-1, -1), math.nan, "finite"), ((-1, -1), math.inf, "finite"), ((-1, -1), True, "finite number"),
])
def test_bad_variant_values_are_refused(window, softcap, expected):
    (problem,) = kernels.variant_problems("cpu", window, softcap)
    assert expected in problem
    with pytest.raises(UnsupportedAttention, match="window=|softcap="):
        kernels.check_variant(window, softcap)
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(UnsupportedAttention):
        kernels.forward(q, q, q, False, None, window=window, softcap=softcap)


def test_valid_variants_are_accepted_on_cpu():
    for window, softcap in (((-1, -1), 0.0), ((0, 0), 1), ([5, -1], 30.0), ((10**9, 3), 0.5)):
        assert kernels.variant_problems("cpu", window, softcap) == []
    assert kernels.check_variant([5, -1], 30) == ((5, -1), 30.0)
