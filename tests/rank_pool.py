"""Real gloo ranks that stay alive across many test examples.

Spawning P processes and a process group costs seconds; hypothesis draws hundreds of
examples. A RankPool starts P workers once, then runs one job at a time on all of them and
returns every rank's result. Any exception on a rank is re-raised in the test with that
rank's traceback; a job that does not finish in time (a hang) fails the test and the pool
is torn down so the next example starts on fresh ranks.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback

import torch.multiprocessing as mp

JOB_TIMEOUT_S = float(os.environ.get("UPIPE_TEST_JOB_TIMEOUT", "180"))


class RankError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, jobs, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=JOB_TIMEOUT_S / 2),
    )
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException as error:  # report everything, including UnsupportedAttention
            results.put((rank, False, (type(error).__name__, str(error), traceback.format_exc())))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world: int):
        self.world = world
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._jobs = [ctx.Queue() for _ in range(self.world)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, args=(r, self.world, port, self._jobs[r], self._results), daemon=True)
            for r in range(self.world)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank; the list of results, by rank."""
        for jobs in self._jobs:
            jobs.put((fn, args, kwargs))
        results, failures = [None] * self.world, []
        for _ in range(self.world):
            try:
                rank, ok, value = self._results.get(timeout=JOB_TIMEOUT_S)
            except queue.Empty:
                self.restart()
                raise RankError(f"{fn.__name__} did not finish on all {self.world} ranks within {JOB_TIMEOUT_S}s (hang)")
            if ok:
                results[rank] = value
            else:
                failures.append((rank, value))
        if failures:
            self.restart()  # a failed collective can leave the group unusable
            rank, (kind, message, tb) = min(failures)
            raise RankError(f"rank {rank} raised {kind}: {message}\n{tb}")
        return results

    def restart(self) -> None:
        self.close()
        self._start()

    def close(self) -> None:
        for p in self._procs:
            p.kill()
            p.join(timeout=10)
