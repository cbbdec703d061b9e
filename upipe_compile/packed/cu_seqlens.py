"""Packed-sequence boundaries (``cu_seqlens``) as a user makes them, from a packed row's
position ids.

The op reads and checks boundaries in :mod:`upipe_compile.attention.document_boundaries`; this
is the user's side (``upipe_compile.cu_seqlens_from_position_ids``).
"""

from __future__ import annotations

import torch


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Boundaries of a packed row whose positions restart at 0 per document (what
    transformers' ``DataCollatorWithFlattening`` produces): int32 ``[n + 1]``.
    ``position_ids`` ``[1, S]`` or ``[S]`` over the full sequence."""
    positions = position_ids.reshape(-1)
    starts = torch.nonzero(positions == 0).flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    end = torch.tensor([positions.numel()], dtype=starts.dtype, device=starts.device)
    return torch.cat([starts, end]).to(torch.int32)
