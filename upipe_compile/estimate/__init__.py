"""Whole-training-step memory estimate: ``python -m upipe_compile.estimate``.

This package measures and reports, whatever built the job: one training step on fake CPU
tensors over a fake process group (step.py: the memory tracker by phase; plain_loops.py and
``upipe_compile.measure.workspace``: what the GPU's kernels allocate where eager CPU torch
allocates otherwise; fake_sharding.py), the report (report.py: the per-rank device peak with a
breakdown, the host memory of offloaded activations, and whether the step fits both a GPU
after a stated reserve, gpu.py, and the node's host memory after a stated reserve,
``upipe_compile.stack.host_memory``), the step-time model (step_time.py), the max-context
search (search.py) and the command line (__main__.py, cli_format.py).

The jobs come from the integrations, found through the entry-point group
``upipe_compile.estimate_jobs`` (job_sources.py): ``torchtitan`` (a torchtitan job,
``upipe_compile.integrations.torchtitan.estimate_command``) and ``hf`` (a transformers model
trained by UPipeTrainer, ``upipe_compile.integrations.hf_estimate``). Nothing here imports
them. See docs/estimate.md.
"""

from __future__ import annotations

from upipe_compile.estimate.errors import JobError
from upipe_compile.estimate.report import H100_80GB_GIB, Estimate, result_of, step_time_report
from upipe_compile.stack.host_memory import HOST_BUDGET_GIB

__all__ = ["H100_80GB_GIB", "HOST_BUDGET_GIB", "Estimate", "JobError", "result_of", "step_time_report"]
