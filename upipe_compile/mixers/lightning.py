"""Lightning attention (MiniMax's linear attention layers) over whole sequences, in torch.

Each head is a causal linear attention with a fixed decay ``s`` per head:
``out_i = sum_{j <= i} exp(-s (i - j)) (q_i . k_j) v_j``. It is computed block by block as the
model does (same blocks from the sequence's start, so the same rounding): inside a block
through the decayed ``q k^T`` scores, across blocks through a running ``k^T v`` state.
transformers writes this loop inside the layer's forward, with no function to swap, so upipe
carries its own; the stage loop gives it whole sequences for a chunk of heads.
"""

from __future__ import annotations

import torch


def lightning_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
                        block_size: int) -> torch.Tensor:
    """q, k, v ``[B, H, S, D]``, slope ``[H, 1, 1]`` (one decay rate per head) -> ``[B, H, S, D]``."""
    batch, heads, length, dim = q.shape
    steps = torch.arange(1, block_size + 1, device=q.device)
    state = q.new_zeros(batch, heads, dim, v.shape[-1])
    out = []
    for begin in range(0, length, block_size):
        n = min(block_size, length - begin)
        qb, kb, vb = (t[:, :, begin:begin + n] for t in (q, k, v))
        # decay of each query from the block's start, of each key to the block's end, within it
        query_decay = torch.exp(-slope * steps[:n, None])
        key_decay = torch.exp(-slope * (n - steps[:n, None]))
        distance = slope * (steps[:n, None] - steps[None, :n])
        within = torch.exp(torch.where(distance >= 0, -distance, float("-inf")))[None]
        scores = torch.matmul(qb, kb.transpose(-1, -2)) * within
        out.append(torch.matmul(scores, vb) + torch.matmul(qb * query_decay, state))
        state = state * torch.exp(-slope * n) + torch.matmul((kb * key_decay).transpose(-1, -2), vb)
    return torch.cat(out, dim=2)
