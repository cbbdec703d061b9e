"""The [upipe] stack keys in torchtitan jobs: bad values and models they cannot apply to are
refused before anything runs, each message naming the TOML key; the offload's host-memory
arithmetic for the shipped 8xH100 TOML and the node check. (Training with the stack on:
tests/test_torchtitan.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests_support import relative_error
from torchtitan_jobs import DEBUG_TOML, load_config, train_debug_model
from upipe_compile.errors import UnsupportedAttention

GIB = 1 << 30


def dims_for(config, world_size):
    from torchtitan.distributed import ParallelDims

    p = config.parallelism
    return ParallelDims(
        dp_shard=p.data_parallel_shard_degree, dp_replicate=p.data_parallel_replicate_degree,
        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
        ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree, world_size=world_size,
    )


def debug_job(*overrides):
    import upipe_compile.integrations.torchtitan  # noqa: F401  registers the spec
    from torchtitan.protocols.train_spec import get_train_spec

    config = load_config(DEBUG_TOML, "--activation_checkpoint.mode=full", *overrides)
    spec = get_train_spec("llama3")
    args = spec.model_args["debugmodel"]
    with torch.device("meta"):
        model = spec.model_cls(args)
    return config, dims_for(config, config.parallelism.context_parallel_degree), args, model


def refusal(*overrides, mutate=None) -> str:
    from upipe_compile.integrations.torchtitan import check_job

    config, dims, args, model = debug_job(*overrides)
    if mutate:
        mutate(model)
    with pytest.raises(UnsupportedAttention) as info:
        check_job(config, dims, args, model)
    return str(info.value)


@pytest.mark.parametrize("key", ["mlp_tile_tokens", "loss_chunk_tokens"])
def test_negative_tile_or_chunk_names_the_key(key):
    assert f"[upipe] {key} = -4 must be a whole number of tokens > 0 (or 0 = off)" in refusal(f"--upipe.{key}=-4")


def test_offload_needs_full_activation_checkpointing():
    message = refusal("--upipe.offload_block_inputs", "--activation_checkpoint.mode=selective")
    assert '[upipe] offload_block_inputs = true needs [activation_checkpoint] mode = "full"' in message


def test_negative_host_reserve_is_refused():
    assert "[upipe] host_memory_reserve_gib = -2.0 must be a number >= 0 (or -1: scaled to the node)" in refusal(
        "--upipe.host_memory_reserve_gib=-2")


def test_tiled_mlp_on_a_model_without_swiglu_names_the_key_and_layer():
    class GeluMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2, self.w3 = nn.Linear(4, 8), nn.Linear(8, 4), nn.Linear(4, 8)

        def forward(self, x):
            return self.w2(nn.functional.gelu(self.w1(x)))

    def swap(model):
        model.layers["0"].feed_forward = GeluMLP()

    message = refusal("--upipe.mlp_tile_tokens=64", mutate=swap)
    assert "[upipe] mlp_tile_tokens = 64 cannot tile layers.0.feed_forward: GeluMLP is not a known SwiGLU feed-forward" in message

    def drop(model):  # a MoE layer has `moe` instead of `feed_forward`
        del model.layers["1"].feed_forward

    assert "cannot tile layers.1: it has neither a feed_forward nor a MoE layer" in refusal("--upipe.mlp_tile_tokens=64", mutate=drop)


def test_chunked_loss_on_an_output_with_bias_names_the_key():
    def biased(model):
        model.output = nn.Linear(model.output.in_features, model.output.out_features, bias=True)

    message = refusal("--upipe.loss_chunk_tokens=128", mutate=biased)
    assert "[upipe] loss_chunk_tokens = 128 needs the model's `output` to be a bias-free nn.Linear" in message


def test_stack_keys_without_the_upipe_backend_are_refused_not_ignored():
    from upipe_compile.integrations.torchtitan import build_loss_fn_upipe, parallelize_llama_upipe

    config, dims, _, model = debug_job("--upipe.mlp_tile_tokens=64", "--compile.backend=inductor")
    with pytest.raises(UnsupportedAttention, match=r"\[upipe\] mlp_tile_tokens only apply with \[compile\]"):
        parallelize_llama_upipe(model, dims, config)
    with pytest.raises(UnsupportedAttention, match=r"\[upipe\] mlp_tile_tokens only apply"):
        build_loss_fn_upipe(config)


def test_stack_defaults_change_nothing():
    from upipe_compile.integrations.torchtitan import check_job

    config, dims, args, model = debug_job()
    assert (config.upipe.offload_block_inputs, config.upipe.mlp_tile_tokens, config.upipe.loss_chunk_tokens) == \
        (False, 0, 0)
    check_job(config, dims, args, model)
    from upipe_compile.integrations.torchtitan.long_context_stack import offload_host_bytes_per_rank

    assert offload_host_bytes_per_rank(config, dims, args) == 0


def test_offload_host_memory_for_8b_at_5m_tokens_and_the_node_check():
    """Llama3-8B, 5M tokens, CP=8, bf16: 655360 x 4096 x 2 B = 5 GiB per block, 32 blocks."""
    from torchtitan.protocols.train_spec import get_train_spec

    from upipe_compile.integrations.torchtitan.long_context_stack import check_offload_fits_host, offload_host_bytes_per_rank

    h100 = DEBUG_TOML.replace("debug_model_upipe_cpu.toml", "llama3_8b_upipe.toml")
    config = load_config(h100, "--training.seq_len=5242880", "--upipe.offload_block_inputs")
    dims = dims_for(config, 8)
    args = get_train_spec("llama3").model_args["8B"]
    assert offload_host_bytes_per_rank(config, dims, args) == 160 * GIB
    check_offload_fits_host(config, dims, args, total_bytes=2048 * GIB, ranks=8)  # a 2 TiB node holds it
    with pytest.raises(UnsupportedAttention) as info:
        check_offload_fits_host(config, dims, args, total_bytes=1024 * GIB, ranks=8)
    message = str(info.value)
    assert message.startswith("[upipe] offload_block_inputs = true: offloading block inputs needs 160.0 GiB")
    assert "x 8 ranks per node = 1280.0 GiB" in message and "node has 1024.0 GiB" in message


def test_default_host_reserve_scales_with_the_node():
    """The default reserve (-1) is a quarter of the node's memory, at most 64 GiB: Llama3-8B's
    1280 GiB of inputs per 8-GPU node at 5M tokens fit 1,700 GiB (64 kept) and not 1,340 GiB;
    a 24 GiB machine keeps 6 GiB, so 16 GiB of inputs fit it where a fixed 64 GiB refused
    every machine under 64 GiB. A reserve the job sets wins."""
    from torchtitan.protocols.train_spec import get_train_spec

    from upipe_compile.integrations.torchtitan.long_context_stack import check_offload_fits_host

    h100 = DEBUG_TOML.replace("debug_model_upipe_cpu.toml", "llama3_8b_upipe.toml")
    config = load_config(h100, "--training.seq_len=5242880", "--upipe.offload_block_inputs")
    assert config.upipe.host_memory_reserve_gib == -1
    dims, args = dims_for(config, 8), get_train_spec("llama3").model_args["8B"]
    check_offload_fits_host(config, dims, args, total_bytes=1700 * GIB, ranks=8)
    with pytest.raises(UnsupportedAttention) as info:
        check_offload_fits_host(config, dims, args, total_bytes=1340 * GIB, ranks=8)
    assert "a reserve of 64.0 GiB (the default: 25% of 1340.0 GiB, at most 64 GiB" in str(info.value)
    small = load_config(h100, "--training.seq_len=524288", "--upipe.offload_block_inputs")  # 16 GiB per rank
    check_offload_fits_host(small, dims, args, total_bytes=24 * GIB, ranks=1)
    with pytest.raises(UnsupportedAttention) as info:
        check_offload_fits_host(small, dims, args, total_bytes=20 * GIB, ranks=1)
    assert "a reserve of 5.0 GiB (the default: 25% of 20.0 GiB" in str(info.value)
    fixed = load_config(h100, "--training.seq_len=524288", "--upipe.offload_block_inputs",
                        "--upipe.host_memory_reserve_gib=64")
    with pytest.raises(UnsupportedAttention) as info:
        check_offload_fits_host(fixed, dims, args, total_bytes=24 * GIB, ranks=1)
    assert "a reserve of 64.0 GiB (host_memory_reserve_gib=64, as set)" in str(info.value)


def test_keep_attention_offloaded_counts_its_outputs_against_the_node():
    """With keep_attention the offload also holds each fused block's attention output and the
    attention's own (5 GiB each per block here) and the stage LSEs (U = P = 8: 4 stages of one
    q head per rank over all 5M tokens, fp32: 80 MiB per block): 482.5 GiB per rank, which a
    2 TiB node cannot hold for 8 ranks, refused naming keep_attention."""
    from torchtitan.protocols.train_spec import get_train_spec

    from upipe_compile.integrations.torchtitan.long_context_stack import check_offload_fits_host, offload_host_bytes_per_rank

    h100 = DEBUG_TOML.replace("debug_model_upipe_cpu.toml", "llama3_8b_upipe.toml")
    config = load_config(h100, "--training.seq_len=5242880", "--upipe.offload_block_inputs",
                         "--activation_checkpoint.mode=full", "--upipe.keep_attention")
    dims = dims_for(config, 8)
    args = get_train_spec("llama3").model_args["8B"]
    lse = 4 * 1 * 5242880 * 4
    assert offload_host_bytes_per_rank(config, dims, args) == 32 * (3 * 5 * GIB + lse)
    with pytest.raises(UnsupportedAttention) as info:
        check_offload_fits_host(config, dims, args, total_bytes=2048 * GIB, ranks=8)
    message = str(info.value)
    assert message.startswith("[upipe] offload_block_inputs = true (with keep_attention's attention outputs)")
    assert "or set [upipe] keep_attention = false" in message


def test_output_group_is_kept_gathered_for_the_chunked_loss(rank_pools):
    assert rank_pools(2).run(_reshard_policy_with_chunked_loss) == [(False, True)] * 2


def _reshard_policy_with_chunked_loss():
    """On a rank: parallelize the debug model with fsdp_reshard_after_forward = "always";
    (norm/output group resharded after forward?, a block resharded after forward?)."""
    from upipe_compile.integrations.torchtitan.estimate_job import torchtitan_on_cpu
    from upipe_compile.integrations.torchtitan import parallelize_llama_upipe

    torchtitan_on_cpu()
    config, dims, _, model = debug_job("--upipe.loss_chunk_tokens=64", "--parallelism.fsdp_reshard_after_forward=always")
    dims.build_mesh()  # FSDP over the fsdp mesh = cp (2 ranks)
    model = parallelize_llama_upipe(model, dims, config)

    def resharded(module):
        return module._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None

    return resharded(model.output), resharded(model.layers["0"])


def test_qwen3_spec_is_registered_and_moe_flavors_refused():
    import upipe_compile.integrations.torchtitan  # noqa: F401
    from torchtitan.protocols.train_spec import get_train_spec

    from upipe_compile.integrations.torchtitan import check_job

    spec = get_train_spec("qwen3")
    assert spec.parallelize_fn.__name__ == "parallelize_qwen3_upipe"
    assert spec.build_loss_fn.__name__ == "build_loss_fn_upipe"
    config = load_config(DEBUG_TOML, "--model.name=qwen3", "--model.flavor=32B")
    dims = dims_for(config, 2)
    check_job(config, dims, spec.model_args["32B"])  # 64 q / 8 kv heads, dense: accepted
    with pytest.raises(UnsupportedAttention, match="model flavor has MoE layers"):
        check_job(config, dims, spec.model_args["30B-A3B"])


def test_a_real_buffer_handed_to_every_block_is_held_once_in_the_param_dtype():
    """FSDP casts each block's floating inputs to bf16 and AC keeps them until backward: an
    fp32 buffer passed to every block (Qwen3's rope_cache) would live once per layer. The
    root pre-forward hook casts it once; complex buffers (Llama3's freqs_cis) stay."""
    from upipe_compile.integrations.torchtitan.release_022.parallelize import _root_buffers_in_param_dtype

    model = torch.nn.Module()
    model.register_buffer("rope_cache", torch.randn(16, 8), persistent=False)
    model.register_buffer("freqs_cis", torch.randn(16, 4, dtype=torch.complex64), persistent=False)
    model.forward = lambda x: x
    reference = model.rope_cache.clone()
    _root_buffers_in_param_dtype(model, torch.bfloat16)
    model(torch.zeros(1))
    assert model.rope_cache.dtype == torch.bfloat16 and model.freqs_cis.dtype == torch.complex64
    assert torch.equal(model.rope_cache, reference.to(torch.bfloat16))
    cast_once = model.rope_cache
    model(torch.zeros(1))
    assert model.rope_cache is cast_once  # once, not per step
    assert "rope_cache" not in model.state_dict()


def test_qwen3_rope_table_reaches_every_block_without_a_copy(rank_pools):
    """FSDP's bf16 mixed precision casts each block's floating arguments; Qwen3 hands every
    block its fp32 RoPE table of the whole sequence, so each block would get (and full AC
    save) its own copy. The integration keeps the table in the param dtype: every block gets
    the model's buffer itself."""
    assert rank_pools(2).run(_rope_table_seen_by_the_blocks) == [[(torch.bfloat16, True)] * 2] * 2


def _rope_table_seen_by_the_blocks():
    """On a rank: the Qwen3 debug model (untied, 2 layers) parallelized with FSDP in bf16 over
    CP = 2, one forward: (dtype, is it the model's buffer) of the RoPE table each block gets."""
    import dataclasses

    import upipe_compile.integrations.torchtitan  # noqa: F401
    from torchtitan.protocols.train_spec import get_train_spec

    from upipe_compile.integrations.torchtitan.estimate_job import torchtitan_on_cpu
    from upipe_compile.integrations.torchtitan import parallelize_qwen3_upipe
    from upipe_compile.integrations.torchtitan.measurement import mark_for_measurement

    torchtitan_on_cpu()
    config = load_config(DEBUG_TOML, "--model.name=qwen3", "--model.flavor=debugmodel",
                         "--activation_checkpoint.mode=full", "--training.mixed_precision_param=bfloat16")
    dims = dims_for(config, 2)
    dims.build_mesh()
    args = get_train_spec("qwen3").model_args["debugmodel"]
    args = dataclasses.replace(args, enable_weight_tying=False, n_layers=2)
    args.update_from_config(config)
    with torch.device("meta"):
        model = get_train_spec("qwen3").model_cls(args)
    model = parallelize_qwen3_upipe(model, dims, mark_for_measurement(config))  # nothing compiled
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    seen = []

    def record(module, block_args):
        rope = block_args[1]
        seen.append((rope.dtype, rope.untyped_storage().data_ptr() == model.rope_cache.untyped_storage().data_ptr()))

    for block in model.layers.values():
        block.register_forward_pre_hook(record)
        block.forward = lambda x, *rest, **kwargs: x  # the block itself is not what is tested
    model(torch.randint(0, args.vocab_size, (1, config.training.seq_len // 2)))
    return seen


def test_keep_attention_runs_attention_once_per_step_with_the_same_numbers(rank_pools):
    """[upipe] keep_attention under full AC: the recompute in backward reruns the block but
    not its attention (one upipe::attention_block forward per layer per step, not two), and
    losses and first-step gradients equal full AC's at CP = 2 (fp32)."""
    full = ("--activation_checkpoint.mode=full",)
    plain = rank_pools(2).run(train_debug_model, 2, 2, None, full)
    kept = rank_pools(2).run(train_debug_model, 2, 2, None, (*full, "--upipe.keep_attention"))
    layers = plain[0]["n_layers"]
    for rank in range(2):
        assert plain[rank]["counts"]["upipe::attention_block"] == 2 * layers, plain[rank]["counts"]
        assert kept[rank]["counts"]["upipe::attention_block"] == layers, kept[rank]["counts"]
        for a, b in zip(kept[rank]["losses"], plain[rank]["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b)
        for name, ref in plain[rank]["grads"].items():
            assert relative_error(kept[rank]["grads"][name], ref) < 1e-5, name


def test_keep_attention_with_offload_moves_the_kept_outputs_to_host(rank_pools):
    """keep_attention with offload_block_inputs: each block's kept attention outputs (the fused
    op's y, o and stage LSEs) go to host beside its input, are fetched back for backward, and the
    numbers equal full AC without either (fp32, every rank); the bytes moved are what
    attention_outputs_bytes_per_rank says beside the block inputs."""
    from upipe_compile.integrations.torchtitan.long_context_stack import attention_outputs_bytes_per_rank

    full = ("--activation_checkpoint.mode=full",)
    offload = (*full, "--upipe.offload_block_inputs", "--upipe.host_memory_reserve_gib=1")
    plain = rank_pools(2).run(train_debug_model, 2, 2, None, full)
    kept = rank_pools(2).run(train_debug_model, 2, 2, None, (*offload, "--upipe.keep_attention"))
    inputs_only = rank_pools(2).run(train_debug_model, 2, 2, None, offload)
    config = load_config(DEBUG_TOML, *offload, "--upipe.keep_attention", "--parallelism.context_parallel_degree=2")
    layers = plain[0]["n_layers"]
    for rank in range(2):
        assert kept[rank]["counts"]["upipe::attention_block"] == layers, kept[rank]["counts"]
        input_tensors, input_bytes = inputs_only[rank]["offloaded"][-1]
        tensors, moved = kept[rank]["offloaded"][-1]
        assert input_tensors == layers
        assert tensors == 4 * layers  # input, y, o, lse
        # fp32 debug model, fused blocks
        assert moved - input_bytes == attention_outputs_bytes_per_rank(config, kept[rank]["model_dims"], 2,
                                                                       torch.float32, fused=True)
        for a, b in zip(kept[rank]["losses"], plain[rank]["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b)
        for name, ref in plain[rank]["grads"].items():
            assert relative_error(kept[rank]["grads"][name], ref) < 1e-5, name


def test_keep_attention_refusals():
    """keep_attention without full AC or with recompute_attention_output is refused before the
    model is built, naming the keys."""
    message = refusal("--upipe.keep_attention", "--activation_checkpoint.mode=selective")
    assert '[upipe] keep_attention = true needs [activation_checkpoint] mode = "full"' in message
    message = refusal("--upipe.keep_attention", "--upipe.recompute_attention_output")
    assert "keep_attention = true and recompute_attention_output = true" in message


def test_kept_blocks_and_fsdp_offload_in_the_node_check():
    """``blocks_kept_on_device = 4`` takes 4 of Llama3-8B's 32 block inputs off the host (140 of
    160 GiB per rank at 5M tokens); FSDP's offloaded state counts beside them, and the refusal
    names both and the key that helps."""
    from torchtitan.protocols.train_spec import get_train_spec

    from upipe_compile.integrations.torchtitan.long_context_stack import (check_offload_fits_host,
                                                                          offload_host_bytes_per_rank)

    h100 = DEBUG_TOML.replace("debug_model_upipe_cpu.toml", "llama3_8b_upipe.toml")
    config = load_config(h100, "--training.seq_len=5242880", "--upipe.offload_block_inputs",
                         "--upipe.blocks_kept_on_device=4", "--training.enable_cpu_offload")
    dims, args = dims_for(config, 8), get_train_spec("llama3").model_args["8B"]
    assert offload_host_bytes_per_rank(config, dims, args) == 140 * GIB
    state = 16 * GIB  # 8B fp32 parameters over 8 ranks x 4 (the parameter, its gradient, two moments)
    check_offload_fits_host(config, dims, args, total_bytes=(8 * 156 + 64) * GIB, ranks=8, fsdp_state_bytes=state)
    with pytest.raises(UnsupportedAttention) as info:
        check_offload_fits_host(config, dims, args, total_bytes=(8 * 156 + 63) * GIB, ranks=8, fsdp_state_bytes=state)
    message = str(info.value)
    assert "needs 156.0 GiB of host memory per rank x 8 ranks per node = 1248.0 GiB" in message
    assert "[training] enable_cpu_offload = true (FSDP's parameters, gradients and optimizer state: 16.0 GiB" in message
    assert "raise [upipe] blocks_kept_on_device" in message


def test_fsdp_host_state_is_each_local_shard_four_times():
    """What the start-up check counts for ``training.enable_cpu_offload``: each parameter's local
    shard (a DTensor's ``to_local()``), its gradient and Adam's two moments."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.tensor import DeviceMesh, DTensor, Shard

    from upipe_compile.integrations.torchtitan.long_context_stack import fsdp_host_state_bytes
    from upipe_compile.measure.memory import fake_process_group

    plain = nn.Linear(4, 3)  # 15 fp32 numbers
    assert fsdp_host_state_bytes(plain) == 4 * 15 * 4
    local = torch.zeros(2, 4)  # this rank's rows of an [8, 4] parameter over 4 ranks
    with fake_process_group(4):
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        sharded = nn.Module()
        sharded.weight = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))
        assert sharded.weight.shape == (8, 4)
        assert fsdp_host_state_bytes(sharded) == 4 * local.nbytes


def test_keeping_every_block_on_device_is_refused_in_each_release_spelling():
    """``blocks_kept_on_device`` >= the model's blocks offloads nothing: refused, naming the keys
    as the job spells them (0.2.2's TOML here)."""
    from types import SimpleNamespace

    from upipe_compile.integrations.torchtitan.config import UPipe
    from upipe_compile.integrations.torchtitan.long_context_stack import offload_problems
    from upipe_compile.integrations.torchtitan.release_022.facts import SPELLING

    model = SimpleNamespace(layers=nn.ModuleDict({str(i): nn.Identity() for i in range(6)}))
    assert offload_problems(model, UPipe(offload_block_inputs=True, blocks_kept_on_device=5), SPELLING) == []
    assert offload_problems(model, UPipe(offload_block_inputs=True, blocks_kept_on_device=6), SPELLING) == [
        "[upipe] blocks_kept_on_device = 6 keeps every one of the model's 6 blocks on the device: offload nothing "
        "([upipe] offload_block_inputs = false) or keep fewer"]
