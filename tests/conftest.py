import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))  # rank_jobs / tests_support, also for spawned ranks

from upipe_compile.launch import RankPool  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402

# Hypothesis draws the same examples on every machine by default, so a commit's test result
# is CI's; HYPOTHESIS_PROFILE=explore draws new ones (run it to look for bugs, not to gate).
hypothesis_settings.register_profile("deterministic", derandomize=True, database=None)
hypothesis_settings.register_profile("explore", derandomize=False)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

def _torchtitan_release() -> tuple:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return tuple(int(p) for p in version("torchtitan").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return ()


# tests/torchtitan03 runs where torchtitan 0.3 is installed (scripts/test_torchtitan03.sh); the
# rest of the suite is the 0.2.2 environment's
collect_ignore = [] if _torchtitan_release() >= (0, 3) else ["torchtitan03"]

# Seconds one job may take on the ranks before the test fails as a hang.
JOB_TIMEOUT_S = float(os.environ.get("UPIPE_TEST_JOB_TIMEOUT", "180"))

_pools: dict[int, RankPool] = {}

# The fast tier (`bash scripts/test.sh --fast`, about 2 minutes on 2 cores): graph passes,
# refusals, kernels, schedules and small numerics over gloo ranks. Everything else (models,
# torchtitan jobs, the estimate, benchmarks, hypothesis sweeps) runs in the suite only; a new
# file is in the suite until it is added here.
FAST_FILES = {
    "test_graph.py", "test_fuse_graph.py", "test_refusals.py", "test_blocked_kernel.py",
    "test_find_block_alloc.py", "test_varlen_copies.py", "test_varlen_groups.py", "test_kernels.py",
    "test_block_accumulation.py", "test_block_loop.py", "test_chunked_loss.py", "test_tiled_mlp.py",
    "test_offload.py", "test_launch.py", "test_readme_results.py", "test_docs_layout.py", "test_token_mixing.py",
    "test_attention_checks.py", "test_mixer_loop.py", "test_hf_own_attention.py", "test_varlen_attn.py",
    "test_step_time.py", "test_source_line.py", "test_pass_pipeline.py", "test_import_structure.py",
    "test_packaging.py", "test_machine_paths.py",
}


# The slow tier (`-m slow`): run by `bash scripts/test.sh --full` (and the 0.3 tier's --full),
# not by CI. Each is the larger twin of a test CI runs on the same path: another parametrization
# (fewer ranks, one loss type of many, a 2 x 2 mesh for a 4 x 2), or the same job without one
# option that a smaller test covers; and the 70B and MoE configs' whole-step estimates (1 to 7
# minutes of fake-tensor ops each alone, up to half an hour niced beside the suite on 2 cores;
# the 8B and 32B configs' run in CI).
SLOW_TESTS = {
    # the shipped 70B jobs' estimates (the 8B and 32B ones stay: the same estimate, smaller)
    "test_shipped_tomls_fit.py::test_shipped_toml_fits_by_the_estimate[llama3_70b_upipe_8_nodes.toml]",
    "torchtitan03/test_torchtitan03_estimate.py::test_shipped_config_fits_by_the_estimate[llama3_70b_upipe_4_nodes]",
    "torchtitan03/test_torchtitan03_estimate.py::test_shipped_config_fits_by_the_estimate[llama3_70b_upipe_8_nodes]",
    # the MoE config at its 4M tokens: its 48 layers' tiles of tokens on fake tensors take
    # minutes (CI: the MoE debug model's estimate with EP and the same stack,
    # test_a_moe_job_with_expert_parallelism_is_estimated)
    "torchtitan03/test_torchtitan03_estimate.py::test_shipped_config_fits_by_the_estimate[qwen3_30b_a3b_upipe]",
    # 4 ranks where the 2-rank twin runs in CI
    "test_hf_grpo.py::test_grpo_resumes_as_if_never_stopped[4]",
    "test_hf_grpo.py::test_grpo_trains_as_the_stock_trainer[llama, 4 ranks]",
    "test_hf_trainer.py::test_sft_trainer_resumes_as_if_never_stopped[4]",
    "test_hf_stack.py::test_sft_trainer_with_tiled_mlp_and_offload_trains_exactly[mistral-4]",
    "test_hf_families.py::test_family_matches_full_sequence_eager[deepseek_v3-4]",
    "test_hf_families.py::test_family_matches_full_sequence_eager[gpt_oss-4]",
    "test_hf_families.py::test_family_matches_full_sequence_eager[gemma2-4]",
    "test_hf_families.py::test_family_matches_full_sequence_eager[gemma3-4]",
    "test_hf_families.py::test_family_matches_full_sequence_eager[qwen2-4]",
    "test_hf_families.py::test_family_unfused_matches[deepseek_v3-4]",
    "test_hf_hybrid_numerics.py::test_hybrid_family_matches_full_sequence[jamba-P4]",
    "test_hf_hybrid_numerics.py::test_hybrid_family_matches_full_sequence[qwen3_5-P4]",
    "test_hf_hybrid_numerics.py::test_hybrid_family_matches_full_sequence[falcon_h1-P4]",
    "test_hf_hybrid_numerics.py::test_hybrid_family_matches_full_sequence[minimax-P4]",
    "test_hf_hybrid_numerics.py::test_hybrid_family_matches_full_sequence[olmo_hybrid-P4]",
    "test_hf_hybrid_numerics.py::test_hybrid_family_matches_full_sequence[lfm2-P4]",
    "test_hf_hybrid_numerics.py::test_hybrid_family_matches_full_sequence[bamba-P4]",
    "test_hf_stack.py::test_whole_stack_trains_exactly[all llama, 4 ranks]",
    # a 4 x 2 mesh (8 ranks) where the 2 x 2 twins run in CI
    "test_hf_families.py::test_sliding_window_family_over_a_ring_by_all_to_all_mesh[qwen3-4x2]",
    "test_hf_families.py::test_sliding_window_family_over_a_ring_by_all_to_all_mesh[qwen3-4x2-packed]",
    "test_hf_llama.py::test_llama_over_a_4_by_2_mesh_with_and_without_packed_positions",
    # every GRPO loss type (CI: the default and one other, with the stack); more families under
    # GRPO and the whole stack, whose models the Trainer's tests run in CI
    "test_hf_grpo.py::test_every_loss_type",
    "test_hf_grpo.py::test_grpo_trains_as_the_stock_trainer[mistral (sliding window)]",
    "test_hf_grpo.py::test_grpo_trains_as_the_stock_trainer[qwen3_next (hybrid, MoE router loss)]",
    "test_hf_stack.py::test_whole_stack_trains_exactly[all qwen3_next]",
    "test_hf_stack.py::test_whole_stack_trains_exactly[all mistral]",
    "test_hf_stack.py::test_whole_stack_trains_exactly[all qwen3]",
    # the Trainer on Mistral's variant (sliding window): CI trains Mistral as shipped through it
    "test_hf_trainer.py::test_attention_variants_train_exactly[mistral]",
    # the max-context search stopped by the host on a real step (CI: the same search stopped by
    # the host on a modelled curve, test_max_context_search_stops_at_the_host_bound, and the
    # --max-context command on a real step, test_estimate_hf's)
    "test_estimate.py::test_max_context_host_bound_on_a_real_step",
    # the 0.2.2 debug job: CP 2, the stack on Qwen3 and keep_attention alone run in CI (the ring
    # over packed documents: 0.3's config path, test_config_path_equals_cp1[ring2x2])
    "test_torchtitan.py::test_debug_model_ring_2x2_matches_cp1",
    "test_torchtitan.py::test_debug_model_with_documents_ring_2x2_matches_cp1",
    "test_torchtitan.py::test_debug_model_with_documents_cp2_matches_cp1",
    "test_torchtitan.py::test_debug_model_with_stack_cp2_matches_cp1",
    "test_torchtitan_stack.py::test_keep_attention_with_offload_moves_the_kept_outputs_to_host",
    # 0.3: TP x CP, the ring on Llama and Qwen3 on CP 2 run in CI
    "torchtitan03/test_torchtitan03_train.py::test_tensor_parallel_2_x_ring_2_x_all_to_all_2_equals_one_rank",
    "torchtitan03/test_torchtitan03_train.py::test_qwen3_config_path_equals_cp1[ring2x2]",
    # 0.3: CP 4 alone (CI: CP 2, the 2 x 2 ring, and CP 4 beside TP 2's run); the resume onto
    # the 2 x 2 ring (CI: the resumes at CP 2 and 4)
    "torchtitan03/test_torchtitan03_train.py::test_config_path_equals_cp1[cp4]",
    # 0.3: the config path with a sliding window (CI: the config path at CP 2, and the window
    # through the compiled model, test_torchtitan03_model's test_varlen_debug_model_matches_cp1)
    "torchtitan03/test_torchtitan03_train.py::test_config_path_equals_cp1[cp2-window]",
    "torchtitan03/test_torchtitan03_checkpoint.py::test_a_resumed_job_goes_on_as_the_uninterrupted_one[ring2x2]",
    # 0.3 MoE: the estimate with EP against a measured step (CI: its TP twin, and the EP
    # estimate beside the one without EP, test_a_moe_job_with_expert_parallelism_is_estimated)
    "torchtitan03/test_torchtitan03_estimate_check.py::test_estimate_matches_the_profiled_step_on_every_rank[ep2-cp2]",
    # 0.3 MoE: EP beside TP (CI: EP 2 on 2 CP ranks, and TP 2 x CP 2 on the dense models)
    "torchtitan03/test_torchtitan03_train.py::test_moe_expert_parallel_beside_tensor_parallel_equals_one_rank",
    # 0.3 MoE: EP 2 on 2 CP ranks untiled, EP on 4 CP ranks, and over 2 data shards x 2 CP ranks
    # (CI: EP 2 on 2 CP ranks with the MoE layers' tokens in tiles, each tile dispatched by the
    # same all-to-alls, test_moe_long_context_stack_equals_one_rank; MoE on CP 2 without EP,
    # test_moe_load_balancing_follows_the_whole_sequence)
    "torchtitan03/test_torchtitan03_train.py::test_moe_expert_parallel_equals_cp_alone_and_one_rank[cp2-ep2]",
    "torchtitan03/test_torchtitan03_train.py::test_moe_expert_parallel_over_data_and_context_ranks_equals_one_rank",
    "torchtitan03/test_torchtitan03_train.py::test_moe_expert_parallel_equals_cp_alone_and_one_rank[cp4-ep2]",
    "torchtitan03/test_torchtitan03_train.py::test_moe_expert_parallel_equals_cp_alone_and_one_rank[cp4-ep4]",
}


def _test_id(item) -> str:
    return os.path.relpath(str(item.path), os.path.dirname(__file__)).replace(os.sep, "/") + "::" + item.name


def _check_slow_tier(config, ids: list[str]) -> None:
    """A slow-tier name that no longer names a test (renamed, parametrized anew) is an error
    where its file was collected whole, so a test cannot drop into CI or out of it unseen."""
    if any("::" in arg for arg in config.args):
        return  # single tests named on the command line: their files are not collected whole
    collected = set(ids)
    files = {test_id.split("::")[0] for test_id in collected}
    stale = sorted(name for name in SLOW_TESTS if name.split("::")[0] in files and name not in collected)
    if stale:
        raise pytest.UsageError(f"tests/conftest.py SLOW_TESTS names no collected test: {stale}")


def pytest_collection_modifyitems(config, items):
    from estimate_commands import reads_estimates

    ids = [_test_id(item) for item in items]
    _check_slow_tier(config, ids)
    for item, test_id in zip(items, ids):
        if item.path.name in FAST_FILES:
            item.add_marker(pytest.mark.fast)
        if test_id in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
    # The tests that read whole-step estimates run last: their estimates, started in the
    # background when collection ends, have had the whole run to finish.
    items[:] = [item for item in items if not reads_estimates(item)] + [item for item in items if reads_estimates(item)]


def pytest_collection_finish(session):
    """The whole-step estimates the selected tests read start now, in the background at a low
    priority (estimate_commands.py)."""
    from estimate_commands import start_selected

    if not session.config.option.collectonly:
        start_selected(session.items)


def pytest_sessionfinish(session):
    from estimate_commands import cancel_queued

    cancel_queued()  # a session that stops early (-x, ^C) does not run what no test will read


@pytest.fixture(scope="module")
def fake_world(request):
    """A fake default group of the test module's ``WORLD`` ranks (this process is rank 0), for
    graph tests that compile and inspect but never exchange data. Other test files run real
    gloo ranks in subprocesses, so the pytest process has no group of its own."""
    from upipe_compile.measure.memory import fake_process_group

    assert not dist.is_initialized(), "a default process group leaked into the pytest process"
    with fake_process_group(request.module.WORLD) as group:
        yield group


@pytest.fixture
def world(fake_world):
    """The fake world group, with Dynamo's caches cleared around each test."""
    torch._dynamo.reset()
    yield fake_world
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def rank_pools():
    """``rank_pools(P)``: a pool of P live gloo ranks (one torch thread each), started once
    per session and reused across tests and hypothesis examples."""

    def get(world: int) -> RankPool:
        if world not in _pools:
            _pools[world] = RankPool(world, threads=1, timeout_s=JOB_TIMEOUT_S)
        return _pools[world]

    def close(world: int) -> None:
        """Stop the pool of ``world`` ranks (a large one, used once, gives its memory back)."""
        pool = _pools.pop(world, None)
        if pool is not None:
            pool.close()

    get.close = close
    yield get
    for pool in _pools.values():
        pool.close()
