"""How a packed row's varlen backward is split into calls (a run-time decision of the CUDA
kernels, which the memory model of ``upipe_compile/measure/workspace.py`` counts too), and the
rounding both count with."""

from __future__ import annotations


H100_SMS = 132
"""Streaming multiprocessors of an H100 SXM: flash's deterministic backward keeps one dq
accumulator per split, and it splits until every SM has work."""


def ceil_div(x: int, y: int) -> int:
    return -(-x // y)


def round_up(x: int, multiple: int) -> int:
    return ceil_div(x, multiple) * multiple


def varlen_backward_groups(documents, q_heads: int, deterministic: bool, sms: int = H100_SMS) -> list[tuple[int, int]]:
    """Documents ``[first, last)`` per varlen backward call. flash's varlen backward pads its
    fp32 ``dq_accum`` and ``softmax_d`` by 128 rows per document (``mha_varlen_bwd``): over a
    1M-token row of 1000 documents, 12% more than the dense kernel's. Documents are taken in
    order while a call's padded rows (times its deterministic splits) stay within the dense
    kernel's for the whole row; a document that alone exceeds it is a call of its own."""
    seq = documents.bounds[-1]

    def size(tokens: int, count: int) -> int:
        splits = ceil_div(sms, count * q_heads) if deterministic else 1
        return splits * (tokens + 128 * count)

    dense = size(round_up(seq, 128) - 128, 1)  # the dense kernel's rows x splits (batch 1)
    groups, first = [], 0
    for last in range(1, len(documents.spans) + 1):
        tokens = documents.bounds[last] - documents.bounds[first]
        if last - first > 1 and size(tokens, last - first) > dense:
            groups.append((first, last - 1))
            first = last - 1
    groups.append((first, len(documents.spans)))
    return groups
