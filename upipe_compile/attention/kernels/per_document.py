"""Packed documents for kernels without a variable-length form: the dense kernel once per
document, on slices of the stage buffers."""

from __future__ import annotations

import torch

from upipe_compile.attention.kernels.contract import NO_WINDOW


class PerDocumentKernels:
    """Packed sequences by running the dense kernel once per document on slices of the
    full-sequence buffers (written into full-size out/lse, dq/dk/dv): exact, including the
    log-sum-exp backward needs, and with no allocation beyond one document's outputs. A
    window and ALiBi's bias are relative to the query, so they apply to each document's
    slice unchanged."""

    def forward_documents(self, q, k, v, documents, is_causal: bool, scale: float | None, window=NO_WINDOW,
                          softcap: float = 0.0, alibi_slopes=None):
        batch, heads, seq, _ = q.shape
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = q.new_empty((batch, heads, seq), dtype=torch.float32)
        for start, end in documents.spans:
            piece = slice(start, end)
            out_doc, lse_doc = self.forward(q[:, :, piece], k[:, :, piece], v[:, :, piece], is_causal, scale,
                                            window, softcap, alibi_slopes)
            out[:, :, piece].copy_(out_doc)
            lse[:, :, piece].copy_(lse_doc)
        return out, lse

    def backward_documents(self, dout, q, k, v, out, lse, documents, is_causal: bool, scale: float | None,
                           window=NO_WINDOW, softcap: float = 0.0, alibi_slopes=None):
        dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
        for start, end in documents.spans:
            piece = slice(start, end)
            grads = self.backward(
                dout[:, :, piece], q[:, :, piece], k[:, :, piece], v[:, :, piece], out[:, :, piece],
                lse[:, :, piece].contiguous(), is_causal, scale, window, softcap, alibi_slopes,
            )
            for dest, grad in zip((dq, dk, dv), grads):
                dest[:, :, piece].copy_(grad)
        return dq, dk, dv

