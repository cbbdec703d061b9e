"""transformers' Trainer and TRL's SFTTrainer with UPipe (upipe_compile.integrations.hf_trainer)
on 2 gloo ranks (DDP over gloo, context parallelism over both ranks), against the stock trainer
on one process over the full sequences with stock "sdpa" attention: a tiny seeded fp32 model,
SGD, gradient accumulation 2, gradient clipping on. Every logged loss and every final parameter
must agree within 1e-5; see tests/hf_trainer_jobs.py."""

from __future__ import annotations

import math
import os
import signal

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import hf_trainer_jobs as jobs  # noqa: E402
from upipe_compile.errors import UnsupportedAttention  # noqa: E402
from upipe_compile.integrations.hf_batch import upipe_batch  # noqa: E402

TOLERANCE = 1e-5
WORLD = 2


def _compare(ranks, ref, family="llama"):
    ref_losses, ref_params = ref
    assert len(ref_losses) >= 2  # several optimizer steps, each of 2 accumulated micro-batches
    start = dict(jobs.build_model(family).named_parameters())
    for rank, (losses, params, *_) in enumerate(ranks):
        assert len(losses) == len(ref_losses), (rank, losses, ref_losses)
        loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
        assert loss_diff <= TOLERANCE, (rank, losses, ref_losses)
        assert set(params) == set(ref_params)
        param_diff = max((params[k] - ref_params[k]).abs().max().item() for k in params)
        assert param_diff <= TOLERANCE, (rank, param_diff)
    # not vacuous: training moved the weights
    assert max((ref_params[k] - start[k]).abs().max().item() for k in ref_params) > 1e-2


def test_trainer_matches_one_process(rank_pools):
    """Trainer at P = 2 (rows of 32 tokens, every third right-padded with a mask, different
    numbers of labelled tokens per row) equals Trainer on one process."""
    ranks = rank_pools(WORLD).run(jobs.run_trainer, True, mask_fn=jobs.right_padded, samples=12)
    ref = jobs.run_trainer(False, mask_fn=jobs.right_padded, samples=12)
    _compare(ranks, ref)
    layers = jobs.build_model().config.num_hidden_layers
    for rank, (*_, counts) in enumerate(ranks):
        # Attention ran as upipe's fused block on every rank, never as plain SDPA on a shard:
        # at least 2 layers x 6 micro-batches, forward and backward (the profiler also sees
        # the ops traced while compiling).
        assert "plain sdpa outside upipe" not in counts, (rank, counts)
        assert counts["upipe::attention_block"] >= 6 * layers, (rank, counts)
        assert counts["upipe::attention_block_backward"] >= 6 * layers, (rank, counts)


def test_evaluate_and_predict_report_stock_trainer_numbers(rank_pools):
    """evaluate() and predict() at eval batch 4 (rows of 32, right padding, different labelled
    counts) on P = 2 ranks: the loss stock Trainer reports on one process, on every rank, and
    predict()'s logits over the whole sequences, once per row."""
    _assert_evaluation_matches(rank_pools(WORLD).run(jobs.run_evaluate, True, 4, True),
                               jobs.run_evaluate(False, 4, True))


def test_evaluate_and_predict_over_data_parallel_replicas(rank_pools):
    """Two data-parallel replicas of P = 2 (4 ranks): evaluate() and predict() equal stock
    Trainer with DDP over 2 processes (each row gathered once, over the replicas only)."""
    _assert_evaluation_matches(rank_pools(4).run(jobs.run_evaluate, True, 2, True, 2),
                               rank_pools(2).run(jobs.run_evaluate, False, 2, True)[0])


def _assert_evaluation_matches(ranks, stock):
    """Every rank's (eval loss, predict loss, predicted logits) equal the stock trainer's, the
    logits at the real tokens (padded positions carry no label and, with no mask, see other
    padding under causal attention)."""
    loss, predict_loss, logits = stock
    real = torch.tensor([row["attention_mask"] for row in jobs.evaluation_rows()], dtype=torch.bool)
    for rank, (rank_loss, rank_predict_loss, rank_logits) in enumerate(ranks):
        assert abs(rank_loss - loss) <= TOLERANCE * abs(loss), (rank, rank_loss, loss)
        assert abs(rank_predict_loss - predict_loss) <= TOLERANCE * abs(loss), (rank, rank_predict_loss, loss)
        assert rank_logits.shape == logits.shape, (rank, rank_logits.shape, logits.shape)
        assert (rank_logits - logits)[real].abs().max().item() <= TOLERANCE, rank


def test_training_without_the_device_copy_matches_one_process(rank_pools):
    """Batch 2 with Trainer's per-batch device copy left out (a GPU's batch is already on its
    device): every shard handed to the model is contiguous, and training equals one process."""
    ranks = rank_pools(WORLD).run(jobs.run_trainer_without_device_copy, True)
    ref = jobs.run_trainer(False, mask_fn=jobs.right_padded, samples=8)
    _compare([r[:2] for r in ranks], ref)


def test_trainer_over_a_ring_by_all_to_all_mesh_matches_one_process(rank_pools):
    """ring_degree=2 on 4 ranks (two all-to-all pairs, ring attention between them): batches
    sharded in the mesh's zigzag layout with its positions; equals Trainer on one process."""
    ranks = rank_pools(4).run(jobs.run_trainer, True, mask_fn=jobs.right_padded, samples=8, ring_degree=2)
    _compare(ranks, jobs.run_trainer(False, mask_fn=jobs.right_padded, samples=8))


def test_sft_trainer_leaves_the_users_config_alone(rank_pools):
    """UPipeSFTTrainer pads to a multiple of P in its own copy of the SFTConfig."""
    for user, own in rank_pools(WORLD).run(jobs.sft_config_untouched):
        assert user is None and own == WORLD, (user, own)


def test_sft_padding_free_matches_one_process(rank_pools):
    """TRL SFTTrainer with padding_free=True: one packed row of 2 documents per micro-batch,
    positions restarting per document, attending within documents (and SFTConfig's gradient
    checkpointing, TRL's fused LM head)."""
    ranks = rank_pools(WORLD).run(jobs.run_sft, True)
    _compare(ranks, jobs.run_sft(False))


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt_oss"])
def test_attention_variants_train_exactly(rank_pools, family):
    """Sliding window across the shard boundary (Mistral), softcap (Gemma2), sinks (GPT-OSS)."""
    ranks = rank_pools(WORLD).run(jobs.run_trainer, True, family=family)
    _compare(ranks, jobs.run_trainer(False, family=family), family)


@pytest.mark.parametrize("family", ["mistral", "qwen3_next"])
def test_trainer_with_the_config_as_shipped_trains_exactly(rank_pools, family):
    """A sliding-window family and a hybrid whose configs keep ``use_cache`` on, as shipped:
    UPipeTrainer equals the stock trainer (which builds and ignores the cache)."""
    ranks = rank_pools(WORLD).run(jobs.run_trainer, True, family=family, as_shipped=True)
    _compare(ranks, jobs.run_trainer(False, family=family, as_shipped=True), family)


@pytest.mark.parametrize("family", ["mistral"])
def test_sft_trainer_with_the_config_as_shipped_trains_exactly(rank_pools, family):
    """TRL's SFTTrainer, padding-free, on the sliding-window family at its shipped config (a
    hybrid's packed rows need causal-conv1d in transformers itself, with or without upipe)."""
    ranks = rank_pools(WORLD).run(jobs.run_sft, True, family=family, as_shipped=True)
    _compare(ranks, jobs.run_sft(False, family=family, as_shipped=True), family)


def test_hybrid_trains_exactly(rank_pools):
    """LFM2 (gated short convs beside attention): its convs run as upipe stage loops."""
    ranks = rank_pools(WORLD).run(jobs.run_trainer, True, family="lfm2")
    _compare(ranks, jobs.run_trainer(False, family="lfm2"), "lfm2")
    for *_, counts in ranks:
        # the convs ran as stage loops every micro-batch, forward and backward; the plain
        # mixer shows only where Dynamo traced it while compiling (as document_sdpa does)
        assert counts.get("upipe::head_mixer_loop", 0) >= 8, counts
        assert counts.get("upipe::head_mixer", 0) <= counts.get("upipe::document_sdpa", 0), counts


def _same_numbers(a: float, b: float) -> bool:
    """Within the tolerance, a NaN only where the other is NaN."""
    return math.isnan(a) == math.isnan(b) and (math.isnan(a) or abs(a - b) <= TOLERANCE)


def _assert_same_steps(ranks, ref):
    """Every rank logs what the stock trainer logs, step by step (loss and grad norm, NaN where it is
    NaN), and ends with its parameters (NaN where they are)."""
    ref_rows, ref_params = ref
    for rank, (rows, params) in enumerate(ranks):
        assert len(rows) == len(ref_rows), (rank, rows, ref_rows)
        for row, ref_row in zip(rows, ref_rows):
            for key in ("loss", "grad_norm"):
                assert _same_numbers(row[key], ref_row[key]), (rank, key, rows, ref_rows)
        for name, p in params.items():
            assert torch.equal(p.isnan(), ref_params[name].isnan()), (rank, name)
            assert torch.allclose(p, ref_params[name], atol=TOLERANCE, rtol=0, equal_nan=True), (rank, name)


def test_a_non_finite_loss_on_one_rank_is_filtered_on_every_rank(rank_pools):
    """NaN added to rank 1's loss only (its gradient stays finite) at the second micro-batch of
    step 2: the filter (``logging_nan_inf_filter``) replaces that micro-batch's loss on every rank
    alike, so each rank logs what stock Trainer logs with the NaN in the whole loss, and training
    goes on to its parameters."""
    ranks = rank_pools(WORLD).run(jobs.run_with_nan, True, "loss", 3)
    ref = jobs.run_with_nan(False, "loss", 3)
    ref_rows, ref_params = ref
    assert all(math.isfinite(row["loss"]) for row in ref_rows)  # filtered, not logged as NaN
    assert all(p.isfinite().all() for p in ref_params.values())
    _assert_same_steps(ranks, ref)


def test_a_non_finite_gradient_on_one_rank_reaches_every_rank(rank_pools):
    """NaN in one logit of a labelled token on rank 1 (a hook on the LM head), at the first
    micro-batch of step 2: the gradient norm is NaN on every rank at step 2 (DDP's all-reduce spreads it; clipping then makes
    every parameter NaN, on every rank alike), and each rank logs what stock Trainer logs."""
    ranks = rank_pools(WORLD).run(jobs.run_with_nan, True, "logits", 2)
    ref = jobs.run_with_nan(False, "logits", 2)
    ref_rows, _ = ref
    assert [math.isnan(row["grad_norm"]) for row in ref_rows] == [False, True, True], ref_rows
    _assert_same_steps(ranks, ref)


@pytest.mark.parametrize("world", [2, 4])
def test_sft_trainer_resumes_as_if_never_stopped(rank_pools, tmp_path, world):
    """UPipeSFTTrainer on 2 and 4 ranks, padding-free packing, AdamW, 4 steps, a checkpoint every 2:
    a fresh trainer resumed from the step-2 checkpoint equals the uninterrupted run on every rank."""
    pool = rank_pools(world)
    straight = pool.run(jobs.run_sft_resumable, str(tmp_path / "straight"))
    resumed = pool.run(jobs.run_sft_resumable, str(tmp_path / "resumed"),
                       resume_from=str(tmp_path / "straight" / "checkpoint-2"))
    for rank in range(world):
        jobs.assert_resumed_as_straight(straight[rank], resumed[rank], checkpoint_step=2)
    # the last checkpoint is the model's own: transformers loads it with no upipe in the process's way
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "checkpoint-4", attn_implementation="sdpa")
    loaded = dict(plain.named_parameters())
    assert loaded.keys() == straight[0]["params"].keys()
    for name, p in straight[0]["params"].items():
        assert torch.equal(loaded[name].detach(), p), name


def _torchrun_job(out, *flags) -> tuple[float, str]:
    """tests/hf_rank_death_job.py under torchrun, 2 CPU ranks: (seconds, log).

    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: torchrun otherwise hands every attempt the same
    rendezvous store, and a restarted rank can read its dead peer's gloo address from the attempt
    before (``Connection refused``, then a wait for the store's timeout). A job that outlives the
    limit is killed with its whole process group, and the test fails with the log so far."""
    import subprocess
    import sys
    import time

    job = os.path.join(os.path.dirname(__file__), "hf_rank_death_job.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "--max-restarts", "1", "--monitor-interval", "1", job, str(out), *flags]
    start = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    try:
        log, _ = process.communicate(timeout=RANK_DEATH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        log, _ = process.communicate()
        raise AssertionError(f"torchrun still running after {RANK_DEATH_TIMEOUT_S} s:\n{log[-5000:]}") from None
    assert process.returncode == 0, log[-5000:]
    return time.monotonic() - start, log


RANK_DEATH_TIMEOUT_S = 300  # each torchrun job; about 40 s each on 2 shared cores


def test_a_rank_that_dies_is_restarted_from_the_last_checkpoint(tmp_path):
    """torchrun --max-restarts 1, 2 gloo ranks, UPipeTrainer (AdamW, 6 steps, a checkpoint every
    2): rank 1 SIGKILLs itself in the middle of step 4 on the first attempt. Rank 0 ends with an
    error within the collective timeout (gloo sees the dead peer's socket close; a peer that hangs
    instead would raise at ``ddp_timeout``), not a hang; torchrun restarts both, the job resumes
    from checkpoint-2, and its losses from step 3 on and its final parameters equal the
    uninterrupted run's."""
    import json

    from hf_rank_death_job import COLLECTIVE_TIMEOUT_S, KILLED_AT

    _torchrun_job(tmp_path / "straight")
    _, log = _torchrun_job(tmp_path / "killed", "--kill")
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    died_at = float((killed / KILLED_AT).read_text())
    survivor = json.loads((killed / "error0_attempt0.json").read_text())
    assert 0 <= survivor["at"] - died_at < COLLECTIVE_TIMEOUT_S, (survivor, died_at)
    assert "exitcode: -9" in log, log[-5000:]  # torchrun saw rank 1 killed, then restarted the group
    reference = [json.loads((straight / f"rank{r}.json").read_text()) for r in range(2)]
    for rank in range(2):
        record = json.loads((killed / f"rank{rank}.json").read_text())
        assert record["attempt"] >= 1 and (record["resumed_from"], record["start_step"]) == ("checkpoint-2", 2), record
        after = [row for row in reference[rank]["rows"] if row["step"] > 2]
        assert [row["step"] for row in record["rows"]] == [row["step"] for row in after] == [3, 4, 5, 6]
        for row, ref in zip(record["rows"], after):
            assert abs(row["loss"] - ref["loss"]) <= jobs.RESUME_TOLERANCE * abs(ref["loss"]), (row, ref)
    params, ref_params = torch.load(killed / "params.pt"), torch.load(straight / "params.pt")
    for name, ref in ref_params.items():
        assert (params[name] - ref).abs().max().item() <= jobs.RESUME_TOLERANCE * ref.abs().max().item(), name


def _refusal(chain, *words):
    names = [name for name, _ in chain]
    message = " ".join(text for _, text in chain)
    assert "UnsupportedAttention" in names or "UnsupportedAttention" in message, chain
    for word in words:
        assert word in message, (word, chain)


def test_uneven_length_is_refused_with_the_fix(rank_pools):
    for chain in rank_pools(WORLD).run(jobs.refused, jobs.run_trainer, True, seq=31):
        _refusal(chain, "not divisible", "pad_to_multiple_of=2")


def test_left_padding_is_refused(rank_pools):
    for chain in rank_pools(WORLD).run(jobs.refused, jobs.run_trainer, True, mask_fn=jobs.left_padded):
        _refusal(chain, "not right padding", "padding_free=True")


def test_a_batch_refused_on_one_replica_stops_every_process(rank_pools):
    """4 processes, P = 2: two data-parallel replicas see different batches; the second's are
    left-padded. Its ranks raise the refusal, the first replica's ranks raise naming them,
    instead of waiting for them in the next collective."""
    chains = rank_pools(4).run(jobs.refused, jobs.run_trainer, True, cp_size=2,
                               mask_fn=jobs.left_padded_on_the_second_replica)
    for chain in chains[2:]:
        _refusal(chain, "not right padding")
    for chain in chains[:2]:
        _refusal(chain, "refused on process(es) [2, 3]")


def test_attention_upipe_cannot_rewrite_is_refused_on_every_rank(rank_pools):
    """attention dropout: refused when the first step compiles, on both ranks."""
    for chain in rank_pools(WORLD).run(jobs.refused, jobs.run_trainer, True, attention_dropout=0.1):
        _refusal(chain, "dropout")


def _row(length=8):
    ids = torch.arange(length)[None]
    return {"input_ids": ids, "labels": ids.clone()}


def test_batch_checks_before_any_collective():
    """upipe_batch refuses on the full sequence, before it shards (no process group here)."""
    mid = _row()
    mid["attention_mask"] = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 1]])
    with pytest.raises(UnsupportedAttention, match="not right padding"):
        upipe_batch(mid, world=2)
    labelled_pad = _row()
    labelled_pad["attention_mask"] = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])
    with pytest.raises(UnsupportedAttention, match="padded positions carry labels"):
        upipe_batch(labelled_pad, world=2)
    with pytest.raises(UnsupportedAttention, match="pad_to_multiple_of=4"):
        upipe_batch(_row(6), world=4)
    with pytest.raises(UnsupportedAttention, match="inputs_embeds"):
        upipe_batch({**_row(), "inputs_embeds": torch.zeros(1, 8, 4)}, world=2)


def test_deepspeed_sp_is_refused():
    """ParallelismConfig(sp_size > 1) is DeepSpeed's Ulysses: refused before training."""
    from types import SimpleNamespace

    from accelerate import ParallelismConfig

    from upipe_compile.integrations.hf_layout import process_layout

    pc = ParallelismConfig(sp_size=2, sp_backend="deepspeed")
    with pytest.raises(UnsupportedAttention, match="sp_size=2.*DeepSpeed"):
        process_layout(SimpleNamespace(parallelism_config=pc), None, 1)


def test_keep_attention_with_gradient_checkpointing_matches_one_process(rank_pools):
    """keep_attention=True with gradient_checkpointing: losses and final weights equal stock
    Trainer's with checkpointing on one process, and the fused attention forward runs fewer
    times than under plain checkpointing (not again in each recompute)."""
    kept = rank_pools(WORLD).run(jobs.run_trainer, True, gradient_checkpointing=True, keep_attention=True)
    plain = rank_pools(WORLD).run(jobs.run_trainer, True, gradient_checkpointing=True)
    ref = jobs.run_trainer(False, gradient_checkpointing=True)
    _compare(kept, ref)
    layers = jobs.build_model().config.num_hidden_layers
    for (*_, kept_counts), (*_, plain_counts) in zip(kept, plain):
        # 4 micro-batches: plain checkpointing runs each layer's attention forward twice
        assert plain_counts["upipe::attention_block"] - kept_counts["upipe::attention_block"] >= 4 * layers, (
            kept_counts, plain_counts)


def test_ring_mesh_splits_accelerates_cp_dimension():
    """ParallelismConfig(cp_size=8) with ring_degree=4: accelerate's "cp" mesh dimension (beside its
    data-parallel one) becomes 4 ring groups of 2 consecutive ranks, as the DDP layout makes them;
    a ring that does not divide P is refused."""
    from torch.distributed.device_mesh import init_device_mesh

    from upipe_compile.errors import UnsupportedAttention
    from upipe_compile.integrations.hf_layout import ring_mesh
    from upipe_compile.measure.memory import fake_process_group

    with fake_process_group(16):
        cp = init_device_mesh("cpu", (2, 8), mesh_dim_names=("dp_shard", "cp"))["cp"]
        assert ring_mesh(cp, 1) is cp
        mesh = ring_mesh(cp, 4)
        assert mesh.mesh_dim_names == ("cp_ring", "cp_a2a")
        assert mesh.mesh.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]  # this process's (rank 0) cp group
        with pytest.raises(UnsupportedAttention, match="ring_degree=3 must be >= 1 and divide"):
            ring_mesh(cp, 3)
