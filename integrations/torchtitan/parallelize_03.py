"""torchtitan 0.3: what a job must be for UPipe context parallelism (:func:`config_problems`)
and the model's parallelization (:func:`parallelize_upipe`), in the order of 0.3's own
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
  backend), with plain SUM reductions on gloo.

The inputs are sharded by the Trainer (trainer_03.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
from torchtitan.models.common.attention import BaseAttention, FlexAttention, VarlenAttention

from upipe_compile.errors import UnsupportedAttention
from upipe_compile.integrations.torchtitan import stack
from upipe_compile.integrations.torchtitan.rope_positions import compute_rope_rows
from upipe_compile.integrations.torchtitan.parallelize import (
    _sum_reductions_on_gloo, compile_blocks, upipe_enabled,
)
from upipe_compile.options import option_problems
from upipe_compile.sharding import sequence_multiple
from upipe_compile.stack.keep_attention import KEPT_OPS, keep_attention


MODELS = ("llama3", "qwen3")
"""The 0.3 models whose own parallelize upipe's replaces (dense flavors)."""

SPMD_BACKEND = "partial_dtensor"
"""0.3's DTensor-FSDP path, the one whose parallelize applies CP as a separate step (the one
upipe replaces); "spmd_types" and "full_dtensor" annotate every tensor with its CP sharding."""

FLEX_FIX = ('use varlen attention: model_registry(flavor, attn_backend="varlen") (upipe rewrites '
            "varlen_attn over the documents of the whole sequence; Flex masks it cannot read)")



def attention_configs(config):
    """Every attention config of the job's model: (fqn, config)."""
    return [(fqn, cfg) for fqn, cfg, _, _ in config.model_spec.model.traverse(BaseAttention.Config)]


def config_problems(config) -> list[str]:
    """Everything a 0.3 job with ``compile.backend = "upipe"`` gets wrong, each naming the
    field to change (empty: nothing). Reads the config only: runs before any process group."""
    cfg, p, training = config.upipe, config.parallelism, config.training
    cp, ring = p.context_parallel_degree, cfg.ring_degree
    problems = []
    if "model" not in config.compile.components:
        problems.append('compile.components must contain "model" (the blocks are what upipe rewrites)')
    for name in ("tensor_parallel_degree", "pipeline_parallel_degree", "expert_parallel_degree"):
        if getattr(p, name) > 1:
            problems.append(f"parallelism.{name} = {getattr(p, name)}: not supported with compile.backend = "
                            "\"upipe\" (not implemented)")
    if p.spmd_backend != SPMD_BACKEND:
        problems.append(f"parallelism.spmd_backend = {p.spmd_backend!r}: upipe's context parallelism runs on the "
                        f"{SPMD_BACKEND!r} backend (plain tensors inside the blocks); set it")
    if cp > 1 and p.context_parallel_load_balancer is not None:
        problems.append(f"parallelism.context_parallel_load_balancer = {p.context_parallel_load_balancer!r}: "
                        "torchtitan's load balancer reorders the sequence for its own CP; upipe lays it out "
                        "itself (contiguous shards, zigzag over the ring with upipe.ring_degree): set it to None")
    if cp > 1 and config.validator.enable:
        problems.append("validator.enable = True: torchtitan's validator shards its batches for torchtitan's own "
                        "context parallelism, not upipe's; set it to False")
    if training.seq_len % cp:
        problems.append(f"training.seq_len = {training.seq_len} must be divisible by "
                        f"parallelism.context_parallel_degree = {cp}")
    if ring < 1 or cp % ring:
        problems.append(f"upipe.ring_degree = {ring} must be >= 1 and divide parallelism.context_parallel_degree = {cp}")
    elif ring > 1 and training.seq_len % sequence_multiple(cp, ring):
        problems.append(f"training.seq_len = {training.seq_len} must be divisible by 2 x context_parallel_degree = "
                        f"{sequence_multiple(cp, ring)} with upipe.ring_degree = {ring} (two zigzag chunks per ring "
                        "rank)")
    a2a = cfg.all_to_all_degree(cp)
    problems += [f"upipe.{p_}" for p_ in option_problems(
        world=a2a, heads_per_stage=cfg.heads_per_stage_option, prefetch=cfg.prefetch,
        inner_backend=cfg.inner_backend, fuse_projections=cfg.fuse_projections,
        recompute_attention_output=cfg.recompute_attention_output)]
    problems += [p_ for p_ in (stack.count_problem(cfg, "mlp_tile_tokens"), stack.count_problem(cfg, "loss_chunk_tokens"))
                 if p_]
    if cfg.loss_chunk_tokens and not isinstance(config.loss, ChunkedLossWrapper.Config):
        problems.append(f"upipe.loss_chunk_tokens = {cfg.loss_chunk_tokens!r} sizes the chunks of torchtitan 0.3's own "
                        f"chunked loss, but loss is {type(config.loss).__qualname__}: set "
                        "loss=ChunkedLossWrapper.Config(loss_fn=...)")
    ac = config.activation_checkpoint
    if isinstance(ac, MemoryBudgetAC.Config):
        problems.append("activation_checkpoint = MemoryBudgetAC.Config: not supported with upipe (its budget is "
                        "solved by inductor's partitioner, which upipe's ops sit outside); use FullAC or SelectiveAC")
    full_ac = isinstance(ac, FullAC.Config)
    if cfg.keep_attention and not full_ac:
        problems.append(f"upipe.keep_attention = True needs activation_checkpoint = FullAC.Config() (got "
                        f"{type(ac).__qualname__}): without a recompute there is no second attention forward "
                        "to save (SelectiveAC keeps upipe's attention ops already)")
    if cfg.keep_attention and cfg.recompute_attention_output:
        problems.append("upipe.keep_attention and upipe.recompute_attention_output ask for opposite things: set one")
    if cfg.offload_block_inputs and not full_ac:
        problems.append(f"upipe.offload_block_inputs = True needs activation_checkpoint = FullAC.Config() (got "
                        f"{type(ac).__qualname__}): only then is the block input all a block saves")
    problems += _model_problems(config, a2a)
    return problems


def _model_problems(config, a2a: int) -> list[str]:
    spec = config.model_spec
    if spec is None:
        return ["model_spec is not set: upipe parallelizes the model the config names"]
    if spec.name not in MODELS:
        hybrid = (" Its linear-attention layers (Gated DeltaNet, fla's kernels) mix tokens along the sequence "
                  "and have no context-parallel form here: they would run on each rank's shard alone. Qwen3.5 "
                  "runs exactly through upipe's transformers integration (upipe_compile.integrations."
                  "transformers.register()), its mixers as stage loops."
                  if spec.name == "qwen3_5" else "")
        return [f"model_spec.name = {spec.name!r}: upipe's 0.3 Trainer runs {' and '.join(MODELS)} (dense).{hybrid}"]
    problems = []
    if spec.parallelize_fn is not stock_parallelize(spec.name):
        problems.append(f"model_spec.parallelize_fn is {getattr(spec.parallelize_fn, '__qualname__', spec.parallelize_fn)}, "
                        f"not torchtitan's parallelize for {spec.name!r}: upipe replaces that one (without its "
                        "apply_cp_to_forward) and cannot tell what another does")
    if any(getattr(layer, "moe", None) is not None for layer in spec.model.layers):
        problems.append(f"model_spec.flavor = {spec.flavor!r} has MoE layers: not supported with upipe's 0.3 Trainer "
                        "(not implemented); use a dense flavor")
    uses_varlen = False
    for fqn, attention in attention_configs(config):
        inner = getattr(attention, "inner_attention", None)
        if isinstance(inner, FlexAttention.Config):
            problems.append(f"{fqn}.inner_attention is FlexAttention: {FLEX_FIX}")
            break
        uses_varlen |= isinstance(inner, VarlenAttention.Config)
        heads = getattr(attention, "n_heads", None)
        if heads is not None and heads % a2a:
            problems.append(f"{fqn}.n_heads = {heads} is not divisible by the all-to-all degree {a2a} "
                            "(context_parallel_degree / upipe.ring_degree): raise upipe.ring_degree")
            break
        if heads is not None and config.upipe.heads_per_stage and heads % config.upipe.heads_per_stage:
            problems.append(f"upipe.heads_per_stage = {config.upipe.heads_per_stage} must divide {fqn}.n_heads = {heads}")
            break
    if uses_varlen and config.training.local_batch_size != 1:
        problems.append(f"training.local_batch_size = {config.training.local_batch_size}: varlen attention needs 1 "
                        "(one packed row of documents per rank; varlen_attn flattens the batch into one row)")
    return problems


def check_config(config) -> None:
    """Refuse, before the first step, a 0.3 job upipe cannot run exactly."""
    problems = config_problems(config)
    if problems:
        raise UnsupportedAttention('torchtitan job cannot run with compile.backend = "upipe":\n'
                                   + "".join(f"  - {p}\n" for p in problems))


def stock_parallelize(model_name: str):
    """torchtitan 0.3's own parallelize function for ``model_name`` (None: not one upipe knows)."""
    if model_name == "llama3":
        from torchtitan.models.llama3.parallelize import parallelize_llama

        return parallelize_llama
    if model_name == "qwen3":
        from torchtitan.models.qwen3.parallelize import parallelize_qwen3

        return parallelize_qwen3
    return None


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
    bound by :func:`trainer_03.take_over`; ``stock``: the model's own function,
    run unchanged when the job does not compile with backend "upipe")."""
    if not upipe_enabled(job):
        return stock(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                     compile_config=compile_config, ac_config=ac_config, dump_folder=dump_folder)
    problems = stack.mlp_tile_problems(model, job.upipe)  # (the loss chunks are 0.3's own ChunkedLossWrapper's)
    if problems:
        raise UnsupportedAttention("\n".join(problems))
    stack.tile_mlps(model, job.upipe)
    compute_rope_rows(model)  # each rank computes its own tokens' RoPE rows: no table
    _apply_ac(model, ac_config, job.upipe, dump_folder)
    compile_blocks(model, job, parallel_dims)
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    dp_mesh = parallel_dims.get_mesh(names)
    apply_fsdp_to_decoder(
        model, dp_mesh,
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        pp_enabled=parallel_dims.pp_enabled, cpu_offload=training.enable_cpu_offload,
        reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
        enable_symm_mem=parallelism.enable_fsdp_symm_mem,
    )
    _sum_reductions_on_gloo(model, dp_mesh)
    model_dims = model_dims_03(job.model_spec.model)
    stack.install_offload(model, job, parallel_dims, model_dims)
    return model


def model_dims_03(model_config):
    """What the offload and the estimate read of a 0.3 model config, under 0.2.2's
    ``model_args`` names."""
    attention = model_config.layers[0].attention
    return SimpleNamespace(
        n_layers=len(model_config.layers), dim=model_config.dim, vocab_size=model_config.vocab_size,
        n_heads=attention.n_heads, n_kv_heads=getattr(attention, "n_kv_heads", None) or attention.n_heads,
        head_dim=getattr(attention, "head_dim", None) or model_config.dim // attention.n_heads,
    )
