"""What any torchtitan release's training step shares in the whole-step estimate (step.py's
``run_step`` measures it; each release's own step is in ``release_022/estimate.py`` and
``release_03/estimate.py``): the step's end (clip, optimizer).
"""

from __future__ import annotations

from upipe_compile.integrations.torchtitan.estimate_job import Job


def clip_and_step(job: Job, label) -> None:
    """The step's end, as the Trainer runs it: gradient clipping, then the optimizer."""
    from torchtitan.distributed import utils as dist_utils

    label("grad clip")
    dist_utils.clip_grad_norm_(list(job.model.parameters()), job.job_config.training.max_norm, foreach=True,
                               ep_enabled=job.parallel_dims.ep_enabled)  # EP's experts: their own norm, as the Trainer
    label("optimizer step")
    job.optimizers.step()
