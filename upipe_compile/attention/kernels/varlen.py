"""Packed documents through a CUDA kernel's variable-length ("varlen") form."""

from __future__ import annotations

import torch

from upipe_compile.attention.kernels.contract import NO_WINDOW
from upipe_compile.attention.varlen_groups import varlen_backward_groups


class VarlenKernels:
    """Packed sequences through a CUDA kernel's variable-length form, one batch row at a
    time: the row's ``[H, S, D]`` stage buffers go in as ``[S, H, D]`` views (no copies)
    with the documents' ``cu_seqlens`` as both query and key boundaries. Subclasses give
    ``_varlen_forward_row`` / ``_varlen_backward_row``. Their log-sum-exp comes either
    packed ``[H, S]`` or padded per document ``[n, H, max_len]`` (flash-attn 2.5); the
    stage loop keeps it packed and pads it again for a backward that wants it so."""

    lse_padded: bool | None = None  # learned from the first forward

    def forward_documents(self, q, k, v, documents, is_causal: bool, scale: float | None, window=NO_WINDOW,
                          softcap: float = 0.0, alibi_slopes=None):
        batch, heads, seq, dim = q.shape
        lse = q.new_empty((batch, heads, seq), dtype=torch.float32)
        out = None if batch == 1 else q.new_empty((batch, seq, heads, dim))
        for row in range(batch):
            out_row, lse_row = self._varlen_forward_row(
                q[row].transpose(0, 1), k[row].transpose(0, 1), v[row].transpose(0, 1), documents, is_causal, scale,
                window, softcap, alibi_slopes,
            )
            self.lse_padded = lse_row.dim() == 3
            lse[row].copy_(_packed_lse(lse_row, documents) if self.lse_padded else lse_row)
            if out is None:
                out = out_row.unsqueeze(0)
            else:
                out[row].copy_(out_row)
        return out.transpose(1, 2), lse

    def backward_documents(self, dout, q, k, v, out, lse, documents, is_causal: bool, scale: float | None,
                           window=NO_WINDOW, softcap: float = 0.0, alibi_slopes=None):
        """One varlen call per group of documents (:func:`varlen_backward_groups`): each
        call's padded workspace stays within the dense kernel's, and documents do not
        interact, so each group's gradients are exact on their own."""
        batch, seq = q.shape[0], q.shape[2]
        grads = [torch.empty((batch, seq, t.shape[1], t.shape[3]), dtype=t.dtype, device=t.device) for t in (q, k, v)]
        groups = varlen_backward_groups(documents, q.shape[1], torch.are_deterministic_algorithms_enabled())
        for row in range(batch):
            tensors = [t[row].transpose(0, 1) for t in (dout, q, k, v, out)]  # [S, H, D] views
            for first, last in groups:
                start, end = documents.bounds[first], documents.bounds[last]
                group = documents.subset(first, last)
                lse_group = lse[row][:, start:end].contiguous()
                if self.lse_padded:
                    lse_group = _padded_lse(lse_group, group)
                results = self._varlen_backward_row(
                    *(t[start:end] for t in tensors), lse_group, group, is_causal, scale, window, softcap,
                    alibi_slopes)
                for full, part in zip(grads, results):
                    full[row, start:end].copy_(part)
                del results
        return tuple(g.transpose(1, 2) for g in grads)


def _packed_lse(padded: torch.Tensor, documents) -> torch.Tensor:
    """``[n, H, max_len]`` (document i's rows first) as ``[H, S]``."""
    packed = padded.new_empty((padded.shape[1], documents.bounds[-1]))
    for i, (start, end) in enumerate(documents.spans):
        packed[:, start:end].copy_(padded[i, :, : end - start])
    return packed


def _padded_lse(packed: torch.Tensor, documents) -> torch.Tensor:
    padded = packed.new_zeros((len(documents.spans), packed.shape[0], documents.max_length))
    for i, (start, end) in enumerate(documents.spans):
        padded[i, :, : end - start].copy_(packed[:, start:end])
    return padded

