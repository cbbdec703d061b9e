"""benchmarks/gpu_rank.py at its tiny size on CPU: one rank of the debug job over a fake
process group, each method in its own process, beside the estimate of the same job."""

from __future__ import annotations

import os
import subprocess
import sys
import time

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


def _gpu_rank():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import gpu_rank
    finally:
        sys.path.pop(0)
    return gpu_rank


def test_a_deadline_keeps_what_finished_and_names_what_did_not():
    gpu_rank = _gpu_rank()
    quick = subprocess.Popen([sys.executable, "-c", "print('done')"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    outputs, failures = gpu_rank._finish({"quick": quick, "slow": slow}, time.monotonic() + 5)
    assert outputs == {"quick": "done\n"} and failures == {"slow": "stopped at the deadline"}
    assert slow.poll() is not None  # killed, not left running


def test_table_leaves_cells_empty_where_their_inputs_are_missing():
    gpu_rank = _gpu_rank()
    rows = [
        {"method": "UPipe (U = 8)", "seq_len": 1024, "step_s": 2.0, "measured_peak_gib": 3.0,
         "estimated_peak_gib": 2.5, "host_gib_per_rank": 0.5, "modelled_step_s_h100": 1.0},
        {"method": "UPipe (U = 8)", "seq_len": 2048, "step_s": 4.0, "measured_peak_gib": 5.0},  # no estimate
        {"method": "Ulysses (U = 32)", "seq_len": 1024, "step_s": 3.0, "measured_peak_gib": 4.0},
    ]
    lines = [line for line in gpu_rank.table(rows).splitlines()[2:]]
    cells = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]
    assert cells[0][3] == "1.500" and cells[0][6] == "1.200"  # 3.0 / 2.0; 3.0 / 2.5
    assert cells[1][3] == "" and cells[1][5] == "" and cells[1][6] == ""  # no Ulysses at 2048, no estimate
    assert cells[2][3] == "1.000"
