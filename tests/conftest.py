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
# torchtitan jobs, the estimate, benchmarks, hypothesis sweeps) runs in the full suite only;
# a new file is in the full suite until it is added here.
FAST_FILES = {
    "test_graph.py", "test_fuse_graph.py", "test_refusals.py", "test_blocked_kernel.py",
    "test_find_block_alloc.py", "test_varlen_copies.py", "test_varlen_groups.py", "test_kernels.py",
    "test_block_accumulation.py", "test_block_loop.py", "test_chunked_loss.py", "test_tiled_mlp.py",
    "test_offload.py", "test_launch.py", "test_readme_results.py", "test_docs_layout.py", "test_token_mixing.py",
    "test_attention_checks.py", "test_mixer_loop.py", "test_hf_own_attention.py", "test_varlen_attn.py",
    "test_step_time.py", "test_source_line.py", "test_pass_pipeline.py", "test_import_structure.py",
    "test_packaging.py", "test_machine_paths.py",
}


def pytest_collection_modifyitems(config, items):
    from estimate_commands import reads_estimates

    for item in items:
        if item.path.name in FAST_FILES:
            item.add_marker(pytest.mark.fast)
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
