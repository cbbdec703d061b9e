import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # rank_jobs / tests_support, also for spawned ranks

from upipe_compile.launch import RankPool  # noqa: E402

# Seconds one job may take on the ranks before the test fails as a hang.
JOB_TIMEOUT_S = float(os.environ.get("UPIPE_TEST_JOB_TIMEOUT", "180"))

_pools: dict[int, RankPool] = {}


@pytest.fixture(scope="session")
def rank_pools():
    """``rank_pools(P)``: a pool of P live gloo ranks (one torch thread each), started once
    per session and reused across tests and hypothesis examples."""

    def get(world: int) -> RankPool:
        if world not in _pools:
            _pools[world] = RankPool(world, threads=1, timeout_s=JOB_TIMEOUT_S)
        return _pools[world]

    yield get
    for pool in _pools.values():
        pool.close()
