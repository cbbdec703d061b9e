"""Whole-step estimates of shipped jobs, in the background: each runs in its own process (it
needs its own fake default group) and keeps one core busy (fake tensors: Python, not kernels).

When collection ends (conftest.py), every estimate a selected test will read is queued, in the
order the tests run (those tests last), on one pool of two workers shared by every module, each
process at :data:`NICENESS`, so that it gives way to the tests. A test then reads its result,
waiting for it where it has not finished. (Measured on 2 cores: the estimates cost the tests
about the time they save at the end; the gloo ranks leave few cycles idle.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor

ESTIMATE = [sys.executable, "-m", "upipe_compile.estimate"]
CORES = 2
NICENESS = 10
_POOL = ThreadPoolExecutor(max_workers=CORES)  # at most CORES estimates at once, across modules


class EstimateRuns:
    """``runs[name]``: the JSON report of ``python -m upipe_compile.estimate *commands[name]``.
    ``read_by``: the test (item name) that reads each command's report; a command it does not
    name is read by any test of the module."""

    def __init__(self, commands: dict[str, list[str]], cwd: str, read_by: dict[str, str] | None = None,
                 timeout_s: float = 3600):  # (a 70B estimate, niced under a busy suite, took over 1800 s)
        self.commands, self.cwd, self.timeout_s = commands, cwd, timeout_s
        self.read_by = read_by or {}
        self._futures: dict[str, Future] = {}

    def _run(self, argv: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(["nice", "-n", str(NICENESS), *ESTIMATE, *argv], capture_output=True, text=True,
                              timeout=self.timeout_s, cwd=self.cwd)

    def start(self, names) -> "EstimateRuns":
        for name in names:
            if name not in self._futures:
                self._futures[name] = _POOL.submit(self._run, self.commands[name])
        return self

    def start_for(self, test_names: set[str]) -> "EstimateRuns":
        """Start the commands that one of ``test_names`` (the module's selected tests) reads."""
        return self.start([name for name in self.commands
                           if name not in self.read_by or self.read_by[name] in test_names])

    def process(self, name: str) -> subprocess.CompletedProcess:
        return self.start([name])._futures[name].result()

    def __getitem__(self, name: str) -> dict:
        done = self.process(name)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)


def _runs_of(item) -> EstimateRuns | None:
    """``item``'s module's estimates (its ``RUNS``), None where it reads none."""
    runs = getattr(getattr(item, "module", None), "RUNS", None)
    return runs if isinstance(runs, EstimateRuns) else None


def reads_estimates(item) -> bool:
    return _runs_of(item) is not None


def start_selected(items) -> None:
    """Queue the estimates the selected ``items`` read (each module's ``RUNS``), in test order."""
    selected: dict[int, tuple[EstimateRuns, set[str]]] = {}
    for item in items:
        runs = _runs_of(item)
        if runs is not None:
            selected.setdefault(id(runs), (runs, set()))[1].add(item.name)
    for runs, names in selected.values():
        runs.start_for(names)


def cancel_queued() -> None:
    """Drop the estimates not yet started (those running finish)."""
    _POOL.shutdown(wait=False, cancel_futures=True)


def started_for_selected(request, runs: EstimateRuns) -> EstimateRuns:
    """``runs`` with the commands started that this session's selected tests of the requesting
    module read (already queued at collection's end; here for a module imported otherwise)."""
    return runs.start_for({item.name for item in request.session.items if item.path == request.path})
