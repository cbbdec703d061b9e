"""Document boundaries of a packed sequence (``cu_seqlens``), checked and read once, for the
attention ops, the fused block and document_sdpa (which all sit above this module).

A packed sequence holds several documents end to end; ``cu_seqlens`` ``[n + 1]`` (int32 or
int64) are their cumulative lengths over the *full* sequence: ``0 = c_0 < c_1 < ... < c_n
= S``, document ``i`` being tokens ``[c_i, c_{i+1})``. Every batch row uses the same
boundaries. After the sequence->head all-to-all every rank holds the whole sequence for
its heads, so the kernels need only these ``n + 1`` numbers: no mask tensor ever exists.

The boundaries must be identical on every rank (each rank attends over the same full
sequence), which only a collective can tell. :func:`documents_for` checks a boundaries
tensor once -- locally, then one tiny all-gather of a fixed-size summary -- and remembers
the answer on that tensor object (until it is modified in place), so the many layers of
one step that share one ``cu_seqlens`` tensor pay one device read-back and one collective,
not one per layer. Each call still all-gathers one host integer (no device work): the
remembered answer is used only when every rank has one, so no rank skips a collective
another rank enters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

from upipe_compile.attention.collectives import (
    all_gather, check_same_local_shape, every_rank_agrees, group_from_name, values_of_every_rank,
)
from upipe_compile.attention.zigzag import zigzag_unshard
from upipe_compile.errors import UnsupportedAttention

BOUNDARY_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Documents:
    """Checked boundaries: ``bounds`` on the host, ``cu_seqlens`` (int32, on the kernels'
    device) for the varlen kernels that take them as a tensor."""

    bounds: tuple[int, ...]
    cu_seqlens: torch.Tensor
    _subsets: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def spans(self) -> list[tuple[int, int]]:
        return list(zip(self.bounds[:-1], self.bounds[1:]))

    @property
    def max_length(self) -> int:
        return max(end - start for start, end in self.spans)

    @property
    def is_single(self) -> bool:
        """One document over the whole sequence: the dense kernels' case."""
        return len(self.bounds) == 2

    def subset(self, first: int, last: int) -> "Documents":
        """Documents ``[first, last)`` as a sequence of their own (boundaries from 0). Derived
        on the device from ``cu_seqlens`` (no host-to-device copy, no sync) and kept per
        ``(first, last)``: the varlen backward asks for the same groups every stage and layer."""
        if (first, last) == (0, len(self.bounds) - 1):
            return self
        start = self.bounds[first]
        bounds = tuple(b - start for b in self.bounds[first:last + 1])
        if torch._guards.detect_fake_mode() is not None:  # nothing cached: a fake tensor must not outlive its mode
            return Documents.from_bounds(bounds, self.cu_seqlens.device)
        if (first, last) not in self._subsets:
            self._subsets[first, last] = Documents(bounds, self.cu_seqlens[first:last + 1] - self.cu_seqlens[first])
        return self._subsets[first, last]

    @classmethod
    def from_bounds(cls, bounds, device) -> "Documents":
        bounds = tuple(int(b) for b in bounds)
        return cls(bounds, torch.tensor(bounds, dtype=torch.int32, device=device))

    @classmethod
    def read(cls, cu_seqlens: torch.Tensor, device) -> "Documents":
        """From a valid 1-D boundaries tensor: one read-back for the host bounds; the device
        copy comes from the tensor (no host-to-device copy when it is already there)."""
        bounds = tuple(cu_seqlens.tolist())
        if torch._guards.detect_fake_mode() is not None:  # a real tensor cannot enter fake ops
            return cls.from_bounds(bounds, device)
        return cls(bounds, cu_seqlens.to(device=device, dtype=torch.int32, copy=True))


def boundary_problems(cu_seqlens: torch.Tensor, seq: int) -> list[str]:
    """Why ``cu_seqlens`` are not valid boundaries of a sequence of ``seq`` tokens (empty: valid)."""
    if cu_seqlens.dtype not in BOUNDARY_DTYPES:
        return [f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}"]
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        return [f"cu_seqlens must be 1-D with at least 2 entries (0 and S), got shape {tuple(cu_seqlens.shape)}"]
    values = cu_seqlens.tolist()
    problems = []
    if values[0] != 0:
        problems.append(f"cu_seqlens must start at 0, got {values[0]}")
    if values[-1] != seq:
        problems.append(f"cu_seqlens must end at the full sequence length {seq} (all ranks' tokens), got {values[-1]}")
    bad = next((i for i in range(1, len(values)) if values[i] <= values[i - 1]), None)
    if bad is not None:
        problems.append(
            f"cu_seqlens must be strictly increasing (no empty documents), got {values[bad - 1]} then {values[bad]} "
            f"at index {bad}"
        )
    return problems


_MODULUS = (1 << 61) - 1  # a prime: the summary's hash of the values fits an int64


def _summary(cu_seqlens: torch.Tensor, ok: bool) -> list[int]:
    """Fixed-size fingerprint of the boundaries: [ok, count, first, last, hash]. Equal
    fingerprints on all ranks mean equal boundaries (up to a 2^-61 hash collision)."""
    values = [int(x) for x in cu_seqlens.flatten().tolist()] if cu_seqlens.numel() else []
    digest = 0
    for x in values:
        digest = (digest * 1_000_003 + x) % _MODULUS
    return [int(ok), len(values), values[0] if values else -1, values[-1] if values else -1, digest]


_checked: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""boundaries tensor -> ((its version counter, group name, seq), Documents) when it passed.

Reads: once per boundaries (or positions) tensor, never once per layer, and again whenever
the tensor changes (its version counter moves). A backward may see the tensor the forward
read as another Python object viewing the same memory (AOTAutograd saves graph inputs;
before torch 2.14 it hands back a fresh alias): :func:`_cached` finds it through the tensor
it aliases. The cache holds its tensors weakly and only looks at live ones, whose memory
cannot have been reused by another tensor."""


def _cached(tensor: torch.Tensor):
    entry = _checked.get(tensor)
    if entry is not None:
        return entry
    for seen, entry in list(_checked.items()):
        if _same_view(seen, tensor):
            return entry
    return None


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same elements of the same memory, and unchanged since (aliases share the version counter)."""
    try:
        return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() != 0
                and a.storage_offset() == b.storage_offset() and a.shape == b.shape and a.stride() == b.stride()
                and a.dtype == b.dtype and a.device == b.device and a._version == b._version)
    except (RuntimeError, NotImplementedError):  # fake or functional tensors: no memory to compare
        return False


def documents_for(boundaries_or_positions: torch.Tensor, seq: int, group: dist.ProcessGroup, device: torch.device,
                  ring_group: Optional[dist.ProcessGroup] = None) -> Optional[Documents]:
    """The checked documents of a full sequence of ``seq`` tokens, raising
    UnsupportedAttention on every rank at once when any rank's are invalid or they differ
    across ranks. Every rank must call this for the same calls (as for the op itself).
    ``boundaries_or_positions``: the ``cu_seqlens`` boundaries, or, 2-D, this rank's
    ``position_ids`` shard (see :func:`documents_from_positions`)."""
    cached = _cached(boundaries_or_positions)
    key = (boundaries_or_positions._version, group.group_name, seq,
           None if ring_group is None else ring_group.group_name)
    hit = cached is not None and cached[0] == key
    if every_rank_agrees(hit, group):  # one rank's miss sends every rank through the collectives below
        return cached[1]
    if boundaries_or_positions.dim() == 2:
        documents = documents_from_positions(boundaries_or_positions, seq, group, device, ring_group)
        _checked[boundaries_or_positions] = (key, documents)
        return documents
    cu_seqlens = boundaries_or_positions
    problems = boundary_problems(cu_seqlens, seq)
    rows = values_of_every_rank(_summary(cu_seqlens, not problems), group, device)
    invalid = [rank for rank, row in enumerate(rows) if not row[0]]
    if invalid:
        detail = "; ".join(problems) if problems else "this rank's are valid"
        raise UnsupportedAttention(
            f"invalid packed-sequence boundaries (cu_seqlens) on rank(s) {invalid} of the context-parallel group: "
            f"{detail}. cu_seqlens are the cumulative document lengths over the full sequence, "
            f"e.g. [0, len_0, len_0 + len_1, ..., {seq}], int32 or int64"
        )
    if any(row != rows[0] for row in rows):
        raise UnsupportedAttention(
            "packed-sequence boundaries (cu_seqlens) differ across the context-parallel ranks "
            f"(per rank [count, first, last]: {[row[1:4] for row in rows]}; this rank's: {_preview(cu_seqlens)}); "
            "every rank must pass the boundaries of the same full sequence, not of its own shard"
        )
    documents = Documents.read(cu_seqlens, device)
    _checked[cu_seqlens] = (key, documents)
    return documents


def documents_of(boundaries_or_positions: Optional[torch.Tensor], local_seq: int, group_name: str,
                 device: torch.device, ring_group_name: str = "") -> Optional["Documents"]:
    """The checked documents the stage loops and the fused block use for a call whose shard
    holds ``local_seq`` tokens (:func:`documents_for` over the full sequence), or None for
    one sequence per batch row. ``boundaries_or_positions``: the op's ``cu_seqlens``
    argument, boundaries or 2-D position ids. ``ring_group_name``: under a ring x all-to-all
    mesh, where position ids are the layout's (one sequence) unless they restart."""
    if boundaries_or_positions is None:
        return None
    group = group_from_name(group_name)
    ring_group = group_from_name(ring_group_name) if ring_group_name else None
    seq = local_seq * group.size() * (1 if ring_group is None else ring_group.size())
    if dist.get_backend(group) == "fake" and not is_fake(boundaries_or_positions):
        # A memory estimate on fake tensors, given real boundaries (their values are data):
        # read them as real tensors; the fake group's ranks all hold these.
        with unset_fake_temporarily():
            return documents_for(boundaries_or_positions, seq, group, device, ring_group)
    return documents_for(boundaries_or_positions, seq, group, device, ring_group)


def _preview(cu_seqlens: torch.Tensor, limit: int = 8) -> str:
    values = cu_seqlens.flatten().tolist()
    return str(values) if len(values) <= limit else f"{values[:limit]}... ({len(values)} values)"


def bounds_from_positions(positions: torch.Tensor) -> list[int]:
    """Document boundaries of full-sequence ``positions [B, S]``: a document starts at 0 and
    wherever a position is not its predecessor + 1 (transformers' rule for packed rows).
    Every row must have the same boundaries; raises ValueError naming the rows otherwise."""
    starts = positions[:, 1:] != positions[:, :-1] + 1  # [B, S - 1]
    if positions.shape[0] > 1 and not bool((starts == starts[:1]).all()):
        rows = sorted({int(r) for r in torch.nonzero((starts != starts[:1]).any(dim=1)).flatten().tolist()})
        raise ValueError(f"batch rows {rows} start documents at other tokens than row 0; every row of a packed "
                         "batch must share the same document boundaries (pack one row per step)")
    bounds = [0, *(torch.nonzero(starts[0]).flatten() + 1).tolist(), positions.shape[1]]
    return bounds


def documents_from_positions(local_positions: torch.Tensor, seq: int, group: dist.ProcessGroup,
                             device: torch.device, ring_group: Optional[dist.ProcessGroup] = None
                             ) -> Optional[Documents]:
    """The documents of a packed sequence given as this rank's ``position_ids [B, S/P]``
    (restarting per document, as flash-attention users feed packed rows): one all-gather of
    the positions, so every rank derives the same boundaries from the same full sequence
    (and raises, or not, together). Positions counting straight through are one document.
    The shards' shapes are agreed first (host integers): the all-gather is sized by them.

    Under a ring x all-to-all mesh (``ring_group``) the positions are this rank's shard of the
    layout (zigzag over the ring): gathered over both groups and put back in order, so the
    layout's own positions (not monotonic on a rank) are one sequence (None: the ring runs it
    plainly) and positions that restart are packed documents over the whole sequence. ``seq``
    is then the whole sequence's length."""
    check_same_local_shape(tuple(local_positions.shape), group)
    if ring_group is not None:
        check_same_local_shape(tuple(local_positions.shape), ring_group)
    if local_positions.dtype.is_floating_point or local_positions.dtype.is_complex:
        problem = f"position_ids must be integers, got {local_positions.dtype}"
    elif local_positions.shape[1] * group.size() * (1 if ring_group is None else ring_group.size()) != seq:
        problem = (f"position_ids cover {local_positions.shape[1]} tokens on this rank, the attention's shard has "
                   f"{seq // (group.size() * (1 if ring_group is None else ring_group.size()))}")
    else:
        problem = ""
    flags = values_of_every_rank([int(bool(problem))], group, device)
    if any(row[0] for row in flags):
        raise UnsupportedAttention(f"packed-sequence position_ids refused on rank(s) "
                                   f"{[r for r, row in enumerate(flags) if row[0]]}: {problem or 'see those ranks'}")
    positions = local_positions.to(device=device, dtype=torch.int64)
    full = positions if group.size() == 1 else all_gather(positions, group, dim=1)
    if ring_group is not None:
        full = zigzag_unshard(list(all_gather(full, ring_group, dim=1).chunk(ring_group.size(), dim=1)), dim=1)
    try:
        bounds = bounds_from_positions(full)
    except ValueError as e:  # every rank holds the same full positions: all raise together
        raise UnsupportedAttention(f"packed-sequence position_ids: {e}") from None
    if ring_group is not None and len(bounds) == 2:
        return None
    return Documents.from_bounds(bounds, device)
