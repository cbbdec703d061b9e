"""ALiBi (attention with linear biases; Bloom, MPT, Falcon's ALiBi models): one slope per
query head, and the score of query ``i`` and key ``j`` gets ``-slope[h] * |i - j|`` added
before the softmax (after a softcap, as flash-attn adds it).

Positions are the full sequence's (within a document for packed documents): each stage
attends over the whole sequence, and the bias depends only on ``i - j``, so a document's
slice of the stage buffers carries it unchanged. With causal attention every visible key has
``j <= i``, so the bias is ``-slope * (i - j)``, which differs from Bloom's and MPT's
``slope * j`` by a per-row constant (the softmax is the same; the log-sum-exp is the true
one's). Non-causal attention uses ``-slope * |i - j|``, flash-attn's convention.

The bias is head-separable: a stage's kernel takes its own heads' slopes, gathered with the
same schedule as its query heads. The slopes take no gradient (ALiBi's are fixed); a slope
tensor that requires one is refused rather than left without it.

A kernel aligns queries and keys of unequal lengths at the last of each (``i + Sk - Sq``
against ``j``): a ring's chunk pairs whose global offset differs from that are cut by
:mod:`upipe_compile.attention.ring` into calls where the kernel's bias is the true one up to
a per-head constant, which goes into the log-sum-exp.
"""

from __future__ import annotations

from typing import Optional

import torch


def kernel_slopes(alibi_slopes: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    """The slopes as every kernel takes them: float32, contiguous, on ``device`` (None: no ALiBi)."""
    if alibi_slopes is None:
        return None
    return alibi_slopes.detach().to(device=device, dtype=torch.float32).contiguous()


def alibi_bias(alibi_slopes: torch.Tensor, q_len: int, k_len: int, dtype=torch.float64) -> torch.Tensor:
    """``[H, q_len, k_len]``: ``-slope * |i + (k_len - q_len) - j|``, the bias a kernel adds
    (queries and keys aligned at the last of each). For references and tests; the kernels
    never build it whole."""
    device = alibi_slopes.device
    i = torch.arange(q_len, dtype=dtype, device=device)[:, None] + (k_len - q_len)
    j = torch.arange(k_len, dtype=dtype, device=device)[None, :]
    return -alibi_slopes.to(dtype)[:, None, None] * (i - j).abs()
