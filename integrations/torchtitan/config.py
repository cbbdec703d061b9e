"""The ``[upipe]`` section of a torchtitan job TOML.

torchtitan 0.2.2 merges a user dataclass into its JobConfig when the TOML names it:

    [job]
    custom_config_module = "upipe_compile.integrations.torchtitan.config"

    [upipe]
    heads_per_stage = 0         # U; 0 = the all-to-all degree (one head per rank per stage, least memory)
    ring_degree = 1             # R > 1: ring attention over R groups of CP / R all-to-all ranks (multi-node)
    inner_backend = "inductor"  # what compiles each block after the UPipe rewrite
    prefetch = "forward"        # overlap the next stage's all-to-alls: none | forward | both
    fuse_projections = true     # projections, RoPE/QK-norm, attention, output projection: one stage loop
    recompute_attention_output = false  # fused blocks: no attention output kept for backward
    keep_attention = false      # full AC: keep each block's attention output, never run its forward twice
    # the long-context stack (each off by default; see long_context_stack.py and README.md)
    offload_block_inputs = false    # checkpointed block inputs -> host memory (needs full AC)
    blocks_kept_on_device = 0       # with offload: the last blocks whose inputs stay on the GPU
    host_memory_reserve_gib = -1    # node RAM kept free for everything else; -1: a quarter of it, <= 64 GiB
    mlp_tile_tokens = 0             # SwiGLU (or a MoE layer's tokens) over tiles of this many tokens; 0 = untiled
    loss_chunk_tokens = 0           # output projection + loss over chunks; 0 = whole logits

Without that line the section is unknown to torchtitan's ConfigManager (it rejects the TOML),
and the integration uses the defaults below.
"""


from dataclasses import dataclass, field

from upipe_compile.attention.stage_loop import DEFAULT_PREFETCH
from upipe_compile.options import DEFAULT_FUSE_PROJECTIONS, DEFAULT_INNER_BACKEND, DEFAULT_RECOMPUTE_ATTENTION_OUTPUT

DEFAULT_HOST_RESERVE = -1.0
"""``host_memory_reserve_gib``'s default: not a size but "scaled to the machine" (TOML and the
0.3 flags take numbers only; a reserve is never negative, so -1 cannot mean a size)."""


@dataclass
class UPipe:
    heads_per_stage: int = 0
    """U: query heads per stage across the all-to-all ranks, a multiple of their number A
    (A = the CP degree P without a ring, P / ring_degree with one). 0 means U = A (least
    attention memory; TOML has no None: 0 becomes UPipeOptions' heads_per_stage=None); U =
    number of query heads is plain Ulysses. Checked by
    upipe_compile.options.option_problems, as UPipeOptions is."""

    ring_degree: int = 1
    """R: split the CP ranks ([parallelism] context_parallel_degree = P) into R groups of
    A = P / R consecutive ranks: the all-to-all (UPipe) runs within a group (put one group
    in a node: 8 on an 8-GPU node) and each stage's attention as ring attention across the R
    groups (K/V passed point-to-point, overlapped with the kernels). P is then no longer
    bounded by the head count, only A is. The sequence is laid out zigzag over the ring
    (cp_layout.py). 1 = no ring: the all-to-all over all P ranks."""

    def all_to_all_degree(self, cp: int) -> int:
        """A, the ranks each all-to-all spans (U and the heads are counted over them):
        ``cp / ring_degree``, or ``cp`` while ring_degree is 1 or invalid (job_rules.py names it)."""
        ring = self.ring_degree
        return cp // ring if ring >= 1 and cp % ring == 0 else cp

    @property
    def heads_per_stage_option(self):
        """``heads_per_stage`` as UPipeOptions takes it (None = the default, P)."""
        return self.heads_per_stage or None

    inner_backend: str = DEFAULT_INNER_BACKEND
    """What compiles each TransformerBlock after the UPipe passes (and the loss, when
    [compile] components has "loss"): "inductor", "aot_eager", "eager" or
    "aot_eager_decomp_partition"."""

    prefetch: str = DEFAULT_PREFETCH
    """Start the next stage's all-to-alls during this stage's attention: "forward" (no extra
    peak memory for GQA models), "both" (backward too; about U = 2P's memory) or "none"."""

    fuse_projections: bool = DEFAULT_FUSE_PROJECTIONS
    """Fuse each block's q/k/v projections, per-head ops (RoPE, QK-norm), attention and output
    projection into one stage loop (upipe::attention_block), so no rank holds the q, k, v of
    all heads; blocks that are not head-separable keep the plain attention op."""

    recompute_attention_output: bool = DEFAULT_RECOMPUTE_ATTENTION_OUTPUT
    """Fused blocks keep no attention output for backward (one activation of the block
    input's size per block being recomputed); each stage's attention forward runs again in
    backward instead: less memory, one more attention forward per block."""

    keep_attention: bool = False
    """Under [activation_checkpoint] mode = "full": keep each block's attention outputs
    (upipe::attention / upipe::attention_block: the output, and what its backward needs, on the
    GPU) from the forward, so the recompute in backward reruns the rest of the block but not
    attention, at long context almost all of the work. Costs each block's attention outputs
    (with fused blocks: the block's attention output and the attention's own, each x-sized, and
    the stage LSEs) until that block's backward: on the GPU, or with offload_block_inputs on the
    host beside the block input (about three times the host memory of the inputs alone). With
    mode = "selective" (op) the ops are already kept."""

    # --- the long-context stack: each piece opt-in ---
    offload_block_inputs: bool = False
    """Move each TransformerBlock's checkpointed input to pinned host memory after the block's
    forward and back just before its recompute (side CUDA stream, overlapped with the
    neighbouring block). Needs [activation_checkpoint] mode = "full". Host memory per rank:
    n_layers x local_batch_size x seq_len / CP x dim x activation bytes, plus keep_attention's
    outputs when it is on; the job refuses to start when the node (x ranks per node) cannot hold
    it next to host_memory_reserve_gib."""

    blocks_kept_on_device: int = 0
    """With offload_block_inputs: the last this many blocks keep their checkpointed inputs on the
    GPU (their backward runs first, so nothing waits for a fetch). Trades GPU memory for host
    memory where the node's RAM, not the GPU, bounds the context (e.g. with FSDP's own CPU
    offload, ``training.enable_cpu_offload``, sharing that RAM). 0: every block offloads."""

    host_memory_reserve_gib: float = DEFAULT_HOST_RESERVE
    """Node RAM the offload check leaves for everything else (OS, the ranks' own CPU memory,
    dataloader workers, pinned staging). -1 (the default): scaled to the node, a quarter of the
    memory its ranks may use, at most 64 GiB (``upipe_compile.stack.host_memory``)."""

    mlp_tile_tokens: int = 0
    """Run each block's SwiGLU feed-forward over tiles of this many tokens, recomputed tile by
    tile in backward, so tokens x hidden_dim intermediates exist for one tile only; a MoE
    layer (torchtitan 0.3) runs its tokens in tiles of as many, each recomputed on its own, so
    its routed copies exist for one tile only. 0 = off."""

    loss_chunk_tokens: int = 0
    """Compute the output projection and cross-entropy this many tokens at a time (logits
    recomputed per chunk in backward), so tokens x vocab logits never exist for the whole
    local sequence. 0 = off (torchtitan's loss on full logits)."""


@dataclass
class JobConfig:
    upipe: UPipe = field(default_factory=UPipe)


def upipe_config(job_config) -> UPipe:
    """The job's [upipe] section, or the defaults when the custom config module is not loaded."""
    return getattr(job_config, "upipe", None) or UPipe()
