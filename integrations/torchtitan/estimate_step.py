"""What any torchtitan release's training step shares in the whole-step estimate (step.py's
``run_step`` measures it; each release's own step is in ``release_022/estimate.py`` and
``release_03/estimate.py``): the step's end (clip, optimizer) and torchtitan's Llama3 RoPE
counted as the fused kernel the compiled block runs.
"""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import torch
from torch._subclasses.fake_tensor import is_fake

from upipe_compile.estimate.plain_loops import FusedRoPEFunction
from upipe_compile.integrations.torchtitan.estimate_job import Job


@contextmanager
def fused_rope():
    """Fake-tensor RoPE of torchtitan's Llama3 allocates what a fused kernel does (see
    upipe_compile.estimate.plain_loops' module doc). Other models' RoPE (e.g. Qwen3's
    rotate-half) is counted as eager runs it; torchtitan 0.3's, which the estimate measures in
    fused blocks only, as the block runs it."""
    try:
        from torchtitan.models.llama3.model import model as llama3
    except ImportError:  # torchtitan 0.3
        yield
        return

    original = llama3.apply_rotary_emb

    def apply_rotary_emb(xq, xk, freqs_cis, positions=None):
        if torch.compiler.is_compiling() or not is_fake(xq):  # traced: the fusion pass reads the real op
            return original(xq, xk, freqs_cis, positions)
        return FusedRoPEFunction.apply(xq, xk)

    with mock.patch.object(llama3, "apply_rotary_emb", apply_rotary_emb):
        yield


MODEL_KERNELS = (fused_rope,)
"""What torchtitan's models run as fused kernels beyond RMSNorm, for step.py's ``kernel_models``."""


def clip_and_step(job: Job, label) -> None:
    """The step's end, as the Trainer runs it: gradient clipping, then the optimizer."""
    from torchtitan.distributed import utils as dist_utils

    label("grad clip")
    dist_utils.clip_grad_norm_(list(job.model.parameters()), job.job_config.training.max_norm, foreach=True)
    label("optimizer step")
    job.optimizers.step()
