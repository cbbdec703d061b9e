"""The whole-step estimate's build and step for a torchtitan 0.3 job (a Python function
returning ``UPipeTrainer.Config``): the same steps and functions as 0.3's ``Trainer.__init__``
and ``train_step``, on fake CPU tensors over torch's "fake" process group of the job's world
size.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from upipe_compile.estimate.errors import JobError
from upipe_compile.estimate.step import DEVICE, PhaseTracker, SavedOnDevice, measured
from upipe_compile.integrations.torchtitan.estimate_job import (Job, torchtitan_on_cpu, values_not_initialised,
                                                                world_size)
from upipe_compile.integrations.torchtitan.estimate_step import clip_and_step
from upipe_compile.integrations.torchtitan.measurement import mark_for_measurement
from upipe_compile.integrations.torchtitan.release_03.parallelize import model_dims_03
from upipe_compile.integrations.torchtitan.release_03.trainer import shard_batch, take_over


MODEL_KERNELS = ()
"""0.3's RoPE is measured as the job runs it (in the fused block, or eagerly beside TP): nothing
to stand in for."""


def load_config(config_name: str, overrides: list[str], module: str | None = None):
    """torchtitan 0.3's ConfigManager on ``--module``/``--config`` and command-line overrides."""
    from torchtitan.config import ConfigManager

    if module is None:
        raise JobError(f"--config {config_name} without --module: the installed torchtitan 0.3 reads Python job "
                       "configs (--module upipe_compile.integrations.torchtitan --config FUNCTION); TOML files "
                       "are 0.2.2's")
    return ConfigManager().parse_args(["--module", module, "--config", config_name, *overrides])


def _build_meshes(config, parallel_dims) -> None:
    """The job's meshes (built outside fake mode: they hold real rank lists), with the SPMD
    backend set as 0.3's Trainer sets it (TP's loss reads it)."""
    from torchtitan.distributed import utils as dist_utils

    parallel_dims.build_mesh()
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)


def _model_and_loss(config, parallel_dims, *, measuring: bool):
    """What 0.3's Trainer.__init__ builds before the weights exist: the model config updated
    from the job, the meta-device model, the ModelSpec's parallelize (the config marked for
    measurement where ``measuring``) and the config's loss (ChunkedLossWrapper on the model's
    lm_head). Returns (model, loss_fn)."""
    from torchtitan.components.loss import ChunkedLossWrapper

    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    if measuring:
        mark_for_measurement(config)  # built for measurement: nothing compiled, offloaded inputs on "meta"
    model = config.model_spec.parallelize_fn(
        model, parallel_dims=parallel_dims, training=config.training, parallelism=config.parallelism,
        compile_config=config.compile, ac_config=config.activation_checkpoint, dump_folder=config.dump_folder)
    loss_fn = config.loss.build(compile_config=None)
    if isinstance(loss_fn, ChunkedLossWrapper):  # as the Trainer does
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    return model, loss_fn


def build_real_job(config, device: torch.device, world: int) -> Job:
    """The Trainer's model, optimizers and loss for a torchtitan 0.3 job with real tensors on
    ``device``, for a measurement beside the estimate's (benchmarks/estimate_check_03.py).
    Needs the default process group; seed torch first for reproducible weights."""
    if device.type == "cpu":
        torchtitan_on_cpu()
    if not take_over(config):
        raise JobError('upipe jobs only: compile.enable = True and compile.backend = "upipe"')
    from torchtitan.distributed import ParallelDims

    parallel_dims = ParallelDims.from_config(config.parallelism, world)
    _build_meshes(config, parallel_dims)
    model, loss_fn = _model_and_loss(config, parallel_dims, measuring=False)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizers = config.optimizer.build(model_parts=[model])
    return Job(config, parallel_dims, model_dims_03(config.model_spec.model), model, optimizers, loss_fn)


def build_job(config, fake_mode) -> Job:
    """The Trainer's model, optimizers and loss for a torchtitan 0.3 job (a
    :class:`UPipeTrainer.Config`) as fake CPU tensors: the Trainer's take-over of the job,
    ParallelDims, the meta build, the ModelSpec's parallelize, the config's loss and optimizer.
    TP runs as 0.3's own DTensor modules over the fake group, the attention through the
    stage-loop op's eager twin."""
    torchtitan_on_cpu()
    if not take_over(config):
        raise JobError('the estimate measures upipe jobs: compile.enable = True and compile.backend = "upipe"')
    from torchtitan.distributed import ParallelDims

    parallel_dims = ParallelDims.from_config(config.parallelism, world_size(config))
    if not parallel_dims.fsdp_enabled:
        raise JobError("the estimate measures FSDP jobs (its tracker follows FSDP's buffers): "
                       "parallelism.data_parallel_shard_degree x context_parallel_degree must be > 1")
    _build_meshes(config, parallel_dims)
    model, loss_fn = _model_and_loss(config, parallel_dims, measuring=True)
    with fake_mode:
        model.to_empty(device="cpu")
        with torch.no_grad(), values_not_initialised():
            model.init_weights(buffer_device=None)  # creates the buffers (the RoPE tables)
    model.train()
    optimizers = config.optimizer.build(model_parts=[model])
    return Job(config, parallel_dims, model_dims_03(config.model_spec.model), model, optimizers, loss_fn)


@contextmanager
def balanced_expert_dispatch():
    """Expert parallelism's token exchange as a balanced router sends it: each rank sends the
    same number of routed tokens to every EP rank (equal all-to-all splits), what
    torchtitan's forced load-balance routing does. The real counts are data, which fake
    tensors do not hold; the experts' buffers and the dispatch's then have their balanced
    sizes (a skewed router's busiest rank holds more)."""
    from torch._subclasses.fake_tensor import is_fake
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    exchange = AllToAllTokenDispatcher._sync_token_count_exchange

    def balanced(self, num_local_tokens_per_expert_E, num_global_tokens_per_local_expert_EP_e, ep_size):
        if not is_fake(num_local_tokens_per_expert_E):
            return exchange(self, num_local_tokens_per_expert_E, num_global_tokens_per_local_expert_EP_e, ep_size)
        wait = torch.ops._c10d_functional.wait_tensor
        return wait(num_global_tokens_per_local_expert_EP_e).reshape(-1), None, None  # None: equal splits

    AllToAllTokenDispatcher._sync_token_count_exchange = balanced
    try:
        yield
    finally:
        AllToAllTokenDispatcher._sync_token_count_exchange = exchange


def train_step(job: Job, tracker: PhaseTracker):
    """torchtitan 0.3's Trainer.train_step for one microbatch, without PP, with UPipeTrainer's
    input sharding: one row of one document (positions 0..S-1). The documents' metadata is
    built outside fake mode (its cumulative lengths are data); tokens, positions and labels
    are then made fake device tensors, the full row's as the Trainer holds them."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torchtitan.components.loss import IGNORE_INDEX

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
    with balanced_expert_dispatch():
        label("forward")
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            pred = job.model(inputs, **extra)
        logits = 0 if getattr(job.model, "_skip_lm_head", False) else pred.numel() * pred.element_size()
        after_forward = tracker.get_tracker_snapshot("current").get(DEVICE, {}).get("Total", 0)
        label("loss")
        loss, _ = job.loss_fn(pred, local_labels, global_valid_tokens, positions=extra["positions"])
        del pred
        loss.backward()
    clip_and_step(job, label)
    del on_device
    return measured(tracker, saved, logits, after_forward)
