"""The hook the whole-step memory estimate (``python -m upipe_compile.estimate``) uses to build
a job through the real ``parallelize_llama_upipe`` on fake tensors.

Under :func:`measuring`, parallelize does everything it does for training (the job checks,
activation checkpointing, the opt-in ``[upipe]`` stack pieces, FSDP) except compiling the blocks:

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
:func:`host_device`: "cpu" normally, "meta" while measuring. The estimate runs everything
as fake CPU tensors, so a host copy on "cpu" would be indistinguishable from device memory;
on "meta" the memory tracker reports it as a separate device (the host).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

_measuring = False


@contextmanager
def measuring():
    """parallelize_llama_upipe / build_loss_fn_upipe build the job for memory measurement."""
    global _measuring
    previous, _measuring = _measuring, True
    try:
        yield
    finally:
        _measuring = previous


def is_measuring() -> bool:
    return _measuring


def host_device() -> torch.device:
    """Where offloaded activations live: the host ("cpu"), or "meta" under :func:`measuring`."""
    return torch.device("meta" if _measuring else "cpu")
