"""All-to-all layouts for sequence <-> head exchanges over one process group.

A rank holds a tensor ``x`` of layout ``[B, H, S_local, D]`` (its contiguous slice of the
sequence, all heads). To give every rank a few heads over the *whole* sequence, it sends
rank ``r`` the heads that ``r`` owns: the send buffer is ``[P, n, B, S_local, D]``
(destination rank outermost, so ``all_to_all_single`` splits it evenly along dim 0; n heads
per rank). After the exchange dim 0 indexes the
*source* rank, i.e. the sequence chunk, and :func:`assemble_sequence` lays the chunks end
to end. The reverse direction uses the same buffers transposed.

Only functional collectives are used, so the same code runs over gloo, NCCL and the fake
process group (under FakeTensorMode, for memory measurement).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from upipe_compile.errors import UnsupportedAttention

_c10d = torch.ops._c10d_functional


def resolve_group(cp_mesh: DeviceMesh | dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The process group that context parallelism runs over."""
    if isinstance(cp_mesh, DeviceMesh):
        if cp_mesh.ndim != 1:
            raise UnsupportedAttention(
                f"cp_mesh must be a 1-D DeviceMesh here, got {cp_mesh.ndim} dims "
                f"{cp_mesh.mesh_dim_names}; pass the context-parallel sub-mesh, e.g. mesh['cp'] (a 2-D "
                f"{RING_MESH_DIMS} mesh, ring x all-to-all, is taken by upipe_attention, upipe_attention_block, "
                f"backend='upipe' and the shard_sequence helpers, not here yet)"
            )
        return cp_mesh.get_group()
    if isinstance(cp_mesh, dist.ProcessGroup):
        return cp_mesh
    if cp_mesh is not None:
        raise UnsupportedAttention(
            f"cp_mesh must be a DeviceMesh, a ProcessGroup or None, got {type(cp_mesh).__name__}"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise UnsupportedAttention(
            "no process group: call torch.distributed.init_process_group(...) before the first "
            "compiled call, or pass options={'cp_mesh': init_device_mesh(...)}"
        )
    return dist.group.WORLD


RING_MESH_DIMS = ("cp_ring", "cp_a2a")
"""The dimension names of a two-dimensional context-parallel mesh: a ring of R ranks (meant
to span nodes) by an all-to-all of A ranks (meant to lie within a node)."""


def resolve_groups(cp_mesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """``(all-to-all group, ring group or None)``: a 2-D mesh named :data:`RING_MESH_DIMS`
    gives both; anything :func:`resolve_group` takes gives its group and no ring."""
    if isinstance(cp_mesh, DeviceMesh) and cp_mesh.ndim == 2:
        if tuple(cp_mesh.mesh_dim_names or ()) != RING_MESH_DIMS:
            raise UnsupportedAttention(
                f"a 2-D cp_mesh is ring x all-to-all and must name its dimensions {RING_MESH_DIMS} (ring across "
                f"nodes, all-to-all within a node), got {cp_mesh.mesh_dim_names}: "
                f"init_device_mesh(device, (R, A), mesh_dim_names={RING_MESH_DIMS}); for one context-parallel "
                f"dimension pass a 1-D DeviceMesh, e.g. mesh['cp']"
            )
        return cp_mesh[RING_MESH_DIMS[1]].get_group(), cp_mesh[RING_MESH_DIMS[0]].get_group()
    return resolve_group(cp_mesh), None


def group_from_name(group_name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(group_name)


def pack_heads(x: torch.Tensor, head_index: torch.Tensor, world: int) -> torch.Tensor:
    """The send buffer ``[P, n, B, S_local, D]`` holding the heads ``head_index`` (``n`` per
    destination rank, in rank order) of the local ``[B, H, S_local, D]`` tensor ``x``:
    one gather, whose rank-major rows are already the send layout."""
    send = torch.index_select(x.transpose(0, 1), 0, head_index)
    return send.view(world, -1, *send.shape[1:])


def all_to_all(send: torch.Tensor, group_name: str) -> torch.Tensor:
    """Blocking even all-to-all along dim 0 (dim 0 is the world size)."""
    return _c10d.wait_tensor(start_all_to_all(send, group_name))


def start_all_to_all(send: torch.Tensor, group_name: str) -> torch.Tensor:
    """Launch an even all-to-all; pass the result to :func:`wait` before reading it."""
    splits = [1] * send.shape[0]
    return _c10d.all_to_all_single(send, splits, splits, group_name)


def wait(t: torch.Tensor) -> torch.Tensor:
    return _c10d.wait_tensor(t)


def all_gather(t: torch.Tensor, group: dist.ProcessGroup, dim: int = 0) -> torch.Tensor:
    """Every rank's ``t`` concatenated along ``dim`` (blocking)."""
    first = t.movedim(dim, 0).contiguous()
    gathered = wait(_c10d.all_gather_into_tensor(first, group.size(), group.group_name))
    return gathered.movedim(0, dim)


def assemble_sequence(recv: torch.Tensor, reuse: torch.Tensor | None = None) -> torch.Tensor:
    """A received ``[P, n, B, S_local, D]`` (dim 0 = sequence chunk) as ``[B, n, P * S_local, D]``.
    With one head and batch 1 (U = P, the long-context case) the chunks already lie end to
    end: the received tensor itself, no copy. Otherwise they are copied into ``reuse`` (a
    previous stage's buffer of that shape; allocated when None)."""
    world, n, batch, s_local, d = recv.shape
    if n * batch == 1:
        return recv.view(1, 1, world * s_local, d)
    if reuse is None:
        reuse = recv.new_empty((batch, n, world * s_local, d))
    reuse.view(batch, n, world, s_local, d).copy_(recv.permute(2, 1, 0, 3, 4))
    return reuse


def split_sequence(full: torch.Tensor, world: int) -> torch.Tensor:
    """Inverse of :func:`assemble_sequence`: ``[B, n, P * S_local, D]`` into a send buffer
    ``[P, n, B, S_local, D]`` (dim 0 = destination rank = sequence chunk)."""
    batch, n, seq, d = full.shape
    return full.view(batch, n, world, seq // world, d).permute(2, 1, 0, 3, 4).contiguous()


def scatter_heads_back(recv: torch.Tensor, head_index: torch.Tensor, dest: torch.Tensor, accumulate: bool) -> None:
    """Write a received ``[P, n, B, S_local, D]`` (dim 0 = source rank, which computed the
    heads ``head_index[r*n:(r+1)*n]``) into the local ``dest`` ``[B, H, S_local, D]``.
    ``accumulate`` sums heads that appear more than once (replicated KV heads)."""
    world, n = recv.shape[:2]
    rows = recv.reshape(world * n, *recv.shape[2:])
    heads_first = dest.transpose(0, 1)
    if accumulate:
        heads_first.index_add_(0, head_index, rows)
    else:
        heads_first.index_copy_(0, head_index, rows)


def values_of_every_rank(values, group: dist.ProcessGroup, device: torch.device) -> list[list[int]]:
    """Every rank's list of ``len(values)`` integers, by rank (one tiny all-gather and a
    read-back to the host: a host sync, for checks made once, not per call). The fake group
    of memory measurements exchanges no data: every rank is taken to hold this rank's values."""
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    if group.size() == 1 or dist.get_backend(group) == "fake":
        return [mine.tolist()] * group.size()
    return all_gather(mine, group).view(group.size(), -1).tolist()


_host_groups: dict[str, dist.ProcessGroup] = {}


def host_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A group over ``group``'s ranks whose collectives take host tensors: ``group`` itself
    when it has a CPU backend (gloo, or "cpu:gloo,cuda:nccl"), else a gloo twin made on the
    first call. Every member makes that first call together (it is the first upipe op of the
    step on every rank), so the twin is created collectively; non-members need not join."""
    if "gloo" in str(dist.get_backend(group)):
        return group
    twin = _host_groups.get(group.group_name)
    if twin is None:
        twin = dist.new_group(dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True)
        _host_groups[group.group_name] = twin
    return twin


def host_values_of_every_rank(values, group: dist.ProcessGroup) -> list[list[int]]:
    """Every rank's list of ``len(values)`` integers, by rank, all-gathered as host integers
    over :func:`host_group`: on CUDA it neither waits for nor launches device work, so it can
    run on every call. Every rank must pass the same count. The fake group of memory
    measurements exchanges no data: every rank is taken to hold this rank's values."""
    mine = torch.tensor(list(values), dtype=torch.int64)
    if group.size() == 1 or dist.get_backend(group) == "fake":
        return [mine.tolist()] * group.size()
    rows = torch.empty((group.size(), mine.numel()), dtype=torch.int64)
    dist.all_gather(list(rows.unbind()), mine, group=host_group(group))
    return rows.tolist()


def every_rank_agrees(flag: bool, group: dist.ProcessGroup) -> bool:
    """Whether ``flag`` is true on every rank (a host all-gather): a cache hit is used only
    when it is a hit everywhere, so no rank skips a collective that another rank enters."""
    return all(row[0] for row in host_values_of_every_rank([int(flag)], group))


_SHAPE_SLOTS = 6


def check_same_local_shape(shape: tuple[int, ...], group: dist.ProcessGroup) -> None:
    """Refuse, on every rank at once, shards whose shapes differ across ranks.

    An even all-to-all over shards of different lengths would silently pair the wrong
    chunks or hang; one tiny all-gather of the shapes turns that into a clear error. It runs
    on every call (host integers, :func:`host_values_of_every_rank`): a check skipped on
    ranks that saw their shape before while another rank (whose shape is new) waits in it
    would hang."""
    # One fixed length for every caller: ranks whose graphs differ (the plain loop on one, the
    # fused block on another, after a recompile on one rank only) still meet in one all-gather.
    padded = list(shape) + [-1] * (_SHAPE_SLOTS - len(shape))
    rows = host_values_of_every_rank(padded, group)
    if any(row != padded for row in rows):
        shapes = [[size for size in row if size >= 0] for row in rows]
        raise UnsupportedAttention(
            "UPipe needs every rank to hold an equal, contiguous shard of the sequence "
            f"(and equal batch/heads/head_dim); local shapes per rank: {shapes}. "
            "Pad the sequence to a multiple of the context-parallel size before sharding "
            "(upipe_compile.shard_sequence refuses uneven lengths)."
        )
