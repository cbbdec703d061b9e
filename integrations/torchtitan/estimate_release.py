"""The torchtitan estimate's adapter for the installed torchtitan release, chosen once: how it
reads a job's config and facts, builds the job and runs its training step, each from the
release's own subpackage (``release_022/``, ``release_03/``). The rest of the torchtitan
estimate asks it instead of asking which release is installed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from upipe_compile.integrations.torchtitan.release import python_configs


@dataclass(frozen=True)
class TorchtitanRelease:
    name: str
    load_config: Callable
    """(config, overrides, module=None) -> the job's config, as the release's ConfigManager reads it."""
    job_facts: Callable
    """config -> job_rules.JobFacts (the upipe section, CP degree, AC kind, ...)."""
    build_job: Callable
    """(config, fake_mode) -> estimate_job.Job, as the release's Trainer builds it."""
    train_step: Callable
    """(job, tracker) -> upipe_compile.estimate.step.StepMemory: the release's Trainer.train_step
    for one microbatch."""
    model_kernels: tuple
    """What the release's models run as fused kernels beyond RMSNorm, for step.py's ``kernel_models``."""


@functools.lru_cache(maxsize=None)
def installed_release() -> TorchtitanRelease:
    if python_configs():  # 0.3: Python job configs (its modules import 0.3's torchtitan)
        from upipe_compile.integrations.torchtitan.release_03 import estimate, facts
    else:
        from upipe_compile.integrations.torchtitan.release_022 import estimate, facts
    return TorchtitanRelease(facts.NAME, estimate.load_config, facts.job_facts, estimate.build_job,
                             estimate.train_step, estimate.MODEL_KERNELS)
