"""The node's host memory as a budget for offloaded activations (like the estimate's GPU
budget, ``upipe_compile/estimate/gpu.py``).

One owner for the figures, below both users: a job's start-up check (the reserve it keeps when
none is set) takes :func:`default_host_reserve_gib` from here without loading the estimate;
the estimate's search, its CLI (``--host-gib``), ``benchmarks/max_context.py`` and
``tests/test_shipped_tomls_fit.py`` take ``HOST_BUDGET_GIB``.
"""

from __future__ import annotations

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
