"""The step-time model (upipe_compile.estimate.step_time): what full activation checkpointing,
keep_attention, recompute_attention_output, UPipe's stages, a ring and offload each add, on
Llama3-8B's shape and an H100."""

from __future__ import annotations

from dataclasses import replace

import pytest

from upipe_compile.estimate.step_time import (H100, ModelShape, Setup, attention_forward_flops, model_flops, step_time,
                                              ulysses)

LLAMA3_8B = ModelShape(n_layers=32, dim=4096, q_heads=32, kv_heads=8, head_dim=128, vocab_size=128256,
                       layer_weights=2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)


def test_attention_flops_per_layer_and_rank():
    """4 S^2 D Hq / P forward, half of it causal: at 3M tokens about 7.4e16 per layer in all."""
    setup = Setup(seq_len=3 << 20, cp=8, heads_per_stage=8)
    assert attention_forward_flops(LLAMA3_8B, setup) * 8 == pytest.approx(2 * (3 << 20) ** 2 * 128 * 32)
    assert attention_forward_flops(LLAMA3_8B, replace(setup, causal=False)) == 2 * attention_forward_flops(
        LLAMA3_8B, setup)


def test_keep_attention_drops_one_attention_forward_and_recompute_output_adds_one():
    setup = Setup(seq_len=1 << 20, cp=8, heads_per_stage=8)
    forward = attention_forward_flops(LLAMA3_8B, setup) / H100.attention_forward_flops
    full, kept = step_time(LLAMA3_8B, setup), step_time(LLAMA3_8B, replace(setup, keep_attention=True))
    rerun = step_time(LLAMA3_8B, replace(setup, recompute_attention_output=True))
    assert full.attention - kept.attention == pytest.approx(32 * forward)
    assert rerun.attention - full.attention == pytest.approx(32 * forward)
    # Without AC there is no recompute: keep changes nothing; the linear algebra runs 3 times, not 4.
    plain = replace(setup, full_ac=False)
    assert step_time(LLAMA3_8B, plain).total == step_time(LLAMA3_8B, replace(plain, keep_attention=True)).total
    assert step_time(LLAMA3_8B, plain).linear == pytest.approx(full.linear * 3 / 4)


@pytest.mark.parametrize("seq_len", [1 << 20, 2 << 20, 3 << 20])
def test_upipe_with_keep_is_over_1_2x_ulysses_at_1_to_3m_tokens_on_h100(seq_len):
    setup = Setup(seq_len=seq_len, cp=8, heads_per_stage=8)
    base = step_time(LLAMA3_8B, ulysses(setup, LLAMA3_8B)).total
    assert base / step_time(LLAMA3_8B, replace(setup, keep_attention=True)).total >= 1.2
    # Without keep, UPipe is Ulysses' speed within 1% (its stages' all-to-alls hide under attention).
    assert base / step_time(LLAMA3_8B, setup).total == pytest.approx(1.0, abs=0.01)


def test_stages_hide_their_all_to_alls_but_pay_latency():
    short = Setup(seq_len=262144, cp=8, heads_per_stage=8)
    one_stage = step_time(LLAMA3_8B, ulysses(short, LLAMA3_8B))
    stages = step_time(LLAMA3_8B, short)
    assert stages.all_to_all < one_stage.all_to_all  # bytes hidden under attention
    tiny = replace(short, seq_len=1024)
    assert step_time(LLAMA3_8B, tiny).all_to_all > step_time(LLAMA3_8B, ulysses(tiny, LLAMA3_8B)).all_to_all


def test_a_ring_across_nodes_costs_latency_and_an_all_to_all_across_nodes_bandwidth():
    setup = Setup(seq_len=24 << 20, cp=32, heads_per_stage=8, ring_degree=4)
    assert step_time(LLAMA3_8B, setup).ring > 0
    assert step_time(LLAMA3_8B, replace(setup, ring_degree=1)).ring == 0
    within = step_time(LLAMA3_8B, Setup(seq_len=24 << 20, cp=8, heads_per_stage=8, ranks_per_node=8))
    across = step_time(LLAMA3_8B, Setup(seq_len=24 << 20, cp=8, heads_per_stage=8, ranks_per_node=4))
    assert across.all_to_all > within.all_to_all


def test_offload_transfers_hide_under_compute_at_long_context_not_over_a_slow_link():
    setup = Setup(seq_len=5 << 20, cp=8, heads_per_stage=8, offload_block_inputs=True, keep_attention=True)
    assert step_time(LLAMA3_8B, setup).offload == 0
    slow = replace(H100, host_link_bytes=1e6)
    assert step_time(LLAMA3_8B, replace(setup, seq_len=65536), slow).offload > 0


def test_rows_of_a_batch_attend_each_to_itself():
    """Two rows of S tokens: twice one row's attention and linear work (not a 2S-token row's
    four times the attention), and twice its tokens per second at the same step time."""
    one = Setup(seq_len=1 << 20, cp=8, heads_per_stage=8)
    two = replace(one, batch=2)
    assert attention_forward_flops(LLAMA3_8B, two) == 2 * attention_forward_flops(LLAMA3_8B, one)
    a, b = step_time(LLAMA3_8B, one), step_time(LLAMA3_8B, two)
    assert b.attention == pytest.approx(2 * a.attention) and b.linear == pytest.approx(2 * a.linear)
    assert b.tokens_per_s(two) == pytest.approx(2 * (1 << 20) / b.total)


def test_fsdp_cpu_offload_adds_the_host_optimizer_step_and_hides_its_copies_at_long_context():
    """FSDP's CPU offload: the optimizer step runs on the host, bound by its memory (28 bytes a
    parameter: fused fp32 AdamW), after backward; the parameter shards in and gradients out hide
    under a layer's compute at 1M tokens but not at 8K."""
    from upipe_compile.estimate.step_time import HOST_ADAMW_BYTES_PER_PARAM

    setup = Setup(seq_len=1 << 20, cp=8, heads_per_stage=8, fsdp_shards=8)
    kept, offloaded = step_time(LLAMA3_8B, setup), step_time(LLAMA3_8B, replace(setup, offload_state=True))
    params = (32 * LLAMA3_8B.layer_weights + 2 * LLAMA3_8B.vocab_size * LLAMA3_8B.dim) / 8
    assert offloaded.host_optimizer == pytest.approx(params * HOST_ADAMW_BYTES_PER_PARAM / H100.host_memory_bytes)
    assert kept.host_optimizer == 0 and offloaded.offload == kept.offload == 0
    assert offloaded.total == pytest.approx(kept.total + offloaded.host_optimizer)
    short = replace(setup, seq_len=8192)
    assert step_time(LLAMA3_8B, replace(short, offload_state=True)).offload > 0


def test_tensor_parallelism_splits_the_work_and_adds_sequence_parallel_collectives():
    """TP 8 beside CP 4 (32 ranks): each rank does 1/8 of the matmuls and of the attention of
    its CP shard, the all-to-all carries 1/8 of the heads, and each layer run adds 4 all-gathers
    or reduce-scatters of 7/8 of the shard's activations over NVLink."""
    cp4 = Setup(seq_len=1 << 20, cp=4, heads_per_stage=8, ring_degree=4, ranks_per_node=8)
    tp8 = replace(cp4, tp=8)
    alone, split = step_time(LLAMA3_8B, cp4), step_time(LLAMA3_8B, tp8)
    assert split.attention == pytest.approx(alone.attention / 8)
    assert split.head_and_loss == pytest.approx(alone.head_and_loss / 8)
    n = (1 << 20) / 4
    collectives = 3 * 4 * (7 / 8 * n * 4096 * 2 / H100.all_to_all_bytes + H100.collective_latency_s)
    assert split.linear == pytest.approx(alone.linear / 8 + 32 * collectives)


def test_a_moe_layer_runs_its_tokens_through_top_k_experts_and_ep_sends_each_routed_copy():
    """Qwen3-30B-A3B's shape (128 experts, 8 a token): the matmuls count the weights a token
    runs through, not every expert's; EP 8 adds a dispatch and a combine all-to-all of each
    routed token copy per layer run and two in backward (full AC: three runs in all), 7/8 of
    them leaving the rank; the FSDP state the host keeps is every expert's; tiles of tokens
    run the MoE layer once more."""
    dense_weights = 4096 * 2048 * 2 + 512 * 2048 * 2 + 128 * 2048
    experts = 128 * 3 * 2048 * 768
    moe = ModelShape(n_layers=48, dim=2048, q_heads=32, kv_heads=4, head_dim=128, vocab_size=151936,
                     layer_weights=dense_weights + experts, active_layer_weights=dense_weights + experts // 16,
                     experts_per_token=8)
    cp8 = Setup(seq_len=1 << 20, cp=8, heads_per_stage=8)
    as_dense = step_time(replace(moe, active_layer_weights=0, experts_per_token=0), cp8)
    routed = step_time(moe, cp8)
    assert routed.linear == pytest.approx(as_dense.linear * (dense_weights + experts / 16) / (dense_weights + experts))
    assert routed.expert_all_to_all == 0  # no EP: the experts are local
    ep8 = step_time(moe, replace(cp8, ep=8))
    n = (1 << 20) / 8
    per_layer = 3 * 2 * (7 / 8 * n * 8 * 2048 * 2 / H100.all_to_all_bytes + H100.collective_latency_s)
    assert ep8.expert_all_to_all == pytest.approx(48 * per_layer)
    assert ep8.total == pytest.approx(routed.total + ep8.expert_all_to_all)
    assert model_flops(moe, cp8) < model_flops(replace(moe, active_layer_weights=0), cp8)
    on_host = replace(cp8, offload_state=True, fsdp_shards=8)
    assert step_time(moe, on_host).host_optimizer == step_time(replace(moe, active_layer_weights=0),
                                                               on_host).host_optimizer > 0
    # tokens in tiles (mlp_tile_tokens): each tile's MoE layer runs once more in backward, its
    # router and experts' matmuls and both all-to-alls (four runs instead of three)
    tiled = step_time(moe, replace(cp8, ep=8, moe_tiles=True))
    assert tiled.linear - ep8.linear == pytest.approx(48 * 2 * n * (128 * 2048 + experts / 16) / H100.matmul_flops)
    assert tiled.expert_all_to_all == pytest.approx(ep8.expert_all_to_all * 4 / 3)
    assert step_time(replace(moe, active_layer_weights=0, experts_per_token=0), replace(cp8, moe_tiles=True)) == as_dense
