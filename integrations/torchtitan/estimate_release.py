"""The torchtitan estimate's adapter for the installed torchtitan release: how it reads a job's
facts (release_022.py or release_03.py), builds the job (estimate_job.py) and runs its training
step (estimate_step.py). Chosen once; the rest of the torchtitan estimate asks it instead of
asking which release is installed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from upipe_compile.integrations.torchtitan.estimate_job import build_job, build_job_03
from upipe_compile.integrations.torchtitan.estimate_step import train_step_022, train_step_03
from upipe_compile.integrations.torchtitan.release import python_configs


@dataclass(frozen=True)
class TorchtitanRelease:
    name: str
    job_facts: Callable
    """config -> job_rules.JobFacts (the upipe section, CP degree, AC kind, ...)."""
    build_job: Callable
    """(config, fake_mode) -> estimate_job.Job, as the release's Trainer builds it."""
    train_step: Callable
    """(job, tracker) -> upipe_compile.estimate.step.StepMemory: the release's Trainer.train_step
    for one microbatch."""


@functools.lru_cache(maxsize=None)
def installed_release() -> TorchtitanRelease:
    if python_configs():  # 0.3: Python job configs (its modules import 0.3's torchtitan)
        from upipe_compile.integrations.torchtitan import release_03

        return TorchtitanRelease(release_03.NAME, release_03.job_facts, build_job_03, train_step_03)
    from upipe_compile.integrations.torchtitan import release_022

    return TorchtitanRelease(release_022.NAME, release_022.job_facts, build_job, train_step_022)
