"""Ring attention over the R ranks of a ring group: exact attention of each rank's queries
against the whole sequence, with K/V passed around the ring one rank's share at a time and
the partial outputs merged by their log-sum-exp. The ring dimension of a two-dimensional
(ring x all-to-all) context-parallel layout: each UPipe stage's attention over the ring.

Layout ("zigzag", for causal load balance): the sequence is cut into 2R equal chunks and ring
rank ``r`` holds chunks ``r`` and ``2R - 1 - r``, concatenated, so every rank has the same
amount of causal work. :func:`zigzag_chunks` names them; :func:`zigzag_shard` and
:func:`zigzag_unshard` cut a full-sequence tensor into a rank's share and put the shares back.
A sliding window (global positions) is shifted to each chunk pair by :func:`_band`. Packed
documents are cut to each chunk pair by :func:`_document_pairs`, with the window and softcap.
ALiBi's bias depends on the global ``i - j``; a call whose rows and keys end at different
global positions is cut by :func:`_alibi_parts` into calls where the kernel's own bias is the
true one up to a per-head constant, added to their log-sum-exp.

Shapes as :mod:`upipe_compile.attention.kernels`: q ``[B, Hq, s, D]``, k/v ``[B, Hkv, s, D]``
(``Hkv`` divides ``Hq``), ``s`` this rank's tokens (two chunks of ``s / 2``); ``lse`` is
``[B, Hq, s]`` float32. Every kernel call pairs one query chunk with one key chunk of the
same length (or equal row ranges of them, under a window): a later key chunk is skipped
under causal attention, the same chunk is causal, an earlier one is attended in full. Under
packed documents a call against another chunk takes the one document crossing both, whose
rows and keys can differ in number (the kernels align the window at the last of each).

Backward: each K/V share travels the ring again with an accumulator of its dK/dV (in K/V's
dtype), which every rank adds its queries' part to in fp32; after R steps the accumulator
is one hop from home and is sent there. Every exchange is started before the kernels it can run under and
finished after them (:class:`_Exchange`). The kernels' backward takes the final output and log-sum-exp, so
each chunk pair's gradient is exact without the partial outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from upipe_compile.attention import kernels
from upipe_compile.attention.zigzag import zigzag_chunks
from upipe_compile.attention.document_boundaries import Documents


@dataclass(frozen=True)
class PairBand:
    """One kernel call of a chunk pair: this rank's query chunk ``qi`` (0 or 1) against the
    held share's key chunk ``kj``, over query rows ``rows`` and key rows ``keys`` of the
    two chunks (equal lengths), with the kernel's ``window`` in those rows' own indices
    (causal attention is the window ``(-1, 0)``; the kernels run each window in its
    plainest form)."""

    qi: int
    kj: int
    rows: slice
    keys: slice
    window: tuple[int, int]


def _band(q_chunk: int, k_chunk: int, chunk: int, is_causal: bool, window: tuple[int, int]):
    """Query chunk ``q_chunk`` against key chunk ``k_chunk`` (``chunk`` tokens each): None when
    no key is visible, else ``(rows, keys, window)``. Query i and key j (chunk-local) see each
    other when ``lo <= j - i <= hi``: the global window shifted by the chunks' distance. A
    band wholly right (left) of the diagonal is moved onto it by dropping the rows that see
    nothing and the keys no row sees, so every call is a square the kernels take."""
    distance = (q_chunk - k_chunk) * chunk
    left, right = window
    lo = -(chunk - 1) if left < 0 else max(distance - left, -(chunk - 1))
    hi = chunk - 1 if right < 0 else min(distance + right, chunk - 1)
    if is_causal:
        hi = min(hi, distance)
    if lo > hi:
        return None
    if lo > 0:  # keys only right of the diagonal: rows [0, chunk - lo) against keys [lo, chunk)
        return slice(0, chunk - lo), slice(lo, chunk), (0, hi - lo)
    if hi < 0:  # keys only left of it: rows [-hi, chunk) against keys [0, chunk + hi)
        return slice(-hi, chunk), slice(0, chunk + hi), (hi - lo, 0)
    return slice(0, chunk), slice(0, chunk), (-lo, hi)


def _visible_pairs(rank: int, source: int, ring: int, chunk: int, is_causal: bool,
                   window: tuple[int, int] = (-1, -1)) -> Iterator[PairBand]:
    """Each kernel call between this rank's query chunks and ``source``'s key chunks that has
    any visible key."""
    for qi, q_chunk in enumerate(zigzag_chunks(rank, ring)):
        for kj, k_chunk in enumerate(zigzag_chunks(source, ring)):
            band = _band(q_chunk, k_chunk, chunk, is_causal, window)
            if band is not None:
                yield PairBand(qi, kj, *band)


@dataclass(frozen=True)
class DocumentPair:
    """One kernel call of a chunk pair under packed documents: query rows ``rows`` of this
    rank's chunk ``qi`` against key rows ``keys`` of the held share's chunk ``kj``. A chunk
    against itself: causal (or not) within ``documents`` (None: one document) with the
    global ``window``. Against another chunk: the one document both touch, its rows against
    its keys under ``window`` counted from the last row and the last key (the kernels'
    convention for unequal lengths)."""

    qi: int
    kj: int
    rows: slice
    keys: slice
    is_causal: bool
    window: tuple[int, int]
    documents: Optional[Documents]


def _document_pairs(rank: int, source: int, ring: int, chunk: int, is_causal: bool, window: tuple[int, int],
                    documents: Documents) -> Iterator[DocumentPair]:
    """Each kernel call between this rank's query chunks and ``source``'s key chunks with packed
    ``documents`` (bounds over the whole sequence): a chunk against itself with the documents
    cut to it; against another chunk, the document that crosses from one to the other (at
    most one can), cut to the rows and keys its window lets see each other."""
    for qi, q_chunk in enumerate(zigzag_chunks(rank, ring)):
        for kj, k_chunk in enumerate(zigzag_chunks(source, ring)):
            if is_causal and k_chunk > q_chunk:
                continue
            q0, k0 = q_chunk * chunk, k_chunk * chunk
            if q_chunk == k_chunk:
                yield DocumentPair(qi, kj, slice(0, chunk), slice(0, chunk), is_causal, window,
                                   _cut(documents, q0, q0 + chunk))
                continue
            for start, end in documents.spans:
                rows = (max(start, q0) - q0, min(end, q0 + chunk) - q0)
                keys = (max(start, k0) - k0, min(end, k0 + chunk) - k0)
                if rows[0] < rows[1] and keys[0] < keys[1]:
                    call = _windowed_rectangle(rows, keys, q0 - k0, is_causal, window)
                    if call is not None:
                        call_rows, call_keys, call_window = call
                        yield DocumentPair(qi, kj, call_rows, call_keys, False, call_window, None)


def _windowed_rectangle(rows: tuple[int, int], keys: tuple[int, int], distance: int, is_causal: bool,
                        window: tuple[int, int]):
    """Query rows ``[r0, r1)`` of a chunk against key rows ``[c0, c1)`` of a chunk ``distance``
    tokens before it (negative: after): query i sees key j when ``lo <= j - i <= hi``, the
    global window shifted by the distance. None when no key is visible, else ``(rows, keys,
    window)`` cut to the rows that see a key and the keys some row sees, the window counted
    from the last row and last key: the first row then sees from the first key, the last row
    up to the last key, so both edges are >= 0."""
    left, right = window
    lo = None if left < 0 else distance - left
    hi = None if right < 0 else distance + right
    if is_causal:
        hi = distance if hi is None else min(hi, distance)
    (r0, r1), (c0, c1) = rows, keys
    if hi is not None:
        r0 = max(r0, c0 - hi)
    if lo is not None:
        r1 = min(r1, c1 - lo)
    if r0 >= r1:
        return None
    if lo is not None:
        c0 = max(c0, r0 + lo)
    if hi is not None:
        c1 = min(c1, r1 + hi)
    if c0 >= c1:
        return None
    return slice(r0, r1), slice(c0, c1), (-1 if lo is None else c1 - r1 - lo, -1 if hi is None else hi - c1 + r1)


def _cut(documents: Documents, start: int, end: int) -> Optional[Documents]:
    """The documents within tokens ``[start, end)``, counted from ``start`` (None: one)."""
    bounds = [0, *(b - start for b in documents.bounds if start < b < end), end - start]
    return None if len(bounds) == 2 else Documents.from_bounds(bounds, documents.cu_seqlens.device)


def _calls(rank: int, source: int, ring: int, chunk: int, is_causal: bool, window, documents):
    """``(qi, kj, rows, keys, is_causal, window, documents)`` of each kernel call of a step."""
    if documents is None:
        for pair in _visible_pairs(rank, source, ring, chunk, is_causal, window):
            yield pair.qi, pair.kj, pair.rows, pair.keys, False, pair.window, None
    else:
        for pair in _document_pairs(rank, source, ring, chunk, is_causal, window, documents):
            yield pair.qi, pair.kj, pair.rows, pair.keys, pair.is_causal, pair.window, pair.documents


@dataclass(frozen=True)
class AlibiPart:
    """One kernel call of a chunk pair's call under ALiBi: its rows ``rows`` (of the call's),
    all its keys, ``is_causal`` and ``window`` in those rows' and keys' indices, the slopes the
    kernel takes and the per-head constant (None: 0) that turns the kernel's log-sum-exp into
    the true one."""

    rows: slice
    is_causal: bool
    window: tuple[int, int]
    slopes: Optional[torch.Tensor]
    constant: Optional[torch.Tensor]


def _alibi_parts(q_start: int, k_start: int, rows: int, keys: int, is_causal: bool, window: tuple[int, int],
                 slopes: Optional[torch.Tensor], queries_after_keys: bool) -> Iterator[AlibiPart]:
    """The kernel calls that run a call of ``rows`` queries from global position ``q_start``
    against ``keys`` keys from ``k_start`` (its ``is_causal`` / ``window`` counted from the last
    row and key, as the kernels count them) with ALiBi's true bias ``-slope * |I - J|``.

    A kernel adds ``-m * |κ|``, ``κ = i + (keys - rows) - j``; globally ``I - J = κ + D`` with
    ``D`` the distance between the call's last row and last key. ``D = 0`` (a chunk against
    itself): the kernel's bias is the true one, one call. Otherwise the call pairs two chunks,
    so ``I - J`` has one sign ``s`` (+1: the queries come after the keys) on all of it, and
    the true bias is linear, ``-slope * s * (κ + D)``; a kernel gives that where ``κ`` keeps
    one sign ``σ``, with slopes ``m = slope * s * σ``, up to the constant ``-slope * s * D``.
    A call whose visible ``κ`` takes both signs runs as two: ``κ >= 0`` (the call's causal part,
    window ``(left, 0)``) and ``κ < 0``, which without its last row (it sees no key there) is
    ``κ + 1 <= 0``, window ``(0, right - 1)``; each keeps only the rows that see a key."""
    distance = (q_start + rows) - (k_start + keys)
    if slopes is None or distance == 0:
        yield AlibiPart(slice(0, rows), is_causal, window, slopes, None)
        return
    sign = 1.0 if queries_after_keys else -1.0
    left, right = window
    if is_causal:
        right = 0
    shift = keys - rows

    def part(first: int, last: int, call_window, sigma: float) -> AlibiPart:
        call_distance = (q_start + last) - (k_start + keys)
        return AlibiPart(slice(first, last), False, call_window, slopes * (sign * sigma),
                         slopes * (-sign * call_distance))

    if right == 0:  # every visible key has κ >= 0
        yield part(0, rows, (left, 0), 1.0)
    elif left == 0:  # every visible key has κ <= 0
        yield part(0, rows, (0, right), -1.0)
    else:
        first = max(0, -shift)  # rows before it have no key with κ >= 0
        if first < rows:
            yield part(first, rows, (left, 0), 1.0)
        first = max(0, -shift - right) if right >= 0 else 0  # rows before it see no key right of κ = 0
        if first < rows - 1:
            yield part(first, rows - 1, (0, right - 1 if right > 0 else -1), -1.0)


class _Exchange:
    """A started ring exchange: each of ``sends`` to the next ring rank, ``recvs`` from the
    previous. Started before a step's kernels and finished after them, so the transfer runs
    while they do: on NCCL the send/receive run on the process group's own stream and
    :meth:`finish` only makes the compute stream wait for it (no host block); on gloo they run
    on its background threads. The send tensors must stay untouched until :meth:`finish`."""

    def __init__(self, sends: list[torch.Tensor], recvs: list[torch.Tensor], group: dist.ProcessGroup):
        rank, ring = group.rank(), group.size()
        ops = [dist.P2POp(dist.isend, t, group=group, group_peer=(rank + 1) % ring) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=(rank - 1) % ring) for t in recvs]
        self.sends, self.recvs = sends, recvs
        self.works = dist.batch_isend_irecv(ops)

    def finish(self) -> list[torch.Tensor]:
        """The received tensors, once they have landed."""
        for work in self.works:
            work.wait()
        self.works, self.sends = [], []
        return self.recvs


def _pass_on(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> _Exchange:
    """Start sending ``tensors`` to the next ring rank while receiving their likes from the previous."""
    return _Exchange(tensors, [torch.empty_like(t) for t in tensors], group)


def _merge(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold one chunk pair's (output, log-sum-exp) into the running fp32 ones, in place."""
    merged = torch.logaddexp(lse, part_lse)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1)).add_(part_out.float() * torch.exp(part_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


def _parts(rank: int, source: int, ring: int, chunk: int, is_causal: bool, window, documents, slopes):
    """``(qi, kj, rows, keys, is_causal, window, documents, slopes, constant)`` of each kernel
    call of a step: :func:`_calls`, each cut for ALiBi by :func:`_alibi_parts` (one call
    without ALiBi)."""
    for qi, kj, rows, keys, causal, band, docs in _calls(rank, source, ring, chunk, is_causal, window, documents):
        q_chunk, k_chunk = zigzag_chunks(rank, ring)[qi], zigzag_chunks(source, ring)[kj]
        for part in _alibi_parts(q_chunk * chunk + rows.start, k_chunk * chunk + keys.start, rows.stop - rows.start,
                                 keys.stop - keys.start, causal, band, slopes, q_chunk > k_chunk):
            if part.constant is not None and docs is not None:  # only a chunk against itself has documents
                raise AssertionError("a chunk pair with packed documents needs no ALiBi cut")
            part_rows = slice(rows.start + part.rows.start, rows.start + part.rows.stop)
            yield qi, kj, part_rows, keys, part.is_causal, part.window, docs, part.slopes, part.constant


def _per_row(constant: torch.Tensor) -> torch.Tensor:
    """A per-head constant ``[H]`` broadcast over a log-sum-exp ``[B, H, rows]``."""
    return constant[None, :, None]


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: Optional[float],
                 group: dist.ProcessGroup, softcap: float = 0.0, window: tuple[int, int] = (-1, -1),
                 documents: Optional[Documents] = None,
                 alibi_slopes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of this rank's zigzag share of the queries against the whole ring's keys.
    The next step's K/V share is on its way while this step's chunk pairs run. ``documents``:
    packed documents' bounds over the whole sequence (attention stays inside each).
    ``alibi_slopes``: the heads' ALiBi slopes (float32 ``[Hq]``), positions global."""
    rank, ring = group.rank(), group.size()
    if q.shape[2] % 2:
        raise ValueError(f"a ring rank's share must hold two equal chunks; it has {q.shape[2]} tokens")
    q_parts = q.chunk(2, dim=2)
    out = [torch.zeros(p.shape, dtype=torch.float32, device=q.device) for p in q_parts]
    lse = [torch.full(p.shape[:3], float("-inf"), dtype=torch.float32, device=q.device) for p in q_parts]
    kv = [k.contiguous(), v.contiguous()]  # sent as they are: a stage's K/V may be a head slice
    for step in range(ring):
        source = (rank - step) % ring
        incoming = _pass_on(kv, group) if step + 1 < ring else None
        k_parts, v_parts = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
        for qi, kj, rows, keys, causal, band, docs, slopes, constant in _parts(
                rank, source, ring, q_parts[0].shape[2], is_causal, window, documents, alibi_slopes):
            part_out, part_lse = kernels.forward(q_parts[qi][:, :, rows], k_parts[kj][:, :, keys],
                                                 v_parts[kj][:, :, keys], causal, scale, docs, window=band,
                                                 softcap=softcap, alibi_slopes=slopes)
            if constant is not None:
                part_lse = part_lse + _per_row(constant)
            _merge(out[qi][:, :, rows], lse[qi][:, :, rows], part_out, part_lse)
        del k_parts, v_parts
        if incoming is not None:
            kv = incoming.finish()
    return torch.cat(out, dim=2).to(q.dtype), torch.cat(lse, dim=2)


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, is_causal: bool, scale: Optional[float], group: dist.ProcessGroup,
                  softcap: float = 0.0, window: tuple[int, int] = (-1, -1), documents: Optional[Documents] = None,
                  alibi_slopes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of this rank's share, from what :func:`ring_forward` returned.

    Each step: the next K/V share is received while this one's chunk pairs run (their dK/dV
    summed into a fresh fp32 buffer); only then is the share's travelling dK/dV accumulator
    awaited, added and the sum passed on, so that exchange runs under the next step's kernels.
    After R steps each accumulator has visited every rank and goes one more hop, home."""
    rank, ring = group.rank(), group.size()
    q_parts, dout_parts, out_parts = (t.chunk(2, dim=2) for t in (q, dout, out))
    lse_parts = lse.chunk(2, dim=2)
    dq = [torch.zeros(p.shape, dtype=torch.float32, device=q.device) for p in q_parts]
    kv = [k.contiguous(), v.contiguous()]
    travelling: Optional[_Exchange] = None  # the accumulator of the share held now, on its way here
    for step in range(ring):
        source = (rank - step) % ring
        incoming = _pass_on(kv, group) if step + 1 < ring else None
        part = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
        k_parts, v_parts = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
        dk_parts, dv_parts = part[0].chunk(2, dim=2), part[1].chunk(2, dim=2)
        for qi, kj, rows, keys, causal, band, docs, slopes, constant in _parts(
                rank, source, ring, q_parts[0].shape[2], is_causal, window, documents, alibi_slopes):
            part_lse = lse_parts[qi][:, :, rows]
            part_lse = part_lse.contiguous() if constant is None else part_lse - _per_row(constant)
            dq_part, dk_part, dv_part = kernels.backward(
                dout_parts[qi][:, :, rows], q_parts[qi][:, :, rows], k_parts[kj][:, :, keys],
                v_parts[kj][:, :, keys], out_parts[qi][:, :, rows], part_lse, causal,
                scale, docs, window=band, softcap=softcap, alibi_slopes=slopes)
            dq[qi][:, :, rows].add_(dq_part)
            dk_parts[kj][:, :, keys].add_(dk_part)
            dv_parts[kj][:, :, keys].add_(dv_part)
        del k_parts, v_parts, dk_parts, dv_parts
        if travelling is not None:
            part.add_(travelling.finish()[0])
        if ring == 1:  # a ring of one: the share never leaves home
            dkv = part
            break
        # On to the rank that holds this share next (or home), in K/V's dtype: each hop's sum
        # is exact in fp32 and rounded once, and the two buffers in flight under the next
        # step's kernels are half the size (at 24M tokens on 4 x 8 ranks: 6 GiB, not 12).
        travelling = _pass_on([part.to(k.dtype)], group)
        del part
        if incoming is not None:
            kv = incoming.finish()
    else:
        dkv = travelling.finish()[0]
    return torch.cat(dq, dim=2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)
