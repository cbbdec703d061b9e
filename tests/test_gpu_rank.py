"""benchmarks/gpu_rank.py at its tiny size on CPU: one rank of the debug job over a fake
process group, each method in its own process, beside the estimate of the same job."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_rank_runs_each_method_beside_its_estimate(tmp_path):
    out = tmp_path / "gpu_rank.md"
    done = subprocess.run([sys.executable, "benchmarks/gpu_rank.py", "--tiny", "--layers", "2", "--seqs", "512",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in out.read_text().splitlines() if line.startswith("|") and "512" in line]
    assert [line.split("|")[2].strip() for line in lines] == ["UPipe (U = 2)", "UPipe + keep_attention",
                                                             "Ulysses (U = 16)"]
    for line in lines:
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        step_s, estimate_gib = float(cells[2]), float(cells[5])
        assert step_s > 0 and estimate_gib > 0, line
    assert lines[-1].split("|")[4].strip() == "1.000"  # Ulysses is its own baseline
