"""A sliding-window layer costs what a dense one does, and UPipe saves the same share of it
(benchmarks/window_memory.py at P = 8, 1M tokens, window 4096; own process: it needs its own
fake default process group)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_windowed_layer_saves_as_a_dense_one():
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "window_memory.py"), "--presets", "Llama3-8B", "--json"],
        capture_output=True, text=True, timeout=900, check=True, cwd=ROOT,
    )
    dense, windowed = json.loads(result.stdout)
    assert windowed["attention"] == "window 4096"
    for ratio in ("UPipe / Ulysses", "fused / Ulysses"):
        assert windowed[ratio] < 1.0 and abs(windowed[ratio] - dense[ratio]) < 1e-9, (dense, windowed)
    assert windowed["fused / Ulysses"] < windowed["UPipe / Ulysses"]
