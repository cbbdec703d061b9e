"""The whole-step memory estimate of a torchtitan job: ``python -m upipe_compile.estimate
--config JOB``.

Builds the job as torchtitan's Trainer would (estimate_job.py), on fake CPU tensors over a
fake process group of the job's world size, runs the release's training step
(estimate_step.py) under the estimate's memory tracker (upipe_compile.estimate.step) with the
CUDA attention kernel's workspaces switched on
(``upipe_compile.measure.workspace.modelled_cuda_kernel``), and reports it through
upipe_compile.estimate.report: the per-rank device peak with a breakdown, the host memory of
offloaded activations, and whether the step fits a GPU and the node's host memory after their
reserves. See docs/estimate.md.
"""

from __future__ import annotations

import contextlib
import time

import torch

from upipe_compile.attention.kernels import DEFAULT_CUDA_KERNEL
from upipe_compile.estimate.fake_sharding import private_sharding_fake_mode
from upipe_compile.estimate.gpu import CUBLAS_WORKSPACES_GIB, DEVICE_RATIO, GIB
from upipe_compile.estimate.plain_loops import plain_stack_loops
from upipe_compile.estimate.report import H100_80GB_GIB, Estimate, result_of, step_time_report
from upipe_compile.estimate.step import offload_staging_bytes, run_step
from upipe_compile.estimate.step_time import ModelShape, Setup
from upipe_compile.integrations.torchtitan.estimate_job import world_size
from upipe_compile.integrations.torchtitan.estimate_release import installed_release
from upipe_compile.integrations.torchtitan.long_context_stack import (attention_outputs_bytes_per_rank,
                                                                    offloaded_share)
from upipe_compile.measure import workspace
from upipe_compile.measure.memory import counting_eager_calls
from upipe_compile.options import resolved_heads_per_stage
from upipe_compile.stack.host_memory import HOST_BUDGET_GIB


def estimate(job_config, *, gpu_gib: float = H100_80GB_GIB, gpus_per_node: int = 8,
             host_gib: float = HOST_BUDGET_GIB, cuda_kernel: str | None = DEFAULT_CUDA_KERNEL,
             device_ratio: float | None = None, fused_kernels: bool | None = None) -> Estimate:
    """Measure one training step of ``job_config`` (a torchtitan JobConfig). Runs in a fresh
    fake default process group: call it where no process group exists. ``cuda_kernel=None``:
    the same job with CPU kernels (no GPU workspace; RMSNorm and RoPE as eager CPU torch runs
    them), what a CPU run of the job allocates (benchmarks/estimate_check.py).
    ``device_ratio``: applied to the peak above the persistent state before it meets the
    budget; None is gpu.DEVICE_RATIO for a GPU job, 1.0 with ``cuda_kernel=None``.
    ``fused_kernels``: RMSNorm and RoPE counted as fused kernels (what inductor makes of them on
    any device); None: with a ``cuda_kernel`` only."""
    if device_ratio is None:
        device_ratio = DEVICE_RATIO if cuda_kernel else 1.0
    if not device_ratio >= 1.0:
        raise ValueError(f"device_ratio must be at least 1 (a device holds what the step holds), got {device_ratio!r}")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from upipe_compile.measure.memory import fake_process_group

    release = installed_release()
    facts = release.job_facts(job_config)  # the job's settings, read once
    start = time.time()
    world = world_size(job_config)
    if torch.cuda.is_available():
        # On a GPU node the step's first CUDA call would initialise CUDA inside a checkpointed
        # block's forward, which torch.utils.checkpoint refuses: initialise it before.
        torch.cuda.init()
    kernel_workspace = workspace.modelled_cuda_kernel(cuda_kernel) if cuda_kernel else contextlib.nullcontext()
    with fake_process_group(world), private_sharding_fake_mode(), kernel_workspace, plain_stack_loops(), \
            counting_eager_calls() as eager_calls:
        # Non-fake inputs are the meta-device model and the meshes' rank tensors.
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        job = release.build_job(job_config, fake_mode)
        fused = cuda_kernel is not None if fused_kernels is None else fused_kernels
        memory = run_step(job, fake_mode, train_step=release.train_step, fused_kernels=fused,
                          cuda_ops=cuda_kernel is not None, model_kernels=release.model_kernels,
                          offloaded_state=facts.fsdp_cpu_offload)
    cp, cfg = facts.cp, facts.upipe
    a2a = facts.all_to_all_degree
    heads_per_stage = resolved_heads_per_stage(cfg.heads_per_stage_option, a2a)
    calls = dict(eager_calls)
    modelled, modelled_host = {}, {}
    if cuda_kernel:
        modelled["cublas_workspaces"] = CUBLAS_WORKSPACES_GIB
    if facts.fsdp_cpu_offload:
        modelled["cpu_offload_staging"] = _gib(offload_staging_bytes(job.model))
    if cp > 1 and _op_selective_ac(facts):
        # The compiled path saves every layer's upipe::attention / attention_block outputs
        # (the ops are in the save list) where the step run here recomputes them.
        kept_bytes = attention_outputs_bytes_per_rank(job_config, job.model_args, cp, _param_dtype(job_config),
                                                      fused="fused block" in calls)
        # The offloaded blocks' go to the host beside their inputs (on the device each comes
        # back with its block's input, where full AC's recompute, what the step ran, makes the
        # same tensors); the other blocks' stay on the device.
        on_host = offloaded_share(kept_bytes, cfg, job.model_args.n_layers)
        if on_host:
            modelled_host["kept_attention_outputs"] = _gib(on_host)
        if kept_bytes > on_host:
            modelled["sac_saved_attention_outputs"] = _gib(kept_bytes - on_host)
    return result_of(
        memory, seq_len=job_config.training.seq_len, cuda_kernel=cuda_kernel, world=world, cp=cp,
        heads_per_stage=heads_per_stage, ring_degree=cp // a2a, modelled=modelled, modelled_host=modelled_host,
        gpu_gib=gpu_gib, gpus_per_node=gpus_per_node, host_gib=host_gib, device_ratio=device_ratio,
        step_time=step_time_report(shape_of(job.model, job.model_args),
                                   step_setup(job_config, heads_per_stage, cp // a2a, facts)),
        attention_calls=calls, start=start, tp=facts.tp,
    )


def _op_selective_ac(facts) -> bool:
    """Whether the blocks keep upipe's attention ops' outputs from the forward: selective op
    AC, or full AC with upipe's keep_attention (selective op AC that keeps only them)."""
    return facts.ac == "selective_op" or (facts.ac == "full" and facts.upipe.keep_attention)


def step_setup(job_config, heads_per_stage: int, ring_degree: int, facts=None) -> Setup:
    """The step-time model's view of a job (``facts``: its job facts where already read)."""
    facts = facts or installed_release().job_facts(job_config)
    cfg = facts.upipe
    return Setup(seq_len=facts.seq_len, batch=facts.local_batch_size, cp=facts.cp, heads_per_stage=heads_per_stage,
                 ring_degree=ring_degree, full_ac=facts.ac == "full", keep_attention=cfg.keep_attention,
                 recompute_attention_output=cfg.recompute_attention_output,
                 offload_block_inputs=cfg.offload_block_inputs, element_bytes=_param_dtype(job_config).itemsize,
                 offload_state=facts.fsdp_cpu_offload,
                 fsdp_shards=world_size(job_config) // (job_config.parallelism.data_parallel_replicate_degree * facts.tp),
                 tp=facts.tp, ep=facts.ep, moe_tiles=bool(facts.moe and cfg.mlp_tile_tokens))


def shape_of(model, model_args) -> ModelShape:
    """The shape of a torchtitan model (0.2.2 model_args, or 0.3's dims under those names): a
    layer's matmul weights counted from the (meta or fake) modules themselves, the mean over
    the layers; a MoE layer's routed experts (its 3-D weights, one slice per expert) also by
    what one token runs through: ``top_k`` of ``num_experts``."""
    layers = list(model.layers.values())
    weights = active = top_k = 0
    for layer in layers:
        router = getattr(getattr(layer, "moe", None), "router", None)
        share = router.top_k / router.num_experts if router is not None else 1.0
        top_k = max(top_k, router.top_k if router is not None else 0)
        for p in layer.parameters():
            if p.dim() >= 2:
                weights += p.numel()
                active += p.numel() * (share if p.dim() == 3 else 1.0)
    heads = model_args.n_heads
    head_dim = getattr(model_args, "head_dim", None) or model_args.dim // heads
    return ModelShape(n_layers=model_args.n_layers, dim=model_args.dim, q_heads=heads,
                      kv_heads=model_args.n_kv_heads or heads, head_dim=head_dim, layer_weights=weights // len(layers),
                      vocab_size=model_args.vocab_size, active_layer_weights=round(active / len(layers)),
                      experts_per_token=top_k)


def _param_dtype(job_config):
    from torchtitan.config import TORCH_DTYPE_MAP

    return TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]


def _gib(x: int) -> float:
    return round(x / GIB, 6)
