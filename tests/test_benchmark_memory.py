"""benchmarks/memory.py at a tiny setting, so that it cannot rot: it writes its table, CSV
and plot, measures every method, and its numbers agree with the analytic count."""

import csv
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_memory_benchmark_quick(tmp_path):
    result = subprocess.run(
        [sys.executable, "benchmarks/memory.py", "--quick", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    table = (tmp_path / "memory.md").read_text()
    assert table.startswith("$ python benchmarks/memory.py --quick")
    assert "torch ring context parallelism, P=4:" in table
    assert (tmp_path / "memory.png").stat().st_size > 10_000
    rows = list(csv.DictReader(open(tmp_path / "memory.csv")))
    assert {r["method"] for r in rows} == {"Ulysses", "UPipe U=1P", "UPipe U=2P", "UPipe U=4P"}
    for r in rows:
        ratio, expected, gib = float(r["ratio"]), float(r["expected"]), float(r["GiB"])
        assert gib > 0.1, r
        assert abs(ratio / expected - 1) < 0.10, r  # measured within 10% of the analytic count
        if r["method"] != "Ulysses":
            assert ratio < 1.0, r
