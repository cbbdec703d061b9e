"""Step-time model: the expected seconds of one training step per rank, phase by phase, from
FLOPs and bytes and what a device sustains of each.

Per layer and rank, with ``n = S / P`` local tokens of a ``S``-token row over ``P`` CP ranks:

- the layer's linear algebra (projections, MLP): ``2 n W`` FLOPs forward for ``W`` weights, twice
  that backward, at the device's matmul rate;
- attention: ``4 S^2 D Hq / P`` FLOPs forward (half that causal), 2.5 x that backward (five
  matmuls against two), at the attention kernel's rates;
- the all-to-alls: q, k, v and the output forward; backward the stage loop gathers q, k, v,
  the output and its gradient again and returns dq, dk, dv: ``(A - 1) / A`` of each local tensor
  crosses the link. UPipe sends the same bytes in ``m`` stages and overlaps all but one stage's
  with attention; Ulysses (one stage) overlaps none. Each collective also pays a launch latency;
- a ring of R: each rank's K/V share goes round R - 1 times per attention run and twice more
  (with its dK/dV) in backward, hidden under attention but for its latency;
- tensor parallelism of T (with sequence parallelism, torchtitan's own, no async TP): each rank
  holds 1/T of every matmul's weights and of the heads, so the linear algebra, attention, the
  all-to-alls and the head's share of the work are 1/T; each layer's forward all-gathers its
  ``n`` tokens' activations before attention and the MLP and reduce-scatters after each
  (``(T - 1) / T`` of ``n * dim`` crosses the link each time), as its backward and every AC
  recompute do, not overlapped. The CP groups then stride T ranks: an all-to-all of A ranks
  spans A x T consecutive ranks.

Full activation checkpointing runs each layer's forward again in backward: the linear algebra
always (a MoE layer's in tiles once more, with its all-to-alls), attention and its all-to-alls
unless ``keep_attention`` keeps them (``recompute_attention_output`` runs attention once more
in backward). The output projection
and loss add ``6 n V dim`` FLOPs per step. Offloaded block inputs and kept outputs travel over
the host link while the blocks compute; only what a layer's transfer exceeds its compute is
counted. So do the parameter shards and gradients of FSDP's CPU offload (``offload_state``: each
layer's fp32 shard in before its forward and again before its backward, its fp32 gradient out);
its optimizer step runs on the host after backward, bound by the host's memory bandwidth.

The device rates are sustained rates, not peaks: :data:`H100` states where its numbers come
from. A CPU run is modelled with rates measured on the machine (benchmarks/keep_speed.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Device:
    name: str
    matmul_flops: float
    """Sustained dense matmul FLOP/s in the activation dtype."""
    attention_forward_flops: float
    attention_backward_flops: float
    """Sustained FLOP/s of the attention kernel's forward and backward (causal, long rows)."""
    all_to_all_bytes: float
    """Bytes per second one rank sends to ranks of its own node (the GPUs' link, sustained)."""
    inter_node_bytes: float
    """Bytes per second one rank sends to other nodes."""
    collective_latency_s: float
    """Fixed cost of one collective call."""
    host_link_bytes: float
    """Device <-> host bytes per second per rank (offload)."""
    host_memory_bytes: float
    """A rank's share of its node's DRAM bandwidth (the optimizer step of an offloaded state)."""


H100 = Device(
    # H100 SXM: 989 TFLOP/s dense bf16 peak, ~70% sustained in large GEMMs; FlashAttention-2's
    # reported long-sequence causal rates on H100 (~330 TFLOP/s forward, ~270 backward); NVLink 4
    # at 450 GB/s per direction, ~80% in all-to-all; one 400 Gb/s InfiniBand NIC per GPU between
    # nodes; PCIe 5 x16 at ~50 GB/s per GPU; two 8-channel DDR5-4800 sockets (614 GB/s), ~60%
    # sustained by a many-threaded stream, shared by 8 ranks.
    name="H100 SXM 80GB", matmul_flops=0.70 * 989e12, attention_forward_flops=330e12,
    attention_backward_flops=270e12, all_to_all_bytes=0.8 * 450e9, inter_node_bytes=0.8 * 50e9,
    collective_latency_s=30e-6,
    host_link_bytes=50e9, host_memory_bytes=0.6 * 614e9 / 8,
)

HOST_ADAMW_BYTES_PER_PARAM = 28
"""Fused fp32 AdamW on the host reads each parameter, its gradient and both moments and writes
the parameter and both moments back."""


@dataclass(frozen=True)
class ModelShape:
    n_layers: int
    dim: int
    q_heads: int
    kv_heads: int
    head_dim: int
    layer_weights: int
    """Weights of one layer's matmuls (projections and MLP; a MoE layer's every expert)."""
    vocab_size: int
    active_layer_weights: int = 0
    """The weights one token's matmuls run through: a MoE layer's router, shared experts and
    ``experts_per_token`` of its routed experts (0: all of ``layer_weights``)."""
    experts_per_token: int = 0
    """A MoE layer's routed experts per token (0: dense)."""

    @property
    def token_weights(self) -> int:
        return self.active_layer_weights or self.layer_weights

    @property
    def attention_weights(self) -> int:
        """One layer's q, k, v and output projections."""
        return 2 * self.dim * (self.q_heads + self.kv_heads) * self.head_dim


@dataclass(frozen=True)
class Setup:
    """What the step runs: the row, its split, the method and the stack's choices."""
    seq_len: int
    cp: int
    heads_per_stage: int
    """U over the all-to-all ranks; ``q_heads`` (all heads) is Ulysses."""
    ring_degree: int = 1
    causal: bool = True
    full_ac: bool = True
    keep_attention: bool = False
    recompute_attention_output: bool = False
    offload_block_inputs: bool = False
    element_bytes: int = 2
    batch: int = 1
    """Rows per step (each of ``seq_len`` tokens, split over the same ranks)."""
    ranks_per_node: int = 8
    """Consecutive ranks share a node: an all-to-all or ring wider than this crosses nodes."""
    offload_state: bool = False
    """FSDP keeps the fp32 parameter shards, gradients and optimizer state on the host."""
    fsdp_shards: int = 1
    """Ranks FSDP shards the parameters over (dp_shard x cp)."""
    tp: int = 1
    """Tensor-parallel degree (heads and matmul weights split over T ranks of a node)."""
    ep: int = 1
    """Expert-parallel degree (a MoE layer's experts split over E of the CP ranks)."""
    moe_tiles: bool = False
    """A MoE layer's tokens run in tiles (``mlp_tile_tokens``), each run once more in backward."""


@dataclass(frozen=True)
class StepTime:
    """Seconds per step by phase; ``total`` is their sum."""
    linear: float
    attention: float
    all_to_all: float
    ring: float
    offload: float
    head_and_loss: float
    host_optimizer: float = 0.0
    expert_all_to_all: float = 0.0

    @property
    def total(self) -> float:
        return (self.linear + self.attention + self.all_to_all + self.ring + self.offload + self.head_and_loss
                + self.host_optimizer + self.expert_all_to_all)

    def tokens_per_s(self, setup: "Setup") -> float:
        """Tokens of the rows per second (every rank works on the same rows)."""
        return setup.batch * setup.seq_len / self.total


def attention_forward_flops(shape: ModelShape, setup: Setup) -> float:
    """One layer's attention forward on one rank."""
    full = 4.0 * setup.batch * setup.seq_len ** 2 * shape.head_dim * shape.q_heads / (setup.cp * setup.tp)
    return full / 2 if setup.causal else full


def step_time(shape: ModelShape, setup: Setup, device: Device = H100) -> StepTime:
    n = setup.batch * setup.seq_len / setup.cp  # this rank's tokens
    a2a_ranks = setup.cp // setup.ring_degree
    tp = setup.tp
    linear_forward = 2.0 * n * shape.token_weights / tp / device.matmul_flops
    attention_forward = attention_forward_flops(shape, setup) / device.attention_forward_flops
    attention_backward = 2.5 * attention_forward_flops(shape, setup) / device.attention_backward_flops

    attention_runs = 1 + (setup.full_ac and not setup.keep_attention) + setup.recompute_attention_output
    linear_runs = 1 + setup.full_ac
    per_layer_linear = linear_runs * linear_forward + 2 * linear_forward
    moe_reruns = int(setup.moe_tiles and shape.experts_per_token > 0)
    per_layer_linear += moe_reruns * 2.0 * n * (shape.token_weights - shape.attention_weights) / tp / device.matmul_flops
    per_layer_attention = attention_runs * attention_forward + attention_backward

    # Bytes one rank sends: q, k, v, out forward; q, k, v, out, dout in and dq, dk, dv out backward.
    q_bytes = n * shape.q_heads // tp * shape.head_dim * setup.element_bytes
    kv_bytes = n * max(1, shape.kv_heads // tp) * shape.head_dim * setup.element_bytes
    forward_bytes = 2 * q_bytes + 2 * kv_bytes
    backward_bytes = 4 * q_bytes + 4 * kv_bytes
    share = (a2a_ranks - 1) / a2a_ranks
    stages = max(1, shape.q_heads // tp // max(1, setup.heads_per_stage))
    collectives = attention_runs * 4 * stages + 8 * stages
    a2a_link = device.all_to_all_bytes if a2a_ranks * tp <= setup.ranks_per_node else device.inter_node_bytes
    moved = share * (attention_runs * forward_bytes + backward_bytes) / a2a_link
    exposed = moved / stages if stages > 1 else moved  # UPipe hides all but one stage's
    if stages > 1:
        exposed += max(0.0, moved - per_layer_attention)  # unless it outlasts the attention
    per_layer_a2a = exposed + collectives * device.collective_latency_s if a2a_ranks > 1 else 0.0

    # Ring of R: each attention run passes this rank's K/V share on R - 1 times; backward passes
    # it again with its dK/dV accumulator. Overlapped with the chunk pairs' attention.
    ring = setup.ring_degree
    per_layer_ring = 0.0
    if ring > 1:
        ring_link = device.all_to_all_bytes if setup.cp * tp <= setup.ranks_per_node else device.inter_node_bytes
        passed = (ring - 1) * 2 * kv_bytes * (attention_runs + 2) / ring_link
        per_layer_ring = (max(0.0, passed - per_layer_attention)
                          + (ring - 1) * stages * (attention_runs + 2) * device.collective_latency_s)

    transfer = 0.0
    if setup.offload_block_inputs:
        x_bytes = n * shape.dim * setup.element_bytes
        kept = (x_bytes + q_bytes) if setup.keep_attention else 0.0  # the fused block's y and o
        transfer += 2 * (x_bytes + kept) / device.host_link_bytes  # out after forward, back before backward
    host_optimizer = 0.0
    if setup.offload_state:
        transfer += 3 * 4 * shape.layer_weights / setup.fsdp_shards / device.host_link_bytes
        params = (shape.n_layers * shape.layer_weights + 2 * shape.vocab_size * shape.dim) / setup.fsdp_shards
        host_optimizer = params * HOST_ADAMW_BYTES_PER_PARAM / device.host_memory_bytes
    per_layer_offload = max(0.0, transfer - (per_layer_linear + per_layer_attention))

    if tp > 1:  # sequence parallelism's all-gathers and reduce-scatters, 4 per layer run
        tp_link = device.all_to_all_bytes if tp <= setup.ranks_per_node else device.inter_node_bytes
        gathered = (tp - 1) / tp * n * shape.dim * setup.element_bytes
        per_layer_linear += (linear_runs + 1) * 4 * (gathered / tp_link + device.collective_latency_s)

    per_layer_experts = 0.0
    if setup.ep > 1 and shape.experts_per_token:
        # EP's dispatch and combine all-to-alls of each routed token copy, as a balanced router
        # sends them, in each run of the layer and twice in backward; not overlapped
        ep_link = device.all_to_all_bytes if setup.ep * tp <= setup.ranks_per_node else device.inter_node_bytes
        routed = (setup.ep - 1) / setup.ep * n / tp * shape.experts_per_token * shape.dim * setup.element_bytes
        per_layer_experts = (linear_runs + 1 + moe_reruns) * 2 * (routed / ep_link + device.collective_latency_s)

    head = 6.0 * n * shape.vocab_size * shape.dim / tp / device.matmul_flops
    layers = shape.n_layers
    return StepTime(linear=layers * per_layer_linear, attention=layers * per_layer_attention,
                    all_to_all=layers * per_layer_a2a, ring=layers * per_layer_ring, offload=layers * per_layer_offload,
                    head_and_loss=head, host_optimizer=host_optimizer, expert_all_to_all=layers * per_layer_experts)


def model_flops(shape: ModelShape, setup: Setup) -> float:
    """One rank's model FLOPs of one step, what model FLOPs utilization divides by the step's
    seconds: the layers' matmuls forward and backward (``6 n W``), attention forward and
    backward (1 + 2.5 x its forward, as above) and the output head with its loss (``6 n V
    dim``). Recomputation (activation checkpointing, keep_attention's rerun) is not counted."""
    n = setup.batch * setup.seq_len / setup.cp
    per_layer = 6.0 * n * shape.token_weights / setup.tp + 3.5 * attention_forward_flops(shape, setup)
    return shape.n_layers * per_layer + 6.0 * n * shape.vocab_size * shape.dim / setup.tp


def ulysses(setup: Setup, shape: ModelShape) -> Setup:
    """The same step with one stage of all heads."""
    return replace(setup, heads_per_stage=shape.q_heads, ring_degree=1)
