"""The hook the whole-step memory estimate (``python -m upipe_compile.estimate``) uses to build
a job through the real ``parallelize_llama_upipe`` on fake tensors.

For a job config marked by :func:`mark_for_measurement`, parallelize does everything it does
for training (the job checks, activation checkpointing, the opt-in ``[upipe]`` stack pieces,
FSDP) except compiling the blocks:

- each TransformerBlock's attention runs the real stage loops: with ``fuse_projections``
  (the default) its attention module is compiled with
  :func:`upipe_compile.measure.eager_twins.eager_twin_backend` (the upipe passes, then the
  fused block op swapped for its eager twin); without it, its SDPA calls run eagerly as the
  plain op's twin (:class:`upipe_compile.measure.memory.SDPAThroughStageLoops`, same group,
  U and prefetch as the compiled op). Under FakeTensorMode the compiled custom ops would run
  only their fake kernels, so their stage buffers would never be allocated;
- the loss is not compiled either (same eager code as when ``[compile] components`` lacks
  "loss").

Code that moves activations to host memory (offload) must put its host copies on
:func:`host_device` of their job config: "cpu" normally, "meta" while measuring. The estimate runs everything
as fake CPU tensors, so a host copy on "cpu" would be indistinguishable from device memory;
on "meta" the memory tracker reports it as a separate device (the host).
"""

from __future__ import annotations

import torch

_MEASURED = "_upipe_measured_by_the_estimate"


def mark_for_measurement(job_config):
    """``job_config`` marked as the memory estimate's: the parallelize and loss builders that
    take it build the job for measurement (nothing compiled, offloaded inputs on "meta"). The
    mark travels on the job's own ``upipe`` section (torchtitan 0.3's config classes take no
    new attributes), so no other job in the process sees it. Returns the config."""
    section = getattr(job_config, "upipe", None)
    if section is None:
        raise ValueError("the memory estimate measures upipe jobs: this job config has no upipe section")
    object.__setattr__(section, _MEASURED, True)
    return job_config


def is_measuring(job_config) -> bool:
    """Whether ``job_config`` was marked by :func:`mark_for_measurement`."""
    return getattr(getattr(job_config, "upipe", None), _MEASURED, False)


def host_device(job_config) -> torch.device:
    """Where the job's offloaded activations live: the host ("cpu"), or "meta" for a job
    marked by :func:`mark_for_measurement`."""
    return torch.device("meta" if is_measuring(job_config) else "cpu")
