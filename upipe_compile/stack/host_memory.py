"""The node's host memory as a budget for offloaded activations (like the estimate's GPU
budget, ``upipe_compile/estimate/gpu.py``).

One owner for the figures, below both users: a job's start-up check (``[upipe]
host_memory_reserve_gib``'s default) takes ``HOST_RESERVE_GIB`` from here without loading the
estimate; the estimate's search, its CLI (``--host-gib``), ``benchmarks/max_context.py`` and
``tests/test_shipped_tomls_fit.py`` take ``HOST_BUDGET_GIB``.
"""

from __future__ import annotations

NODE_2TB_MEMTOTAL_GIB = 1862
"""An 8xH100 node sold with "2 TB" of RAM, counted as vendors count it: 2 x 10^12 bytes = 1,862.6 GiB,
taken as the node's ``MemTotal`` (/proc/meminfo: installed memory less what firmware and the
kernel keep; a node whose MemTotal is larger passes its own ``--host-gib``)."""

HOST_RESERVE_GIB = 64
"""Node RAM kept for everything but the offloaded block inputs: the OS and kernel (page
tables for 2 TB, slab, a little page cache), the 8 trainer processes' own memory (Python,
torch and the CUDA libraries, the CUDA context's host side, NCCL's host buffers), the
dataloader, and the pinned allocations' page rounding. The same figure as
``[upipe] host_memory_reserve_gib``'s default, so that a job the estimate passes also passes
the offload's start-up check (node MemTotal >= offloaded bytes per node + that reserve)."""

HOST_BUDGET_GIB = NODE_2TB_MEMTOTAL_GIB - HOST_RESERVE_GIB
"""The default ``--host-gib``: what the offloaded activations of one node may take (1,798 GiB)."""
