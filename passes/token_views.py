"""Where the tokens go through a view (:mod:`upipe_compile.passes.token_placement` follows them):
the shape-only ops, and the dimension of a view that holds a sharded dimension's tokens, with
their span there. Pure shape arithmetic, no tensors."""

from __future__ import annotations

import torch

_aten = torch.ops.aten
VIEW_ALIASES = frozenset({
    _aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.alias.default,
    _aten.view.dtype, _aten.lift_fresh.default, _aten.detach.default,
})
"""Shape-only ops: a placement moves with the view."""


def view_dim(src: tuple, dst: tuple, dim: int, size: int, inner: int) -> tuple[int, tuple[int, int]] | None:
    """Where the tokens of a ``src``-shaped tensor's dimension ``dim`` land in its ``dst``-shaped
    view, and their span there: along a dimension, the token index is ``(i // inner) % size``.
    Dimensions that merge keep the tokens with the inner dimensions' product as ``inner`` (tokens
    flattened with the batch); a dimension that splits puts them in the piece holding the
    tokens' fastest-varying factor."""
    groups = _view_groups(src, dst)
    for src_dims, dst_dims in groups:
        if dim not in src_dims:
            continue
        # the token factor's stride within the merged group
        after = 1
        for d in src_dims[src_dims.index(dim) + 1:]:
            after *= src[d]
        low = inner * after  # the stride of the token index within the group
        stride = 1
        for d in reversed(dst_dims):
            if stride <= low < stride * dst[d] and dst[d] != 1:
                return d, (size, low // stride)
            stride *= dst[d]
        return None
    return None


def _view_groups(src: tuple, dst: tuple) -> list[tuple[list[int], list[int]]]:
    """The smallest runs of ``src`` and ``dst`` dimensions with equal products (a view merges
    and splits within such runs); size-1 dimensions join the run before them."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        src_dims, dst_dims = [], []
        src_prod = dst_prod = 1
        while True:
            if i < len(src) and (src_prod < dst_prod or not src_dims or (j == len(dst) and src_prod == dst_prod)):
                src_prod *= src[i]
                src_dims.append(i)
                i += 1
            elif j < len(dst) and (dst_prod < src_prod or not dst_dims):
                dst_prod *= dst[j]
                dst_dims.append(j)
                j += 1
            else:
                break
            if src_prod == dst_prod and src_dims and dst_dims:
                # size-1 dimensions that follow belong to this run
                while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
                    src_dims.append(i)
                    i += 1
                while j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
                    dst_dims.append(j)
                    j += 1
                break
            if i >= len(src) and j >= len(dst):
                break
        groups.append((src_dims, dst_dims))
    return groups
