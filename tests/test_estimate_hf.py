"""The whole-step estimate of a transformers model trained by UPipeTrainer
(``python -m upipe_compile.estimate --hf``, upipe_compile/integrations/hf_estimate.py), on tiny Llama and
Qwen3 configs: it runs, its persistent terms are hand arithmetic, the chunked loss removes the
logits, offload moves the block inputs to the host, and bad input is refused before the step."""

from __future__ import annotations

import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from upipe_compile.errors import UnsupportedAttention  # noqa: E402
from upipe_compile.estimate import JobError  # noqa: E402
from upipe_compile.estimate.gpu import GIB  # noqa: E402
from upipe_compile.integrations.hf_estimate import (  # noqa: E402
    HFJob, build_model, estimate_hf, load_config, shipped_configs,
)

HIDDEN, LAYERS, VOCAB, SEQ, CP = 256, 2, 2048, 8192, 2
LOCAL = SEQ // CP
TINY = {
    "llama": {"model_type": "llama", "rms_norm_eps": 1e-5},
    "qwen3": {"model_type": "qwen3", "head_dim": 32, "rms_norm_eps": 1e-6},
}
MOE = {"model_type": "qwen3_moe", "head_dim": 32, "moe_intermediate_size": 128, "num_experts": 4,
       "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": []}


def _write(tmp_path, name: str, extra: dict, **overrides) -> str:
    config = {"hidden_size": HIDDEN, "intermediate_size": 512, "num_hidden_layers": LAYERS, "num_attention_heads": 8,
              "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 1 << 20,
              "tie_word_embeddings": False, "hidden_act": "silu", **extra, **overrides}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture
def tiny(tmp_path):
    return lambda family, **overrides: _write(tmp_path, family, TINY[family], **overrides)


def _gib(nbytes: float) -> float:
    return nbytes / GIB


@pytest.mark.parametrize("family", sorted(TINY))
def test_tiny_model_runs_and_its_persistent_terms_are_hand_arithmetic(tiny, family):
    path = tiny(family)
    result = estimate_hf(HFJob(path, seq_len=SEQ, cp=CP))
    # rank 0's FSDP2 shard of every parameter (dim 0 padded to a multiple of the ranks), fp32
    params = list(build_model(load_config(path)).parameters())
    shard = sum(math.ceil(p.shape[0] / CP) * p[0].numel() * 4 for p in params)
    assert result.breakdown["sharded_params"] == pytest.approx(_gib(shard), abs=2e-6)
    # AdamW: two fp32 moments per element, and a 4-byte step per parameter (the fused optimizer's)
    assert result.breakdown["optimizer_state"] == pytest.approx(_gib(2 * shard + 4 * len(params)), abs=2e-6)
    assert result.attention_calls == {"fused block": 2 * LAYERS}  # forward and AC's recompute, real loops
    assert result.world_size == CP and result.heads_per_stage == CP
    # full AC on every layer: only each layer's bf16 input stays on the device after forward
    assert result.breakdown["checkpointed_inputs_on_device"] == pytest.approx(_gib(LAYERS * LOCAL * HIDDEN * 2),
                                                                           abs=2e-6)
    assert result.fits and result.budget_gib == pytest.approx(72.95, abs=0.01)
    assert result.peak_device_gib == pytest.approx(sum(
        result.breakdown[k] for k in ("sharded_params", "sharded_grads", "optimizer_state", "fsdp_buffers",
                                      "model_buffers", "inputs", "activations_and_temps"))
        + sum(result.modelled.values()), abs=1e-5)


def test_chunked_loss_drops_the_logits(tiny):
    """A vocabulary large enough that the logits set the peak: without chunks the loss holds the
    local tokens' logits in bf16 and fp32 and their fp32 gradient (10 B a logit at least);
    chunked, none of it, so the peak falls by about that, less a chunk's share."""
    vocab, chunk = 16384, 512
    path = tiny("llama", vocab_size=vocab)
    whole = estimate_hf(HFJob(path, seq_len=SEQ, cp=CP))
    chunked = estimate_hf(HFJob(path, seq_len=SEQ, cp=CP, loss_chunk_tokens=chunk))
    logits = LOCAL * vocab
    assert whole.peak_phase.startswith("loss") and whole.breakdown["loss"] >= _gib(10 * logits)
    assert chunked.breakdown["loss"] <= _gib(16 * chunk * vocab) + _gib(4 * LOCAL * HIDDEN)
    drop = whole.peak_device_gib - chunked.peak_device_gib
    assert _gib(10 * logits) * 0.85 <= drop <= _gib(12 * logits), (drop, whole.breakdown, chunked.breakdown)


def test_offload_moves_the_block_inputs_to_host(tiny):
    path = tiny("qwen3")
    on_device = estimate_hf(HFJob(path, seq_len=SEQ, cp=CP))
    offloaded = estimate_hf(HFJob(path, seq_len=SEQ, cp=CP, offload_block_inputs=True, mlp_tile_tokens=1024),
                            gpus_per_node=8)
    inputs = _gib(LAYERS * LOCAL * HIDDEN * 2)  # one bf16 input per layer
    assert on_device.host_gib_per_rank == 0
    assert offloaded.breakdown["checkpointed_inputs_on_device"] == 0
    assert offloaded.host_gib_per_rank == pytest.approx(inputs, abs=2e-6)
    assert offloaded.host_gib_per_node == pytest.approx(CP * inputs, abs=1e-5)  # both ranks on one node


def test_fsdp_cpu_offload_moves_the_state_of_a_moe_model_to_the_host(tmp_path):
    """``--fsdp-cpu-offload`` on a tiny Qwen3-MoE: the sharded parameters, gradients and AdamW
    state leave the device and are on the host in full (hand arithmetic), the largest FSDP
    unit's staging copies join the device peak, and the step-time model adds the host's
    optimizer step."""
    path = _write(tmp_path, "moe", MOE)
    kept = estimate_hf(HFJob(path, seq_len=SEQ, cp=CP))
    offloaded = estimate_hf(HFJob(path, seq_len=SEQ, cp=CP, fsdp_cpu_offload=True))
    params = list(build_model(load_config(path)).parameters())
    shard = sum(math.ceil(p.shape[0] / CP) * p[0].numel() * 4 for p in params)
    assert all(offloaded.breakdown[k] == 0 for k in ("sharded_params", "sharded_grads", "optimizer_state"))
    # fp32 parameters and gradients, two fp32 moments, a 4-byte step per parameter
    assert offloaded.host_state_gib_per_rank == pytest.approx(_gib(4 * shard + 4 * len(params)), abs=2e-6)
    assert offloaded.host_gib_per_rank == offloaded.host_state_gib_per_rank
    assert offloaded.modelled["cpu_offload_staging"] > 0
    device = offloaded.peak_device_gib - sum(offloaded.modelled.values())
    before = kept.peak_device_gib - sum(kept.modelled.values())
    b = kept.breakdown
    assert device <= before - b["sharded_params"] - b["optimizer_state"] + 1e-5
    assert device >= before - b["sharded_params"] - b["sharded_grads"] - b["optimizer_state"] - 1e-5
    assert offloaded.step_time["phases"]["host_optimizer"] > 0 == kept.step_time["phases"]["host_optimizer"]


def test_cli_json(tiny, capsys):
    from upipe_compile.estimate.__main__ import main

    path = tiny("llama")
    assert main(["--hf", path, "--seq-len", str(SEQ), "--cp", str(CP), "--keep-attention",
                 "--offload-block-inputs", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["hf"]["keep_attention"] and payload["hf"]["world_size"] == CP and payload["fits"]
    # UPipeTrainer's offloader takes the block inputs only: the kept attention outputs (each
    # layer's output [S/P, Hq, D] and the fused block's [S/P, dim] in bf16, the stage LSEs in
    # fp32, U = P: Hq / P stages of one head a rank) stay on the device
    stages = 8 // CP
    kept = LAYERS * (LOCAL * 8 * 32 * 2 + LOCAL * HIDDEN * 2 + stages * SEQ * 4)
    assert payload["modelled"]["kept_attention_outputs"] == pytest.approx(_gib(kept), abs=2e-6)
    assert "kept_attention_outputs" not in payload["modelled_host"]


def test_shipped_configs_load():
    assert {"llama-3.1-8b", "llama-3.1-70b", "qwen3-8b"} <= set(shipped_configs())
    llama, qwen = load_config("llama-3.1-8b"), load_config("Qwen3-8B")
    assert (llama.model_type, llama.num_hidden_layers, llama.vocab_size) == ("llama", 32, 128256)
    big = load_config("llama-3.1-70b")
    assert (big.hidden_size, big.num_hidden_layers, big.num_attention_heads, big.num_key_value_heads,
            big.intermediate_size) == (8192, 80, 64, 8, 28672)
    assert (qwen.model_type, qwen.num_hidden_layers, qwen.vocab_size) == ("qwen3", 36, 151936)
    moe = load_config("qwen3-30b-a3b")
    assert (moe.model_type, moe.num_hidden_layers, moe.num_experts, moe.num_experts_per_tok,
            moe.moe_intermediate_size, moe.num_attention_heads, moe.num_key_value_heads) == \
        ("qwen3_moe", 48, 128, 8, 768, 32, 4)


@pytest.mark.parametrize("job, error, words", [
    (HFJob("llama-9b", seq_len=SEQ, cp=CP), JobError, "shipped: llama-3.1-70b, llama-3.1-8b"),
    (HFJob("llama-3.1-8b", seq_len=SEQ + 1, cp=CP), JobError, "not divisible by 2"),
    (HFJob("llama-3.1-8b", seq_len=SEQ, cp=CP, heads_per_stage=3), JobError, "multiple of the all-to-all ranks"),
    (HFJob("llama-3.1-8b", seq_len=SEQ, cp=4, ring_degree=3), JobError, "--ring-degree 3 must divide --cp 4"),
    (HFJob("llama-3.1-8b", seq_len=4 * 1023, cp=4, ring_degree=2), JobError, r"not divisible by 8.*zigzag"),
    (HFJob("llama-3.1-8b", seq_len=SEQ, cp=4, ring_degree=2, heads_per_stage=3), JobError,
     r"all-to-all ranks \(2 = --cp / --ring-degree\)"),
    (HFJob("llama-3.1-8b", seq_len=SEQ, cp=CP, offload_block_inputs=True, gradient_checkpointing=False), JobError,
     "needs gradient checkpointing"),
])
def test_bad_jobs_are_refused(job, error, words):
    with pytest.raises(error, match=words):
        estimate_hf(job)


def test_moe_with_tiled_mlp_is_refused(tmp_path):
    path = _write(tmp_path, "moe", MOE)
    with pytest.raises(UnsupportedAttention, match="mixture-of-experts"):
        estimate_hf(HFJob(path, seq_len=SEQ, cp=CP, mlp_tile_tokens=1024))


def test_cli_refusals(capsys):
    from upipe_compile.estimate.__main__ import main

    assert main(["--hf", "no-such-model", "--seq-len", "1024", "--cp", "2"]) == 2
    assert "shipped:" in capsys.readouterr().err
    assert main(["--hf", "qwen3-8b", "--cp", "2"]) == 2
    assert "--hf needs --seq-len" in capsys.readouterr().err
    assert main(["--hf", "qwen3-8b", "--seq-len", "1024", "--cp", "2", "--training.seq_len", "4"]) == 2
    assert "unknown arguments" in capsys.readouterr().err


def test_cli_max_context(tiny, capsys):
    """The torchtitan estimate's search over --seq-len: on a GPU small enough that the tiny job
    stops within a few probes, the answer fits and the next grid step does not."""
    from upipe_compile.estimate.__main__ import main

    assert main(["--hf", tiny("llama"), "--seq-len", str(SEQ), "--cp", str(CP), "--max-context", "--gpu-gib", "3.2",
                 "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    probes = dict(payload["probes"])
    found = payload["max_context"]
    assert payload["bound"] == "device" and found % (1024 * CP) == 0 and payload["fits"]
    assert probes[found + 1024 * CP] > payload["budget_gib"] >= probes[found]


def test_ring_layout(tiny):
    """UPipeTrainer's ring_degree: 4 ranks as a ring of 2 all-to-all pairs (U counted over the
    pair) and as a ring of 4 single ranks with every head at once (accelerate's own context
    parallelism, as the max-context table models it). Both run the real ring loops; keep_attention's
    kept stage LSEs cover the ring group's tokens (S / R), not the whole row."""
    path = tiny("llama")
    pairs = estimate_hf(HFJob(path, seq_len=SEQ, cp=4, ring_degree=2, keep_attention=True))
    assert (pairs.ring_degree, pairs.heads_per_stage, pairs.cp) == (2, 2, 4)
    local, stages = SEQ // 4, 8 // 2  # U = 2 over 2 all-to-all ranks: one query head a rank a stage
    kept = LAYERS * (local * 8 * 32 * 2 + local * HIDDEN * 2 + stages * (SEQ // 2) * 4)
    assert pairs.modelled["kept_attention_outputs"] == pytest.approx(_gib(kept), abs=2e-6)
    ring = estimate_hf(HFJob(path, seq_len=SEQ, cp=4, ring_degree=4, heads_per_stage=8))
    assert (ring.ring_degree, ring.heads_per_stage) == (4, 8) and ring.fits
    assert sum(ring.attention_calls.values()) == 2 * LAYERS  # forward and AC's recompute
