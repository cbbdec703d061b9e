"""Whole-step estimates of shipped jobs, two at a time: each runs in its own process (it needs
its own fake default group) and keeps one core busy (fake tensors: Python, not kernels), so a
test module starts the ones its selected tests ask for together and two cores run them side by
side."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor

ESTIMATE = [sys.executable, "-m", "upipe_compile.estimate"]
CORES = 2


class EstimateRuns:
    """``runs[name]``: the JSON report of ``python -m upipe_compile.estimate *commands[name]``;
    :meth:`start` runs the named commands CORES at a time, a name not started runs when asked."""

    def __init__(self, commands: dict[str, list[str]], cwd: str, timeout_s: float = 1800):
        self.commands, self.cwd, self.timeout_s = commands, cwd, timeout_s
        self._futures: dict[str, Future] = {}

    def _run(self, argv: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([*ESTIMATE, *argv], capture_output=True, text=True, timeout=self.timeout_s, cwd=self.cwd)

    def start(self, names) -> "EstimateRuns":
        pool = ThreadPoolExecutor(max_workers=CORES)
        self._futures.update({name: pool.submit(self._run, self.commands[name]) for name in names
                              if name not in self._futures})
        pool.shutdown(wait=False)
        return self

    def process(self, name: str) -> subprocess.CompletedProcess:
        return self.start([name])._futures[name].result()

    def __getitem__(self, name: str) -> dict:
        done = self.process(name)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)


def started_for_selected(request, runs: EstimateRuns, test_of: dict[str, str]) -> EstimateRuns:
    """``runs`` with the commands started whose test (command name -> test item name) this
    session selected in the requesting module."""
    selected = {item.name for item in request.session.items if item.path == request.path}
    return runs.start([name for name, test in test_of.items() if test in selected])
