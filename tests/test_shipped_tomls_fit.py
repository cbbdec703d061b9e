"""Every TOML this project ships fits an 80 GB H100 and a 2 TB node's host budget by the
whole-step memory estimate, at its own seq_len (the estimates run two at a time, each in its own
process: estimate_commands.py); every max-context row shipped fits the host budget too."""

from __future__ import annotations

import os

import pytest

from estimate_commands import EstimateRuns, started_for_selected
from upipe_compile.estimate.gpu import device_peak_gib
from upipe_compile.stack.host_memory import HOST_BUDGET_GIB

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOML_DIR = os.path.join(ROOT, "integrations", "torchtitan")
SHIPPED = sorted(f for f in os.listdir(TOML_DIR) if f.endswith(".toml"))
SIX_MILLION = "llama3_8b_upipe_5m.toml at 6 x 2^20 tokens, device ratio 1"
RUNS = EstimateRuns({
    **{toml: ["--config", os.path.join(TOML_DIR, toml), "--json"] for toml in SHIPPED},
    SIX_MILLION: ["--config", os.path.join(TOML_DIR, "llama3_8b_upipe_5m.toml"), "--training.seq_len",
                  str(6 * 2**20), "--device-ratio", "1", "--json"],
}, cwd=ROOT, read_by={
    **{toml: f"test_shipped_toml_fits_by_the_estimate[{toml}]" for toml in SHIPPED},
    SIX_MILLION: "test_the_device_ratio_decides_six_million_tokens_on_one_node"})


@pytest.fixture(scope="module")
def runs(request):
    """The estimates the module's selected tests read (started when collection ended)."""
    return started_for_selected(request, RUNS)


@pytest.mark.parametrize("toml", SHIPPED)
def test_shipped_toml_fits_by_the_estimate(toml, runs):
    estimate = runs[toml]
    assert estimate["fits"] and estimate["fits_device"] and estimate["fits_host"], estimate
    assert estimate["device_ratio"] > 1  # the ratio a GPU measured, not the estimate alone
    assert 0 < estimate["peak_device_gib"] < estimate["expected_device_peak_gib"] <= estimate["budget_gib"] < 79.1
    assert estimate["host_budget_gib_per_node"] == HOST_BUDGET_GIB, estimate
    assert estimate["host_gib_per_node"] <= HOST_BUDGET_GIB, estimate


def test_the_device_ratio_decides_six_million_tokens_on_one_node(runs):
    """The long-context stack with fused attention blocks: Llama3-8B at 6 x 2^20 tokens on
    8 ranks (the shipped 5M TOML, longer) fits by the estimate alone (--device-ratio 1), and
    not with the ratio a GPU measured against it (the default), which the report applies to
    everything above the parameters, gradients and optimizer state."""
    estimate = runs[SIX_MILLION]
    assert estimate["seq_len"] == 6291456 and estimate["world_size"] == 8, estimate
    assert estimate["attention_calls"].get("fused block", 0) > 0, estimate
    assert estimate["device_ratio"] == 1 and estimate["expected_device_peak_gib"] == estimate["peak_device_gib"]
    assert estimate["fits"] and estimate["peak_device_gib"] <= estimate["budget_gib"], estimate
    assert estimate["fits_host"] and estimate["host_gib_per_node"] <= HOST_BUDGET_GIB, estimate
    b = estimate["breakdown"]
    persistent = b["sharded_params"] + b["sharded_grads"] + b["optimizer_state"] + b["model_buffers"]
    assert device_peak_gib(estimate["peak_device_gib"], persistent) > estimate["budget_gib"]


def test_max_context_rows_fit_the_host_budget():
    """benchmarks/results/max_context.md (which docs/results.md and the README quote) states only lengths whose
    offloaded inputs fit one node's host budget, and says which bound stopped each."""
    with open(os.path.join(ROOT, "benchmarks", "results", "max_context.md")) as f:
        lines = [line for line in f if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip().strip("|").split("|")]
    rows = [dict(zip(header, (cell.strip() for cell in line.strip().strip("|").split("|")))) for line in lines[2:]]
    assert rows
    for row in rows:
        assert float(row["host GiB per node"]) <= HOST_BUDGET_GIB, row
        assert row["bound"] in ("device", "host", "device and host"), row
