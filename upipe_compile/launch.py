"""Run a function on P local ranks: one process per rank, one process group among them.

A :class:`RankPool` starts P worker processes once (spawn), joins them into a process
group, and then runs one job at a time on all of them, returning every rank's result::

    with RankPool(4) as pool:
        results = pool.run(fn, *args)        # fn(*args) on ranks 0..3, results by rank

Workers outlive a job, so a caller with many small jobs (a property-based test) pays for
process start and rendezvous once. An exception on any rank is re-raised in the caller as
:class:`RankError` carrying that rank's traceback; a job that does not finish in time, or
a worker that dies, fails the same way. After any failure the pool restarts its workers,
because a failed collective can leave the process group unusable.

A job may call :func:`report` to send progress to the caller while it runs (for example
"compiling"), which ``run(..., on_report=...)`` receives as it arrives.
"""

from __future__ import annotations

import datetime
import os
import queue
import signal
import socket
import time
import traceback
from typing import Any, Callable, Optional

import torch.multiprocessing as mp

# Set in a worker process: where report() sends progress, and this worker's rank.
_outbox = None
_rank: Optional[int] = None

# How often the caller checks for dead workers while it waits.
_POLL_S = 5.0


class RankError(RuntimeError):
    """A job failed on a rank, hung, or a worker died."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(message: Any) -> None:
    """From inside a job: send ``message`` (picklable) to the caller's ``on_report``.
    Outside a pool worker it does nothing."""
    if _outbox is not None:
        _outbox.put(("report", _rank, message))


def _worker(rank: int, world: int, port: int, backend: str, threads: int, group_timeout_s: float,
            jobs, results) -> None:
    global _outbox, _rank
    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.enable()  # a rank that crashes in native code prints where, before its exit code is reported

    _outbox, _rank = results, rank
    if backend == "nccl":
        torch.cuda.set_device(rank)
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # for libraries that read them (DeepSpeed)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=group_timeout_s))
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            results.put(("done", rank, fn(*args, **kwargs)))
        except BaseException as error:  # report everything, including UnsupportedAttention
            results.put(("failed", rank, (type(error).__name__, str(error), traceback.format_exc())))
    dist.destroy_process_group()


class RankPool:
    """P persistent ranks in one process group.

    ``backend``: "gloo" (CPU) or "nccl" (rank r uses GPU r). ``threads``: torch threads per
    rank. ``timeout_s``: how long one job may take before it counts as hung (None: no
    limit; dead workers are still noticed). ``group_timeout_s``: the process group's own
    timeout for a collective (default: half the job timeout, so that a stuck collective
    raises on its rank before the job times out). ``env``: environment variables the
    workers start with (the caller's environment is left as it was).
    """

    def __init__(self, world: int, *, backend: str = "gloo", threads: int = 1, timeout_s: Optional[float] = 180,
                 group_timeout_s: Optional[float] = None, env: Optional[dict[str, str]] = None):
        self.world, self.backend, self.threads, self.timeout_s = world, backend, threads, timeout_s
        self.group_timeout_s = group_timeout_s or (timeout_s / 2 if timeout_s else 1800)
        self.env = dict(env or {})
        self._procs: list = []
        self._jobs: list = []
        self._start()

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self._jobs = [ctx.Queue() for _ in range(self.world)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, daemon=True, args=(
                r, self.world, port, self.backend, self.threads, self.group_timeout_s, self._jobs[r], self._results))
            for r in range(self.world)
        ]
        # A spawned process takes its environment from ours when it starts.
        saved = {key: os.environ.get(key) for key in self.env}
        os.environ.update(self.env)
        try:
            for p in self._procs:
                p.start()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def run(self, fn: Callable, *args, on_report: Optional[Callable[[int, Any], None]] = None, **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank; the list of results, by rank.
        ``on_report(rank, message)`` receives what the job passes to :func:`report`."""
        for jobs in self._jobs:
            jobs.put((fn, args, kwargs))
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        results, failures, pending = [None] * self.world, [], self.world
        while pending:
            wait = _POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic()))
            try:
                kind, rank, value = self._results.get(timeout=wait)
            except queue.Empty:
                self._check_alive(fn)
                if deadline is not None and time.monotonic() >= deadline:
                    self.restart()
                    raise RankError(f"{fn.__name__} did not finish on all {self.world} ranks "
                                    f"within {self.timeout_s}s (hang)") from None
                continue
            if kind == "report":
                if on_report is not None:
                    on_report(rank, value)
                continue
            pending -= 1
            if kind == "done":
                results[rank] = value
            else:
                failures.append((rank, value))
        if failures:
            self.restart()
            rank, (name, message, tb) = min(failures)
            raise RankError(f"rank {rank} raised {name}: {message}\n{tb}")
        return results

    def _check_alive(self, fn: Callable) -> None:
        dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if p.exitcode is not None]
        if dead:
            self.restart()
            rank, code = dead[0]
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            raise RankError(f"rank {rank} {how} while running {fn.__name__} (a crash's Python stack is on its stderr)")

    def restart(self) -> None:
        self._stop(wait_s=0)  # the group may be broken: no goodbye over it
        self._start()

    def close(self) -> None:
        """Let idle workers leave the group and exit; kill any that do not within seconds."""
        self._stop(wait_s=10)

    def _stop(self, wait_s: float) -> None:
        if wait_s:
            for jobs in self._jobs:
                jobs.put(None)
            deadline = time.monotonic() + wait_s
            for p in self._procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
        self._procs = []


def run_on_ranks(world: int, fn: Callable, *args, on_report=None, **pool_options) -> list:
    """``fn(*args)`` once on ``world`` fresh ranks (see :class:`RankPool` for the options);
    the results by rank."""
    with RankPool(world, **pool_options) as pool:
        return pool.run(fn, *args, on_report=on_report)
