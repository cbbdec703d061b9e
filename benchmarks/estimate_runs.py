"""One estimate command a benchmark row stands on, run once and kept: the JSON it printed is
saved beside the results, and a kept one is read back instead of running again (a 70B step on
fake tensors takes minutes on a CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def kept_estimate(arguments: list[str], path: str, cwd: str, report_only: bool = False) -> dict | None:
    """``python -m upipe_compile.estimate *arguments`` (which must ask for ``--json``) as a dict,
    from ``path`` when it is there, else run in its own process and saved to ``path``. None when
    ``report_only`` and nothing is kept."""
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    if report_only:
        return None
    cmd = [sys.executable, "-m", "upipe_compile.estimate", *arguments]
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return result
