"""The long-context stack on a torchtitan model, from the [upipe] keys: sequence-tiled MLP (a MoE
layer's tokens in tiles), chunked output projection + loss, offload of checkpointed block
inputs. Each piece is a plain module of upipe_compile (tiled_mlp, tiled_moe, chunked_loss,
offload); this file only checks the keys, applies them to torchtitan's model at the right
point of ``parallelize_llama_upipe`` and builds the matching loss.

Where each piece goes, relative to torchtitan's AC -> per-block compile -> FSDP:

- tiled MLP and the lazy output projection replace submodules of the *raw* model (before AC),
  a tiled MoE layer keeps its module (its class gains a tiled forward), all keeping parameter
  names, so AC, compile, FSDP, init_weights and checkpoints see the same parameters under the
  same state-dict keys;
- the offload hooks go on the final per-block modules (after FSDP), outside the compiled
  region: they see what the compiled, checkpointed block saves for backward.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn as nn

from upipe_compile.stack.chunked_loss import LazyOutputProjection, lazy_logits_cross_entropy
from upipe_compile.integrations.torchtitan.config import DEFAULT_HOST_RESERVE, upipe_config
from upipe_compile.options import resolved_heads_per_stage
from upipe_compile.integrations.torchtitan.measurement import host_device
from upipe_compile.stack.host_memory import node_host_memory_problem, ranks_per_node, size_text
from upipe_compile.stack.offload import BlockInputOffloader, host_bytes_per_rank
from upipe_compile.stack.tiled_mlp import SequenceTiledSwiGLU, swiglu_problem
from upipe_compile.stack.tiled_moe import moe_tiling_problem, tile_moe_tokens

log = logging.getLogger(__name__)

STACK_KEYS = ("offload_block_inputs", "mlp_tile_tokens", "loss_chunk_tokens")


def stack_enabled(cfg) -> list[str]:
    """The stack keys the job turns on."""
    return [key for key in STACK_KEYS if getattr(cfg, key)]


def _token_mixers(block: nn.Module) -> tuple[str, nn.Module | None]:
    """A block's feed-forward: its MoE layer (0.3's MoE blocks) or its SwiGLU."""
    if getattr(block, "moe_enabled", False):
        return "moe", block.moe
    return "feed_forward", getattr(block, "feed_forward", None)


def mlp_tile_problems(model: nn.Module, cfg) -> list[str]:
    """What ``mlp_tile_tokens`` cannot tile on this model (torchtitan 0.2.2 and 0.3)."""
    if cfg.mlp_tile_tokens:
        for name, block in model.layers.named_children():
            attr, module = _token_mixers(block)
            if module is None:
                where, problem = f"layers.{name}", "it has neither a feed_forward nor a MoE layer"
            else:
                where = f"layers.{name}.{attr}"
                problem = moe_tiling_problem(module) if attr == "moe" else swiglu_problem(module)
            if problem:
                return [f"[upipe] mlp_tile_tokens = {cfg.mlp_tile_tokens} cannot tile {where}: {problem}"]
    return []


def tile_mlps(model: nn.Module, cfg) -> None:
    """Each block's SwiGLU over tiles of ``mlp_tile_tokens`` tokens, each MoE layer's tokens in
    tiles of as many (raw model: before AC/compile/FSDP; after AC,
    :func:`count_tiled_moe_tokens_twice_where_recomputed`)."""
    if cfg.mlp_tile_tokens:
        for block in model.layers.values():
            attr, module = _token_mixers(block)
            if attr == "moe":
                tile_moe_tokens(module, cfg.mlp_tile_tokens)
            else:
                block.feed_forward = SequenceTiledSwiGLU(module, cfg.mlp_tile_tokens)
        log.info("upipe: the feed-forward of %d blocks tiled by %d tokens", len(model.layers), cfg.mlp_tile_tokens)


def count_tiled_moe_tokens_twice_where_recomputed(model: nn.Module) -> None:
    """After AC: a tiled MoE layer counts its tokens as the untiled one does, twice where AC
    recomputes its block, as torchtitan's bias update tells it (it then halves the counts)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl

    for block in model.layers.values():
        attr, module = _token_mixers(block)
        if attr == "moe" and hasattr(module, "upipe_block_recomputed"):
            module.upipe_block_recomputed = getattr(block, "checkpoint_impl", None) is CheckpointImpl.NO_REENTRANT


def model_problems(model: nn.Module, job_config, spelling) -> list[str]:
    """What the stack keys cannot apply to on this model (``spelling``: the release's
    job_rules.Spelling, how its job names the keys)."""
    cfg = upipe_config(job_config)
    problems = mlp_tile_problems(model, cfg)
    if cfg.loss_chunk_tokens:
        output = getattr(model, "output", None)
        if not isinstance(output, nn.Linear) or output.bias is not None:
            problems.append(f"[upipe] loss_chunk_tokens = {cfg.loss_chunk_tokens} needs the model's `output` to be "
                            f"a bias-free nn.Linear, got {type(output).__name__}")
    return problems + offload_problems(model, cfg, spelling)


def offload_problems(model: nn.Module, cfg, spelling) -> list[str]:
    """What offloading block inputs cannot do on this model, spelled as the release's job
    names the keys (``spelling``: job_rules.Spelling)."""
    offload = spelling.key("upipe.offload_block_inputs")
    if not cfg.offload_block_inputs:
        return []
    if not len(getattr(model, "layers", ())):
        return [f"{offload} = {spelling.value(True)} needs a model with `layers`"]
    if cfg.blocks_kept_on_device >= len(model.layers):
        return [f"{spelling.key('upipe.blocks_kept_on_device')} = {cfg.blocks_kept_on_device} keeps every one of "
                f"the model's {len(model.layers)} blocks on the device: offload nothing ({offload} = "
                f"{spelling.value(False)}) or keep fewer"]
    return []



def apply_module_swaps(model: nn.Module, job_config) -> None:
    """Tiled MLP and lazy output projection, on the raw model (before AC/compile/FSDP)."""
    cfg = upipe_config(job_config)
    tile_mlps(model, cfg)
    if cfg.loss_chunk_tokens:
        model.output = LazyOutputProjection(model.output)
        log.info("upipe: output projection deferred to the loss, %d tokens per chunk", cfg.loss_chunk_tokens)


def keep_output_weight_for_loss(model: nn.Module, job_config) -> None:
    """The chunked loss multiplies by the output weight after the output module's forward has
    returned, so FSDP must not reshard that group after forward (torchtitan only does so with
    fsdp_reshard_after_forward = "always")."""
    from torch.distributed.fsdp import FSDPModule

    if upipe_config(job_config).loss_chunk_tokens and isinstance(model.output, FSDPModule):
        if job_config.parallelism.fsdp_reshard_after_forward == "always":
            log.warning('upipe: [upipe] loss_chunk_tokens keeps the output weight gathered until the loss '
                        'ran: [parallelism] fsdp_reshard_after_forward = "always" is not applied to norm/output')
        model.output.set_reshard_after_forward(False, recurse=False)


def activation_dtype(job_config, parallel_dims) -> torch.dtype:
    """The residual stream's dtype: FSDP's param dtype (the blocks compute in it), else fp32."""
    from torchtitan.config import TORCH_DTYPE_MAP

    if parallel_dims.fsdp_enabled:
        return TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]
    return torch.float32


def value_head_dim(model_args) -> int:
    """The attention output's head dim: MLA's ``v_head_dim`` (its q/k heads are wider),
    else the model's ``head_dim`` (Qwen3's is not dim / n_heads), else dim / n_heads (Llama)."""
    for name in ("v_head_dim", "head_dim"):
        if getattr(model_args, name, None):
            return getattr(model_args, name)
    return model_args.dim // model_args.n_heads


def attention_outputs_bytes_per_rank(job_config, model_args, cp: int, dtype: torch.dtype, fused: bool) -> int:
    """What every layer's kept attention ops' outputs take on one rank (``keep_attention``, or
    selective op AC, which saves the ops too): ``upipe::attention``'s output ``[B, Hq, S/P, D]``
    in ``dtype`` and per-stage LSE ``[B, m, S/R]`` fp32 (over the all-to-all's ranks' tokens: the
    ring rank's share with a ring of R), and with ``fused`` blocks their output ``[B, S/P, dim]``."""
    from upipe_compile.attention.schedule import plan_stages

    cfg = upipe_config(job_config)
    a2a = cfg.all_to_all_degree(cp)
    schedule = plan_stages(model_args.n_heads, model_args.n_kv_heads or model_args.n_heads, a2a,
                           resolved_heads_per_stage(cfg.heads_per_stage_option, a2a))
    batch, seq = job_config.training.local_batch_size, job_config.training.seq_len
    element = torch.empty((), dtype=dtype).element_size()
    out = batch * model_args.n_heads * (seq // cp) * value_head_dim(model_args) * element
    lse = len(schedule.stages) * batch * schedule.q_per_rank * (seq // (cp // a2a)) * 4
    block_output = batch * (seq // cp) * model_args.dim * element if fused else 0
    return model_args.n_layers * (out + lse + block_output)


def offloaded_blocks(cfg, n_layers: int) -> int:
    """How many blocks offload their inputs: all but the last ``blocks_kept_on_device``."""
    return max(0, n_layers - cfg.blocks_kept_on_device) if cfg.offload_block_inputs else 0


def offloaded_share(total_bytes: int, cfg, n_layers: int) -> int:
    """What of every block's ``total_bytes`` (kept attention outputs) the offloaded blocks hold."""
    return total_bytes * offloaded_blocks(cfg, n_layers) // n_layers


def offload_host_bytes_per_rank(job_config, parallel_dims, model_args) -> int:
    """Host memory the offloader takes per rank (0 when offload is off): the offloaded blocks'
    inputs, and with ``keep_attention`` their kept attention outputs (fused blocks unless
    ``fuse_projections = false``)."""
    cfg = upipe_config(job_config)
    blocks = offloaded_blocks(cfg, model_args.n_layers)
    if not blocks:
        return 0
    tokens = job_config.training.local_batch_size * job_config.training.seq_len // parallel_dims.cp
    dtype = activation_dtype(job_config, parallel_dims)
    inputs = host_bytes_per_rank(blocks, tokens, model_args.dim, dtype)
    if not cfg.keep_attention:
        return inputs
    outputs = attention_outputs_bytes_per_rank(job_config, model_args, parallel_dims.cp, dtype,
                                               fused=cfg.fuse_projections)
    return inputs + offloaded_share(outputs, cfg, model_args.n_layers)


def fsdp_host_state_bytes(model: nn.Module) -> int:
    """What FSDP's CPU offload (``training.enable_cpu_offload``) keeps on this rank's host: each
    parameter's local shard, its gradient and an Adam-family optimizer's two moments."""
    return sum(4 * p.to_local().nbytes if hasattr(p, "to_local") else 4 * p.nbytes for p in model.parameters())


def check_offload_fits_host(job_config, parallel_dims, model_args, *, total_bytes: int | None = None,
                            ranks: int | None = None, fsdp_state_bytes: int = 0) -> None:
    """Refuse to start when the host memory this node's ranks may use (MemTotal, or the cgroup's
    limit where smaller; ``total_bytes`` overrides it) cannot hold every local rank's offloaded
    inputs (exact-size buffers: all the stack allocates on host), and ``fsdp_state_bytes`` of
    FSDP's own offloaded state per rank, next to the reserve."""
    from upipe_compile.errors import UnsupportedAttention

    cfg = upipe_config(job_config)
    inputs = offload_host_bytes_per_rank(job_config, parallel_dims, model_args)
    if not inputs:
        return
    per_rank = inputs + fsdp_state_bytes
    ranks = ranks if ranks is not None else ranks_per_node(default=parallel_dims.world_size)
    set_reserve = None if cfg.host_memory_reserve_gib == DEFAULT_HOST_RESERVE else cfg.host_memory_reserve_gib
    problem = node_host_memory_problem(per_rank, ranks, set_reserve, total_bytes)
    if problem:
        keep = " (with keep_attention's attention outputs)" if cfg.keep_attention else ""
        if fsdp_state_bytes:
            keep += (f" and [training] enable_cpu_offload = true (FSDP's parameters, gradients and optimizer "
                     f"state: {size_text(fsdp_state_bytes)} of that per rank)")
        raise UnsupportedAttention(
            f"[upipe] offload_block_inputs = true{keep}: {problem}. Lower [training] seq_len, raise "
            "[parallelism] context_parallel_degree (more nodes), raise [upipe] blocks_kept_on_device (their inputs "
            "stay on the GPU), lower [upipe] host_memory_reserve_gib"
            + (", or set [upipe] keep_attention = false (its attention outputs are part of that memory)."
               if keep else "."))
    log.info("upipe: offload needs %.1f GiB host memory per rank, %.1f GiB for %d ranks on this node",
             per_rank / (1 << 30), per_rank * ranks / (1 << 30), ranks)


def _on_fake_process_group() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_backend() == "fake"


def install_offload(model: nn.Module, job_config, parallel_dims, model_args=None) -> BlockInputOffloader | None:
    """Offload hooks on the final per-block modules; checks the node's RAM first (skipped on a
    fake process group: a memory estimate reports host memory instead of refusing).
    ``model_args``: what has the model's ``n_layers`` and ``dim`` (0.2.2: ``model.model_args``)."""
    cfg = upipe_config(job_config)
    if not cfg.offload_block_inputs:
        return None
    if not _on_fake_process_group():
        state = fsdp_host_state_bytes(model) if job_config.training.enable_cpu_offload else 0
        check_offload_fits_host(job_config, parallel_dims, model_args or model.model_args, fsdp_state_bytes=state)
    # On "meta" while the memory estimate measures, so host bytes stay apart from device bytes.
    # The last blocks_kept_on_device blocks are left alone: their inputs stay where AC keeps them.
    blocks = list(model.layers.values())[:offloaded_blocks(cfg, len(model.layers))]
    offloader = BlockInputOffloader(blocks, host_device=host_device(job_config), kept_outputs=cfg.keep_attention)
    model.upipe_offloader = offloader  # for inspection (tests, the memory estimate); not a submodule
    return offloader


def stack_loss_fn(job_config):
    """The chunked loss when [upipe] loss_chunk_tokens is set, else None."""
    chunk = upipe_config(job_config).loss_chunk_tokens
    return functools.partial(lazy_logits_cross_entropy, chunk_tokens=chunk) if chunk else None
