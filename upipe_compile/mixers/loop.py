"""The mixer stage loops (plain functions of tensors, no autograd of their own): the loop's
forward and backward over head stages with their all-to-alls, the mixer over the whole sequence
(once per packed document), and the recompute that gives a stage's gradients. The custom ops of
:mod:`upipe_compile.mixers.ops` run them; tests and benchmarks call them directly."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from upipe_compile.attention.collectives import all_to_all, group_from_name
from upipe_compile.mixers.registry import TensorDims


@contextlib.contextmanager
def _autograd_below_the_op():
    """A custom op's implementation runs with autograd's dispatch keys excluded; the backward
    ops recompute the mixer under autograd, so they lift that exclusion for the recompute."""
    with contextlib.ExitStack() as stack:
        for key in (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView):
            stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(key, False))
        yield


def recompute_grads(spec, implementation, tensors, options, dout, bounds=None) -> list:
    """Gradients of ``sum(mixer(tensors) * dout)`` for the floating-point tensors."""
    leaves = [t.detach().requires_grad_(True) if t is not None and t.is_floating_point() else t for t in tensors]
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    with torch.enable_grad(), _autograd_below_the_op():
        out = run_mixer(spec, implementation, leaves, options, bounds)
        grads = torch.autograd.grad(out, wanted, dout, allow_unused=True)
    found = iter(grads)
    return [next(found) if t is not None and t.requires_grad else None for t in leaves]


def loop_forward(spec, implementation, full: list, settings: dict, group_name: str, world: int,
                 stages: int, bounds: Optional[list[int]] = None) -> torch.Tensor:
    """The stage loop's forward (no autograd): the mixer's output on this rank's shard."""
    out = spec.output_like(full)
    per_rank = _heads(spec, full) // (world * stages)
    for stage in range(stages):
        start = stage * world * per_rank
        chunk = _stage_inputs(spec, full, start, per_rank, world, group_name)
        with torch.no_grad():
            result = run_mixer(spec, implementation, chunk, settings, bounds)
        _to_sequence_into(result, spec.output, out, start, per_rank, world, group_name)
    return out


def loop_backward(spec, implementation, full: list, settings: dict, group_name: str, world: int, stages: int,
                  dout: torch.Tensor, bounds: Optional[list[int]] = None) -> list:
    """The stage loop's backward: gradients of ``full``'s floating-point tensors (None elsewhere)."""
    grads = [torch.zeros_like(t) if t is not None and t.is_floating_point() else None for t in full]
    per_rank = _heads(spec, full) // (world * stages)
    for stage in range(stages):
        start = stage * world * per_rank
        chunk = _stage_inputs(spec, full, start, per_rank, world, group_name)
        dout_chunk = _to_heads(dout.contiguous(), spec.output, start, per_rank, world, group_name)
        chunk_grads = recompute_grads(spec, implementation, chunk, settings, dout_chunk, bounds)
        heads = _heads(spec, full)
        for layout, grad, total in zip(spec.inputs, chunk_grads, grads):
            if grad is None or total is None:
                continue
            if layout.seq is None:  # this rank's heads of a parameter
                total.narrow(layout.head, start + _rank(group_name) * per_rank, per_rank).add_(grad)
            elif layout.head is None:  # every rank's share of the whole sequence, summed
                total.add_(_reduce_scatter_sequence(grad, layout.seq, world, group_name))
            elif layout.grouped:  # back as each rank's group rows, summed into the groups
                index, rows = _group_rows(heads, total.shape[layout.head], start, per_rank, world, total.device)
                shape = list(total.shape)
                shape[layout.head] = world * rows
                per_row = total.new_zeros(shape)
                _to_sequence_into(grad, layout, per_row, 0, rows, world, group_name)
                total.index_add_(layout.head, index, per_row)
            else:
                _to_sequence_into(grad, layout, total, start, per_rank, world, group_name)
    return grads


# --- documents ------------------------------------------------------------------------------
def document_bounds(documents: Optional[torch.Tensor]) -> Optional[list[int]]:
    """Document boundaries over the full sequence as host integers (one read per call), or None."""
    return None if documents is None else [int(b) for b in documents.tolist()]


def run_mixer(spec, implementation, tensors: list, settings: dict, bounds: Optional[list[int]]) -> torch.Tensor:
    """The mixer over the full sequence; with packed documents (``bounds``, batch 1), once per
    document, so that a conv's window and a scan's state restart at each one."""
    if bounds is None or len(bounds) <= 2:
        return spec.call(implementation, tensors, settings)
    pieces = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            part = [t if t is None or layout.seq is None else t.narrow(layout.seq, a, b - a)
                    for layout, t in zip(spec.inputs, tensors)]
            pieces.append(spec.call(implementation, part, settings))
    return torch.cat(pieces, dim=spec.output.seq)


# --- layouts --------------------------------------------------------------------------------
def _heads(spec, tensors) -> int:
    return tensors[spec.head_input].shape[spec.inputs[spec.head_input].head]


def _rank(group_name: str) -> int:
    return group_from_name(group_name).rank()


def _stage_inputs(spec, tensors, start, per_rank, world, group_name) -> list:
    """This rank's ``per_rank`` heads of the stage starting at head ``start``: activations over
    the whole sequence, parameters sliced."""
    chunk = []
    heads = _heads(spec, tensors)
    for layout, t in zip(spec.inputs, tensors):
        if t is None:
            chunk.append(None)
        elif layout.seq is None:
            chunk.append(t.narrow(layout.head, start + _rank(group_name) * per_rank, per_rank))
        elif layout.head is None:
            chunk.append(_gather_sequence(t, layout.seq, world, group_name))
        elif layout.grouped:  # each rank gets the groups its heads share
            index, rows = _group_rows(heads, t.shape[layout.head], start, per_rank, world, t.device)
            chunk.append(_to_heads(t.index_select(layout.head, index), layout, 0, rows, world, group_name))
        else:
            chunk.append(_to_heads(t, layout, start, per_rank, world, group_name))
    return chunk


def _group_rows(heads: int, groups: int, start: int, per_rank: int, world: int, device) -> tuple[torch.Tensor, int]:
    """The rows of a grouped tensor each rank needs for its ``per_rank`` heads of the stage that
    starts at head ``start`` (groups are shared by consecutive heads), as one index over the
    ranks in order, and how many rows each rank gets. Where a rank's heads cover whole groups,
    or lie in one, it gets just those groups (the mixer repeats them to its heads, as it does
    for all of them); otherwise one row per head."""
    shared_by = heads // groups
    firsts = torch.arange(world, device=device) * per_rank + start  # each rank's first head
    if per_rank % shared_by == 0:
        rows = per_rank // shared_by
        index = firsts[:, None] // shared_by + torch.arange(rows, device=device)
    elif shared_by % per_rank == 0:
        rows, index = 1, firsts[:, None] // shared_by
    else:
        rows = per_rank
        index = (firsts[:, None] + torch.arange(rows, device=device)) // shared_by
    return index.reshape(-1), rows


def _gather_sequence(x: torch.Tensor, seq: int, world: int, group_name: str) -> torch.Tensor:
    """This rank's shard of a tensor every head shares -> the whole sequence, on every rank."""
    recv = all_to_all(x.unsqueeze(0).expand(world, *x.shape).contiguous(), group_name)  # dim 0: source rank
    y = recv.movedim(0, seq)  # [..., rank, S_local, ...]
    return y.reshape(*y.shape[:seq], -1, *y.shape[seq + 2:])


def _reduce_scatter_sequence(grad: torch.Tensor, seq: int, world: int, group_name: str) -> torch.Tensor:
    """Inverse of :func:`_gather_sequence` for gradients: every rank's contribution to this
    rank's shard, summed."""
    t = grad.reshape(*grad.shape[:seq], world, -1, *grad.shape[seq + 1:])
    recv = all_to_all(t.movedim(seq, 0).contiguous(), group_name)  # dim 0: the rank that computed it
    return recv.sum(0)


def _to_heads(x: torch.Tensor, layout: TensorDims, start: int, per_rank: int, world: int, group_name: str):
    """Local ``x`` (this rank's sequence shard, all heads) -> heads ``[start + r*n, start + (r+1)*n)``
    over the whole sequence on rank ``r``."""
    heads, seq = layout.head, layout.seq
    send = x.narrow(heads, start, world * per_rank).movedim(heads, 0)
    send = send.reshape(world, per_rank, *send.shape[1:]).contiguous()
    recv = all_to_all(send, group_name)  # dim 0: the source rank = the sequence chunk
    k = seq - (1 if seq > heads else 0)  # the sequence's place among the other dims
    y = recv.movedim(0, 1 + k)  # [n, ..., chunk, S_local, ...]
    y = y.reshape(*y.shape[:1 + k], -1, *y.shape[3 + k:])
    return y.movedim(0, heads)


def _to_sequence_into(y: torch.Tensor, layout: TensorDims, dest: torch.Tensor, start: int, per_rank: int, world: int,
                      group_name: str) -> None:
    """Inverse of :func:`_to_heads`, written into ``dest``'s heads ``[start, start + world*n)``."""
    heads, seq = layout.head, layout.seq
    k = seq - (1 if seq > heads else 0)
    t = y.movedim(heads, 0)
    t = t.reshape(*t.shape[:1 + k], world, -1, *t.shape[2 + k:])  # split the sequence into chunks
    send = t.movedim(1 + k, 0).contiguous()  # [dest rank, n, ...]
    recv = all_to_all(send, group_name)  # dim 0: the rank that computed these heads
    rows = recv.reshape(world * per_rank, *recv.shape[2:]).movedim(0, heads)
    dest.narrow(heads, start, world * per_rank).copy_(rows)
