"""The ``--hf`` estimate against a real step on CPU (benchmarks/estimate_check_hf.py): tiny
Llama and Qwen3 (QK-norm, wider heads) built as UPipeTrainer builds them, the whole stack on,
FSDP2 with accelerate's policy, one profiled step on 2 gloo ranks against ``estimate_hf`` of
the same job with CPU kernels: the peak (device + host) on every rank within 5 % for Llama (2.2 %
measured) and 10 % for Qwen3 (5-8 % measured, see estimate_check_hf.TOLERANCE), and the offloaded bytes exactly the estimate's host
memory. Gloo's late-freed buffers ("retained", estimate_check.py) are left out, as there."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import estimate_check_hf  # noqa: E402


@pytest.mark.parametrize("family", sorted(estimate_check_hf.CASES))
def test_estimated_peak_matches_the_profiled_step_on_every_rank(rank_pools, family):
    est, ranks, rows = estimate_check_hf.compare(estimate_check_hf.CASES[family], rank_pools(2))
    assert len(rows) == 2
    for row, m in zip(rows, ranks):
        # the estimate reports GiB to 6 decimals
        assert m["offloaded"] == m["start"]["host_buffers"] == pytest.approx(est["host"], abs=1e-6 * 2 ** 30)
        assert m["terms"]["retained"] <= 0.3 * m["rise"], m["terms"]
        assert abs(row["ratio without gloo's retained"] - 1) <= estimate_check_hf.TOLERANCE[family], row
