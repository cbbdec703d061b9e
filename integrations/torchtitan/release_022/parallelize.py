"""Llama3 and Qwen3 parallelization with UPipe context parallelism, built from torchtitan 0.2.2's own
pieces (apply_ac, apply_fsdp, apply_ddp) in the same order as its ``parallelize_llama``:
activation checkpointing -> per-block torch.compile -> FSDP/HSDP (or DDP).

Differences from stock ``parallelize_llama`` when ``[compile] backend = "upipe"``:

- no ``apply_cp_to_attention_module``: torchtitan's ring attention (the DTensor CP dispatcher
  and the ``_ContextParallel`` module plan) is never installed; the UPipe rewrite inside the
  compiled blocks does the context parallelism instead;
- ``parallelism.context_parallel_load_balancer`` is forced to None, and the Trainer's
  ``prepare_context_parallel_input`` (routed by this package's import, cp_layout.py) shards
  inputs and labels in upipe's layout (rank r of a 1-D CP holds tokens [r*S/P, (r+1)*S/P)),
  with no positions: each rank's RoPE table is cut to its own rows (rope_rows.py);
- each TransformerBlock is compiled with ``backend="upipe"`` and the CP mesh of torchtitan's
  ParallelDims (``parallel_dims.get_mesh("cp")``; with [upipe] ring_degree its (cp_ring,
  cp_a2a) unflattening, cp_layout.py), U and the inner backend from [upipe];
- FSDP shards over torchtitan's "fsdp" mesh (dp_shard x cp), as stock torchtitan does, so
  gradients are reduced over data-parallel x CP ranks; HSDP/DDP over dp_replicate likewise.

The long-context stack ([upipe] mlp_tile_tokens, loss_chunk_tokens, offload_block_inputs;
long_context_stack.py) is applied here too: module swaps before AC, offload hooks after FSDP.

With any other [compile] backend the stock ``parallelize_llama`` runs unchanged (and stack
keys are refused: they would do nothing).

For a job config marked by ``measurement.mark_for_measurement`` (the whole-step memory
estimate's) nothing is compiled: each block's SDPA runs eagerly through the real stage loops
instead (see measurement.py).
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from upipe_compile.errors import UnsupportedAttention
from upipe_compile.integrations.torchtitan import long_context_stack
from upipe_compile.integrations.torchtitan.compile_blocks import (
    BACKEND, compile_blocks, compile_options, inner_backend, upipe_enabled,
)
from upipe_compile.integrations.torchtitan.config import upipe_config
from upipe_compile.integrations.torchtitan.cp_layout import forget_layout, upipe_cp_mesh
from upipe_compile.integrations.torchtitan.release_022.document_attention import use_document_attention
from upipe_compile.integrations.torchtitan.fsdp_on_gloo import sum_reductions_on_gloo
from upipe_compile.integrations.torchtitan.job_rules import STACK_RULES, job_problems, refuse
from upipe_compile.integrations.torchtitan.measurement import is_measuring
from upipe_compile.integrations.torchtitan.release_022.facts import SPELLING, job_facts
from upipe_compile.integrations.torchtitan.release_022.rope_rows import keep_local_rope_rows
from upipe_compile.stack.keep_attention import KEPT_OPS

__all__ = ["BACKEND", "build_loss_fn_upipe", "check_job", "compile_blocks", "compile_options",
           "parallelize_llama_upipe", "parallelize_qwen3_upipe", "upipe_enabled"]

log = logging.getLogger(__name__)

def refuse_stack_without_upipe(job_config) -> None:
    """Stack keys only act on the upipe path; set without it they would be silently ignored."""
    keys = long_context_stack.stack_enabled(upipe_config(job_config))
    if keys and not upipe_enabled(job_config):
        raise UnsupportedAttention(
            f"[upipe] {', '.join(keys)} only apply with [compile] enable = true and backend = \"upipe\" "
            f"(got enable = {job_config.compile.enable}, backend = {job_config.compile.backend!r})"
        )


def check_job(job_config, parallel_dims, model_args=None, model=None) -> None:
    """Everything the UPipe path refuses (job_rules.py), with the TOML key to change; with
    ``model``, what the stack keys cannot apply to on it."""
    problems = job_problems(job_facts(job_config, parallel_dims, model_args))
    if model is not None:
        problems += long_context_stack.model_problems(model, job_config, SPELLING)
    refuse(problems, SPELLING)


def disable_torchtitan_cp_sharding_balance(job_config) -> None:
    """Ulysses/UPipe need contiguous shards: turn torchtitan's load balancer off. The Trainer
    reads this field every step, so its own input sharding becomes contiguous."""
    lb = job_config.parallelism.context_parallel_load_balancer
    if lb is not None:
        log.info("upipe: parallelism.context_parallel_load_balancer %r -> None (contiguous shards)", lb)
    job_config.parallelism.context_parallel_load_balancer = None


def parallelize_llama_upipe(model: nn.Module, parallel_dims, job_config) -> nn.Module:
    """torchtitan ParallelizeFunction for Llama3 (registered by this package's TrainSpec)."""
    from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list, apply_fsdp, parallelize_llama

    return _parallelize_upipe(model, parallel_dims, job_config, stock=parallelize_llama,
                              sac_save_list=_op_sac_save_list, apply_fsdp=apply_fsdp)


def parallelize_qwen3_upipe(model: nn.Module, parallel_dims, job_config) -> nn.Module:
    """torchtitan ParallelizeFunction for Qwen3's dense flavors; torchtitan's Qwen3 applies
    llama4's (MoE-aware) apply_fsdp, and so does this."""
    from torchtitan.models.llama4.infra.parallelize import apply_fsdp
    from torchtitan.models.qwen3.infra.parallelize import _op_sac_save_list, parallelize_qwen3

    return _parallelize_upipe(model, parallel_dims, job_config, stock=parallelize_qwen3,
                              sac_save_list=_op_sac_save_list, apply_fsdp=apply_fsdp)


def _parallelize_upipe(model: nn.Module, parallel_dims, job_config, *, stock, sac_save_list, apply_fsdp) -> nn.Module:
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.llama3.infra.parallelize import apply_ddp

    refuse_stack_without_upipe(job_config)
    if not upipe_enabled(job_config):
        forget_layout(parallel_dims)
        return stock(model, parallel_dims, job_config)

    check_job(job_config, parallel_dims, getattr(model, "model_args", None), model)
    disable_torchtitan_cp_sharding_balance(job_config)
    use_document_attention(model)  # varlen flavors: document masking through UPipe (document_attention.py)
    long_context_stack.apply_module_swaps(model, job_config)

    if job_config.activation_checkpoint.mode != "none":
        ac_config, save_list = _ac_with_upipe_ops(job_config, sac_save_list)
        apply_ac(model, ac_config, model_compile_enabled=True, op_sac_save_list=save_list,
                 base_folder=job_config.job.dump_folder)

    compile_blocks(model, job_config, parallel_dims)

    if parallel_dims.fsdp_enabled:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        apply_fsdp(
            model, parallel_dims.get_mesh(names),
            param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
            pp_enabled=parallel_dims.pp_enabled,
            # measuring, the estimate's tracker moves the offloaded state to the host itself
            cpu_offload=job_config.training.enable_cpu_offload and not is_measuring(job_config),
            reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward,
        )
        sum_reductions_on_gloo(model, parallel_dims.get_mesh(names))
        _root_buffers_in_param_dtype(model, TORCH_DTYPE_MAP[job_config.training.mixed_precision_param])
        long_context_stack.keep_output_weight_for_loss(model, job_config)
    elif parallel_dims.dp_replicate_enabled:
        mesh = parallel_dims.get_mesh("dp_replicate")
        if parallel_dims.world_size != mesh.size():
            raise RuntimeError("DDP has not supported > 1D parallelism")
        apply_ddp(model, mesh, enable_compile=True)
    if parallel_dims.cp_enabled:  # after the root-buffer cast's hook: the table it cuts is the one kept
        keep_local_rope_rows(model, upipe_cp_mesh(job_config, parallel_dims))
    long_context_stack.install_offload(model, job_config, parallel_dims)
    return model


def _ac_with_upipe_ops(job_config, sac_save_list):
    """The AC config and op save list the blocks get: selective op AC saves upipe's attention
    ops beside torchtitan's list; full AC with [upipe] keep_attention becomes selective op AC
    that saves those ops and nothing else (everything else is recomputed, as under full AC)."""
    import dataclasses

    ac_config = job_config.activation_checkpoint
    if upipe_config(job_config).keep_attention and ac_config.mode == "full":
        return dataclasses.replace(ac_config, mode="selective", selective_ac_option="op"), set(KEPT_OPS)
    return ac_config, set(sac_save_list) | KEPT_OPS


def _root_buffers_in_param_dtype(model: nn.Module, param_dtype: torch.dtype) -> None:
    """FSDP casts each block's floating-point inputs to the param dtype, and activation
    checkpointing keeps every block's inputs until its backward. A real fp32 buffer the model
    hands to every block (Qwen3's ``rope_cache`` [max_seq_len, 2 * head_dim]) thus lives
    once per layer in bf16: 64 GiB per rank for Qwen3-32B at 2M tokens. Casting the buffer
    itself once, before the first forward (init_weights makes it after parallelize), makes
    FSDP's cast a no-op: the same bf16 values reach every block (Qwen3's RoPE casts cos and
    sin to the activations' dtype anyway), held once. Complex buffers (Llama3's
    ``freqs_cis``) are not cast by FSDP and are left alone."""
    if param_dtype == torch.float32:
        return

    def cast_once(module, args, kwargs):
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != param_dtype:
                setattr(module, name, buffer.to(param_dtype))
        return None

    model.register_forward_pre_hook(cast_once, with_kwargs=True)


def build_loss_fn_upipe(job_config, **kwargs):
    """torchtitan's cross-entropy loss, or with [upipe] loss_chunk_tokens the chunked one (the
    model then returns LazyLogits, see long_context_stack.py); with backend "upipe" the loss (no attention in
    it) is compiled with the [upipe] inner backend."""
    from torchtitan.components.loss import build_cross_entropy_loss, cross_entropy_loss

    refuse_stack_without_upipe(job_config)
    if not upipe_enabled(job_config):
        return build_cross_entropy_loss(job_config, **kwargs)
    refuse(job_problems(job_facts(job_config), STACK_RULES), SPELLING)
    loss_fn = long_context_stack.stack_loss_fn(job_config) or cross_entropy_loss
    if "loss" in job_config.compile.components and not is_measuring(job_config):
        return torch.compile(loss_fn, backend=inner_backend(upipe_config(job_config).inner_backend))
    return loss_fn
