"""One training step of a torchtitan job as the installed release's Trainer runs it, for the
whole-step memory estimate (step.py's ``run_step`` measures it; estimate_release.py picks the
release's), and torchtitan's Llama3 RoPE counted as the fused kernel the compiled block runs.
"""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import torch
from torch._subclasses.fake_tensor import is_fake

from upipe_compile.estimate.plain_loops import FusedRoPEFunction
from upipe_compile.estimate.step import DEVICE, PhaseTracker, SavedOnDevice, measured
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


def _clip_and_step(job: Job, label) -> None:
    """The step's end, as the Trainer runs it: gradient clipping, then the optimizer."""
    from torchtitan.distributed import utils as dist_utils

    label("grad clip")
    dist_utils.clip_grad_norm_(list(job.model.parameters()), job.job_config.training.max_norm, foreach=True)
    label("optimizer step")
    job.optimizers.step()


def train_step_022(job: Job, tracker: PhaseTracker):
    """torchtitan 0.2.2's Trainer.train_step for one microbatch, without PP."""
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.train import prepare_context_parallel_input  # the Trainer's (upipe's layouts: cp_layout.py)

    config, dims = job.job_config, job.parallel_dims

    def label(name):
        tracker.outside_model = name

    job.optimizers.zero_grad()
    batch, seq = config.training.local_batch_size, config.training.seq_len
    inputs = torch.randint(0, job.model_args.vocab_size, (batch, seq), device=DEVICE)
    labels = torch.randint(0, job.model_args.vocab_size, (batch, seq), device=DEVICE)
    global_valid_tokens = (labels != IGNORE_INDEX).sum().float()
    extra_kwargs = {}
    if dims.cp_enabled:
        inputs, labels, extra_kwargs = prepare_context_parallel_input(
            inputs, labels, extra_kwargs, dims.get_mesh("cp"), DEVICE,
            config.parallelism.context_parallel_load_balancer,
        )
    saved = SavedOnDevice(tracker, job.model)
    loss_parallel = dims.tp_enabled and not config.parallelism.disable_loss_parallel
    # AMP only where FSDP does not already cast (DDP / one device), as the Trainer decides.
    amp = dist_utils.maybe_enable_amp(dims, config.training.mixed_precision_param, DEVICE.type)
    with dist_utils.get_train_context(loss_parallel)(), amp:
        label("forward")
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            pred = job.model(inputs, **extra_kwargs)
        # With [upipe] loss_chunk_tokens the model returns LazyLogits: no logits tensor exists.
        logits = pred.numel() * pred.element_size() if isinstance(pred, torch.Tensor) else 0
        after_forward = tracker.get_tracker_snapshot("current").get(DEVICE, {}).get("Total", 0)
        label("loss")
        loss = job.loss_fn(pred, labels) / global_valid_tokens
        del pred
        loss.backward()
    _clip_and_step(job, label)
    return measured(tracker, saved, logits, after_forward)


def train_step_03(job: Job, tracker: PhaseTracker):
    """torchtitan 0.3's Trainer.train_step for one microbatch, without PP, with UPipeTrainer's
    input sharding: one row of one document (positions 0..S-1). The documents' metadata is
    built outside fake mode (its cumulative lengths are data); tokens, positions and labels
    are then made fake device tensors, the full row's as the Trainer holds them."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torchtitan.components.loss import IGNORE_INDEX

    from upipe_compile.integrations.torchtitan.trainer_03 import shard_batch

    config, dims = job.job_config, job.parallel_dims

    def label(name):
        tracker.outside_model = name

    job.optimizers.zero_grad()
    batch, seq = config.training.local_batch_size, config.training.seq_len
    with unset_fake_temporarily():
        full = {"input": torch.randint(0, job.model_args.vocab_size, (batch, seq)),
                "positions": torch.arange(seq).expand(batch, seq)}
        labels = torch.randint(0, job.model_args.vocab_size, (batch, seq))
        inputs, local_labels, extra = shard_batch(config, dims, job.model, dict(full), labels)
    on_device = {key: value.clone() for key, value in full.items()}  # the Trainer's batch on the GPU
    inputs, local_labels = inputs.clone(), local_labels.clone()
    extra["positions"] = extra["positions"].clone()
    global_valid_tokens = (labels != IGNORE_INDEX).sum().float()
    saved = SavedOnDevice(tracker, job.model)
    label("forward")
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        pred = job.model(inputs, **extra)
    logits = 0 if getattr(job.model, "_skip_lm_head", False) else pred.numel() * pred.element_size()
    after_forward = tracker.get_tracker_snapshot("current").get(DEVICE, {}).get("Total", 0)
    label("loss")
    loss, _ = job.loss_fn(pred, local_labels, global_valid_tokens, positions=extra["positions"])
    del pred
    loss.backward()
    _clip_and_step(job, label)
    del on_device
    return measured(tracker, saved, logits, after_forward)
