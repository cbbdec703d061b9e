"""benchmarks/run_all (the GPU grid) in --dry-run mode runs end to end on a CPU-only
machine, and every command it would run names a script that exists and flags it accepts."""

import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_run_all_dry_run_prints_valid_commands():
    result = subprocess.run(
        ["bash", "benchmarks/run_all", "--dry-run"], capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert result.returncode == 0, result.stderr
    assert "# torch " in result.stdout and "flash-attn" in result.stdout
    commands = [shlex.split(line[2:]) for line in result.stdout.splitlines() if line.startswith("+ ")]
    scripts = [c[1] for c in commands]
    assert scripts == ["benchmarks/kernel_check.py", "benchmarks/op_memory.py", "benchmarks/memory.py",
                       "benchmarks/gpu_rank.py", "benchmarks/throughput.py"]
    for command in commands:
        assert os.path.exists(os.path.join(ROOT, command[1])), command
        help_text = subprocess.run(
            [sys.executable, command[1], "--help"], capture_output=True, text=True, timeout=300, cwd=ROOT, check=True,
        ).stdout
        for flag in (arg for arg in command[2:] if arg.startswith("--")):
            assert re.search(rf"{re.escape(flag)}\b", help_text), (command[1], flag)


def test_kernel_check_passes_on_this_machines_kernels():
    result = subprocess.run([sys.executable, "benchmarks/kernel_check.py"], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| aten-cpu" in result.stdout and ", 0 failed" in result.stdout
