"""upipe_compile.launch: results by rank, a rank's exception with its traceback, progress
reports, and a hang or a crash in native code that fails the job and leaves the pool usable."""

import time

import pytest
import torch
import torch.distributed as dist

from upipe_compile.launch import RankError, RankPool, report


def rank_and_sum(x):
    report(f"rank {dist.get_rank()} started")
    t = torch.tensor([float(x)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def fails_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 is unhappy")
    return "fine"


def hangs_on_rank_0():
    if dist.get_rank() == 0:
        time.sleep(60)
    return "done"


def crashes_on_rank_1():
    if dist.get_rank() == 1:
        import ctypes

        ctypes.string_at(0)  # reads address 0: SIGSEGV
    dist.barrier()
    return "fine"


def test_pool_runs_reports_fails_and_recovers(capfd):
    with RankPool(2, timeout_s=20) as pool:
        reports = []
        assert pool.run(rank_and_sum, 3, on_report=lambda rank, m: reports.append((rank, m))) == [(0, 6.0), (1, 6.0)]
        assert sorted(reports) == [(0, "rank 0 started"), (1, "rank 1 started")]

        with pytest.raises(RankError, match=r"(?s)rank 1 raised ValueError: rank 1 is unhappy.*Traceback"):
            pool.run(fails_on_rank_1)
        assert pool.run(rank_and_sum, 1) == [(0, 2.0), (1, 2.0)]  # restarted after the failure: a fresh group

        pool.timeout_s = 3
        with pytest.raises(RankError, match="hang"):
            pool.run(hangs_on_rank_0)
        pool.timeout_s = 20
        assert pool.run(rank_and_sum, 2) == [(0, 4.0), (1, 4.0)]

        with pytest.raises(RankError, match="rank 1 was killed by SIGSEGV while running crashes_on_rank_1"):
            pool.run(crashes_on_rank_1)
        assert "in crashes_on_rank_1" in capfd.readouterr().err  # faulthandler's stack of the crash
        assert pool.run(rank_and_sum, 5) == [(0, 10.0), (1, 10.0)]
