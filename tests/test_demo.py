"""The README's demo runs end to end (tiny setting) and reports agreement with eager."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_runs_and_matches_eager(tmp_path):
    """Run by its path from another folder, in safe-path mode (the script's folder not on
    sys.path): it still finds benchmarks/ beside it."""
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "demo.py"), "--seq", "128", "--repeats", "1", "--inner-backend",
         "aot_eager", "--memory-seq", "65536"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK: logits and all parameter gradients match eager" in result.stdout
    assert "| UPipe" in result.stdout and "| Ulysses" in result.stdout
