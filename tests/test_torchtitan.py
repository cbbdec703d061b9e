"""torchtitan 0.2.2 integration (upipe_compile.integrations.torchtitan).

- The shipped TOMLs load through torchtitan's own ConfigManager (with the [upipe] section
  from the custom config module); the 8xH100 one validates its ParallelDims for world size 8.
- torchtitan's debug model trained on 2 gloo ranks with CP=2 through the upipe path matches
  CP=1: same losses for several steps, same gradients after the first step. The Trainer
  cannot run on a CPU-only build (integrations/torchtitan/README.md says why), so
  tests/torchtitan_jobs.py drives the same integration code at the model level.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests_support import relative_error
from torchtitan_jobs import DEBUG_TOML, load_config, rope_rows_across_lengths, train_debug_model

TOML_DIR = os.path.join(os.path.dirname(__file__), "..", "integrations", "torchtitan")
H100_TOML = os.path.join(TOML_DIR, "llama3_8b_upipe.toml")
STEPS = 4


def test_every_shipped_toml_loads_through_config_manager():
    tomls = sorted(f for f in os.listdir(TOML_DIR) if f.endswith(".toml"))
    assert tomls == ["debug_model_upipe_cpu.toml", "llama3_70b_upipe_8_nodes.toml", "llama3_8b_upipe.toml",
                     "llama3_8b_upipe_4_nodes.toml", "llama3_8b_upipe_5m.toml", "qwen3_32b_upipe.toml"]
    for name in tomls:
        config = load_config(os.path.join(TOML_DIR, name))
        assert config.compile.enable and config.compile.backend == "upipe", name
        assert config.experimental.custom_import == "upipe_compile.integrations.torchtitan", name
        assert config.job.custom_config_module == "upipe_compile.integrations.torchtitan.config", name
        assert config.parallelism.context_parallel_degree > 1, name
        assert hasattr(config, "upipe"), name


def test_h100_toml_parallel_dims_for_world_size_8():
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.train_spec import get_train_spec

    from upipe_compile.integrations.torchtitan import check_job

    config = load_config(H100_TOML)
    p = config.parallelism
    dims = ParallelDims(  # __post_init__ validates the degrees against the world size
        dp_shard=p.data_parallel_shard_degree, dp_replicate=p.data_parallel_replicate_degree,
        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
        ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree, world_size=8,
    )
    assert (dims.cp, dims.dp_shard, dims.dp_replicate, dims.tp, dims.pp) == (8, 1, 1, 1, 1)
    assert dims.fsdp_enabled and dims.fsdp_gradient_divide_factor == 8
    assert config.training.seq_len % (1024 * dims.cp) == 0
    assert config.activation_checkpoint.mode != "none"
    assert config.model.name == "llama3" and config.model.flavor == "8B"
    spec = get_train_spec(config.model.name)  # the custom_import has registered upipe's spec
    assert spec.parallelize_fn.__name__ == "parallelize_llama_upipe"
    args = spec.model_args[config.model.flavor]
    assert (args.n_heads, args.n_kv_heads) == (32, 8)
    check_job(config, dims, args)  # nothing refused
    with pytest.raises(Exception, match="attn_type"):
        check_job(config, dims, spec.model_args["8B_flex"])
    assert config.upipe.prefetch == "forward"
    with pytest.raises(Exception, match=r"\[upipe\] prefetch='always' is not one of"):
        config.upipe.prefetch = "always"
        check_job(config, dims, args)
    config.upipe.prefetch = "forward"
    with pytest.raises(Exception, match=r"\[upipe\] recompute_attention_output=True acts on fused attention blocks only"):
        config.upipe.fuse_projections, config.upipe.recompute_attention_output = False, True
        check_job(config, dims, args)
    config.upipe.fuse_projections, config.upipe.recompute_attention_output = True, False
    with pytest.raises(Exception, match="divisible by the CP degree"):
        config.training.seq_len += 4
        check_job(config, dims, args)
    with pytest.raises(AssertionError, match="WORLD_SIZE"):  # the same TOML degrees on 16 ranks
        ParallelDims(dp_shard=1, dp_replicate=1, cp=8, tp=1, pp=1, ep=1, etp=1, world_size=16)


def test_ring_degree_is_checked_against_the_job():
    """[upipe] ring_degree: what a 32-rank, 4-node job may ask, and what it may not."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.train_spec import get_train_spec

    from upipe_compile.errors import UnsupportedAttention
    from upipe_compile.integrations.torchtitan import check_job

    config = load_config(H100_TOML, "--parallelism.context_parallel_degree=32")
    dims = ParallelDims(dp_shard=1, dp_replicate=1, cp=32, tp=1, pp=1, ep=1, etp=1, world_size=32)
    spec = get_train_spec("llama3")
    args = spec.model_args["8B"]  # 32 q heads: a 1-D CP of 32 is Ulysses, 64 would be refused
    check_job(config, dims, args)
    config.upipe.ring_degree, config.upipe.heads_per_stage = 4, 8  # U counts the 8 all-to-all ranks
    check_job(config, dims, args)
    cases = [
        ({"ring_degree": 3}, r"ring_degree = 3 must divide \[parallelism\] context_parallel_degree = 32"),
        ({"ring_degree": 0}, r"ring_degree = 0 must be >= 1"),
        ({"heads_per_stage": 4}, r"heads_per_stage=4 must be a positive multiple of the context-parallel size P=8"),
        ({"ring_degree": 1, "heads_per_stage": 0}, None),
    ]
    for changes, message in cases:
        saved = {key: getattr(config.upipe, key) for key in changes}
        for key, value in changes.items():
            setattr(config.upipe, key, value)
        if message is None:
            check_job(config, dims, args)
        else:
            with pytest.raises(UnsupportedAttention, match=message):
                check_job(config, dims, args)
        for key, value in saved.items():
            setattr(config.upipe, key, value)
    with pytest.raises(UnsupportedAttention, match=r"seq_len = .* must be divisible by 2 x context_parallel_degree = 64"):
        config.training.seq_len = 32 * 1024 * 3 + 32
        check_job(config, dims, args)
    config.training.seq_len = 32 * 1024
    check_job(config, dims, spec.model_args["8B_varlen"])  # packed documents over the ring run
    config.upipe.ring_degree = 1
    with pytest.raises(UnsupportedAttention, match=r"n_heads = 32 is not divisible by the CP degree 64: set \[upipe\] ring_degree"):
        check_job(config, ParallelDims(dp_shard=1, dp_replicate=1, cp=64, tp=1, pp=1, ep=1, etp=1, world_size=64),
                  args)


def test_debug_toml_is_the_debug_model():
    config = load_config(DEBUG_TOML)
    assert (config.model.name, config.model.flavor) == ("llama3", "debugmodel")
    assert config.parallelism.context_parallel_degree == 2
    assert config.training.steps >= STEPS


def test_debug_model_cp2_matches_cp1(rank_pools):
    cp2 = rank_pools(2).run(train_debug_model, 2, STEPS)
    cp1 = rank_pools(1).run(train_debug_model, 1, STEPS)[0]
    layers = cp1["n_layers"]
    assert layers == 6

    for rank, result in enumerate(cp2):
        # torchtitan's load balancer was turned off by the integration, and the Trainer's
        # input sharding (routed by it) gave contiguous shards and no positions: the rank's
        # RoPE table holds exactly its tokens' rows.
        assert result["load_balancer"] is None and result["positions"] is None
        seq_local = result["seq_local"]
        expected = result["full_rope_table"][rank * seq_local:(rank + 1) * seq_local]
        assert torch.equal(result["rope_table"], expected), rank
        # Every layer's attention block ran as the fused upipe op (forward, plus AC
        # recomputation, and backward), and no SDPA kernel ran outside it: torchtitan's ring
        # attention is off.
        counts = result["counts"]
        assert counts.get("plain sdpa outside upipe", 0) == 0, counts
        assert counts["upipe::attention_block_backward"] == layers, counts
        assert counts["upipe::attention_block"] >= layers, counts
        assert "upipe::attention" not in counts, counts
        # The loss is summed over torchtitan's "loss" mesh (dp x cp): identical on all ranks.
        assert result["losses"] == cp2[0]["losses"]

    assert len(cp1["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(cp2[0]["losses"], cp1["losses"])):
        assert abs(a - b) <= 1e-5 * abs(b), (step, a, b)
    assert cp1["losses"][-1] != cp1["losses"][0]  # it trains

    # First-step gradients, reduced by FSDP over the fsdp (dp_shard x cp) mesh.
    assert set(cp2[0]["grads"]) == set(cp1["grads"])
    for name, ref in cp1["grads"].items():
        assert ref.norm() > 0, name
        for result in cp2:
            assert relative_error(result["grads"][name], ref) < 1e-5, name


def test_debug_model_ring_2x2_matches_cp1(rank_pools):
    """[upipe] ring_degree = 2 at CP = 4: two all-to-all pairs, ring attention between them;
    inputs and labels sharded zigzag over the ring by the Trainer's own call, each rank's RoPE
    table cut to its tokens' rows."""
    from upipe_compile.attention.zigzag import zigzag_shard

    ring = rank_pools(4).run(train_debug_model, 4, STEPS, None, ("--upipe.ring_degree=2",))
    cp1 = rank_pools(1).run(train_debug_model, 1, STEPS)[0]
    layers = cp1["n_layers"]
    seq = ring[0]["seq_local"] * 4
    for rank, result in enumerate(ring):
        # rank = ring rank x 2 + all-to-all rank: its all-to-all pair holds two zigzag chunks,
        # and its RoPE table those tokens' rows
        share = zigzag_shard(torch.arange(seq), rank // 2, 2, dim=0).chunk(2)[rank % 2]
        assert result["positions"] is None
        assert torch.equal(result["rope_table"], result["full_rope_table"][share]), rank
        counts = result["counts"]
        assert counts.get("plain sdpa outside upipe", 0) == 0, counts
        backwards = counts.get("upipe::attention_backward", 0) + counts.get("upipe::attention_block_backward", 0)
        assert backwards == layers, counts
        assert result["losses"] == ring[0]["losses"]
    for step, (a, b) in enumerate(zip(ring[0]["losses"], cp1["losses"])):
        assert abs(a - b) <= 1e-5 * abs(b), (step, a, b)
    assert set(ring[0]["grads"]) == set(cp1["grads"])
    for name, ref in cp1["grads"].items():
        for result in ring:
            assert relative_error(result["grads"][name], ref) < 1e-5, name


def test_debug_model_with_documents_ring_2x2_matches_cp1(rank_pools):
    """The varlen flavor (packed documents, boundaries over the whole sequence) with [upipe]
    ring_degree = 2 at CP = 4: each chunk pair's kernel sees the documents cut to it; losses
    and first-step gradients equal CP = 1."""
    ring = rank_pools(4).run(train_debug_model, 4, 2, None, ("--upipe.ring_degree=2",), documents=True)
    cp1 = rank_pools(1).run(train_debug_model, 1, 2, documents=True)[0]
    assert all(n >= 5 for n in cp1["documents"]), cp1["documents"]
    for result in ring:
        assert result["counts"].get("plain sdpa outside upipe", 0) == 0, result["counts"]
    for step, (a, b) in enumerate(zip(ring[0]["losses"], cp1["losses"])):
        assert abs(a - b) <= 1e-5 * abs(b), (step, a, b)
    for name, ref in cp1["grads"].items():
        for result in ring:
            assert relative_error(result["grads"][name], ref) < 1e-5, name


def test_rope_rows_follow_the_step_length(rank_pools):
    """Each rank's cut RoPE table holds its own tokens' rows at every length (a validation
    step of another length is cut again from the whole table), positions are refused, and
    a sequence longer than the table is named."""
    for rank, (read, errors) in enumerate(rank_pools(2).run(rope_rows_across_lengths)):
        assert read == [list(range(8 * rank, 8 * rank + 8)), list(range(4 * rank, 4 * rank + 4)),
                        list(range(8 * rank, 8 * rank + 8))], rank
        assert "the model got RoPE positions" in errors[0]
        assert "fewer than the 64 tokens of this step's sequence" in errors[1]


def test_blocks_are_compiled_with_the_backend_callable(monkeypatch):
    """Not the name "upipe", which resolves only through the installed entry point."""
    from types import SimpleNamespace

    from upipe_compile import upipe_backend
    from upipe_compile.integrations.torchtitan.release_022 import parallelize

    seen = []
    monkeypatch.setattr(torch, "compile", lambda module, **kwargs: seen.append(kwargs) or module)
    model = SimpleNamespace(layers=torch.nn.ModuleDict({"0": torch.nn.Linear(2, 2), "1": torch.nn.Linear(2, 2)}))
    cp_mesh = SimpleNamespace()  # stands in for torchtitan's "cp" mesh
    dims = SimpleNamespace(cp_enabled=True, cp=2, get_mesh=lambda name: {"cp": cp_mesh}[name])
    parallelize.compile_blocks(model, load_config(DEBUG_TOML), dims)
    assert [kwargs["backend"] for kwargs in seen] == [upipe_backend, upipe_backend]
    assert all(kwargs["options"]["cp_mesh"] is cp_mesh for kwargs in seen)


def test_a_upipe_jobs_state_dict_has_the_models_own_names():
    """Blocks compiled in place: the parallelized debug job's state_dict (what a checkpoint is
    keyed by) is the plain model's, no "_orig_mod.", so checkpoints move between jobs with and
    without upipe. On meta tensors over a fake CP = 2 world: nothing runs."""
    import copy
    import importlib

    from torchtitan.protocols.train_spec import get_train_spec

    from upipe_compile.integrations.torchtitan.estimate_job import torchtitan_on_cpu
    from upipe_compile.integrations.torchtitan.release_022.estimate import parallel_dims_of
    from upipe_compile.measure.memory import fake_process_group

    job_config = load_config(DEBUG_TOML)
    importlib.import_module(job_config.experimental.custom_import)  # registers upipe's train spec
    spec = get_train_spec(job_config.model.name)
    model_args = copy.deepcopy(spec.model_args[job_config.model.flavor])
    model_args.update_from_config(job_config)
    with torch.device("meta"):
        plain, model = spec.model_cls(model_args), spec.model_cls(model_args)
    torchtitan_on_cpu()
    world = job_config.parallelism.context_parallel_degree
    with fake_process_group(world):
        parallel_dims = parallel_dims_of(job_config, world)
        parallel_dims.build_mesh()
        model = spec.parallelize_fn(model, parallel_dims, job_config)
        keys = list(model.state_dict())
    assert keys == list(plain.state_dict())


def test_debug_model_with_stack_cp2_matches_cp1(rank_pools):
    """Offload + tiled MLP + chunked loss on (full AC, compiled blocks, FSDP over dp x cp):
    CP=2 matches CP=1, losses and every first-step gradient, and each piece really ran."""
    from torchtitan_jobs import STACK_OVERRIDES

    cp2 = rank_pools(2).run(train_debug_model, 2, STEPS, None, STACK_OVERRIDES)
    cp1 = rank_pools(1).run(train_debug_model, 1, STEPS, None, STACK_OVERRIDES)[0]
    layers = cp1["n_layers"]
    for result in (*cp2, cp1):
        assert result["pred_type"] == "LazyLogits"  # the model no longer makes logits
        counts = result["counts"]
        # Once per block in forward; the compiled recompute skips it (its backward needs only
        # its input and weights, and nothing downstream needs its output).
        assert counts["upipe::tiled_swiglu"] == layers, counts
        assert counts["upipe::tiled_swiglu_backward"] == layers, counts
        assert counts["upipe::linear_cross_entropy"] == 1, counts
        assert counts["upipe::linear_cross_entropy_backward"] == 1, counts
        # Exactly one tensor per block went to host each step: its input, [B, S/P, dim] fp32.
        block_input_bytes = result["local_tokens"] * result["dim"] * 4
        assert result["offloaded"] == [(layers, layers * block_input_bytes)] * STEPS
    for result in cp2:
        assert result["counts"].get("plain sdpa outside upipe", 0) == 0, result["counts"]
        assert result["counts"]["upipe::attention_block_backward"] == layers
        assert result["losses"] == cp2[0]["losses"]

    for step, (a, b) in enumerate(zip(cp2[0]["losses"], cp1["losses"])):
        assert abs(a - b) <= 1e-5 * abs(b), (step, a, b)
    assert cp1["losses"][-1] != cp1["losses"][0]
    assert set(cp2[0]["grads"]) == set(cp1["grads"]) and len(cp1["grads"]) == 3 + 9 * layers
    for name, ref in cp1["grads"].items():
        assert ref.norm() > 0, name
        for result in cp2:
            assert relative_error(result["grads"][name], ref) < 1e-5, name


def test_debug_model_stack_matches_plain_path_cp1(rank_pools):
    """The stack changes memory, not numbers: CP=1 with it on equals CP=1 with it off."""
    from torchtitan_jobs import STACK_OVERRIDES

    stacked = rank_pools(1).run(train_debug_model, 1, 2, None, STACK_OVERRIDES)[0]
    plain = rank_pools(1).run(train_debug_model, 1, 2, None, ("--activation_checkpoint.mode=full",))[0]
    for a, b in zip(stacked["losses"], plain["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b)
    for name, ref in plain["grads"].items():
        assert relative_error(stacked["grads"][name], ref) < 1e-5, name



QWEN3 = ("--model.name=qwen3", "--model.flavor=debugmodel")


def test_qwen3_debug_model_with_stack_cp2_matches_cp1(rank_pools):
    """The Qwen3 TrainSpec (QK-norm, GQA 16/8 heads, head_dim 128), 2 layers, the whole stack
    on: CP=2 matches CP=1. Untied embeddings, as the 14B/32B flavors: the tied small flavors
    fail in FSDP2 itself (init_weights re-ties the output to the sharded embedding, and
    torch 2.13's FSDP2 refuses a parameter shared by two groups), stack or not."""
    from torchtitan_jobs import STACK_OVERRIDES

    untied = {"enable_weight_tying": False}
    cp2 = rank_pools(2).run(train_debug_model, 2, 2, 2, (*QWEN3, *STACK_OVERRIDES), untied)
    cp1 = rank_pools(1).run(train_debug_model, 1, 2, 2, (*QWEN3, *STACK_OVERRIDES), untied)[0]
    for result in cp2:
        assert result["pred_type"] == "LazyLogits"
        assert result["counts"].get("plain sdpa outside upipe", 0) == 0, result["counts"]
        assert result["counts"]["upipe::attention_block_backward"] == 2
        assert result["counts"]["upipe::tiled_swiglu_backward"] == 2
        assert result["offloaded"][-1][0] == 2
        for a, b in zip(result["losses"], cp1["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b)
        assert set(result["grads"]) == set(cp1["grads"])
        for name, ref in cp1["grads"].items():
            assert relative_error(result["grads"][name], ref) < 1e-5, name


def test_debug_model_with_documents_cp2_matches_cp1(rank_pools):
    """torchtitan's document masking (the varlen flavor, boundaries from EOS tokens made once
    per step by get_attention_masks on the full batch) through UPipe: CP=2 equals CP=1
    (losses and first-step gradients); every layer's attention ran as the upipe op."""
    cp2 = rank_pools(2).run(train_debug_model, 2, 2, documents=True)
    cp1 = rank_pools(1).run(train_debug_model, 1, 2, documents=True)[0]
    assert all(n >= 5 for n in cp1["documents"]), cp1["documents"]
    for result in cp2:
        counts = result["counts"]
        assert counts.get("plain sdpa outside upipe", 0) == 0, counts
        assert counts["upipe::attention_block_backward"] == cp1["n_layers"], counts
        assert "upipe::attention" not in counts, counts  # every block fused, checkpointed ones too
    for step, (a, b) in enumerate(zip(cp2[0]["losses"], cp1["losses"])):
        assert abs(a - b) <= 1e-5 * abs(b), (step, a, b)
    for name, ref in cp1["grads"].items():
        for result in cp2:
            assert relative_error(result["grads"][name], ref) < 1e-5, name
