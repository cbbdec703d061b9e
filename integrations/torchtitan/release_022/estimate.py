"""The whole-step estimate's build and step for a torchtitan 0.2.2 job (a TOML read into a
JobConfig): the same steps and functions as 0.2.2's ``Trainer.__init__`` and ``train_step``.

:func:`build_job`: ConfigManager (TOML + overrides + the custom config module),
``experimental.custom_import``, ParallelDims and its meshes, the registered TrainSpec, a
meta-device model, model converters, ``parallelize_fn`` (its config marked by
:func:`mark_for_measurement`, see measurement.py), ``to_empty`` + ``init_weights``, the
optimizers and the loss. What differs: the device is fake CPU (no data, no memory) and the
process group is torch's "fake" backend of the job's world size. :func:`build_real_job` builds
the same with real tensors, for a measurement beside the estimate. :data:`MODEL_KERNELS`: 0.2.2's
Llama3 RoPE counted as the fused kernel the compiled block runs.
"""

from __future__ import annotations

import copy
import importlib
from contextlib import contextmanager
from unittest import mock

import torch
from torch._subclasses.fake_tensor import is_fake

from upipe_compile.estimate.errors import JobError
from upipe_compile.estimate.plain_loops import FusedRoPEFunction
from upipe_compile.estimate.step import DEVICE, PhaseTracker, SavedOnDevice, measured
from upipe_compile.integrations.torchtitan.estimate_job import (Job, torchtitan_on_cpu, values_not_initialised,
                                                                world_size)
from upipe_compile.integrations.torchtitan.estimate_step import clip_and_step
from upipe_compile.integrations.torchtitan.measurement import mark_for_measurement


def load_config(config_file: str, overrides: list[str], module: str | None = None):
    """torchtitan's ConfigManager on the TOML and command-line overrides (``--section.key value``).
    An unknown key makes it print which one (and what it may have meant) and exit."""
    from torchtitan.config import ConfigManager

    if module is not None:
        raise JobError(f"--module {module}: Python job configs are torchtitan 0.3's; the installed 0.2.2 reads "
                       "a TOML (--config FILE.toml)")
    return ConfigManager().parse_args(["--job.config_file", config_file, *overrides])


def parallel_dims_of(job_config, world: int):
    """torchtitan 0.2.2's ParallelDims for the job's [parallelism] degrees over ``world`` ranks."""
    from torchtitan.distributed import ParallelDims

    p = job_config.parallelism
    return ParallelDims(
        dp_shard=p.data_parallel_shard_degree, dp_replicate=p.data_parallel_replicate_degree,
        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
        ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree, world_size=world,
    )


def _model_and_loss(job_config, parallel_dims, *, measuring: bool):
    """What 0.2.2's Trainer.__init__ builds before the weights exist: ``custom_import``, the
    meshes, the registered TrainSpec, a copy of the flavor's model args updated from the config,
    the meta-device model with its converters, ``parallelize_fn`` (its config marked for
    measurement where ``measuring``) and the loss. Returns (spec, model_args, model, loss_fn)."""
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.protocols.train_spec import get_train_spec

    if job_config.experimental.custom_import:
        importlib.import_module(job_config.experimental.custom_import)  # as Trainer.__init__ does
    parallel_dims.build_mesh()  # outside fake mode: the meshes hold real rank lists
    spec = get_train_spec(job_config.model.name)
    if job_config.model.flavor not in spec.model_args:
        raise JobError(f"[model] flavor = {job_config.model.flavor!r} is not one of {sorted(spec.model_args)}")
    # A copy: update_from_config mutates the registry's args, which later probes would inherit.
    model_args = copy.deepcopy(spec.model_args[job_config.model.flavor])
    model_args.update_from_config(job_config)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    build_model_converters(job_config, parallel_dims).convert(model)
    if measuring:
        mark_for_measurement(job_config)  # built for measurement: nothing compiled, offloaded inputs on "meta"
    model = spec.parallelize_fn(model, parallel_dims, job_config)
    return spec, model_args, model, spec.build_loss_fn(job_config, parallel_dims=parallel_dims)


def build_real_job(job_config, device: torch.device, world: int) -> Job:
    """The Trainer's model, optimizers and loss for a torchtitan 0.2.2 job with real tensors on
    ``device``, for a measurement beside the estimate's (benchmarks/estimate_check.py,
    benchmarks/gpu_rank.py). Needs the default process group (real, or fake with this process
    as one of ``world`` ranks); seed torch first for reproducible weights."""
    if device.type == "cpu":
        torchtitan_on_cpu()
    parallel_dims = parallel_dims_of(job_config, world)
    spec, model_args, model, loss_fn = _model_and_loss(job_config, parallel_dims, measuring=False)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizers = spec.build_optimizers_fn([model], job_config.optimizer, parallel_dims)
    return Job(job_config, parallel_dims, model_args, model, optimizers, loss_fn)


def build_job(job_config, fake_mode) -> Job:
    """The Trainer's model, optimizers and loss for ``job_config``, as fake CPU tensors. Needs
    a default (fake) process group of the job's world size; ``fake_mode`` is the
    FakeTensorMode the step will run in."""
    torchtitan_on_cpu()
    parallel_dims = parallel_dims_of(job_config, world_size(job_config))
    if parallel_dims.pp_enabled:
        raise JobError("[parallelism] pipeline_parallel_degree > 1: the estimate runs one model part per rank")
    if not parallel_dims.fsdp_enabled:
        raise JobError("the estimate measures FSDP jobs (its tracker follows FSDP's buffers): [parallelism] "
                       "data_parallel_shard_degree x context_parallel_degree must be > 1")
    spec, model_args, model, loss_fn = _model_and_loss(job_config, parallel_dims, measuring=True)
    if getattr(model_args, "attn_type", "sdpa") == "varlen":
        raise JobError(f"[model] flavor = {job_config.model.flavor!r} uses varlen attention: the 0.2.2 estimate "
                       "feeds one document a row and no document metadata; estimate the model's SDPA flavor "
                       "(one document a row takes the same memory through upipe)")
    with fake_mode:
        model.to_empty(device="cpu")
        with torch.no_grad(), values_not_initialised():
            model.init_weights(buffer_device=None)  # creates the buffers (the RoPE table)
    model.train()
    optimizers = spec.build_optimizers_fn([model], job_config.optimizer, parallel_dims)
    return Job(job_config, parallel_dims, model_args, model, optimizers, loss_fn)


@contextmanager
def fused_rope():
    """Fake-tensor RoPE of 0.2.2's Llama3 allocates what a fused kernel does (see
    upipe_compile.estimate.plain_loops' module doc). Other models' RoPE (e.g. Qwen3's
    rotate-half) is counted as eager runs it."""
    from torchtitan.models.llama3.model import model as llama3

    original = llama3.apply_rotary_emb

    def apply_rotary_emb(xq, xk, freqs_cis, positions=None):
        if torch.compiler.is_compiling() or not is_fake(xq):  # traced: the fusion pass reads the real op
            return original(xq, xk, freqs_cis, positions)
        return FusedRoPEFunction.apply(xq, xk)

    with mock.patch.object(llama3, "apply_rotary_emb", apply_rotary_emb):
        yield


MODEL_KERNELS = (fused_rope,)
"""What 0.2.2's models run as fused kernels beyond RMSNorm, for step.py's ``kernel_models``."""


def train_step(job: Job, tracker: PhaseTracker):
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
    clip_and_step(job, label)
    return measured(tracker, saved, logits, after_forward)
