"""The node's host memory as a budget for offloaded activations (like the estimate's GPU
budget, ``upipe_compile/estimate/gpu.py``): the figures, what this node's ranks may use (read
from MemTotal and the cgroup's limit), the reserve kept for everything else, and whether the
offloaded inputs fit beside it.

One owner, below every user: a job's start-up check (the reserve it keeps when none is set,
what the node has) reads it here without loading the estimate; the estimate's search, its CLI
(``--host-gib``), ``benchmarks/max_context.py`` and ``tests/test_shipped_tomls_fit.py`` take
``HOST_BUDGET_GIB``. What the offloader's buffers take is :mod:`upipe_compile.stack.offload`'s.
"""

from __future__ import annotations

import os

NODE_2TB_MEMTOTAL_GIB = 1862
"""An 8xH100 node sold with "2 TB" of RAM, counted as vendors count it: 2 x 10^12 bytes = 1,862.6 GiB,
taken as the node's ``MemTotal`` (/proc/meminfo: installed memory less what firmware and the
kernel keep; a node whose MemTotal is larger passes its own ``--host-gib``)."""

HOST_RESERVE_GIB = 64
"""The most RAM the default reserve keeps for everything but the offloaded block inputs (its
size on a "2 TB" node): the OS and kernel (page tables for 2 TB, slab, a little page cache),
the 8 trainer processes' own memory (Python, torch and the CUDA libraries, the CUDA context's
host side, NCCL's host buffers), the dataloader, and the pinned allocations' page rounding.
At that size the default reserve is this cap, so that a job the estimate passes also passes
the offload's start-up check (node MemTotal >= offloaded bytes per node + that reserve)."""

HOST_RESERVE_FRACTION = 0.25
"""The default reserve's share of a smaller machine's memory. Most of what the reserve covers
does not shrink with the machine: each trainer process holds 1 to 4 GiB of its own (Python,
torch and, on a GPU, the CUDA libraries and context), the OS and a desktop or the node's
daemons 1 to 2 GiB, each dataloader worker a copy of the Python process. A quarter keeps 6 GiB
of a 24 GiB workstation for its one or two trainer processes and the OS, 32 GiB of a 128 GiB
node for 4 to 8 of them, and reaches the 64 GiB cap at 256 GiB."""


def default_host_reserve_gib(total_gib: float) -> float:
    """The reserve a job keeps when it sets none: a quarter of the memory its ranks may use
    (``total_gib``: MemTotal, or the cgroup's limit), at most ``HOST_RESERVE_GIB``."""
    return min(float(HOST_RESERVE_GIB), HOST_RESERVE_FRACTION * total_gib)


HOST_BUDGET_GIB = NODE_2TB_MEMTOTAL_GIB - round(default_host_reserve_gib(NODE_2TB_MEMTOTAL_GIB))
"""The default ``--host-gib``: what the offloaded activations of one node may take (1,798 GiB; the
default reserve is its 64 GiB cap at this size)."""


# --- what the node's ranks may use, and whether offloaded inputs fit ---------------------------
def total_host_memory_bytes(meminfo: str = "/proc/meminfo") -> int:
    """The node's RAM: MemTotal from /proc/meminfo, else physical pages x page size."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # the file says kB and means KiB
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


CGROUP_V2_LIMIT = "/sys/fs/cgroup/memory.max"
CGROUP_V1_LIMIT = "/sys/fs/cgroup/memory/memory.limit_in_bytes"


def cgroup_memory_limit_bytes(v2: str = CGROUP_V2_LIMIT, v1: str = CGROUP_V1_LIMIT) -> int | None:
    """The memory limit of this process's cgroup: v2 ``memory.max`` ("max" = none) or v1
    ``memory.limit_in_bytes``, the smaller where both are there; None when neither sets one."""
    limits = []
    for path in (v2, v1):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    return min(limits, default=None)


def usable_host_memory(meminfo: str = "/proc/meminfo", cgroup_v2: str = CGROUP_V2_LIMIT,
                       cgroup_v1: str = CGROUP_V1_LIMIT) -> tuple[int, str]:
    """What this node's ranks may use together, and what that is (for messages): the cgroup's
    limit where it is below MemTotal (it covers every process in the cgroup, usually all of the
    job's ranks on the node; cgroup v1 says "no limit" with a huge number), else MemTotal."""
    total = total_host_memory_bytes(meminfo)
    limit = cgroup_memory_limit_bytes(cgroup_v2, cgroup_v1)
    if limit is not None and limit < total:
        return limit, "the job's cgroup allows"
    return total, "the node has"


def ranks_per_node(default: int) -> int:
    """Processes sharing this node's RAM: torchrun's LOCAL_WORLD_SIZE, else ``default``."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", default))


def host_reserve(total_bytes: int, reserve_gib: float | None = None) -> tuple[int, str]:
    """The host memory kept for everything but the offloaded inputs, and how it was chosen (for
    messages): ``reserve_gib`` where the job sets one, else
    :func:`default_host_reserve_gib` of ``total_bytes``."""
    if reserve_gib is not None:
        return int(reserve_gib * (1 << 30)), f"host_memory_reserve_gib={reserve_gib:g}, as set"
    gib = default_host_reserve_gib(total_bytes / (1 << 30))
    return int(gib * (1 << 30)), (f"the default: {HOST_RESERVE_FRACTION:.0%} of {size_text(total_bytes)}, at most "
                                  f"{HOST_RESERVE_GIB} GiB; host_memory_reserve_gib sets another")


def host_memory_problem(bytes_per_rank: int, ranks: int, total_bytes: int, reserve_bytes: int,
                        what: str = "the node has", reserve_why: str = "") -> str | None:
    """Why ``total_bytes`` (``what`` names it: see :func:`usable_host_memory`) cannot hold
    ``ranks`` x ``bytes_per_rank`` of offloaded inputs next to ``reserve_bytes`` for everything
    else (chosen as ``reserve_why`` says: see :func:`host_reserve`), or None."""
    need = bytes_per_rank * ranks
    if need + reserve_bytes <= total_bytes:
        return None
    why = f" ({reserve_why})" if reserve_why else ""
    return (f"offloading block inputs needs {size_text(bytes_per_rank)} of host memory per rank x {ranks} "
            f"ranks per node = {size_text(need)}, plus a reserve of {size_text(reserve_bytes)}{why}, but {what} "
            f"{size_text(total_bytes)}")


def node_host_memory_problem(bytes_per_rank: int, ranks: int, reserve_gib: float | None = None,
                             total_bytes: int | None = None) -> str | None:
    """The start-up check of every integration: why this node cannot hold ``ranks`` x
    ``bytes_per_rank`` of offloaded inputs next to the reserve (``reserve_gib`` where the job
    sets one, else the default: :func:`host_reserve`), or None. What the ranks may use is read
    (:func:`usable_host_memory`) unless ``total_bytes`` gives it."""
    total, what = (total_bytes, "the node has") if total_bytes is not None else usable_host_memory()
    reserve, reserve_why = host_reserve(total, reserve_gib)
    return host_memory_problem(bytes_per_rank, ranks, total, reserve, what, reserve_why)


def size_text(n: int) -> str:
    """``n`` bytes for messages, in GiB (MiB below one GiB)."""
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"
