"""Exact attention in plain torch for the variants aten's CPU flash kernel lacks: a
sliding window, logit soft-capping and ALiBi (flash-attn's conventions).

``forward(q, k, v, is_causal, scale, window, softcap, alibi_slopes=...) -> (out, lse)`` and
``backward(dout, q, k, v, out, lse, is_causal, scale, window, softcap, alibi_slopes=...) -> (dq, dk, dv)``
with the shapes of :mod:`upipe_compile.attention.kernels`: q ``[B, Hq, S, D]``, k/v ``[B, Hkv, S, D]``
(GQA: query head ``h`` uses KV head ``h // (Hq // Hkv)``), lse ``[B, Hq, S]`` float32.

- ``window=(left, right)``: query ``i`` sees keys ``j`` with ``i - left <= j <= i + right``;
  -1 leaves that side unbounded. ``is_causal`` adds ``j <= i``. With ``Sq`` queries and
  ``Sk`` keys (unequal in a ring's chunk pair) both edges move by ``Sk - Sq``, aligning the
  last query with the last key (flash-attn's convention).
- ``softcap > 0``: the scaled scores ``s`` become ``softcap * tanh(s / softcap)`` before
  the softmax (Gemma 2); 0 turns it off.
- ``alibi_slopes`` ``[Hq]`` (float32, or None): query ``i`` and key ``j`` get
  ``-slope[h] * |i + (Sk - Sq) - j|`` added to their (capped) score before the softmax,
  flash-attn's ALiBi (:mod:`upipe_compile.attention.alibi`). A slope may be negative (the ring
  runs a chunk pair's keys after the diagonal with flipped slopes). The bias is a constant of
  q and k, so the backward's chain rule is unchanged; the slopes take no gradient.

Queries go in blocks of :data:`BLOCK_ROWS` rows, each against only the keys some row of
the block can see, so the scores held at once are ``B x Hq x block x keys-it-sees``, never
``S x S`` (``block_rows=`` overrides the block size per call). The query heads of one KV
head are stacked as rows of one matmul, so K/V are never repeated. Low-precision inputs
are computed in float32 (float64 in float64) and returned in their dtype;
the backward recomputes each block's probabilities from ``lse`` and takes rowsum(dO * O)
from ``out`` (as flash does), and sums dk/dv in float32. A row that sees no key (possible only through a caller's masking, never
with valid windows) gets out 0, lse -inf and zero gradients.
"""

from __future__ import annotations

import torch

BLOCK_ROWS = 256
"""Query rows per block (tests lower it to cover many blocks on short sequences)."""


def forward(q, k, v, is_causal: bool, scale: float | None, window=(-1, -1), softcap: float = 0.0,
            block_rows: int | None = None, alibi_slopes: torch.Tensor | None = None):
    batch, q_heads, seq, dim = q.shape
    kv_heads, group = k.shape[1], q_heads // k.shape[1]
    compute = _compute_dtype(q.dtype)
    scale = dim**-0.5 if scale is None else scale
    out = q.new_empty((batch, kv_heads, group, seq, v.shape[-1]))
    lse = q.new_empty((batch, kv_heads, group, seq), dtype=torch.float32)
    q5 = q.unflatten(1, (kv_heads, group))
    shift = k.shape[2] - seq
    slopes = _slopes(alibi_slopes, kv_heads, group, compute)
    for rows, keys in _blocks(seq, k.shape[2], is_causal, window, block_rows):
        qb = q5[:, :, :, rows].to(compute)
        scores, _ = _scores(qb, k[:, :, keys].to(compute), rows, keys, shift, is_causal, window, scale, softcap,
                            slopes)
        lse_b = scores.logsumexp(-1)
        probs = scores.sub_(_finite(lse_b).unsqueeze(-1)).exp_()
        out[:, :, :, rows] = _rows_matmul(probs, v[:, :, keys].to(compute)).to(out.dtype)
        lse[:, :, :, rows] = lse_b.float()
    return out.flatten(1, 2), lse.flatten(1, 2)


def backward(dout, q, k, v, out, lse, is_causal: bool, scale: float | None, window=(-1, -1), softcap: float = 0.0,
             block_rows: int | None = None, alibi_slopes: torch.Tensor | None = None):
    """Flash's backward, one query block at a time: P = exp(s - lse), dP = dO V^T,
    dS = P * (dP - rowsum(dO * O)), through tanh' when soft-capped, then dq = dS K,
    dk += dS^T Q, dv += P^T dO. rowsum(dO * O) comes from the final output, as in flash:
    a call that sees only some of a row's keys (a ring's chunk pair, with ``lse`` and
    ``out`` over all of them) then gets its share of the exact gradient, which rowsum(P *
    dP) over its own keys would not give."""
    batch, q_heads, seq, dim = q.shape
    kv_heads, group = k.shape[1], q_heads // k.shape[1]
    compute = _compute_dtype(q.dtype)
    scale = dim**-0.5 if scale is None else scale
    dq = q.new_empty((batch, kv_heads, group, seq, dim))
    dk = torch.zeros(k.shape, dtype=compute, device=k.device)
    dv = torch.zeros(v.shape, dtype=compute, device=v.device)
    q5, dout5, lse5 = (t.unflatten(1, (kv_heads, group)) for t in (q, dout, lse))
    delta5 = (dout.to(compute) * out.to(compute)).sum(-1).unflatten(1, (kv_heads, group))  # rowsum(dO * O)
    shift = k.shape[2] - seq
    slopes = _slopes(alibi_slopes, kv_heads, group, compute)
    for rows, keys in _blocks(seq, k.shape[2], is_causal, window, block_rows):
        qb, dob = q5[:, :, :, rows].to(compute), dout5[:, :, :, rows].to(compute)
        kb, vb = k[:, :, keys].to(compute), v[:, :, keys].to(compute)
        scores, capped = _scores(qb, kb, rows, keys, shift, is_causal, window, scale, softcap, slopes)
        probs = scores.sub_(_finite(lse5[:, :, :, rows]).unsqueeze(-1)).exp_()
        dprobs = _rows_matmul(dob, vb.transpose(-1, -2))
        dscores = dprobs.sub_(delta5[:, :, :, rows].unsqueeze(-1)).mul_(probs)
        if capped is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
            dscores.mul_(capped.square_().neg_().add_(1))
        # dS without the scale: it goes on the (smaller) dq block and on dk once at the end
        dq[:, :, :, rows] = (_rows_matmul(dscores, kb) * scale).to(dq.dtype)
        dk[:, :, keys] += _stacked(dscores).transpose(-1, -2) @ _stacked(qb)
        dv[:, :, keys] += _stacked(probs).transpose(-1, -2) @ _stacked(dob)
    return dq.flatten(1, 2), dk.mul_(scale).to(k.dtype), dv.to(v.dtype)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _blocks(q_len: int, k_len: int, is_causal: bool, window, block_rows: int | None):
    """``(rows, keys)`` slices: each block of query rows and the key range its rows can see."""
    left, right = window
    if is_causal:
        right = 0
    shift = k_len - q_len
    step = block_rows or BLOCK_ROWS
    for start in range(0, q_len, step):
        end = min(start + step, q_len)
        lo = 0 if left < 0 else min(k_len, max(0, start + shift - left))
        hi = k_len if right < 0 else max(lo, min(k_len, end + shift + right))
        yield slice(start, end), slice(lo, hi)


def _slopes(alibi_slopes, kv_heads: int, group: int, compute: torch.dtype):
    """The negated ALiBi slopes as ``[1, Hkv, g, 1, 1]`` in the compute dtype (None: no ALiBi)."""
    if alibi_slopes is None:
        return None
    if tuple(alibi_slopes.shape) != (kv_heads * group,):
        raise ValueError(f"alibi_slopes must have shape [{kv_heads * group}], got {list(alibi_slopes.shape)}")
    return alibi_slopes.to(compute).neg().view(1, kv_heads, group, 1, 1)


def _scores(qb, kb, rows: slice, keys: slice, shift: int, is_causal: bool, window, scale: float, softcap: float,
            neg_slopes=None):
    """Masked (with -inf), scaled, soft-capped scores ``[B, Hkv, g, rows, keys]`` (a new
    tensor) with the ALiBi bias added after the cap (``neg_slopes`` from :func:`_slopes`),
    and the tanh the cap applied (None without a cap) for the backward's chain rule. The
    scale (over the cap) multiplies the q block, smaller than the scores."""
    scores = _rows_matmul(qb * (scale / softcap if softcap else scale), kb.transpose(-1, -2))
    capped = None
    if softcap:
        capped = scores.tanh_()
        scores = capped * softcap
    if neg_slopes is not None:  # scores += -slope * |i + shift - j|, in place
        i = torch.arange(rows.start, rows.stop, device=scores.device, dtype=scores.dtype).unsqueeze(-1) + shift
        distance = (i - torch.arange(keys.start, keys.stop, device=scores.device, dtype=scores.dtype)).abs_()
        scores.addcmul_(neg_slopes, distance)
    hidden = _hidden(rows, keys, shift, is_causal, window, scores.device)
    if hidden is not None:
        scores.masked_fill_(hidden, float("-inf"))
    return scores, capped


def _hidden(rows: slice, keys: slice, shift: int, is_causal: bool, window, device):
    """``[rows, keys]`` bool, True where query i may not see key j; None when it may see all.
    The edges are relative to key ``i + shift``, the query's place among the keys."""
    left, right = window
    if is_causal:
        right = 0
    i = torch.arange(rows.start, rows.stop, device=device).unsqueeze(-1) + shift
    offset = torch.arange(keys.start, keys.stop, device=device) - i  # j - (i + shift)
    hidden = None
    if left >= 0 and keys.start < rows.stop - 1 + shift - left:  # the last row's left edge falls inside the keys
        hidden = offset < -left
    if right >= 0 and keys.stop - 1 > rows.start + shift + right:  # the first row's right edge does
        hidden = offset > right if hidden is None else hidden | (offset > right)
    return hidden


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with rows that see no key (-inf) at 0, so their exp(-inf - lse) is 0, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _stacked(x: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, g, rows, n]`` as ``[B, Hkv, g * rows, n]``: a KV head's query heads as rows."""
    return x.flatten(2, 3)


def _rows_matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x [B, Hkv, g, rows, n] @ y [B, Hkv, n, m]`` -> ``[B, Hkv, g, rows, m]`` as one
    matmul per KV head (y is shared by the head's g query heads, not repeated)."""
    return (_stacked(x) @ y).unflatten(2, x.shape[2:4])
