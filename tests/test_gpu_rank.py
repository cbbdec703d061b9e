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
    assert [line.split("|")[3].strip() for line in lines] == ["UPipe (U = 2)", "UPipe + keep_attention",
                                                             "Ulysses (U = 16)"]
    for line in lines:
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        assert cells[1] == "2"  # layers
        step_s, estimate_gib = float(cells[3]), float(cells[7])
        assert step_s > 0 and estimate_gib > 0, line
    assert lines[-1].split("|")[5].strip() == "1.000"  # Ulysses is its own baseline
    assert "peak in `" in out.read_text()  # the estimate's account of its peak, per job


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
        {"method": "UPipe (U = 8)", "seq_len": 1024, "layers": 1, "step_s": 2.0, "measured_peak_gib": 3.0,
         "estimated_peak_gib": 2.5, "host_gib_per_rank": 0.5, "modelled_step_s_h100": 1.0,
         "model_flops": 989e12, "device": "NVIDIA H100 80GB HBM3"},
        {"method": "UPipe (U = 8)", "seq_len": 2048, "layers": 1, "step_s": 4.0, "measured_peak_gib": 5.0},  # no estimate
        {"method": "UPipe (U = 8)", "seq_len": 1024, "layers": 2, "step_s": 4.0, "measured_peak_gib": 5.0},
        {"method": "Ulysses (U = 32)", "seq_len": 1024, "layers": 1, "step_s": 3.0, "measured_peak_gib": 4.0},
    ]
    lines = [line for line in gpu_rank.table(rows).splitlines()[2:]]
    cells = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]
    assert cells[0][4] == "1.500" and cells[0][8] == "1.200"  # 3.0 / 2.0; 3.0 / 2.5
    assert cells[0][5] == "0.500"  # MFU: 989 TFLOP in 2 s on a 989 TFLOP/s device
    assert cells[1][4] == "" and cells[1][7] == "" and cells[1][8] == ""  # no Ulysses at 2048, no estimate
    assert cells[2][4] == ""  # Ulysses ran 1 layer, not 2: no baseline
    assert cells[3][4] == "1.000"


def test_peak_live_allocations_follow_the_allocator_not_the_cache():
    """A block counts from alloc to free_requested (as max_memory_allocated does); the live set
    is taken at the trace's highest point, not at its end."""
    gpu_rank = _gpu_rank()
    frame = lambda name: {"filename": f"/x/site-packages/torch/nn/{name}.py", "line": 1, "name": name}  # noqa: E731
    trace = [
        {"action": "alloc", "addr": 1, "size": 4 << 30, "frames": [frame("a")]},
        {"action": "alloc", "addr": 2, "size": 2 << 30, "frames": [frame("b")]},
        {"action": "free_requested", "addr": 1, "size": 4 << 30},
        {"action": "alloc", "addr": 3, "size": 3 << 30, "frames": [frame("c")]},  # 2 + 3 = 5 < 6
        {"action": "free_completed", "addr": 1, "size": 4 << 30},
        {"action": "free_requested", "addr": 2, "size": 2 << 30},
    ]
    found = gpu_rank.peak_live_allocations({"device_traces": [trace]}, baseline_bytes=1 << 30)
    assert found["history_peak_gib"] == 7.0  # 1 before + 4 + 2, before the first free
    assert [a["gib"] for a in found["peak_allocations"]] == [4.0, 2.0]
    assert found["peak_allocations"][0]["frames"] == ["torch/nn/a.py:1 (a)"]
    assert found["peak_by_origin"] == {"torch/nn/a.py:1 (a)": 4.0, "torch/nn/b.py:1 (b)": 2.0}
    assert gpu_rank.method_jobs([1, 2], [2048, 1024], [8192], upipe=True) == [
        (1, 1024), (1, 2048), (2, 1024), (2, 2048), (1, 8192)]
    assert gpu_rank.method_jobs([1], [1024], [8192], upipe=False) == [(1, 1024)]
