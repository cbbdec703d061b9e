"""Attention whose query/key head dim differs from its value head dim (MLA: DeepSeek-V2/V3,
Kimi K2, MiniCPM3: q/k carry ``nope + rope`` dims, e.g. 192, v 128).

The stage loops, their buffers and the flash kernels take one head dim, so the narrower side
is zero-padded to the wider one and the output cut back. Both are exact: zero columns of v
give zero output columns (cut away; their gradient is zero, so dv's real columns are
untouched), and zero columns of q and k add nothing to any score. The softmax scale stays
``1/sqrt(q/k head dim)`` as the model's. The cost: v (and the output) travel and are held at
the wider width (1.5x for 192 vs 128).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def one_head_dim(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float]):
    """``(q, k, v, scale, value_dim)`` with one head dim; ``value_dim`` is None where they
    already share it (nothing padded), else the width to cut the output back to."""
    qk_dim, value_dim = q.shape[-1], v.shape[-1]
    if qk_dim == value_dim:
        return q, k, v, scale, None
    scale = qk_dim ** -0.5 if scale is None else scale
    if value_dim < qk_dim:
        v = F.pad(v, (0, qk_dim - value_dim))
    else:
        q, k = F.pad(q, (0, value_dim - qk_dim)), F.pad(k, (0, value_dim - qk_dim))
    return q, k, v, scale, value_dim


def cut_to_value_dim(out: torch.Tensor, value_dim: Optional[int]) -> torch.Tensor:
    return out if value_dim is None or out.shape[-1] == value_dim else out[..., :value_dim]
