"""UPipeGRPOTrainer (upipe_compile.integrations.hf_grpo) on 2 and 4 gloo ranks against TRL's
GRPOTrainer on one process (tests/hf_grpo_jobs.py): the same prompts, a deterministic reward and
seeded sampling, so both score the same sequences; every logged loss, reward, reward std, KL and
entropy, and every final parameter within 1e-5 (fp32), on every rank. Tiny Llama (with a reference
model and num_iterations=2 too), Mistral's sliding window and the Qwen3-Next hybrid (with its MoE
router's load-balancing loss, over the whole rows), configs as shipped (use_cache on); each of TRL's
loss types. Generation runs once per step on every rank, whole, and every rank of the group samples
the same completions; the scoring runs through upipe's attention."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

import hf_grpo_jobs as jobs  # noqa: E402
from upipe_compile.errors import UnsupportedAttention  # noqa: E402

TOLERANCE = 1e-5
CASES = {  # name: (family, ranks, beta, num_iterations, the MoE router's auxiliary loss)
    "llama, reference model, 2 iterations": ("llama", 2, 0.1, 2, False),
    "llama, 4 ranks": ("llama", 4, 0.0, 1, False),
    "mistral (sliding window)": ("mistral", 2, 0.1, 1, False),
    "qwen3_next (hybrid, MoE router loss)": ("qwen3_next", 2, 0.0, 1, True),
}
ATTENTION_LAYERS = {"qwen3_next": 1}


@pytest.fixture(scope="module")
def folder():
    with tempfile.TemporaryDirectory() as path:
        yield path


def test_grpo_with_the_stack_and_another_loss_type(rank_pools, folder):
    """Gradient checkpointing with the tiled MLP and block-input offload (each layer compiled on its
    own), TRL's "grpo" loss (per-sequence means) instead of the default: the stock numbers."""
    path = jobs.save_model(folder, "llama")
    stack = dict(mlp_tile_tokens=4, offload_block_inputs=True, host_memory_reserve_gib=0)
    ranks = rank_pools(2).run(jobs.run, True, path, "llama", 0.1, 1, False, loss_type="grpo", checkpointing=True,
                              **stack)
    ref_rows, ref_params, _, _ = jobs.run(False, path, "llama", 0.1, 1, False, loss_type="grpo", checkpointing=True)
    for rows, params, _, ops in ranks:
        for row, ref in zip(rows, ref_rows, strict=True):
            assert all(abs(row[k] - ref[k]) <= TOLERANCE for k in jobs.LOGGED if k in ref), (row, ref)
        assert max((params[k] - ref_params[k]).abs().max().item() for k in params) <= TOLERANCE
        assert ops.get("upipe::tiled_swiglu", 0) > 0 and ops.get("upipe::attention_block", 0) > 0, ops


def test_every_loss_type(rank_pools, folder):
    """Each loss type TRL offers besides the default "dapo" and "grpo" (tested above), over two
    iterations of one generation (the second step's importance ratio is not 1)."""
    path = jobs.save_model(folder, "llama")
    types = {name: {} for name in ("dr_grpo", "bnpo", "cispo", "sapo", "vespo")}
    types["luspo"] = {"importance_sampling_level": "sequence"}
    ranks = rank_pools(2).run(jobs.run_loss_types, path, types)
    for name, config in types.items():
        ref_rows, ref_params, _, _ = jobs.run(False, path, "llama", 0.0, 2, False, loss_type=name, **config)
        for rank in ranks:
            rows, params = rank[name]
            for row, ref in zip(rows, ref_rows, strict=True):
                assert all(abs(row[k] - ref[k]) <= TOLERANCE for k in jobs.LOGGED if k in ref), (name, row, ref)
            assert max((params[k] - ref_params[k]).abs().max().item() for k in params) <= TOLERANCE, name


@pytest.mark.parametrize("name", list(CASES))
def test_grpo_trains_as_the_stock_trainer(rank_pools, folder, name):
    family, world, beta, iterations, aux = CASES[name]
    path = jobs.save_model(folder, family)
    ranks = rank_pools(world).run(jobs.run, True, path, family, beta, iterations, True, aux)
    ref_rows, ref_params, ref_calls, _ = jobs.run(False, path, family, beta, iterations, True, aux)
    assert len(ref_rows) == 2 and ref_calls
    start = dict(jobs.build_model(family).named_parameters())
    assert max((ref_params[k] - start[k]).abs().max().item() for k in ref_params) > 1e-3  # training moved them
    logged = [key for key in jobs.LOGGED if key in ref_rows[0]]
    assert {"loss", "reward", "reward_std", "entropy"} <= set(logged) and ("kl" in logged) == (beta > 0)
    assert ("aux_loss" in logged) == aux and all(row.get("aux_loss", 1) > 0 for row in ref_rows)
    for rank, (rows, params, calls, ops) in enumerate(ranks):
        assert len(rows) == len(ref_rows), rank
        for row, ref in zip(rows, ref_rows):
            for key in logged:
                if key in ref:
                    assert abs(row[key] - ref[key]) <= TOLERANCE, (rank, key, row, ref)
        assert max((params[k] - ref_params[k]).abs().max().item() for k in params) <= TOLERANCE, rank
        # generation: as often as the stock trainer's, whole, and the same token ids on every rank
        assert len(calls) == len(ref_calls), (rank, len(calls), len(ref_calls))
        for mine, theirs in zip(calls, ref_calls):
            assert mine.shape == theirs.shape and bool((mine == theirs).all()), rank
        # scoring: every attention layer through upipe, forward and backward, no plain SDPA on a shard
        layers = ATTENTION_LAYERS.get(family, 2)
        assert "plain sdpa outside upipe" not in ops, ops
        assert ops.get("sdpa in generate", 0) > 0 or family != "llama", ops  # Llama generates with sdpa
        forward = ops.get("upipe::attention_block", 0) + ops.get("upipe::attention", 0)
        backward = ops.get("upipe::attention_block_backward", 0) + ops.get("upipe::attention_backward", 0)
        assert forward >= layers and backward >= layers, ops


@pytest.mark.parametrize("world", [2, 4])
def test_grpo_resumes_as_if_never_stopped(rank_pools, folder, tmp_path, world):
    """UPipeGRPOTrainer on 2 and 4 ranks with a reference model and num_iterations=2, AdamW, 4 steps, a
    checkpoint every 2 (at a generation boundary): a fresh trainer resumed from the step-2
    checkpoint starts at step 2, generates the same completions (the RNG comes back from the
    checkpoint), and logs the uninterrupted run's losses and ends with its parameters."""
    from hf_trainer_jobs import assert_resumed_as_straight

    path = jobs.save_model(folder, "llama")
    pool = rank_pools(world)
    straight = pool.run(jobs.run_resumable, path, str(tmp_path / "straight"))
    resumed = pool.run(jobs.run_resumable, path, str(tmp_path / "resumed"),
                       resume_from=str(tmp_path / "straight" / "checkpoint-2"))
    for rank in range(world):
        assert_resumed_as_straight(straight[rank], resumed[rank], checkpoint_step=2)


def test_refusals(rank_pools, folder):
    """Before the first step, on every rank: a ring, the chunked loss (TRL's fused head scores in
    chunks already). (vLLM generation is refused too, but TRL needs
    vllm installed to get there.)"""
    path = jobs.save_model(folder, "llama")
    cases = {"ring_degree": ("ring", "ring_degree=1"), "loss_chunk_tokens": ("chunk", "fused LM head")}
    for rank in rank_pools(2).run(jobs.refusals, path):
        for case, chain in rank:
            names = [n for n, _ in chain]
            assert "UnsupportedAttention" in names, (case, chain)
            assert cases[case][1] in " ".join(text for _, text in chain), (case, chain)
    with pytest.raises(UnsupportedAttention, match="fused LM head"):
        from upipe_compile.integrations.hf_trainer import UPipeGRPOTrainer

        UPipeGRPOTrainer(loss_chunk_tokens=8)
