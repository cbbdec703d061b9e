"""The long-context stack in UPipeTrainer (upipe_compile.integrations.hf_stack) on 2 gloo
ranks against the stock transformers Trainer on one process: every logged loss and every final
parameter within 1e-5 (fp32), gradient accumulation 2, for each piece alone and all together
(tiny Llama, Qwen3, Mistral, Mixtral and Qwen3-Next at their shipped configs; 2 and 4 ranks), plus what shows each piece is on and what is
refused. See tests/hf_stack_jobs.py."""

from __future__ import annotations

import copy
import os
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import hf_stack_jobs as jobs  # noqa: E402
from upipe_compile.errors import UnsupportedAttention  # noqa: E402
from upipe_compile.integrations import hf_stack  # noqa: E402

TOLERANCE = 1e-5
WORLD = 2
LAYERS = 2
MICRO_BATCHES = jobs.SAMPLES // 2  # rows of 2
CHUNK = TILE = 16
ALL = dict(loss_chunk_tokens=CHUNK, mlp_tile_tokens=TILE, offload_block_inputs=True, host_memory_reserve_gib=0)
NO_TILES = dict(loss_chunk_tokens=CHUNK, offload_block_inputs=True, host_memory_reserve_gib=0)  # MoE MLPs

RUNS = {  # name: (family, gradient checkpointing, UPipeTrainer's stack keywords, ranks)
    "loss": ("llama", False, dict(loss_chunk_tokens=CHUNK), WORLD),
    "mlp": ("llama", False, dict(mlp_tile_tokens=TILE), WORLD),
    # the default host reserve, scaled to this machine (a quarter of it, not 64 GiB)
    "offload": ("llama", True, dict(offload_block_inputs=True), WORLD),
    "all llama": ("llama", True, {**ALL, "keep_attention": True}, WORLD),
    "all qwen3": ("qwen3", True, ALL, WORLD),
    "all llama, 4 ranks": ("llama", True, {**ALL, "keep_attention": True}, 4),
    "all mistral": ("mistral", True, ALL, WORLD),  # sliding window
    "all mixtral": ("mixtral", True, NO_TILES, WORLD),  # MoE, sliding window
    "all qwen3_next": ("qwen3_next", True, NO_TILES, WORLD),  # hybrid (Gated DeltaNet), MoE
}
ATTENTION_LAYERS = {"qwen3_next": 1}  # its other layer is Gated DeltaNet
_done: dict = {}


def seq_len(world: int) -> int:
    """Rows that give every rank 2 x SEQ tokens: more than any family's hidden size here, so that a
    [tokens, vocab] tensor tells the local tokens from the head's weight."""
    return jobs.SEQ * world


def local_tokens(world: int) -> int:
    return 2 * seq_len(world) // world  # tokens a rank holds in a micro-batch (2 rows)


def _run(rank_pools, name):
    """(each rank's losses, params, evidence; the stock trainer's losses, params), once per session."""
    if name not in _done:
        family, checkpointing, stack, world = RUNS[name]
        ranks = rank_pools(world).run(jobs.run, True, family, checkpointing, seq=seq_len(world), **stack)
        reference = (family, checkpointing, world)
        if reference not in _done:
            _done[reference] = jobs.run(False, family, checkpointing, seq=seq_len(world))
        _done[name] = ranks, _done[reference]
    return _done[name]


def _assert_equal(ranks, ref, family):
    ref_losses, ref_params = ref
    assert len(ref_losses) == MICRO_BATCHES // 2  # optimizer steps of 2 accumulated micro-batches
    start = dict(jobs.build_model(family).named_parameters())
    for rank, (losses, params, _) in enumerate(ranks):
        assert len(losses) == len(ref_losses), (rank, losses, ref_losses)
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOLERANCE, (rank, losses, ref_losses)
        assert set(params) == set(ref_params)  # the swapped modules keep every parameter's name
        diff = max((params[k] - ref_params[k]).abs().max().item() for k in params)
        assert diff <= TOLERANCE, (rank, diff)
    assert max((ref_params[k] - start[k]).abs().max().item() for k in ref_params) > 1e-2  # training moved them


def _assert_logits_chunked(evidence, on: bool, world: int = WORLD):
    # The profiler sees every op's input shapes: with the chunked loss no [tokens, vocab] tensor
    # has more rows than the head's transposed weight (hidden size), never the local tokens.
    local = local_tokens(world)
    assert (evidence["logit_rows"] < local) if on else (evidence["logit_rows"] == local), evidence


def _assert_mlp_tiled(evidence, on: bool, world: int = WORLD):
    local = local_tokens(world)
    if on:
        assert evidence["mlp_rows"] < local, evidence  # down_proj's weight [hidden, intermediate] at most
        assert evidence["ops"].get("upipe::tiled_swiglu", 0) >= LAYERS * MICRO_BATCHES, evidence
    else:
        assert evidence["mlp_rows"] == local and not evidence["tiled_calls"], evidence


def _assert_offloaded(evidence, on: bool, world: int = WORLD, hidden: int = jobs.HIDDEN):
    if not on:
        assert evidence["host"] is None, evidence
        return
    # each layer's checkpointed input went to its own host buffer, exactly its size
    local = local_tokens(world)
    assert evidence["host"]["offloaded"] == LAYERS, evidence
    assert evidence["host"]["bytes"] == LAYERS * local * hidden * 4, evidence
    assert evidence["host"]["buffers"] == [("cpu", (2, local // 2, hidden))] * LAYERS, evidence


def _assert_upipe_attention(evidence, layers: int = LAYERS, mixers: int = 0):
    """Every attention layer ran as a fused block (or, where the block cannot be fused, Qwen3-Next's
    gated attention, the stage loop), forward and backward; and ``mixers`` mixer layers as stage
    loops; no plain SDPA on a shard."""
    ops = evidence["ops"]
    assert "plain sdpa outside upipe" not in ops, evidence
    for suffix in ("", "_backward"):
        ran = ops.get(f"upipe::attention_block{suffix}", 0) + ops.get(f"upipe::attention{suffix}", 0)
        assert ran >= layers * MICRO_BATCHES, evidence
        assert ops.get(f"upipe::head_mixer_loop{suffix}", 0) >= mixers * MICRO_BATCHES, evidence


@pytest.mark.parametrize("piece", ["loss", "mlp", "offload"])
def test_each_piece_trains_exactly_and_only_it_is_on(rank_pools, piece):
    """One piece on: the stock trainer's numbers; that piece shows, the others' full-size tensors
    still show (so each check below can see a piece that is off)."""
    ranks, ref = _run(rank_pools, piece)
    _assert_equal(ranks, ref, "llama")
    for *_, evidence in ranks:
        _assert_logits_chunked(evidence, piece == "loss")
        _assert_mlp_tiled(evidence, piece == "mlp")
        _assert_offloaded(evidence, piece == "offload")
        _assert_upipe_attention(evidence)


@pytest.mark.parametrize("name", [name for name in RUNS if name.startswith("all")])
def test_whole_stack_trains_exactly(rank_pools, name):
    """All pieces the family's shape allows, together (Llama with keep_attention too, also on 4
    ranks; Qwen3 with QK-norm; Mistral's sliding window; Mixtral's and Qwen3-Next's MoE MLPs are
    not tiled): the stock trainer's numbers with gradient checkpointing, and every piece on."""
    family, _, stack, world = RUNS[name]
    ranks, ref = _run(rank_pools, name)
    _assert_equal(ranks, ref, family)
    hidden = jobs.build_model(family).config.hidden_size
    for *_, evidence in ranks:
        _assert_logits_chunked(evidence, True, world)
        if stack.get("mlp_tile_tokens"):
            _assert_mlp_tiled(evidence, True, world)
        _assert_offloaded(evidence, True, world, hidden)
        attention = ATTENTION_LAYERS.get(family, LAYERS)
        _assert_upipe_attention(evidence, attention, mixers=LAYERS - attention)


def test_keep_attention_composes_with_offload(rank_pools):
    """With keep_attention beside offload the recompute skips attention: its fused forward runs once
    less per layer and micro-batch than under offload with plain checkpointing."""
    kept = _run(rank_pools, "all llama")[0]
    plain = _run(rank_pools, "offload")[0]
    for (*_, k), (*_, p) in zip(kept, plain):
        assert p["ops"]["upipe::attention_block"] - k["ops"]["upipe::attention_block"] >= LAYERS * MICRO_BATCHES, (
            k["ops"], p["ops"])


@pytest.mark.parametrize("family,world", [("llama", WORLD), ("mistral", 4)])
def test_sft_trainer_with_tiled_mlp_and_offload_trains_exactly(rank_pools, family, world):
    """UPipeSFTTrainer, padding-free packed rows (TRL's default checkpointing, its own chunked
    LM head): tiled MLP and offload on, TRL's SFTTrainer's numbers on one process; Llama on 2
    ranks, Mistral's sliding window on 4."""
    ranks = rank_pools(world).run(jobs.run_sft, True, family, mlp_tile_tokens=TILE, offload_block_inputs=True,
                                  host_memory_reserve_gib=0)
    ref_losses, ref_params = jobs.run_sft(False, family)
    assert len(ref_losses) >= 2
    for losses, params, evidence in ranks:
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOLERANCE, (losses, ref_losses)
        assert max((params[k] - ref_params[k]).abs().max().item() for k in params) <= TOLERANCE
        assert evidence["ops"].get("upipe::tiled_swiglu", 0) >= LAYERS * 2 * len(ref_losses), evidence
        assert evidence["host"]["offloaded"] == LAYERS, evidence
        assert all(device == "cpu" for device, _ in evidence["host"]["buffers"]), evidence
        _assert_upipe_attention(evidence)


def _chain_text(chain):
    names = [name for name, _ in chain]
    assert "UnsupportedAttention" in names, chain
    return " ".join(text for _, text in chain)


def test_trainer_refusals_before_training(rank_pools):
    """Offload without gradient checkpointing, host memory the node lacks (refused at the first
    batch, before any collective), a negative tile: refused on every rank, naming the fix."""
    expected = {"offload without checkpointing": ["gradient_checkpointing=True"],
                "host memory": ["offloading block inputs needs", "host_memory_reserve_gib=1e+09, as set"],
                "bad tile": ["mlp_tile_tokens=-4", "whole number"]}
    for rank in rank_pools(WORLD).run(jobs.refusals):
        assert [case for case, _ in rank] == list(expected)
        for case, chain in rank:
            text = _chain_text(chain)
            for word in expected[case]:
                assert word in text, (case, word, text)


# --- refusals of the model's shape, in this process (no ranks) ------------------------------------
def _tiny(cls_name, config_name, **extra):
    import transformers as tf

    sizes = dict(vocab_size=jobs.VOCAB, hidden_size=jobs.HIDDEN, intermediate_size=jobs.INTERMEDIATE,
                 num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        return getattr(tf, cls_name)(getattr(tf, config_name)(**{**sizes, **extra}))


def _problems(model, **settings):
    args = SimpleNamespace(activation_checkpointing=settings.pop("checkpointing", True),
                           activation_checkpointing_kwargs=settings.pop("checkpointing_kwargs", None))
    return " ".join(hf_stack.stack_problems(model, hf_stack.StackSettings(**settings), args))


def test_mlps_that_are_not_silu_gated_are_refused():
    assert _problems(_tiny("LlamaForCausalLM", "LlamaConfig"), mlp_tile_tokens=8) == ""
    assert _problems(_tiny("Qwen3ForCausalLM", "Qwen3Config"), mlp_tile_tokens=8) == ""
    assert "PhiMLP is not a SiLU-gated MLP" in _problems(_tiny("PhiForCausalLM", "PhiConfig"), mlp_tile_tokens=8)
    assert "act_fn is GELUActivation, not SiLU" in _problems(
        _tiny("LlamaForCausalLM", "LlamaConfig", hidden_act="gelu"), mlp_tile_tokens=8)
    assert "bias-free" in _problems(_tiny("LlamaForCausalLM", "LlamaConfig", mlp_bias=True), mlp_tile_tokens=8)
    moe = _problems(_tiny("MixtralForCausalLM", "MixtralConfig", num_local_experts=2), mlp_tile_tokens=8)
    assert "MixtralSparseMoeBlock is a mixture-of-experts block" in moe, moe


def test_heads_the_chunked_loss_cannot_reproduce_are_refused():
    assert _problems(_tiny("LlamaForCausalLM", "LlamaConfig"), loss_chunk_tokens=8) == ""
    assert _problems(_tiny("Qwen3ForCausalLM", "Qwen3Config"), loss_chunk_tokens=8) == ""
    assert "lm_head has a bias" in _problems(_tiny("PhiForCausalLM", "PhiConfig"), loss_chunk_tokens=8)
    assert "final_logit_softcapping=30" in _problems(_tiny("Gemma2ForCausalLM", "Gemma2Config", head_dim=8),
                                                     loss_chunk_tokens=8)
    assert "logit_scale" in _problems(_tiny("CohereForCausalLM", "CohereConfig"), loss_chunk_tokens=8)
    # a MoE's forward (Mixtral's: the router's loss added to the model's) is taken; another is not
    assert _problems(_tiny("MixtralForCausalLM", "MixtralConfig", num_local_experts=2), loss_chunk_tokens=8) == ""
    assert "is neither LlamaForCausalLM's nor MixtralForCausalLM's" in _problems(
        _tiny("Gemma3ForCausalLM", "Gemma3TextConfig", head_dim=8), loss_chunk_tokens=8)


def test_offload_needs_non_reentrant_checkpointing():
    llama = _tiny("LlamaForCausalLM", "LlamaConfig")
    assert "gradient_checkpointing=True" in _problems(llama, offload_block_inputs=True, checkpointing=False)
    assert "use_reentrant" in _problems(llama, offload_block_inputs=True,
                                        checkpointing_kwargs={"use_reentrant": True})
    assert _problems(llama, offload_block_inputs=True) == ""


def test_sft_trainer_refuses_the_chunked_loss_it_already_has():
    from upipe_compile.integrations.hf_trainer import UPipeSFTTrainer

    with pytest.raises(UnsupportedAttention, match="fused LM head"):
        UPipeSFTTrainer(loss_chunk_tokens=8)


@pytest.mark.parametrize("family,tied", [("llama", True), ("qwen3", False)])
def test_chunked_loss_is_the_models_own_loss(family, tied):
    """Swapped in place on one process (tied head too; no num_items_in_batch: the mean): the
    model's loss and every gradient as before, and evaluation gets ordinary logits."""
    model = jobs.build_model(family, tie_word_embeddings=tied)
    chunked = copy.deepcopy(model)
    hf_stack.apply_stack(chunked, hf_stack.StackSettings(loss_chunk_tokens=5), SimpleNamespace())
    assert (chunked.lm_head.weight is chunked.model.embed_tokens.weight) == tied
    ids = torch.randint(0, jobs.VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :4] = -100
    losses = []
    for m in (model, chunked):
        m.train()
        loss = m(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        losses.append(loss)
    assert abs(losses[0].item() - losses[1].item()) <= 1e-6
    grads = dict(chunked.named_parameters())
    for name, p in model.named_parameters():
        assert (p.grad - grads[name].grad).abs().max().item() <= 1e-6, name
    chunked.eval()
    with torch.no_grad():
        assert torch.allclose(chunked(input_ids=ids).logits, model.eval()(input_ids=ids).logits)
