"""The whole-step estimate on torchtitan 0.3 jobs (``--module``/``--config``): every shipped
0.3 config fits an 80 GB H100 and a 2 TB node's host budget at its own seq_len, as the 0.2.2
TOMLs do (the estimates run two at a time, each in its own process: estimate_commands.py); the
max-context rows shipped for 0.3 fit the host budget too. Runs in the torchtitan 0.3 tier."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from estimate_commands import EstimateRuns, started_for_selected
from upipe_compile.stack.host_memory import HOST_BUDGET_GIB

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULE = "upipe_compile.integrations.torchtitan"
SHIPPED = ("llama3_8b_upipe", "llama3_8b_upipe_5m", "llama3_8b_upipe_4_nodes", "qwen3_32b_upipe",
           "llama3_70b_upipe_4_nodes", "llama3_70b_upipe_8_nodes", "qwen3_30b_a3b_upipe")
DEBUG = "llama3_debugmodel_upipe_cpu"
RUNS = EstimateRuns({config: ["--module", MODULE, "--config", config, "--json"] for config in (*SHIPPED, DEBUG)},
                    cwd=ROOT, read_by={
                        **{config: f"test_shipped_config_fits_by_the_estimate[{config}]" for config in SHIPPED},
                        DEBUG: "test_the_debug_config_on_cpu_and_a_refusal"})


@pytest.fixture(scope="module")
def runs(request):
    """The estimates the module's selected tests read (started when collection ended)."""
    return started_for_selected(request, RUNS)


@pytest.mark.parametrize("config", SHIPPED)
def test_shipped_config_fits_by_the_estimate(config, runs):
    result = runs[config]
    assert result["fits"] and result["fits_device"] and result["fits_host"], result
    assert result["device_ratio"] > 1  # the ratio a GPU measured, not the estimate alone
    assert 0 < result["peak_device_gib"] < result["expected_device_peak_gib"] <= result["budget_gib"] < 79.1, result
    assert result["host_gib_per_node"] <= result["host_budget_gib_per_node"] == HOST_BUDGET_GIB, result
    # MoE layers keep upipe to each layer's attention alone: the plain stage-loop op
    assert result["attention_calls"].get("stage-loop op" if "a3b" in config else "fused block", 0) > 0, result


def test_the_debug_config_on_cpu_and_a_refusal(runs):
    """The CPU debug config is estimated too; a job the Trainer would refuse is refused by
    the estimate, naming the field."""
    result = runs[DEBUG]
    assert result["world_size"] == 2 and result["fits"], result
    refused = subprocess.run(
        [sys.executable, "-m", "upipe_compile.estimate", "--module", MODULE, "--config", "llama3_debugmodel_upipe_cpu",
         "--parallelism.context_parallel_load_balancer", "headtail"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert refused.returncode != 0 and "parallelism.context_parallel_load_balancer" in refused.stderr, \
        refused.stderr[-2000:]


def test_a_tensor_parallel_job_is_estimated_through_upipes_stage_loop():
    """TP 2 beside UPipe's CP 2 on 4 ranks: 0.3's own TP modules over the fake group, each
    layer's attention through the stage-loop op's eager twin; the step-time model splits the
    work over the TP ranks (its check against a measured step: test_torchtitan03_estimate_check.py)."""
    done = subprocess.run(
        [sys.executable, "-m", "upipe_compile.estimate", "--module", MODULE, "--config", DEBUG,
         "--parallelism.tensor_parallel_degree", "2", "--upipe.no_fuse_projections", "--json"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert (result["world_size"], result["tp"], result["cp"]) == (4, 2, 2), result
    assert result["attention_calls"].get("stage-loop op", 0) > 0 and result["fits"], result
    assert result["step_time"]["phases"]["linear"] > 0, result


MOE_STACK = ("--upipe.offload_block_inputs", "--upipe.mlp_tile_tokens", "512", "--upipe.host_memory_reserve_gib", "0")


def test_a_moe_job_with_expert_parallelism_is_estimated():
    """The MoE debug model (64 experts, 8 a token) on 2 CP ranks, without EP and with EP 2:
    FSDP gathers every expert without EP and a rank's 32 with it, the parameters' shards are
    the same, EP's token exchange is timed, the attention runs through UPipe's stage loop.
    With the stack beside EP (block inputs offloaded, the MoE layers' 8,192 local tokens in
    tiles of 512): the block inputs are on the host, the MoE recompute holds one tile's routed
    copies (at fewer tokens the experts' gathered weights and gradients outweigh them), and the
    step-time model runs the tiles once more."""
    def run(ep: int, *stack: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "upipe_compile.estimate", "--module", MODULE, "--config",
             "qwen3_moe_debugmodel_upipe_cpu", "--training.seq_len", "16384", "--parallelism.expert_parallel_degree",
             str(ep), *stack, "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)

    results = {}
    for key, process in [(key, run(*key)) for key in ((1,), (2,), (2, *MOE_STACK))]:
        out, err = process.communicate(timeout=900)
        assert process.returncode == 0, err[-3000:]
        results[key[0] if len(key) == 1 else "stack"] = json.loads(out)
    stack = results.pop("stack")
    assert stack["breakdown"]["checkpointed_inputs_on_device"] == 0 < results[2]["breakdown"][
        "checkpointed_inputs_on_device"], stack
    assert stack["host_gib_per_rank"] > results[2]["host_gib_per_rank"], stack
    assert stack["block_recompute"]["mlp"] < 0.5 * results[2]["block_recompute"]["mlp"], (stack, results[2])
    assert stack["step_time"]["phases"]["expert_all_to_all"] > results[2]["step_time"]["phases"]["expert_all_to_all"]
    alone, ep2 = results[1]["breakdown"], results[2]["breakdown"]
    assert ep2["sharded_params"] == pytest.approx(alone["sharded_params"], rel=1e-3), (alone, ep2)
    assert ep2["fsdp_buffers"] < 0.5 * alone["fsdp_buffers"], (alone, ep2)
    assert results[2]["step_time"]["phases"]["expert_all_to_all"] > 0 == results[1]["step_time"]["phases"][
        "expert_all_to_all"], results
    for result in results.values():
        assert result["attention_calls"].get("stage-loop op", 0) > 0 and result["fits"], result
    shape = results[2]["step_time"]["shape"]
    assert shape["experts_per_token"] == 8 and shape["active_layer_weights"] < shape["layer_weights"], shape


def test_max_context_rows_fit_the_host_budget():
    with open(os.path.join(ROOT, "benchmarks", "results", "max_context_03.md")) as f:
        lines = [line for line in f if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip().strip("|").split("|")]
    rows = [dict(zip(header, (cell.strip() for cell in line.strip().strip("|").split("|")))) for line in lines[2:]]
    assert rows
    runs = os.path.join(ROOT, "benchmarks", "results", "max_context_03")
    for name in os.listdir(runs):
        with open(os.path.join(runs, name)) as f:
            result = json.load(f)
        assert result["fits"] and result["host_gib_per_node"] <= HOST_BUDGET_GIB, (name, result)
        assert f"{result['max_context']:,}" in {row["0.3 max seq_len"] for row in rows}, name
