"""Build a torchtitan job as its Trainer would, on fake CPU tensors over a fake process group,
for the whole-step memory estimate (``python -m upipe_compile.estimate --config``; the
measuring is upipe_compile.estimate's, the run estimate_run.py).

Same steps and functions as torchtitan 0.2.2's ``Trainer.__init__``: ConfigManager (TOML +
overrides + the custom config module), ``experimental.custom_import``, ParallelDims and its
meshes, the registered TrainSpec, a meta-device model, model converters, ``parallelize_fn``
(its config marked by :func:`mark_for_measurement`, see integrations/torchtitan/measurement.py), ``to_empty`` +
``init_weights``, the optimizers and the loss. What differs: the device is fake CPU
(no data, no memory) and the process group is torch's "fake" backend of the job's world size.
"""

from __future__ import annotations

import copy
import importlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from upipe_compile.estimate.errors import JobError
from upipe_compile.integrations.torchtitan.measurement import mark_for_measurement


def load_job_config(config_file: str, overrides: list[str]):
    """torchtitan's ConfigManager on the TOML and command-line overrides (``--section.key value``).
    An unknown key makes it print which one (and what it may have meant) and exit."""
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--job.config_file", config_file, *overrides])


def world_size(job_config) -> int:
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
def _values_not_initialised():
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


def parallel_dims_of(job_config, world: int):
    """torchtitan 0.2.2's ParallelDims for the job's [parallelism] degrees over ``world`` ranks."""
    from torchtitan.distributed import ParallelDims

    p = job_config.parallelism
    return ParallelDims(
        dp_shard=p.data_parallel_shard_degree, dp_replicate=p.data_parallel_replicate_degree,
        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
        ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree, world_size=world,
    )


def build_real_job(job_config, device: torch.device, world: int) -> Job:
    """The Trainer's model, optimizers and loss for a torchtitan 0.2.2 job with real tensors on
    ``device``, for a measurement beside the estimate's (benchmarks/estimate_check.py,
    benchmarks/gpu_rank.py). Needs the default process group (real, or fake with this process
    as one of ``world`` ranks); seed torch first for reproducible weights."""
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.protocols.train_spec import get_train_spec

    if device.type == "cpu":
        torchtitan_on_cpu()
    if job_config.experimental.custom_import:
        importlib.import_module(job_config.experimental.custom_import)  # as Trainer.__init__ does
    parallel_dims = parallel_dims_of(job_config, world)
    parallel_dims.build_mesh()
    spec = get_train_spec(job_config.model.name)
    model_args = copy.deepcopy(spec.model_args[job_config.model.flavor])  # update_from_config mutates
    model_args.update_from_config(job_config)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    build_model_converters(job_config, parallel_dims).convert(model)  # as the estimate's job (build_job)
    model = spec.parallelize_fn(model, parallel_dims, job_config)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizers = spec.build_optimizers_fn([model], job_config.optimizer, parallel_dims)
    loss_fn = spec.build_loss_fn(job_config, parallel_dims=parallel_dims)
    return Job(job_config, parallel_dims, model_args, model, optimizers, loss_fn)


def build_job(job_config, fake_mode) -> Job:
    """The Trainer's model, optimizers and loss for ``job_config``, as fake CPU tensors. Needs
    a default (fake) process group of the job's world size; ``fake_mode`` is the
    FakeTensorMode the step will run in."""
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.protocols.train_spec import get_train_spec

    torchtitan_on_cpu()
    if job_config.experimental.custom_import:
        importlib.import_module(job_config.experimental.custom_import)  # as Trainer.__init__ does
    parallel_dims = parallel_dims_of(job_config, world_size(job_config))
    if parallel_dims.pp_enabled:
        raise JobError("[parallelism] pipeline_parallel_degree > 1: the estimate runs one model part per rank")
    if not parallel_dims.fsdp_enabled:
        raise JobError("the estimate measures FSDP jobs (its tracker follows FSDP's buffers): [parallelism] "
                       "data_parallel_shard_degree x context_parallel_degree must be > 1")
    parallel_dims.build_mesh()  # outside fake mode: the meshes hold real rank lists

    train_spec = get_train_spec(job_config.model.name)
    if job_config.model.flavor not in train_spec.model_args:
        raise JobError(f"[model] flavor = {job_config.model.flavor!r} is not one of {sorted(train_spec.model_args)}")
    # A copy: update_from_config mutates the registry's args, which later probes would inherit.
    model_args = copy.deepcopy(train_spec.model_args[job_config.model.flavor])
    model_args.update_from_config(job_config)
    with torch.device("meta"):
        model = train_spec.model_cls(model_args)
    build_model_converters(job_config, parallel_dims).convert(model)
    mark_for_measurement(job_config)  # built for measurement: nothing compiled, offloaded inputs on "meta"
    model = train_spec.parallelize_fn(model, parallel_dims, job_config)
    loss_fn = train_spec.build_loss_fn(job_config, parallel_dims=parallel_dims)
    with fake_mode:
        model.to_empty(device="cpu")
        with torch.no_grad(), _values_not_initialised():
            model.init_weights(buffer_device=None)  # creates the buffers (the RoPE table)
    model.train()
    optimizers = train_spec.build_optimizers_fn([model], job_config.optimizer, parallel_dims)
    return Job(job_config, parallel_dims, model_args, model, optimizers, loss_fn)


# --- torchtitan 0.3: Python job configs -------------------------------------------------------

def load_config_03(module: str, config_name: str, overrides: list[str]):
    """torchtitan 0.3's ConfigManager on ``--module``/``--config`` and command-line overrides."""
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--module", module, "--config", config_name, *overrides])


def build_job_03(config, fake_mode) -> Job:
    """:func:`build_job` for a torchtitan 0.3 job (a :class:`UPipeTrainer.Config`): the
    Trainer's take-over of the job, ParallelDims, the meta build, the ModelSpec's
    parallelize, the config's loss (ChunkedLossWrapper on the model's lm_head) and optimizer."""
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.distributed import ParallelDims

    from upipe_compile.integrations.torchtitan.parallelize_03 import model_dims_03
    from upipe_compile.integrations.torchtitan.trainer_03 import take_over

    torchtitan_on_cpu()
    if not take_over(config):
        raise JobError('the estimate measures upipe jobs: compile.enable = True and compile.backend = "upipe"')
    p = config.parallelism
    if p.tensor_parallel_degree > 1:
        raise JobError(f"parallelism.tensor_parallel_degree = {p.tensor_parallel_degree}: the estimate does not "
                       "model tensor parallelism; estimate the same GPUs as parallelism.tensor_parallel_degree = 1 "
                       "and parallelism.context_parallel_degree = "
                       f"{p.context_parallel_degree * p.tensor_parallel_degree} (with the upipe.ring_degree the "
                       "job check asks for, if the heads need one)")
    if not config.upipe.fuse_projections:
        raise JobError("upipe.fuse_projections = False: the estimate measures 0.3's varlen attention through "
                       "fused blocks only")
    parallel_dims = ParallelDims.from_config(config.parallelism, world_size(config))
    if not parallel_dims.fsdp_enabled:
        raise JobError("the estimate measures FSDP jobs (its tracker follows FSDP's buffers): "
                       "parallelism.data_parallel_shard_degree x context_parallel_degree must be > 1")
    parallel_dims.build_mesh()  # outside fake mode: the meshes hold real rank lists
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    mark_for_measurement(config)  # built for measurement: nothing compiled, offloaded inputs on "meta"
    model = config.model_spec.parallelize_fn(
        model, parallel_dims=parallel_dims, training=config.training, parallelism=config.parallelism,
        compile_config=config.compile, ac_config=config.activation_checkpoint, dump_folder=config.dump_folder)
    loss_fn = config.loss.build(compile_config=None)
    if isinstance(loss_fn, ChunkedLossWrapper):  # as the Trainer does
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    with fake_mode:
        model.to_empty(device="cpu")
        with torch.no_grad(), _values_not_initialised():
            model.init_weights(buffer_device=None)  # creates the buffers (the RoPE tables)
    model.train()
    optimizers = config.optimizer.build(model_parts=[model])
    return Job(config, parallel_dims, model_dims_03(model_config), model, optimizers, loss_fn)
