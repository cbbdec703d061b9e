"""torchtitan 0.3: the job check (:func:`check_config`: job_rules.py's rules over the facts
release_03/facts.py reads) and the model's parallelization (:func:`parallelize_upipe`), in the order of 0.3's own
``parallelize_llama``: activation checkpointing -> per-block torch.compile -> FSDP.

Differences from 0.3's ``parallelize_llama`` when ``compile.backend = "upipe"``:

- no ``apply_cp_to_forward``: torchtitan's own context parallelism is never installed; the
  UPipe rewrite inside each compiled block does the context parallelism instead;
- each TransformerBlock is compiled with ``backend="upipe"`` over the "cp" mesh (or its
  ``(cp_ring, cp_a2a)`` unflattening with ``upipe.ring_degree``), the ``upipe`` section's
  options;
- selective AC also saves upipe's attention ops; full AC with ``upipe.keep_attention`` keeps
  them and recomputes the rest;
- FSDP over torchtitan's "fsdp" mesh (dp_shard x cp) exactly as 0.3 does (partial-DTensor
  backend), with plain SUM reductions on gloo;
- with ``parallelism.tensor_parallel_degree`` > 1 or MoE layers (with or without expert
  parallelism), upipe compiles each layer's attention alone, before 0.3's own
  ``model.parallelize`` (TP with sequence parallelism, EP), whose ``local_map`` hands it the
  TP rank's heads; UPipe's all-to-all and stage loop then run over the CP group on those
  heads, and the rest of each block is 0.3's own eager modules: TP's DTensor ops, the
  experts' dispatch (compile_blocks.compile_attention_alone); beside EP, FSDP shards the
  experts over 0.3's "efsdp" mesh. Beside MoE layers without TP the block-input offload runs,
  and ``upipe.mlp_tile_tokens`` runs each MoE layer's tokens in tiles (stack/tiled_moe.py).

The inputs are sharded by the Trainer (release_03/trainer.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

from upipe_compile.errors import UnsupportedAttention
from upipe_compile.integrations.torchtitan import long_context_stack
from upipe_compile.integrations.torchtitan.compile_blocks import (compile_attention_alone, compile_blocks,
                                                                  upipe_enabled)
from upipe_compile.integrations.torchtitan.fsdp_on_gloo import sum_reductions_on_gloo
from upipe_compile.integrations.torchtitan.job_rules import job_problems, refuse
from upipe_compile.integrations.torchtitan.measurement import is_measuring
from upipe_compile.integrations.torchtitan.release_03.facts import SPELLING, job_facts
from upipe_compile.integrations.torchtitan.release_03.rope_positions import compute_rope_rows
from upipe_compile.stack.keep_attention import KEPT_OPS, keep_attention


def config_problems(config) -> list[str]:
    """Everything a 0.3 job with ``compile.backend = "upipe"`` gets wrong, each naming the
    field to change (empty: nothing). Reads the config only: runs before any process group."""
    return job_problems(job_facts(config))


def check_config(config) -> None:
    """Refuse, before the first step, a 0.3 job upipe cannot run exactly."""
    refuse(config_problems(config), SPELLING)


def _apply_ac(model: nn.Module, ac_config, upipe, dump_folder: str) -> None:
    """torchtitan's AC, with upipe's attention ops saved by selective AC, and full AC that
    keeps them with ``upipe.keep_attention``."""
    if ac_config is None:
        return
    if isinstance(ac_config, FullAC.Config) and upipe.keep_attention:
        for layer_id, block in model.layers.named_children():
            model.layers.register_module(layer_id, checkpoint_wrapper(
                block, context_fn=keep_attention, preserve_rng_state=ac_config.preserve_rng_state,
                determinism_check=ac_config.determinism_check, early_stop=False, debug=ac_config.debug))
        return
    if isinstance(ac_config, SelectiveAC.Config):
        SelectiveACKeepingUPipe(ac_config, dump_folder=dump_folder).apply(model)
        return
    ac_config.build(dump_folder=dump_folder).apply(model)


class SelectiveACKeepingUPipe(SelectiveAC):
    """torchtitan's op-level selective AC, whose save set also holds upipe's attention ops."""

    def get_save_ops(self) -> set:
        return set(super().get_save_ops()) | KEPT_OPS


def parallelize_upipe(model: nn.Module, *, parallel_dims, training, parallelism, compile_config, ac_config,
                      dump_folder: str, job, stock):
    """0.3's ParallelizeFunction with UPipe context parallelism (``job``: the Trainer's config,
    bound by :func:`trainer.take_over`; ``stock``: the model's own function,
    run unchanged when the job does not compile with backend "upipe")."""
    if not upipe_enabled(job):
        return stock(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                     compile_config=compile_config, ac_config=ac_config, dump_folder=dump_folder)
    # (the loss chunks are 0.3's own ChunkedLossWrapper's)
    problems = long_context_stack.mlp_tile_problems(model, job.upipe) + long_context_stack.offload_problems(
        model, job.upipe, SPELLING)
    if problems:
        raise UnsupportedAttention("\n".join(problems))
    long_context_stack.tile_mlps(model, job.upipe)
    compute_rope_rows(model)  # each rank computes its own tokens' RoPE rows: no table
    attention_alone = parallel_dims.tp_enabled or _has_moe(model)
    if attention_alone:
        compile_attention_alone(model, job, parallel_dims)  # before parallelize: inside its local_map
    if parallel_dims.tp_enabled or parallel_dims.ep_enabled:
        model.parallelize(parallel_dims)
    _apply_ac(model, ac_config, job.upipe, dump_folder)
    long_context_stack.count_tiled_moe_tokens_twice_where_recomputed(model)
    if not attention_alone:
        compile_blocks(model, job, parallel_dims)
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    dp_mesh = parallel_dims.get_mesh(names)
    apply_fsdp_to_decoder(
        model, dp_mesh, ep_degree=parallel_dims.ep, edp_mesh=_expert_fsdp_mesh(parallel_dims),
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        # measuring, the estimate's tracker moves the offloaded state to the host itself
        pp_enabled=parallel_dims.pp_enabled, cpu_offload=training.enable_cpu_offload and not is_measuring(job),
        reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
        enable_symm_mem=parallelism.enable_fsdp_symm_mem,
    )
    sum_reductions_on_gloo(model, dp_mesh)
    model_dims = model_dims_03(job.model_spec.model)
    long_context_stack.install_offload(model, job, parallel_dims, model_dims)
    return model


def _has_moe(model: nn.Module) -> bool:
    return any(getattr(block, "moe_enabled", False) for block in model.layers.values())


def _expert_fsdp_mesh(parallel_dims):
    """The mesh FSDP shards the experts over beside EP (as 0.3's parallelize_qwen3 chooses it)."""
    if not parallel_dims.ep_enabled:
        return None
    names = ["dp_replicate", "efsdp"] if parallel_dims.dp_replicate_enabled else ["efsdp"]
    return parallel_dims.get_optional_mesh(names)


def model_dims_03(model_config):
    """What the offload and the estimate read of a 0.3 model config, under 0.2.2's
    ``model_args`` names."""
    attention = model_config.layers[0].attention
    return SimpleNamespace(
        n_layers=len(model_config.layers), dim=model_config.dim, vocab_size=model_config.vocab_size,
        n_heads=attention.n_heads, n_kv_heads=getattr(attention, "n_kv_heads", None) or attention.n_heads,
        head_dim=getattr(attention, "head_dim", None) or model_config.dim // attention.n_heads,
    )
