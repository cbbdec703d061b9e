"""benchmarks/gpu_check.py (the first command on a GPU node) runs end to end on CPU in its
--quick form: every section's code path works without a GPU, so a GPU session is not the
first to find a typo. Memory columns stay empty off CUDA; the GPU numbers come from a GPU."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_quick_runs_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.md"
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for section in (1, 2, 4, 5):
        assert f"section {section}: ok" in result.stdout, result.stdout
    assert "all sections passed" in result.stdout
    assert "| UPipe" in result.stdout and "| Ulysses" in result.stdout
    assert out.read_text().startswith("# device: ")


def test_gpu_check_reports_a_failing_section_and_exits_nonzero():
    # --world 3 does not divide the 32 query heads: section 2 fails, section 1 still runs.
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--quick", "--only", "1,2", "--world", "3"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "section 1: ok" in result.stdout
    assert "section 2: FAILED" in result.stdout and "Traceback" in result.stdout
    assert "FAILED sections: [2]" in result.stdout
