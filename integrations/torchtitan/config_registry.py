"""torchtitan 0.3 job configs with UPipe context parallelism:

    torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module upipe_compile.integrations.torchtitan --config llama3_8b_upipe_5m

Each function returns an :class:`UPipeTrainer.Config`: torchtitan's own config for the model
(its ``config_registry``), with

- varlen attention (``varlen_attn`` over the documents of the whole sequence; upipe rewrites
  it, Flex it refuses);
- ``compile.backend = "upipe"``, the switch (``compile.components``: model and loss);
- ``parallelism.context_parallel_degree`` = P, no load balancer (upipe lays the sequence out
  itself), the partial-DTensor FSDP backend;
- full activation checkpointing, and the ``upipe`` section.

Command-line flags change any field: ``--training.seq_len 1048576 --upipe.heads_per_stage 16``.
"""

from __future__ import annotations

import dataclasses

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.config import CompileConfig
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.models.common.config_utils import decoder_vocab_size

from upipe_compile.integrations.torchtitan.config import UPipe
from upipe_compile.integrations.torchtitan.job_rules import SPMD_BACKEND
from upipe_compile.integrations.torchtitan.release_03.trainer import UPipeTrainer

__all__ = ["llama3_8b_upipe", "llama3_8b_upipe_5m", "llama3_8b_upipe_4_nodes", "qwen3_32b_upipe",
           "llama3_70b_upipe_4_nodes", "llama3_70b_upipe_8_nodes", "qwen3_30b_a3b_upipe", "llama3_debugmodel_upipe_cpu",
           "qwen3_debugmodel_upipe_cpu", "qwen3_moe_debugmodel_upipe_cpu", "upipe_job"]

LOSS_CHUNK_TOKENS = 4096
"""Local tokens per chunk (at most) of 0.3's ChunkedLossWrapper (lm_head + loss): 4096 x 128256
x 4 B = 1.96 GiB of fp32 logits per chunk for Llama3's vocabulary."""


def upipe_job(base, *, model_spec, context_parallel_degree: int, seq_len: int, upipe: UPipe,
              loss_chunk_tokens: int = LOSS_CHUNK_TOKENS, inner_components=("model", "loss")) -> UPipeTrainer.Config:
    """torchtitan's config ``base`` as a UPipe job: ``model_spec`` (varlen attention),
    P = ``context_parallel_degree``, one row of ``seq_len`` tokens per step, full AC,
    0.3's ChunkedLossWrapper over chunks of at most ``loss_chunk_tokens`` local tokens
    (``upipe.loss_chunk_tokens``)."""
    config = UPipeTrainer.Config(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, upipe=upipe)
    config.model_spec = model_spec
    config.training.seq_len = seq_len
    config.training.local_batch_size = 1  # one packed row of documents per step
    config.training.disable_cuda_graphs = True  # varlen metadata changes with every batch
    p = config.parallelism
    p.context_parallel_degree = context_parallel_degree
    p.data_parallel_shard_degree = 1  # the job's GPUs are its CP ranks (FSDP shards over them too)
    # torchtitan's 70B and 405B configs shard over TP 8 and pipeline stages: upipe runs no PP
    # beside its CP, and its fused blocks and long-context stack do not run beside TP, so FSDP
    # over all the CP ranks shards the weights instead
    p.tensor_parallel_degree = p.pipeline_parallel_degree = 1
    p.context_parallel_load_balancer = None
    p.spmd_backend = SPMD_BACKEND
    config.compile = CompileConfig(enable=True, components=list(inner_components), backend="upipe")
    config.activation_checkpoint = FullAC.Config()
    # 0.3's chunked loss; UPipeTrainer sets its chunk count from upipe.loss_chunk_tokens
    cross_entropy = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec))
    config.loss = ChunkedLossWrapper.Config(loss_fn=cross_entropy)
    upipe.loss_chunk_tokens = loss_chunk_tokens
    config.validator.enable = False  # its batches would be sharded for torchtitan's own CP
    return config


def _llama3(flavor: str):
    from torchtitan.models.llama3 import model_registry

    return model_registry(flavor, attn_backend="varlen")


def llama3_8b_upipe() -> UPipeTrainer.Config:
    """Llama3-8B, 256K tokens on one 8-GPU node: UPipe with fused attention blocks, U = P = 8."""
    from torchtitan.models.llama3.config_registry import llama3_8b

    return upipe_job(llama3_8b(), model_spec=_llama3("8B"), context_parallel_degree=8, seq_len=262144,
                     upipe=UPipe())


def llama3_8b_upipe_5m() -> UPipeTrainer.Config:
    """Llama3-8B, 5M tokens on one 8-GPU node: UPipe plus the long-context stack (block inputs
    offloaded to host memory, SwiGLU over 16K-token tiles, 0.3's chunked loss), and fused blocks
    that keep no attention output for backward (``recompute_attention_output``: one more
    attention forward per block). Expected on the device with the estimate's device ratio:
    72.82 GiB of the 72.95 budget; without recompute_attention_output 79.8 (0.3's chunked loss
    keeps an fp32 gradient of the hidden states that 0.2.2's path does not)."""
    from torchtitan.models.llama3.config_registry import llama3_8b

    return upipe_job(llama3_8b(), model_spec=_llama3("8B"), context_parallel_degree=8, seq_len=5242880,
                     upipe=UPipe(offload_block_inputs=True, host_memory_reserve_gib=64, mlp_tile_tokens=16384,
                                 recompute_attention_output=True))


def llama3_8b_upipe_4_nodes() -> UPipeTrainer.Config:
    """Llama3-8B, 16M tokens (2^24) on four 8-GPU nodes (P = 32): the all-to-all within each node,
    ring attention across the four (upipe.ring_degree = 4), with the long-context stack.
    Expected on the device with the estimate's device ratio: 72.29 GiB of the 72.95 budget
    (the 0.2.2 TOML fits 17.25M: 0.3's chunked loss keeps an fp32 gradient of the hidden states)."""
    from torchtitan.models.llama3.config_registry import llama3_8b

    return upipe_job(llama3_8b(), model_spec=_llama3("8B"), context_parallel_degree=32, seq_len=16777216,
                     upipe=UPipe(ring_degree=4, offload_block_inputs=True, host_memory_reserve_gib=64,
                                 mlp_tile_tokens=16384))


def qwen3_32b_upipe() -> UPipeTrainer.Config:
    """Qwen3-32B (64 query heads, QK-norm), 2.75M tokens on two 8-GPU nodes (P = 16), with the
    long-context stack; sized to fit with the estimate's device ratio applied."""
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.models.qwen3.config_registry import qwen3_32b

    return upipe_job(qwen3_32b(), model_spec=model_registry("32B", attn_backend="varlen"),
                     context_parallel_degree=16, seq_len=2883584,
                     upipe=UPipe(offload_block_inputs=True, host_memory_reserve_gib=64, mlp_tile_tokens=16384))


def llama3_70b_upipe_4_nodes() -> UPipeTrainer.Config:
    """Llama-3.1-70B, 5,242,880 tokens (5 x 2^20) on four 8-GPU nodes (P = 32): the all-to-all
    within each node, ring attention across the four, the long-context stack with SwiGLU over
    8K-token tiles and fused blocks that keep no attention output. No tensor parallelism: FSDP shards the
    weights over all 32 GPUs and keeps them, their gradients and the optimizer state in host
    memory (``training.enable_cpu_offload``); the GPU memory that frees holds the last 8 blocks'
    inputs, which the node's RAM could not. Expected with the estimate's device ratio: 61.87 GiB
    of the 72.95 budget on the device; host memory 1,703 GiB of 1,798 per node."""
    from torchtitan.models.llama3.config_registry import llama3_70b

    config = upipe_job(llama3_70b(), model_spec=_llama3("70B"), context_parallel_degree=32, seq_len=5242880,
                       upipe=UPipe(ring_degree=4, offload_block_inputs=True, blocks_kept_on_device=8,
                                   host_memory_reserve_gib=64, mlp_tile_tokens=8192,
                                   recompute_attention_output=True))
    config.training.enable_cpu_offload = True
    return config


def llama3_70b_upipe_8_nodes() -> UPipeTrainer.Config:
    """Llama-3.1-70B, 11,010,048 tokens (10.5 x 2^20) on eight 8-GPU nodes (P = 64): UPipe 8 x
    ring 8 with the long-context stack; FSDP shards the weights over all 64 GPUs. Expected on the device with
    the estimate's device ratio: 65.11 GiB of the 72.95 budget; host memory 1,680 GiB per node
    (the bound: 80 layers of offloaded block inputs)."""
    from torchtitan.models.llama3.config_registry import llama3_70b

    return upipe_job(llama3_70b(), model_spec=_llama3("70B"), context_parallel_degree=64, seq_len=11010048,
                     upipe=UPipe(ring_degree=8, offload_block_inputs=True, host_memory_reserve_gib=64,
                                 mlp_tile_tokens=16384))


def qwen3_30b_a3b_upipe() -> UPipeTrainer.Config:
    """Qwen3-30B-A3B (MoE: 48 layers of 128 experts, 8 a token; 32 query / 4 KV heads), 4,112,384
    tokens on one 8-GPU node: each layer's attention as UPipe's stage-loop op (compiled alone
    beside the MoE layers, so no fused block), the experts split over EP 8, FSDP's state in host
    memory, the checkpointed block inputs offloaded and each MoE layer's tokens in tiles of
    16,384. Expected on the device with the estimate's device ratio: 72.65 GiB of the 72.95
    budget (the bound: the attention's stage loop), host memory 1,208 GiB per node; the other
    layouts on the same GPUs: benchmarks/results/fits_moe.md."""
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.models.qwen3.config_registry import qwen3_30b_a3b

    config = upipe_job(qwen3_30b_a3b(), model_spec=model_registry("30B-A3B", attn_backend="varlen"),
                       context_parallel_degree=8, seq_len=4112384,
                       upipe=UPipe(fuse_projections=False, offload_block_inputs=True, mlp_tile_tokens=16384))
    config.parallelism.expert_parallel_degree = 8
    config.training.enable_cpu_offload = True
    return config


def llama3_debugmodel_upipe_cpu() -> UPipeTrainer.Config:
    """The debug model (6 layers, 16 heads, dim 256) on CPU gloo ranks: P = 2, 512 tokens,
    blocks compiled with aot_eager (no C++ toolchain needed), fp32 throughout."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = upipe_job(llama3_debugmodel(), model_spec=_llama3("debugmodel"), context_parallel_degree=2,
                       seq_len=512, upipe=UPipe(inner_backend="aot_eager"), loss_chunk_tokens=64,
                       inner_components=("model",))
    config.training.mixed_precision_param = "float32"
    config.training.steps = 4
    return config


def qwen3_debugmodel_upipe_cpu() -> UPipeTrainer.Config:
    """Qwen3's debug model (QK-norm, 16 query / 8 KV heads of 128, tied embeddings) on CPU
    gloo ranks, as the Llama3 one above."""
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.models.qwen3.config_registry import qwen3_debugmodel

    config = upipe_job(qwen3_debugmodel(), model_spec=model_registry("debugmodel", attn_backend="varlen"),
                       context_parallel_degree=2, seq_len=512, upipe=UPipe(inner_backend="aot_eager"),
                       loss_chunk_tokens=64, inner_components=("model",))
    config.training.mixed_precision_param = "float32"
    config.training.steps = 4
    return config


def qwen3_moe_debugmodel_upipe_cpu() -> UPipeTrainer.Config:
    """Qwen3's MoE debug model (64 experts, 8 a token, the router's load-balancing bias; 16
    query / 8 KV heads of 128) on CPU gloo ranks, as the dense ones above: its attention runs
    as UPipe's plain stage-loop op (fuse_projections off), its MoE layers as 0.3's own, with
    expert parallelism by ``--parallelism.expert_parallel_degree``."""
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.models.qwen3.config_registry import qwen3_debugmodel

    config = upipe_job(qwen3_debugmodel(), model_spec=model_registry("debugmodel_moe", attn_backend="varlen"),
                       context_parallel_degree=2, seq_len=512,
                       upipe=UPipe(inner_backend="aot_eager", fuse_projections=False),
                       loss_chunk_tokens=64, inner_components=("model",))
    config.training.mixed_precision_param = "float32"
    config.training.steps = 4
    return config
