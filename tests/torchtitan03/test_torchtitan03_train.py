"""The torchtitan 0.3 config path, ``--module upipe_compile.integrations.torchtitan``: the CPU
debug config trained for 4 steps on gloo ranks (tt03_jobs.train follows 0.3's Trainer with
UPipeTrainer's own methods) equals CP = 1 on the whole row: the 4 losses within 1e-5
relative and every first-step gradient, at CP = 2, 4, over a 2 x 2 ring x all-to-all mesh,
with a sliding window, with keep_attention and with the long-context stack. These run the
model in fp32 throughout (without 0.3's cast of q, k, v to bf16), so that every difference is
upipe's; one test keeps the cast and holds the gradients to bf16's own error. Bad jobs are
refused before anything is built, naming the field. Runs in the torchtitan 0.3 tier."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import tt03_jobs as jobs
from tests_support import relative_error

STEPS = 4
_REFERENCES: dict = {}


def reference(rank_pools, window=None, fp32_attention=True, config=jobs.CPU_CONFIG, overrides=()):
    """CP = 1 on the whole row (one process), cached."""
    key = (window, fp32_attention, config, overrides)
    if key not in _REFERENCES:
        (_REFERENCES[key],) = rank_pools(1).run(jobs.train, 1, STEPS, overrides, window, fp32_attention, config)
    return _REFERENCES[key]


def assert_equals_cp1(results, expected, grad_bound=1e-5):
    losses, grads, _ = expected
    for rank, (rank_losses, rank_grads, _) in enumerate(results):
        assert len(rank_losses) == STEPS
        for step, (ours, theirs) in enumerate(zip(rank_losses, losses)):
            assert abs(ours - theirs) <= 1e-5 * abs(theirs), (rank, step, ours, theirs)
        assert rank_grads.keys() == grads.keys()
        for name, grad in grads.items():
            err = relative_error(rank_grads[name], grad)
            assert err <= grad_bound, (rank, name, err)


@pytest.mark.parametrize("world, overrides, window", [
    (2, (), None),
    (4, (), None),
    (4, ("--upipe.ring_degree=2",), None),
    (2, (), (37, 0)),
    (2, ("--upipe.no_fuse_projections",), None),
], ids=["cp2", "cp4", "ring2x2", "cp2-window", "cp2-plain-op"])
def test_config_path_equals_cp1(rank_pools, world, overrides, window):
    results = rank_pools(world).run(jobs.train, world, STEPS, overrides, window)
    assert_equals_cp1(results, reference(rank_pools, window))
    fused = "--upipe.no_fuse_projections" not in overrides
    for *_, events in results:
        assert events.get("plain sdpa outside upipe", 0) == 0, events
        assert events.get("upipe::attention_block" if fused else "upipe::attention", 0) > 0, events


@pytest.mark.parametrize("world, overrides", [(2, ()), (4, ("--upipe.ring_degree=2",))], ids=["cp2", "ring2x2"])
def test_qwen3_config_path_equals_cp1(rank_pools, world, overrides):
    """Qwen3 (QK-norm, GQA 16/8 with head_dim 128, its rotate-half RoPE, tied embeddings)."""
    config = "qwen3_debugmodel_upipe_cpu"
    results = rank_pools(world).run(jobs.train, world, STEPS, overrides, None, True, config)
    assert_equals_cp1(results, reference(rank_pools, config=config))
    for *_, events in results:
        assert events.get("upipe::attention_block", 0) > 0, events


PLAIN = ("--upipe.no_fuse_projections",)
TP2 = (*PLAIN, "--parallelism.tensor_parallel_degree=2")


def assert_ran_upipe_per_rank(results):
    """Every rank's forward ran upipe's stage-loop op (one per layer, twice: full AC's
    recompute) and no attention outside it."""
    for *_, events in results:
        assert events.get("plain sdpa outside upipe", 0) == 0, events
        assert events.get("upipe::attention") == 2 * jobs.LAYERS, events


def test_tensor_parallel_2_x_cp_2_equals_cp_4_and_one_rank(rank_pools):
    """TP 2 (with sequence parallelism, 0.3's own) x UPipe CP 2 on four ranks: each TP rank's
    8 of the 16 heads go through UPipe's all-to-all and stage loop over its CP pair. Every
    rank's losses and first-step gradients equal CP = 4 (TP = 1) on the same four ranks and
    the one-rank run."""
    tensor_parallel = rank_pools(4).run(jobs.train, 2, STEPS, TP2)
    cp4 = rank_pools(4).run(jobs.train, 4, STEPS, PLAIN)
    assert_equals_cp1(tensor_parallel, reference(rank_pools))
    assert_equals_cp1(tensor_parallel, cp4[0])
    assert_ran_upipe_per_rank(tensor_parallel)


def test_tensor_parallel_2_x_ring_2_x_all_to_all_2_equals_one_rank(rank_pools):
    """Eight ranks: TP 2 x UPipe CP 4 as a ring of 2 over all-to-all pairs (zigzag shards);
    each TP rank's 8 heads split 4 per all-to-all rank."""
    try:
        results = rank_pools(8).run(jobs.train, 4, STEPS, (*TP2, "--upipe.ring_degree=2"))
    finally:  # eight live ranks beside the other pools would exhaust a 24 GiB runner
        rank_pools.close(8)
    assert_equals_cp1(results, reference(rank_pools))
    assert_ran_upipe_per_rank(results)


def test_qwen3_tensor_parallel_2_x_cp_2_equals_one_rank(rank_pools):
    """Qwen3's TP keeps q and k DTensors through RoPE (upipe's RoPE rows then replicate over
    the TP ranks) and its QK-norm; GQA 16/8 gives each TP rank 8 query and 4 KV heads."""
    config = "qwen3_debugmodel_upipe_cpu"
    results = rank_pools(4).run(jobs.train, 2, STEPS, TP2, None, True, config)
    assert_equals_cp1(results, reference(rank_pools, config=config))
    assert_ran_upipe_per_rank(results)


MOE = "qwen3_moe_debugmodel_upipe_cpu"
FORCED_ROUTING = ("--debug.moe_force_load_balance",)


@pytest.mark.parametrize("world, ep", [(2, 2), (4, 2), (4, 4)], ids=["cp2-ep2", "cp4-ep2", "cp4-ep4"])
def test_moe_expert_parallel_equals_cp_alone_and_one_rank(rank_pools, world, ep):
    """Qwen3's MoE debug model (its MoE layers with 8 experts, 2 a token: tt03_jobs.fewer_experts).
    Its attention goes through UPipe's stage loop; its MoE layers stay 0.3's own, the experts
    sharded over EP ranks borrowed from the CP ranks (tokens dispatched to them by all-to-all).
    Every rank's losses and first-step gradients (the experts' and the router's included)
    equal the same CP degree without EP and the one-rank run. Routed by torchtitan's
    deterministic round-robin (``debug.moe_force_load_balance``; a shard of a multiple of
    experts / top_k tokens routes as the whole row), so that no near-tie of a freshly
    initialised router's top-k can flip between layouts."""
    pool = rank_pools(world)
    expert_parallel = pool.run(jobs.train, world, STEPS, (*FORCED_ROUTING, f"--parallelism.expert_parallel_degree={ep}"),
                               None, True, MOE)
    cp_alone = pool.run(jobs.train, world, STEPS, FORCED_ROUTING, None, True, MOE)
    assert_equals_cp1(expert_parallel, reference(rank_pools, config=MOE, overrides=FORCED_ROUTING))
    assert_equals_cp1(expert_parallel, cp_alone[0])
    assert_ran_upipe_per_rank(expert_parallel)


def test_moe_expert_parallel_over_data_and_context_ranks_equals_one_rank(rank_pools):
    """EP 4 over FSDP's data shards and the CP ranks (data_parallel_shard_degree 2 x CP 2 on
    four ranks): the experts split over all four, each data shard's CP pair through UPipe's
    stage loop. Both data shards train on the same row here, so the step equals the one-rank
    run: every rank's losses and first-step gradients."""
    overrides = (*FORCED_ROUTING, "--parallelism.data_parallel_shard_degree=2",
                 "--parallelism.expert_parallel_degree=4")
    results = rank_pools(4).run(jobs.train, 2, STEPS, overrides, None, True, MOE)
    assert_equals_cp1(results, reference(rank_pools, config=MOE, overrides=FORCED_ROUTING))
    assert_ran_upipe_per_rank(results)


def test_moe_long_context_stack_equals_one_rank(rank_pools):
    """The long-context stack beside MoE layers and EP 2 on CP 2: each MoE layer's tokens in
    tiles of 48 (256 local tokens: uneven tiles), each recomputed on its own with its own
    dispatch all-to-alls, and the checkpointed block inputs offloaded to host memory. Every
    rank's losses and first-step gradients equal the one-rank run's (round-robin routing: 48
    tokens x top 2 is a multiple of the 8 experts, so a tile routes as the whole shard)."""
    overrides = (*FORCED_ROUTING, "--parallelism.expert_parallel_degree=2", "--upipe.offload_block_inputs",
                 "--upipe.mlp_tile_tokens=48", "--upipe.host_memory_reserve_gib=0")
    results = rank_pools(2).run(jobs.train, 2, STEPS, overrides, None, True, MOE)
    assert_equals_cp1(results, reference(rank_pools, config=MOE, overrides=FORCED_ROUTING))
    assert_ran_upipe_per_rank(results)
    for *_, events in results:  # 6 tiles a layer, each run forward, in the block's recompute and its own
        assert events.get("upipe::moe_tile") == jobs.LAYERS * 6 * 3, events


def test_moe_expert_parallel_beside_tensor_parallel_equals_one_rank(rank_pools):
    """EP 2 beside TP 2 x CP 2 on four ranks (the layout of the MoE TP x ring rows): 0.3
    splits each TP group's tokens over its TP ranks before the experts' dispatch (sequence
    parallelism), the experts over EP ranks borrowed from the CP ranks. Every rank's losses
    and first-step gradients equal the one-rank run's. Routed by the router itself:
    torchtitan's round-robin routing does not run beside TP (it gathers a TP DTensor's scores
    with a plain index)."""
    overrides = (*TP2, "--parallelism.expert_parallel_degree=2")
    results = rank_pools(4).run(jobs.train, 2, STEPS, overrides, None, True, MOE)
    assert_equals_cp1(results, reference(rank_pools, config=MOE))
    assert_ran_upipe_per_rank(results)


@pytest.mark.parametrize("overrides", [(), ("--upipe.mlp_tile_tokens=48",),
                                       ("--upipe.mlp_tile_tokens=48", "activation_checkpoint:selective")],
                         ids=["whole", "tiled", "tiled-selective-ac"])
def test_moe_load_balancing_follows_the_whole_sequence(rank_pools, overrides):
    """With the router's own (learned) routing, the load-balancing bias 0.3's optimizer hook
    sets after each step comes from the expert counts of the whole sequence (summed over the
    "loss" mesh, the CP ranks included): every rank's biases equal the one-rank run's (full
    AC), and the losses, routed by them, agree; so with the MoE layers' tokens in tiles, under
    full AC and under 0.3's per-op selective AC (the tiles' checkpoints nested in its
    policy's, which recomputes the router and the count)."""
    steps = 2
    sharded = rank_pools(2).run(jobs.train, 2, steps, overrides, None, True, MOE, None, True)
    (whole,) = rank_pools(1).run(jobs.train, 1, steps, (), None, True, MOE, None, True)
    losses, biases = whole
    assert any(bias.abs().sum() > 0 for bias in biases[0].values())  # the hook moved them
    for rank_losses, rank_biases in sharded:
        for ours, theirs in zip(rank_losses, losses):
            assert abs(ours - theirs) <= 1e-5 * abs(theirs), (ours, theirs)
        for step_biases, expected in zip(rank_biases, biases):
            assert step_biases.keys() == expected.keys()
            for name, bias in expected.items():
                assert torch.equal(step_biases[name], bias), (name, step_biases[name], bias)


def test_with_0_3s_bf16_attention_losses_equal_and_gradients_as_accurate_as_cp1(rank_pools):
    """As shipped, 0.3's varlen attention computes in bf16: the losses still agree within 1e-5;
    each first-step gradient is held to twice CP = 1's own bf16 error against fp32 attention."""
    results = rank_pools(2).run(jobs.train, 2, STEPS, (), None, False)
    bf16_losses, bf16_grads, _ = reference(rank_pools, None, False)
    _, exact, _ = reference(rank_pools)
    for rank_losses, rank_grads, _ in results:
        for ours, theirs in zip(rank_losses, bf16_losses):
            assert abs(ours - theirs) <= 1e-5 * abs(theirs), (ours, theirs)
        for name, grad in exact.items():
            ours, bound = relative_error(rank_grads[name], grad), max(1e-5, 2 * relative_error(bf16_grads[name], grad))
            assert ours <= bound, (name, ours, bound)


def test_a_non_finite_shard_on_one_rank_is_seen_by_every_rank_in_the_same_step(rank_pools):
    """CP = 4, rank 3's final norm outputs NaN at step 2 (after the last attention, so no other
    rank's forward sees it): the loss the Trainer logs, the ranks' sum over the "loss" mesh, is
    NaN on every rank at step 2 and finite at step 1, so the Trainer's own check (a non-finite
    global loss stops training) stops every rank at that step; the gradient norm, all-reduced
    in clip_grad_norm_, is NaN on every rank too."""
    results = rank_pools(4).run(jobs.train, 4, 2, (), None, True, jobs.CPU_CONFIG, (3, 2))
    for rank, (losses, grad_norms) in enumerate(results):
        assert math.isfinite(losses[0]) and math.isfinite(grad_norms[0]), (rank, losses, grad_norms)
        assert math.isnan(losses[1]) and math.isnan(grad_norms[1]), (rank, losses, grad_norms)


@pytest.mark.parametrize("overrides", [
    (), ("--upipe.offload_block_inputs", "--upipe.host_memory_reserve_gib=0"),
    ("--upipe.offload_block_inputs", "--upipe.blocks_kept_on_device=1", "--upipe.host_memory_reserve_gib=0"),
], ids=["on-device", "offloaded", "offloaded-last-kept"])
def test_keep_attention_runs_attention_forward_once_and_equals_cp1(rank_pools, overrides):
    """Full AC reruns each block in backward; with upipe.keep_attention its fused attention
    block is not rerun: one forward per layer per step instead of two; the kept outputs stay on
    the device or go to host beside the offloaded block inputs."""
    kept = rank_pools(2).run(jobs.train, 2, STEPS, ("--upipe.keep_attention", *overrides))
    assert_equals_cp1(kept, reference(rank_pools))
    for *_, events in kept:
        assert events.get("upipe::attention_block") == jobs.LAYERS, events


def test_long_context_stack_equals_cp1(rank_pools):
    """Checkpointed block inputs offloaded to host memory, SwiGLU over tiles of 48 tokens (256
    local tokens: uneven tiles)."""
    stacked = rank_pools(2).run(jobs.train, 2, STEPS, (
        "--upipe.offload_block_inputs", "--upipe.mlp_tile_tokens=48", "--upipe.host_memory_reserve_gib=0"))
    assert_equals_cp1(stacked, reference(rank_pools))


# --- refusals: the whole job is checked before anything is built ---------------------------

def problems_of(*overrides, change=None):
    from upipe_compile.integrations.torchtitan.release_03.parallelize import config_problems

    config = jobs.load_config(*overrides)
    if change:
        change(config)
    return "\n".join(config_problems(config))


def test_the_shipped_configs_pass_the_check():
    from upipe_compile.integrations.torchtitan import config_registry
    from upipe_compile.integrations.torchtitan.release_03.parallelize import config_problems

    for name in config_registry.__all__[:-1]:
        config = getattr(config_registry, name)()
        assert config_problems(config) == [], name
        assert config.compile.backend == "upipe" and config.parallelism.context_parallel_load_balancer is None


@pytest.mark.parametrize("overrides, change, names", [
    (("--parallelism.context_parallel_load_balancer=headtail",), None, "parallelism.context_parallel_load_balancer"),
    (("--parallelism.spmd_backend=spmd_types",), None, "parallelism.spmd_backend"),
    (("--parallelism.tensor_parallel_degree=2",), None, "set upipe.fuse_projections = False"),
    (("--validator.enable",), None, "validator.enable"),
    ((), lambda c: setattr(c, "loss", _plain_loss()), "loss=ChunkedLossWrapper.Config"),
    (("--upipe.loss_chunk_tokens=-1",), None, "loss_chunk_tokens = -1"),
    (("--upipe.keep_attention",), lambda c: setattr(c, "activation_checkpoint", _selective()), "upipe.keep_attention"),
    (("--upipe.offload_block_inputs",), lambda c: setattr(c, "activation_checkpoint", _selective()),
     "upipe.offload_block_inputs"),
    (("--upipe.ring_degree=3", "--parallelism.context_parallel_degree=4"), None, "upipe.ring_degree"),
    (("--parallelism.context_parallel_degree=32", "--training.seq_len=2048"), None, "n_heads = 16"),
    (("--training.local_batch_size=2",), None, "training.local_batch_size"),
    (("--upipe.heads_per_stage=3",), None, "upipe.heads_per_stage"),
    ((), lambda c: _use_flex(c), 'attn_backend="varlen"'),
    ((), lambda c: _custom_parallelize(c), "model_spec.parallelize_fn"),
    ((), lambda c: _qwen35(c), "Gated DeltaNet"),
    ((), lambda c: _qwen3_moe(c), "the model's MoE layers: their token dispatch is torchtitan's own, outside "
                                  "upipe's graph, so upipe cannot fuse the projections into its stage loop; set "
                                  "upipe.fuse_projections = False"),
    (("--parallelism.expert_parallel_degree=2",), None, "parallelism.expert_parallel_degree = 2, but the model has no "
                                                        "MoE layers"),
    (TP2 + ("--upipe.keep_attention",), None, "upipe.keep_attention is not supported where upipe compiles the attention alone"),
    (TP2 + ("--parallelism.context_parallel_degree=16", "--training.seq_len=2048"), None,
     "the heads per TP rank, 8 (n_heads = 16 / parallelism.tensor_parallel_degree 2), is not divisible by the CP "
     "degree 16"),
    (TP2 + ("--training.seq_len=510",), None, "must be divisible by CP x TP = 4"),
    (TP2 + ("--parallelism.pipeline_parallel_degree=2",), None,
     "the same 8 GPUs run under upipe as parallelism.pipeline_parallel_degree = 1 and "
     "parallelism.context_parallel_degree = 4, beside parallelism.tensor_parallel_degree = 2"),
    (TP2 + ("--upipe.keep_attention", "--parallelism.context_parallel_degree=16", "--training.seq_len=2048"), None,
     "fold the TP ranks into parallelism.context_parallel_degree = 32 with upipe.ring_degree = 2"),
    (("--parallelism.tensor_parallel_degree=2",), lambda c: _qwen3_moe(c),
     "parallelism.tensor_parallel_degree = 2 and the model's MoE layers: the q/k/v/o projections are TP-sharded; "
     "their token dispatch is torchtitan's own"),
    (("--upipe.keep_attention",), lambda c: _qwen3_moe(c),
     "the model's MoE layers: upipe.keep_attention is not supported where upipe compiles the attention alone; "
     "turn it off\n"),
    (TP2 + ("--upipe.offload_block_inputs",), lambda c: _qwen3_moe(c),
     "upipe.offload_block_inputs is not supported where upipe compiles the attention alone; turn it off, or set "
     "parallelism.tensor_parallel_degree = 1 and fold the TP ranks into parallelism.context_parallel_degree = 4"),
], ids=["load-balancer", "spmd-types", "tp-fused", "validator", "loss-chunks", "loss-chunk-count", "keep-without-full-ac",
        "offload-without-full-ac", "ring-degree", "heads", "batch", "heads-per-stage", "flex", "custom-parallelize", "qwen3.5",
        "moe-fused", "ep-dense", "tp-keep-attention", "tp-heads", "tp-seq-len", "tp-pp", "tp-fold-ring",
        "tp-moe", "moe-keep-attention", "tp-moe-offload"])
def test_bad_jobs_are_refused_naming_the_field(overrides, change, names):
    assert names in problems_of(*overrides, change=change) + "\n"


def test_beside_moe_layers_alone_the_offload_and_the_tiles_are_accepted():
    assert problems_of("--upipe.offload_block_inputs", "--upipe.mlp_tile_tokens=48", "--upipe.no_fuse_projections",
                       change=_qwen3_moe) == ""


def _plain_loss():
    from torchtitan.components.loss import CrossEntropyLoss

    return CrossEntropyLoss.Config()


def _selective():
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    return SelectiveAC.Config()


def _use_flex(config):
    from torchtitan.models.llama3 import model_registry

    config.model_spec = model_registry("debugmodel")  # 0.3's default: Flex


def _qwen35(config):
    """Qwen3.5's spec by name (its model imports fla's GPU kernels, absent here): the check
    reads the name before anything of the model."""
    config.model_spec = dataclasses.replace(config.model_spec, name="qwen3_5")


def _qwen3_moe(config):
    from torchtitan.models.qwen3 import model_registry

    config.model_spec = model_registry("debugmodel_moe", attn_backend="varlen")


def _custom_parallelize(config):
    config.model_spec = dataclasses.replace(config.model_spec, parallelize_fn=lambda model, **kw: model)


@pytest.mark.parametrize("seq_len, cp, chunks", [(512, 2, 4), (2048 * 3, 4, 24), (1400, 2, 14)])
def test_the_loss_chunks_divide_the_local_tokens(seq_len, cp, chunks):
    """0.3's ChunkedLossWrapper needs a chunk count that divides the local tokens: the fewest
    chunks of at most upipe.loss_chunk_tokens (64 in the debug config) each."""
    from upipe_compile.integrations.torchtitan.release_03.trainer import take_over

    config = jobs.load_config(f"--training.seq_len={seq_len}", f"--parallelism.context_parallel_degree={cp}")
    assert take_over(config)
    local = seq_len // cp
    assert config.loss.num_chunks == chunks and local % chunks == 0 and local // chunks <= 64


def test_the_trainer_refuses_before_building_and_leaves_other_backends_alone():
    from upipe_compile.errors import UnsupportedAttention
    from upipe_compile.integrations.torchtitan.release_03.trainer import take_over

    config = jobs.load_config("--parallelism.context_parallel_load_balancer=headtail")
    with pytest.raises(UnsupportedAttention, match="context_parallel_load_balancer"):
        take_over(config)
    stock = jobs.load_config("--compile.backend=inductor")
    spec = stock.model_spec
    assert take_over(stock) is False and stock.model_spec is spec


def test_the_loss_is_rebuilt_with_the_inner_backend():
    """With "loss" in compile.components the Trainer's loss (compiled with compile.backend,
    "upipe") is rebuilt compiled with upipe.inner_backend, its lm_head kept: the same values."""
    import torch

    from upipe_compile.integrations.torchtitan.release_03.trainer import upipe_loss

    config = jobs.load_config("--compile.components", "model,loss", "--upipe.loss_chunk_tokens=16")
    assert config.upipe.inner_backend == "aot_eager"
    config.loss.num_chunks = 4
    stock = config.loss.build(compile_config=None)
    lm_head = torch.nn.Linear(8, 32, bias=False)
    stock.set_lm_head(lm_head)
    rebuilt = upipe_loss(config, stock)
    assert rebuilt is not stock and rebuilt.lm_head is lm_head and rebuilt.num_chunks == 4
    hidden, labels = torch.randn(1, 64, 8), torch.randint(0, 32, (1, 64))
    ours, _ = rebuilt(hidden, labels, torch.tensor(64.0))
    theirs, _ = stock(hidden, labels, torch.tensor(64.0))
    assert torch.allclose(ours, theirs, rtol=1e-6), (ours, theirs)
