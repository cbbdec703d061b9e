import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # rank_jobs / tests_support, also for spawned ranks

from rank_pool import RankPool  # noqa: E402

_pools: dict[int, RankPool] = {}


@pytest.fixture(scope="session")
def rank_pools():
    """``rank_pools(P)``: a pool of P live gloo ranks, started once per session."""

    def get(world: int) -> RankPool:
        if world not in _pools:
            _pools[world] = RankPool(world)
        return _pools[world]

    yield get
    for pool in _pools.values():
        pool.close()
