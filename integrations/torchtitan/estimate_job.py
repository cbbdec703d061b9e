"""What building any torchtitan release's job for the whole-step estimate shares: the
:class:`Job` it hands the step, the world size of its degrees, torchtitan pointed at the CPU,
and initialisers that fake tensors can run. Each release builds its job as its own Trainer
does, on fake CPU tensors over a fake process group (``release_022/estimate.py``,
``release_03/estimate.py``); the measuring is upipe_compile.estimate's, the run
estimate_run.py's.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from upipe_compile.estimate.errors import JobError


def world_size(job_config) -> int:
    """The ranks the job's degrees multiply to (the same keys in 0.2.2 and 0.3)."""
    p = job_config.parallelism
    degrees = {
        "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "data_parallel_shard_degree": p.data_parallel_shard_degree,
        "context_parallel_degree": p.context_parallel_degree,
        "tensor_parallel_degree": p.tensor_parallel_degree,
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
    }
    if degrees["data_parallel_shard_degree"] == -1:
        raise JobError("[parallelism] data_parallel_shard_degree = -1 (use the rest of the world) needs a world "
                       "size; the estimate takes it from the degrees: set it explicitly")
    for key, value in degrees.items():
        if value < 1:
            raise JobError(f"[parallelism] {key} = {value} must be >= 1")
    world = 1
    for value in degrees.values():
        world *= value
    return world


def torchtitan_on_cpu() -> None:
    """torchtitan resolves its device type once, at import: ``_get_available_device_type() or
    "cuda"``, i.e. "cuda" on a CPU-only build, and ParallelDims builds its meshes (and
    fully_shard its state) on it. Point the modules that read it at "cpu". Fake *cuda*
    tensors would abort the process on a CPU-only build, so everything here is fake CPU."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    import torchtitan.distributed.utils as dist_utils_module
    import torchtitan.tools.utils as tools_utils

    for module in (tools_utils, parallel_dims_module, dist_utils_module):
        module.device_type = "cpu"
    tools_utils.device_module = dist_utils_module.device_module = torch.cpu


@contextmanager
def values_not_initialised():
    """Fake tensors have no values, and trunc_normal_ branches on them (a data-dependent
    ``mask.any()``): initialisers become no-ops, which allocates the same (nothing). Its
    helper too: torchtitan 0.3 holds ``trunc_normal_`` itself in partials made at import."""
    original, helper = torch.nn.init.trunc_normal_, torch.nn.init._no_grad_trunc_normal_
    torch.nn.init.trunc_normal_ = lambda tensor, *args, **kwargs: tensor
    torch.nn.init._no_grad_trunc_normal_ = lambda tensor, *args, **kwargs: tensor
    try:
        yield
    finally:
        torch.nn.init.trunc_normal_, torch.nn.init._no_grad_trunc_normal_ = original, helper


@dataclass
class Job:
    job_config: Any
    parallel_dims: Any
    model_args: Any
    model: torch.nn.Module
    optimizers: Any
    loss_fn: Any
