"""Attention sinks (GPT-OSS ``s_aux``): one learned logit per query head that joins every
row's softmax and carries no value.

No kernel needs to know about them. With ``lse`` the log-sum-exp of a row's scores and
``s`` its head's sink, the sink row's normaliser is ``lse' = logaddexp(lse, s)`` and its
output is the kernel's, rescaled: ``out' = out * exp(lse - lse')`` (= ``out / (1 + exp(s - lse))``).

Backward: the sink is an extra key whose value is zero. A flash-style backward given
``out'`` and ``lse'`` recomputes the probabilities as ``exp(scores - lse')`` (the rescaled
ones) and its ``rowsum(dout * out')`` term is the sink row's, so it returns exactly the
gradients of q, k, v. The sink's own gradient is the zero-value key's score gradient summed
over rows: ``dsink_h = -sum_rows exp(s_h - lse') * rowsum(dout * out')``.
"""

from __future__ import annotations

import torch

_ROWS_PER_CHUNK = 16384
"""Sequence rows per fp32 chunk of ``rowsum(dout * out)``: bounds its temporaries."""


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out', lse')`` for out ``[B, H, S, D]``, lse ``[B, H, S]`` (fp32) and the H heads'
    sinks ``[H]``."""
    total = torch.logaddexp(lse, sinks.float()[None, :, None])
    scaled = out * torch.exp(lse - total).unsqueeze(-1).to(out.dtype)
    return scaled, total


def sink_gradient(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``dsinks [H]`` (fp32) from the sink-normalised ``out'`` and ``lse'`` of H heads."""
    weight = torch.exp(sinks.float()[None, :, None] - lse)  # the sink's probability per row
    grad = torch.zeros(sinks.shape, dtype=torch.float32, device=sinks.device)
    for start in range(0, out.shape[2], _ROWS_PER_CHUNK):
        rows = slice(start, start + _ROWS_PER_CHUNK)
        delta = (dout[:, :, rows].float() * out[:, :, rows].float()).sum(-1)
        grad -= (weight[:, :, rows] * delta).sum(dim=(0, 2))
    return grad
