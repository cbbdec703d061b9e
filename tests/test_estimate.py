"""python -m upipe_compile.estimate on torchtitan's debug model (2 ranks, CP = 2, small seq_len):
its JSON, its parameter / gradient / optimizer / checkpoint terms against hand arithmetic,
and its refusals. Each run is its own process (it needs its own fake default group)."""

from __future__ import annotations

import copy
import functools
import glob
import json
import math
import os
import subprocess
import sys

import pytest

from estimate_commands import EstimateRuns
from torchtitan_jobs import DEBUG_TOML

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1 << 30
ROUNDING = GIB * 1e-6  # the JSON gives GiB to 6 decimals
SEQ = 512
DEBUG_ARGS = ["--config", DEBUG_TOML, "--training.seq_len", str(SEQ), "--activation_checkpoint.mode", "full"]


def run_estimate(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "upipe_compile.estimate", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


STACK = ["--upipe.offload_block_inputs", "--upipe.mlp_tile_tokens", "64", "--upipe.loss_chunk_tokens", "64"]
UNFUSED = ["--upipe.no-fuse_projections"]
# the debug job's estimates the module's fixtures read (any of its tests may), started when collection ends
RUNS = EstimateRuns({
    "debug": [*DEBUG_ARGS, "--json"],
    "stack": [*DEBUG_ARGS, *STACK, "--json"],
    "unfused": [*DEBUG_ARGS, *UNFUSED, "--json"],
    "keep on_device": [*DEBUG_ARGS, "--upipe.keep_attention", "--json"],
    "keep offloaded": [*DEBUG_ARGS, "--upipe.keep_attention", "--upipe.offload_block_inputs", "--json"],
    "fsdp offload": [*DEBUG_ARGS, "--training.enable_cpu_offload", "--json"],
    "stack kept 2": [*DEBUG_ARGS, *STACK, "--upipe.blocks_kept_on_device", "2", "--json"],
}, cwd=ROOT)


@pytest.fixture(scope="module")
def runs():
    return RUNS.start(RUNS.commands)  # (already queued at collection's end, unless imported otherwise)


@pytest.fixture(scope="module")
def debug_estimate(runs):
    return runs["debug"]


@pytest.fixture(scope="module")
def debug_model():
    """The debug model's parameters (on meta) and its config, from the same TOML."""
    import torch
    from torchtitan.protocols.train_spec import get_train_spec

    import upipe_compile.integrations.torchtitan  # noqa: F401  (registers the spec, as custom_import does)
    from torchtitan_jobs import load_config

    config = load_config(DEBUG_TOML, "--training.seq_len", str(SEQ))
    spec = get_train_spec(config.model.name)
    args = spec.model_args[config.model.flavor]
    args.update_from_config(config)
    with torch.device("meta"):
        model = spec.model_cls(args)
    return config, args, [p.shape for p in model.parameters()]


@pytest.fixture(scope="module")
def stack_estimate(runs):
    return runs["stack"]


def test_json_schema(debug_estimate):
    for key, kind in {"seq_len": int, "peak_device_gib": float, "budget_gib": float, "fits": bool,
                      "fits_device": bool, "fits_host": bool, "host_gib_per_node": float,
                      "host_budget_gib_per_node": float, "breakdown": dict, "reserve_gib": float}.items():
        assert isinstance(debug_estimate[key], kind), key
    assert debug_estimate["seq_len"] == SEQ and debug_estimate["world_size"] == 2
    assert debug_estimate["fits"] and debug_estimate["host_gib_per_node"] == 0.0  # no offload configured
    b = debug_estimate["breakdown"]
    by_kind = ("sharded_params", "sharded_grads", "optimizer_state", "fsdp_buffers", "model_buffers", "inputs",
               "activations_and_temps")
    # full AC: nothing the fake run cannot show but cuBLAS's workspaces (4 x 32 MiB)
    assert debug_estimate["modelled"] == {"cublas_workspaces": 0.125}
    assert sum(b[k] for k in by_kind) + 0.125 == pytest.approx(debug_estimate["peak_device_gib"], abs=1e-5)
    # What must fit: the persistent state as estimated, the rest times the ratio measured on a GPU
    persistent = sum(b[k] for k in ("sharded_params", "sharded_grads", "optimizer_state", "model_buffers"))
    assert debug_estimate["device_ratio"] == 1.39  # gpu.DEVICE_RATIO, the H200's largest ratio rounded up
    assert debug_estimate["expected_device_peak_gib"] == pytest.approx(
        persistent + 1.39 * (debug_estimate["peak_device_gib"] - persistent), abs=1e-5)
    assert debug_estimate["budget_gib"] == pytest.approx(79.1 - debug_estimate["reserve_gib"])
    assert debug_estimate["budget_gib"] == pytest.approx((79.1 - 2.5) / 1.05)  # 2.5 GiB + 5% fragmentation
    assert debug_estimate["host_budget_gib_per_node"] == 1862 - 64  # a 2 TB node's MemTotal less the reserve


def test_parameter_and_optimizer_terms_match_hand_arithmetic(debug_estimate, debug_model):
    config, args, shapes = debug_model
    world = 2  # FSDP over dp_shard x cp = 1 x 2
    # fully_shard pads dim 0 to a multiple of the world and keeps fp32 (the TOML's param dtype) shards.
    sharded = sum(math.ceil(s[0] / world) * math.prod(s[1:]) * 4 for s in shapes)
    b = debug_estimate["breakdown"]
    assert b["sharded_params"] * GIB == pytest.approx(sharded, abs=ROUNDING)
    # AdamW: exp_avg and exp_avg_sq per sharded parameter, plus a 4-byte step per parameter.
    assert b["optimizer_state"] * GIB == pytest.approx(2 * sharded + 4 * len(shapes), abs=ROUNDING)
    # The peak is in backward: at most every sharded gradient exists.
    assert 0 <= b["sharded_grads"] * GIB <= sharded + ROUNDING
    # Full AC keeps each block's input [B, S/P, dim] fp32, and the RoPE rows all blocks
    # share: init_weights makes the table for the whole sequence (seq_len x head_dim/2
    # complex64), the first forward cuts it to the rank's S/P rows (rope_rows.py), which are
    # then an input of every block (one tensor), and no module buffer is left at the peak.
    batch, local = config.training.local_batch_size, SEQ // world
    block_inputs = args.n_layers * batch * local * args.dim * 4
    rope_rows = local * (args.dim // args.n_heads // 2) * 8
    assert b["checkpointed_inputs_on_device"] * GIB == pytest.approx(block_inputs + rope_rows, abs=ROUNDING)
    assert b["model_buffers"] == 0


@pytest.fixture(scope="module")
def unfused_estimate(runs):
    return runs["unfused"]


def test_cuda_kernel_workspace_is_counted():
    """aten's flash backward holds more than flash-attn's (its copies of out and dout, made
    when a call has more than one head: U = 16 heads over the ranks here): the stage loop's
    backward buffers show the kernel the estimate was told to model."""
    estimates = {}
    for kernel in ("flash-attn", "aten-flash"):
        result = run_estimate(*DEBUG_ARGS, *UNFUSED, "--upipe.heads_per_stage", "16", "--json", "--cuda-kernel", kernel)
        assert result.returncode == 0, result.stderr[-3000:]
        estimates[kernel] = json.loads(result.stdout)
        assert estimates[kernel]["cuda_kernel"] == kernel
    flash_buffers = estimates["flash-attn"]["block_recompute"]["stage_loop_backward_buffers"]
    assert estimates["aten-flash"]["block_recompute"]["stage_loop_backward_buffers"] > flash_buffers


def test_the_stage_loops_ran(unfused_estimate, debug_model):
    """With fuse_projections off, the route put every block's attention through the real
    plain-op loops: their buffers show."""
    _, args, _ = debug_model
    assert unfused_estimate["attention_calls"] == {"stage-loop op": 2 * args.n_layers}  # forward + AC recompute
    block = unfused_estimate["block_recompute"]
    assert block["stage_loop_forward_buffers"] > 0 and block["stage_loop_backward_buffers"] > 0
    assert block["peak_above_start"] >= max(block["attention_stage_loop"], block["mlp"])


def test_the_fused_blocks_ran(debug_estimate, unfused_estimate, debug_model):
    """By default (fuse_projections on) every block's attention ran as the fused block's eager
    twin, forward and AC recompute, and its backward holds less than the plain op's."""
    _, args, _ = debug_model
    assert debug_estimate["attention_calls"] == {"fused block": 2 * args.n_layers}
    fused, plain = debug_estimate["block_recompute"], unfused_estimate["block_recompute"]
    assert 0 < fused["attention"] < plain["attention_stage_loop"]


def test_unknown_override_names_the_key():
    result = run_estimate(*DEBUG_ARGS, "--upipe.heads_per_stagex", "4")
    assert result.returncode != 0
    assert "--upipe.heads_per_stagex" in result.stderr


def test_a_varlen_flavor_is_refused_naming_the_sdpa_flavor():
    """0.2.2's estimate feeds no document metadata: a varlen flavor is refused before its step
    (not the model's own assertion deep in the forward)."""
    result = run_estimate("--config", DEBUG_TOML, "--model.flavor", "debugmodel_varlen_attn", "--training.seq_len",
                          str(SEQ), "--training.local_batch_size", "1")
    assert result.returncode != 0
    assert "uses varlen attention: the 0.2.2 estimate feeds one document a row" in result.stderr, result.stderr[-2000:]
    assert "estimate the model's SDPA flavor" in result.stderr


def test_job_without_fsdp_is_refused_with_the_keys():
    result = run_estimate("--config", DEBUG_TOML, "--parallelism.context_parallel_degree", "1")
    assert result.returncode == 2
    assert "data_parallel_shard_degree x context_parallel_degree" in result.stderr


def test_impossible_seq_len_names_the_key():
    result = run_estimate("--config", DEBUG_TOML, "--training.seq_len", "1001")
    assert result.returncode == 2
    assert "[training] seq_len = 1001" in result.stderr


def _linear_memory(monkeypatch, base_gib, gib_per_token, curve=0.0, host_gib_per_token=0.0):
    """Replace each probe's step estimate by a known memory curve (device per rank, host per node)."""
    from types import SimpleNamespace

    from upipe_compile.estimate.gpu import budget_gib
    from upipe_compile.integrations.torchtitan import estimate_search

    probed = []

    def probe(job_config, seq_len, gpu_gib, gpus_per_node, host_gib, cuda_kernel, device_ratio):
        probed.append(seq_len)
        peak = base_gib + gib_per_token * seq_len + curve * (seq_len / 1e6) ** 2
        host = host_gib_per_token * seq_len
        fits_device, fits_host = peak <= budget_gib(gpu_gib), host <= host_gib
        return SimpleNamespace(peak_device_gib=peak, expected_device_peak_gib=peak, host_gib_per_node=host,
                               fits=fits_device and fits_host,
                               fits_device=fits_device, fits_host=fits_host, seq_len=seq_len)

    monkeypatch.setattr(estimate_search, "_probe", probe)
    return probed


@pytest.mark.parametrize("start", [8192, 1 << 20, 5 << 20])
@pytest.mark.parametrize("curve", [0.0, 0.4])
def test_max_context_search_finds_the_last_fitting_grid_point(monkeypatch, start, curve):
    from types import SimpleNamespace

    from upipe_compile.integrations.torchtitan.estimate_search import max_context

    probed = _linear_memory(monkeypatch, 12.0, 20.0 / (1 << 20), curve)  # 12 GiB + 20 GiB per 1M tokens
    config = SimpleNamespace(training=SimpleNamespace(seq_len=start),
                             parallelism=SimpleNamespace(context_parallel_degree=8))
    found, result, probes, bound = max_context(config, progress=False)
    step = 8 * 1024

    def fits(s):
        return 12.0 + 20.0 / (1 << 20) * s + curve * (s / 1e6) ** 2 <= (79.1 - 2.5) / 1.05

    assert found % step == 0 and fits(found) and not fits(found + step)
    assert result.seq_len == found and len(probed) <= 8 and bound == "device"


@pytest.mark.parametrize("start", [8192, 1 << 20, 5 << 20])
def test_max_context_search_stops_at_the_host_bound(monkeypatch, start):
    """Host memory per node linear in seq_len (256 KiB per token: Llama3-8B's 32 bf16 block
    inputs of 4096), a device curve that would allow far more: the search stops at the last
    grid point within the host budget and says the host stopped it."""
    from types import SimpleNamespace

    from upipe_compile.integrations.torchtitan.estimate_search import max_context

    per_token = 256 / (1 << 20)
    probed = _linear_memory(monkeypatch, 12.0, 5.0 / (1 << 20), host_gib_per_token=per_token)
    config = SimpleNamespace(training=SimpleNamespace(seq_len=start),
                             parallelism=SimpleNamespace(context_parallel_degree=8))
    found, result, probes, bound = max_context(config, progress=False, host_gib=1000.0)
    step = 8 * 1024
    assert bound == "host" and found % step == 0
    assert found * per_token <= 1000.0 < (found + step) * per_token
    assert result.fits_device and result.seq_len == found and len(probed) <= 8


def test_max_context_refuses_when_nothing_fits(monkeypatch):
    from types import SimpleNamespace

    from upipe_compile.estimate import JobError
    from upipe_compile.integrations.torchtitan.estimate_search import max_context

    _linear_memory(monkeypatch, 100.0, 1e-6)
    config = SimpleNamespace(training=SimpleNamespace(seq_len=65536),
                             parallelism=SimpleNamespace(context_parallel_degree=8))
    with pytest.raises(JobError, match="does not fit"):
        max_context(config, progress=False)


def test_max_context_host_bound_on_a_real_step():
    """The debug model with its block inputs offloaded, on a host budget far below its GPU's:
    the CLI search stops where the node's offloaded inputs (by hand arithmetic: layers x
    seq_len x dim x 4 B, the whole sequence over the node's ranks) pass --host-gib, and
    reports the host as the bound."""
    from torchtitan_jobs import load_config
    from torchtitan.protocols.train_spec import get_train_spec

    import upipe_compile.integrations.torchtitan  # noqa: F401

    config = load_config(DEBUG_TOML, "--training.seq_len", str(SEQ))
    args = get_train_spec(config.model.name).model_args[config.model.flavor]
    per_token = args.n_layers * config.training.local_batch_size * args.dim * 4 / GIB  # per node, all ranks on it
    step = 2 * 1024
    host_gib = (3 * step + step // 2) * per_token  # 3.5 grid steps: the host bound is 3 steps
    result = run_estimate(*DEBUG_ARGS, "--upipe.offload_block_inputs", "--max-context", "--host-gib", repr(host_gib), "--json", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout)
    assert found["bound"] == "host" and found["max_context"] == 3 * step, found
    assert found["fits_device"] and found["fits_host"] and found["host_budget_gib_per_node"] == host_gib
    assert found["host_gib_per_node"] == pytest.approx(3 * step * per_token, abs=1e-5)


def test_selective_op_ac_adds_the_attention_outputs_the_compiled_path_saves(debug_model):
    """Under selective op AC the compiled path saves each layer's upipe::attention outputs
    (out and the per-stage LSE; a fused block's output too), which the eager route
    recomputes: the estimate adds them."""
    import torch

    from upipe_compile.integrations.torchtitan.long_context_stack import attention_outputs_bytes_per_rank

    config, args, _ = debug_model
    world, heads_per_stage = 2, 2
    head_dim = args.dim // args.n_heads
    batch = config.training.local_batch_size
    out = batch * args.n_heads * (SEQ // world) * head_dim * 4  # fp32 debug TOML
    stages, q_per_rank = args.n_heads // heads_per_stage, heads_per_stage // world
    lse = stages * batch * q_per_rank * SEQ * 4
    config = copy.deepcopy(config)
    config.upipe.heads_per_stage = heads_per_stage
    saved = functools.partial(attention_outputs_bytes_per_rank, config, args, world, torch.float32)
    assert saved(fused=False) == args.n_layers * (out + lse)
    block_output = batch * (SEQ // world) * args.dim * 4  # the fused block's y is saved too
    assert saved(fused=True) == args.n_layers * (out + lse + block_output)


def test_keep_attention_counts_the_kept_attention_outputs():
    """Full AC with [upipe] keep_attention keeps upipe's attention outputs as selective op AC
    does: the estimate adds them; plain full AC does not."""
    import upipe_compile.integrations.torchtitan  # noqa: F401  the [upipe] section
    from torchtitan_jobs import load_config
    from upipe_compile.integrations.torchtitan.estimate_run import _op_selective_ac
    from upipe_compile.integrations.torchtitan.release_022.facts import job_facts

    def kept(*overrides):
        return _op_selective_ac(job_facts(load_config(DEBUG_TOML, *overrides)))

    assert kept("--activation_checkpoint.mode=full", "--upipe.keep_attention")
    assert not kept("--activation_checkpoint.mode=full")
    assert kept("--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op")


def test_saved_attention_output_uses_the_value_head_dim():
    """The saved output's head dim: MLA's v_head_dim (DeepSeek-V3: q/k 192, v 128), Qwen3's
    own head_dim (Qwen3-32B: 128, not 5120 / 64 = 80), else dim / n_heads (Llama3)."""
    from types import SimpleNamespace

    from upipe_compile.integrations.torchtitan.long_context_stack import value_head_dim as _value_head_dim

    assert _value_head_dim(SimpleNamespace(dim=7168, n_heads=128, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                           v_head_dim=128)) == 128
    assert _value_head_dim(SimpleNamespace(dim=5120, n_heads=64, head_dim=128)) == 128
    assert _value_head_dim(SimpleNamespace(dim=4096, n_heads=32)) == 128


def test_the_stack_runs_for_real(debug_estimate, stack_estimate, debug_model):
    """With offload, tiled MLP and chunked loss: the block inputs are host memory (per rank and
    per node, by hand arithmetic), none is left on device, and the MLP's
    rise falls (its loop ran with per-tile buffers, not the op's fake kernel). (The debug
    model's vocabulary, 2000, is too small for chunking the loss to save memory here.)"""
    config, args, _ = debug_model
    world = 2
    block_inputs = args.n_layers * config.training.local_batch_size * (SEQ // world) * args.dim * 4
    assert stack_estimate["host_gib_per_rank"] * GIB == pytest.approx(block_inputs, abs=ROUNDING)
    assert stack_estimate["host_gib_per_node"] == pytest.approx(world * stack_estimate["host_gib_per_rank"], abs=1e-5)
    assert stack_estimate["breakdown"]["checkpointed_inputs_on_device"] == 0
    assert stack_estimate["block_recompute"]["mlp"] < debug_estimate["block_recompute"]["mlp"]
    assert stack_estimate["phase_peaks"]["loss"] > 0  # the chunked loss ran (LazyLogits, no logits tensor)


def test_the_last_blocks_kept_on_device_leave_the_host(runs, stack_estimate, debug_model):
    """``blocks_kept_on_device = 2``: the offloader takes the first n - 2 blocks' inputs; the
    last two stay on the device where AC keeps them (by hand arithmetic)."""
    kept = runs["stack kept 2"]
    config, args, _ = debug_model
    block_input = config.training.local_batch_size * (SEQ // 2) * args.dim * 4
    assert kept["host_gib_per_rank"] * GIB == pytest.approx((args.n_layers - 2) * block_input, abs=ROUNDING)
    assert stack_estimate["host_gib_per_rank"] * GIB == pytest.approx(args.n_layers * block_input, abs=ROUNDING)
    on_device = kept["breakdown"]["checkpointed_inputs_on_device"] * GIB
    rope_rows = (SEQ // 2) * (args.dim // args.n_heads // 2) * 8  # the blocks' shared RoPE rows
    assert on_device == pytest.approx(2 * block_input + rope_rows, abs=ROUNDING)


@pytest.fixture(scope="module")
def keep_estimates(runs):
    """The debug job under full AC with keep_attention, its outputs on the device and offloaded."""
    return {name: runs[f"keep {name}"] for name in ("on_device", "offloaded")}


def test_keep_attention_with_offload_counts_the_kept_outputs_on_host(keep_estimates, stack_estimate, debug_model):
    """Offloaded, keep_attention's outputs leave the device peak (full AC's recompute makes the
    same tensors there) and join the offloaded block inputs on host: the same bytes the
    on-device estimate added to its peak."""
    on_device, offloaded = keep_estimates["on_device"], keep_estimates["offloaded"]
    kept = on_device["modelled"]["sac_saved_attention_outputs"]
    assert kept > 0 and offloaded["modelled"] == {"cublas_workspaces": 0.125}
    assert offloaded["modelled_host"] == {"kept_attention_outputs": kept}
    config, args, _ = debug_model
    inputs = args.n_layers * config.training.local_batch_size * (SEQ // 2) * args.dim * 4 / GIB
    assert offloaded["host_gib_per_rank"] == pytest.approx(inputs + kept, abs=2e-6)


def test_the_estimate_carries_the_step_time_model(debug_estimate, keep_estimates):
    """Each estimate states the step-time model's seconds for the job and, at its context,
    for Ulysses, UPipe and UPipe + keep_attention (the same three numbers with or without keep)."""
    model = debug_estimate["step_time"]
    assert model["device"].startswith("H100") and model["seconds"] > 0
    assert model["seconds"] == model["methods_seconds"]["upipe"]  # the job is UPipe without keep
    kept = keep_estimates["on_device"]["step_time"]
    assert kept["seconds"] == kept["methods_seconds"]["upipe_keep"] < kept["methods_seconds"]["upipe"]
    assert kept["methods_seconds"] == model["methods_seconds"]
    assert model["shape"]["n_layers"] == 6 and model["shape"]["q_heads"] == 16


def test_plan_takes_the_fastest_setting_that_fits(debug_estimate, keep_estimates):
    """A GPU whose budget lies between the job's peak with and without keep_attention's
    outputs, and a host budget below any offload: the plan tries the faster keep settings
    first, sees them break a budget, and takes the fastest setting without keep or
    offload; its overrides are the command line that runs it."""
    # what must fit the budget: the device ratio applied (test_json_schema)
    peak, kept_peak = (debug_estimate["expected_device_peak_gib"],
                       keep_estimates["on_device"]["expected_device_peak_gib"])
    assert kept_peak > peak
    gpu_gib = 2.5 + (peak + kept_peak) / 2 * 1.05  # reserve: 2.5 GiB + 5% (test_json_schema)
    host_gib = keep_estimates["offloaded"]["host_gib_per_node"] / 100
    result = run_estimate(*DEBUG_ARGS, "--plan", "--gpu-gib", repr(gpu_gib), "--host-gib", repr(host_gib), "--json",
                          timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout)
    plan, tried = found["plan"], found["tried"]
    assert not plan["keep_attention"] and not plan["offload_block_inputs"], tried
    assert tried[-1][0] == plan and tried[-1][2] == "fits"
    assert all(settings["keep_attention"] for settings, _, _ in tried[:-1]) and len(tried) > 1, tried
    assert all(outcome.startswith("breaks the") for _, _, outcome in tried[:-1]), tried
    seconds = [s for _, s, _ in tried]
    assert seconds == sorted(seconds) and found["seconds"] == seconds[-1]
    assert found["overrides"] == [f"--upipe.heads_per_stage", str(plan["heads_per_stage"]),
                                  "--upipe.ring_degree", str(plan["ring_degree"])]
    assert found["estimate"]["fits"]


def test_plan_overrides_turn_off_what_the_job_turned_on():
    from upipe_compile.integrations.torchtitan.estimate_plan import Plan

    settings = {"heads_per_stage": 8, "ring_degree": 1, "keep_attention": False, "offload_block_inputs": True}
    given = {"heads_per_stage": 32, "ring_degree": 1, "keep_attention": True, "offload_block_inputs": False}
    assert Plan(settings, None, 1.0, [], given).overrides() == [
        "--upipe.heads_per_stage", "8", "--upipe.ring_degree", "1", "--upipe.no-keep_attention",
        "--upipe.offload_block_inputs"]


@pytest.mark.parametrize("kept", sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "fits_70b", "*.json"))),
                         ids=os.path.basename)
def test_a_kept_report_reads_the_same_under_its_own_ratio_and_moves_with_another(kept):
    """with_device_ratio: a committed 70B report re-rated under the ratio it was made with gives
    its own expected peak and fits (the formula is the estimate's), and under a larger ratio only
    the part above the persistent state grows."""
    from upipe_compile.estimate.report import persistent_gib, with_device_ratio

    with open(kept) as f:
        report = json.load(f)
    same = with_device_ratio(report, report["device_ratio"])
    assert same["expected_device_peak_gib"] == pytest.approx(report["expected_device_peak_gib"], abs=1e-5)
    assert (same["fits"], same["fits_device"]) == (report["fits"], report["fits_device"])
    persistent = persistent_gib(report["breakdown"])
    larger = with_device_ratio(report, report["device_ratio"] + 0.5)
    grown = larger["expected_device_peak_gib"] - report["expected_device_peak_gib"]
    assert grown == pytest.approx(0.5 * (report["peak_device_gib"] - persistent), abs=1e-5)
    assert larger["device_ratio"] == report["device_ratio"] + 0.5


def test_fsdp_cpu_offload_moves_the_state_to_the_host(runs, debug_estimate, debug_model):
    """``training.enable_cpu_offload``: FSDP2 keeps the sharded parameters, their gradients and
    the optimizer state on the host (and steps the optimizer there). The device peak loses them
    and gains the staging copies of the largest FSDP unit; the host holds all of them (by hand
    arithmetic); the ratio then scales all that is left on the device."""
    offloaded = runs["fsdp offload"]
    config, args, shapes = debug_model
    world = 2
    sharded = sum(math.ceil(s[0] / world) * math.prod(s[1:]) * 4 for s in shapes)  # fp32 shards
    b, before = offloaded["breakdown"], debug_estimate["breakdown"]
    assert b["sharded_params"] == b["sharded_grads"] == b["optimizer_state"] == 0
    # parameters, every gradient, AdamW's two moments and its 4-byte steps
    assert offloaded["host_state_gib_per_rank"] * GIB == pytest.approx(4 * sharded + 4 * len(shapes), abs=ROUNDING)
    assert offloaded["host_gib_per_rank"] == offloaded["host_state_gib_per_rank"]  # no activations offloaded
    assert offloaded["host_gib_per_node"] == pytest.approx(world * offloaded["host_gib_per_rank"], abs=1e-5)
    # staging: the largest unit (a block: its matrices and two norm weights) in fp32, copied in
    # (4 bytes), kept in the param dtype (fp32 here: 4) and its reduce-scatter output (4)
    per_block = (len(shapes) - 3) // args.n_layers  # less the embedding, the final norm and the output
    unit = sum(math.ceil(s[0] / world) * math.prod(s[1:]) for s in shapes[1:1 + per_block])
    assert offloaded["modelled"]["cpu_offload_staging"] * GIB == pytest.approx(12 * unit, abs=ROUNDING)
    on_device = offloaded["peak_device_gib"] - sum(offloaded["modelled"].values())
    kept = debug_estimate["peak_device_gib"] - sum(debug_estimate["modelled"].values())
    # The step without its state peaks no higher than before less the state that was there
    # all along, and no lower than before less all of the state at the old peak.
    assert on_device <= kept - before["sharded_params"] - before["optimizer_state"] + 1e-5
    assert on_device >= kept - before["sharded_params"] - before["sharded_grads"] - before["optimizer_state"] - 1e-5
    persistent = b["model_buffers"]
    assert offloaded["expected_device_peak_gib"] == pytest.approx(
        persistent + 1.39 * (offloaded["peak_device_gib"] - persistent), abs=1e-5)
    model = offloaded["step_time"]
    assert model["phases"]["host_optimizer"] > 0 and debug_estimate["step_time"]["phases"]["host_optimizer"] == 0
