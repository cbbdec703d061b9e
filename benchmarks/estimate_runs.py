"""One estimate command a benchmark row stands on, run once and kept: the JSON it printed is
saved beside the results, and a kept one is read back instead of running again (a 70B step on
fake tensors takes minutes on a CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def stale_ratio(result: dict, arguments: list[str]) -> bool:
    """A kept GPU estimate made under another device ratio than today's default (gpu.DEVICE_RATIO
    changes when a device measures more): its fit no longer says what the estimate says now.
    A row that names its ratio (``--device-ratio``) or a CPU job's (ratio 1) is never stale."""
    from upipe_compile.estimate.gpu import DEVICE_RATIO

    return "--device-ratio" not in arguments and result.get("device_ratio", 1) not in (1, DEVICE_RATIO)


def kept_estimate(arguments: list[str], path: str, cwd: str, report_only: bool = False) -> dict | None:
    """``python -m upipe_compile.estimate *arguments`` (which must ask for ``--json``) as a dict,
    from ``path`` when it is there, else run in its own process and saved to ``path``. None when
    ``report_only`` and nothing is kept."""
    if os.path.exists(path):
        with open(path) as f:
            kept = json.load(f)
        if not stale_ratio(kept, arguments):
            return kept
        if "max_context" not in kept:  # one step's estimate: the same step under today's ratio
            from upipe_compile.estimate.gpu import DEVICE_RATIO
            from upipe_compile.estimate.report import with_device_ratio

            return with_device_ratio(kept, DEVICE_RATIO)
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
