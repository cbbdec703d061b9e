"""The largest ``[training] seq_len`` of a torchtitan job that fits both the GPU and the node's
host memory: ``python -m upipe_compile.estimate --config JOB --max-context``. The search itself
is the estimate's (upipe_compile.estimate.search); each probe is :func:`estimate_run.estimate`
of the job at another seq_len.
"""

from __future__ import annotations

import copy

from upipe_compile.attention.kernels import DEFAULT_CUDA_KERNEL
from upipe_compile.estimate.report import H100_80GB_GIB, Estimate
from upipe_compile.estimate.search import MAX_PROBES, search
from upipe_compile.integrations.torchtitan.estimate_run import estimate
from upipe_compile.stack.host_memory import HOST_BUDGET_GIB


def grid_step(job_config) -> int:
    return 1024 * job_config.parallelism.context_parallel_degree


def _probe(job_config, seq_len: int, **kwargs) -> Estimate:
    config = copy.deepcopy(job_config)
    config.training.seq_len = seq_len
    return estimate(config, **kwargs)


def max_context(job_config, *, gpu_gib: float = H100_80GB_GIB, gpus_per_node: int = 8,
                host_gib: float = HOST_BUDGET_GIB, progress: bool = True, max_probes: int = MAX_PROBES,
                cuda_kernel: str = DEFAULT_CUDA_KERNEL, device_ratio: float | None = None):
    """(largest fitting seq_len, its Estimate, [(seq_len, peak GiB), ...] probed, the bound
    that stopped it: "device", "host", "device and host", or None when the probes ran out
    before any longer probe failed)."""
    def probe(seq_len: int) -> Estimate:
        return _probe(job_config, seq_len, gpu_gib=gpu_gib, gpus_per_node=gpus_per_node, host_gib=host_gib,
                      cuda_kernel=cuda_kernel, device_ratio=device_ratio)

    return search(probe, job_config.training.seq_len, grid_step(job_config), gpu_gib=gpu_gib, host_gib=host_gib,
                  progress=progress, max_probes=max_probes, name="[training] seq_len")
