"""benchmarks/memory.py at a tiny setting, so that it cannot rot: it writes its table, CSV
and plot, measures every method, and its numbers agree with the analytic count, which
leaves out the CUDA kernel's workspace (checked with --cuda-kernel none); counting
flash-attn's workspace (the default) raises every method's peak."""

import csv
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(out_dir, cuda_kernel):
    result = subprocess.run(
        [sys.executable, "benchmarks/memory.py", "--quick", "--cuda-kernel", cuda_kernel, "--out-dir", str(out_dir)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    return {(r["preset"], r["method"]): r for r in csv.DictReader(open(out_dir / "memory.csv"))}


def test_memory_benchmark_quick(tmp_path):
    cpu = _run(tmp_path / "cpu", "none")
    table = (tmp_path / "cpu" / "memory.md").read_text()
    assert table.startswith("$ python benchmarks/memory.py --quick")
    assert "torch ring context parallelism, P=4:" in table
    assert (tmp_path / "cpu" / "memory.png").stat().st_size > 10_000
    assert {method for _, method in cpu} == {"Ulysses", "UPipe U=1P", "UPipe U=2P", "UPipe U=4P"}
    for r in cpu.values():
        ratio, expected, gib = float(r["ratio"]), float(r["expected"]), float(r["GiB"])
        assert gib > 0.1, r
        assert abs(ratio / expected - 1) < 0.10, r  # measured within 10% of the analytic count
        if r["method"] != "Ulysses":
            assert ratio < 1.0, r

    flash = _run(tmp_path / "flash", "flash-attn")
    assert "CUDA kernel workspace modelled: flash-attn" in (tmp_path / "flash" / "memory.md").read_text()
    for key, r in flash.items():
        assert float(r["GiB"]) > float(cpu[key]["GiB"]), key
