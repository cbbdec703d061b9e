"""A real transformers model under backend="upipe": a tiny LlamaForCausalLM (GQA, RoPE,
random fp32 weights, no downloads) compiled on P gloo ranks, each feeding its contiguous
sequence shard with global position_ids, against the uncompiled model on the full sequence.

See tests/hf_llama_jobs.py for why the model uses a registered attention implementation
(stock sdpa_attention_forward + a mask function returning None) rather than plain "sdpa":
under torch.compile, transformers always hands plain "sdpa" a mask tensor.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.fx as fx  # noqa: E402

from hf_llama_jobs import (  # noqa: E402
    CAUSAL_SDPA, LlamaCase, build_model, compiled_llama_case, eager_reference, make_inputs, refused_llama_case,
)
import hf_llama_jobs as jobs  # noqa: E402
from tests_support import relative_error  # noqa: E402
from upipe_compile.passes import find_attention  # noqa: E402

TOLERANCE = 1e-5

CASES = [
    LlamaCase(world=2, kv_heads=4, heads_per_stage=2),  # U = P
    LlamaCase(world=2, kv_heads=2, heads_per_stage=4),  # U = 2P
    LlamaCase(world=4, kv_heads=2, heads_per_stage=4),  # KV heads replicated to P
    LlamaCase(world=4, kv_heads=4, heads_per_stage=8),  # U = Hq: plain Ulysses
    LlamaCase(world=2, kv_heads=2, heads_per_stage=2, fuse=False),  # SDPA only (upipe::attention)
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"P{c.world}-kv{c.kv_heads}-U{c.heads_per_stage}"
                         + ("" if c.fuse else "-unfused"))
def test_llama_matches_full_sequence_eager(rank_pools, case):
    ranks = rank_pools(case.world).run(compiled_llama_case, case)
    ref_logits, ref_grads = eager_reference(case)

    # The rewrite happened: each layer's attention ran as the upipe op (the whole block
    # fused, or SDPA alone), forward and backward, on every rank, and no SDPA kernel ran
    # outside it.
    op = "upipe::attention_block" if case.fuse else "upipe::attention"
    for rank, (_, _, counts) in enumerate(ranks):
        assert counts == {op: case.layers, f"{op}_backward": case.layers}, (rank, counts)

    logits = torch.cat([r[0] for r in ranks], dim=1)  # rank r holds tokens [r*S/P, (r+1)*S/P)
    assert logits.shape == ref_logits.shape == (case.batch, case.seq, case.vocab)
    assert relative_error(logits, ref_logits) < TOLERANCE

    assert set(ranks[0][1]) == set(ref_grads)
    for name, ref in ref_grads.items():
        grad = sum(r[1][name] for r in ranks)  # each rank's grads cover its own tokens
        assert relative_error(grad, ref) < TOLERANCE, name
        # Not vacuous: attention weights get gradient from every shard's tokens.
        assert ref.norm() > 0, name


def test_padding_mask_is_refused(rank_pools):
    """A padding attention_mask reaches SDPA as attn_mask: refused at compile time, on every
    rank, naming the transformers source line of the SDPA call."""
    case = CASES[0]
    results = rank_pools(case.world).run(refused_llama_case, case, CAUSAL_SDPA, True)
    for result in results:
        assert result["chain"][0] == "BackendCompilerFailed"
        assert "UnsupportedAttention" in result["chain"]
        message = result["message"]
        assert message.startswith(f"upipe cannot run {case.layers} attention call(s)"), message
        assert "sdpa_attention.py:" in message and "scaled_dot_product_attention(" in message
        assert "attn_mask" in message


def test_plain_sdpa_is_refused_under_compile(rank_pools):
    """With attn_implementation="sdpa" and no attention_mask at all, transformers still builds
    a mask tensor under torch.compile: upipe must refuse it rather than run it on shards."""
    case = CASES[0]
    results = rank_pools(case.world).run(refused_llama_case, case, "sdpa", False)
    for result in results:
        assert "UnsupportedAttention" in result["chain"]
        assert "sdpa_attention.py:" in result["message"] and "attn_mask" in result["message"]


def _sdpa_calls(model, **inputs):
    """The SDPA calls Dynamo records for ``model(**inputs)``, as their (normalised) kwargs."""
    calls = []

    def capture(gm: fx.GraphModule, example_inputs):
        for match in find_attention(gm):
            calls.append({
                "attn_mask": None if match.attn_mask is None else "tensor",
                "dropout_p": match.dropout_p, "is_causal": match.is_causal,
                "scale": match.scale, "enable_gqa": match.enable_gqa,
            })
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=capture)(**inputs)
    torch._dynamo.reset()
    return calls


def test_how_transformers_calls_sdpa_under_compile():
    """Single process, no rewrite: the exact SDPA arguments transformers passes while traced."""
    case = CASES[0]
    ids, _ = make_inputs(case)
    inputs = dict(input_ids=ids[:, :case.seq_local], position_ids=torch.arange(case.seq_local).unsqueeze(0) + 16,
                  use_cache=False)
    scale = (case.hidden // case.q_heads) ** -0.5
    causal = _sdpa_calls(build_model(case, CAUSAL_SDPA), **inputs)
    assert causal == [dict(attn_mask=None, dropout_p=0.0, is_causal=True, scale=scale, enable_gqa=True)] * case.layers
    plain = _sdpa_calls(build_model(case, "sdpa"), **inputs)
    assert plain == [dict(attn_mask="tensor", dropout_p=0.0, is_causal=False, scale=scale, enable_gqa=False)] * case.layers


def test_registered_implementation_is_the_same_model():
    """Uncompiled and unsharded, the registered implementation equals stock "sdpa" (so the
    distributed comparison is against transformers' own attention path)."""
    case = CASES[0]
    ids, _ = make_inputs(case)
    with torch.no_grad():
        ours = build_model(case, CAUSAL_SDPA)(input_ids=ids, use_cache=False).logits
        ref = build_model(case, "sdpa")(input_ids=ids, use_cache=False).logits
    assert relative_error(ours, ref) < 1e-6


@pytest.mark.parametrize("attention_mask", [False, True], ids=["no-mask", "all-ones-mask"])
def test_packed_batch_matches_each_document_alone(rank_pools, attention_mask):
    """One padding-free packed row (position_ids restarting per document; a document crossing
    the shard boundary, one of length 1) at P = 2: the compiled model's logits and gradients
    equal running each document alone. Boundaries come from packed_batch (once per step);
    an all-ones attention_mask is accepted."""
    from hf_llama_jobs import packed_llama_case, per_document_reference

    case = LlamaCase(world=2, kv_heads=2, heads_per_stage=4, batch=1)
    lengths = (5, 1, 16, 10)
    ranks = rank_pools(2).run(packed_llama_case, case, lengths, attention_mask)
    ref_logits, ref_grads = per_document_reference(case, lengths)
    assert relative_error(torch.cat([r[0] for r in ranks], dim=1), ref_logits) < TOLERANCE
    for name, grad in ref_grads.items():
        assert relative_error(sum(r[1][name] for r in ranks), grad) < TOLERANCE, name
    for _, _, counts, derived in ranks:
        assert counts == {"upipe::attention_block": case.layers, "upipe::attention_block_backward": case.layers}, \
            counts
        assert derived == (0, 0)  # packed_batch's boundaries: no positions to read


@pytest.mark.parametrize("world,lengths", [(2, (5, 1, 16, 10)), (2, (32,)), (4, (7, 1, 1, 30, 9, 16))],
                         ids=["P2-docs", "P2-one-doc", "P4-docs"])
def test_restarting_position_ids_alone_never_attend_across_documents(rank_pools, world, lengths):
    """A packed row fed as flash_attention_2 users feed it: only this rank's shard of the
    position_ids (restarting per document), no packed_batch, no cu_seq_lens. The compiled
    model equals running each document alone (a document crossing shard boundaries,
    documents of length 1; one document is the plain causal model), and the documents are
    read from the positions once per new positions tensor, never once per layer: not again
    for the same tensor (its backward included, on every torch), again for a new one."""
    from hf_llama_jobs import packed_llama_case, per_document_reference

    case = LlamaCase(world=world, kv_heads=2, heads_per_stage=4, batch=1, seq_local=sum(lengths) // world)
    ranks = rank_pools(world).run(packed_llama_case, case, lengths, False, "position_ids")
    ref_logits, ref_grads = per_document_reference(case, lengths)
    assert relative_error(torch.cat([r[0] for r in ranks], dim=1), ref_logits) < TOLERANCE
    for name, grad in ref_grads.items():
        assert relative_error(sum(r[1][name] for r in ranks), grad) < TOLERANCE, name
    for _, _, counts, derived in ranks:
        assert counts == {"upipe::attention_block": case.layers, "upipe::attention_block_backward": case.layers}, \
            counts
        assert derived == (0, 1)


def test_packed_batch_boundaries_come_from_the_full_sequence():
    from upipe_compile.packed.cu_seqlens import cu_seqlens_from_position_ids

    positions = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3]])
    assert cu_seqlens_from_position_ids(positions).tolist() == [0, 3, 4, 8]
    assert cu_seqlens_from_position_ids(torch.tensor([[5, 6, 0, 1]])).tolist() == [0, 2, 4]


def test_documents_from_positions_rule():
    """A document starts at 0 and wherever a position is not the previous one + 1; rows of a
    batch must agree."""
    from upipe_compile.attention.document_boundaries import bounds_from_positions

    assert bounds_from_positions(torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3]])) == [0, 3, 4, 8]
    assert bounds_from_positions(torch.tensor([[16, 17, 18, 19]])) == [0, 4]  # a shard of one document
    assert bounds_from_positions(torch.tensor([[5, 6, 0, 1], [5, 6, 0, 1]])) == [0, 2, 4]
    with pytest.raises(ValueError, match=r"batch rows \[1\]"):
        bounds_from_positions(torch.tensor([[0, 1, 2, 3], [0, 1, 0, 1]]))


def test_position_ids_refused_on_every_rank(rank_pools):
    """Float position_ids on one rank: every rank raises (no hang, no silent leak)."""
    from hf_llama_jobs import bad_positions_case

    messages = rank_pools(2).run(bad_positions_case)
    assert all("position_ids must be integers" in m or "refused on rank(s) [1]" in m for m in messages), messages
    assert all("refused on rank(s) [1]" in m for m in messages), messages


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "plain"])
def test_uneven_shards_with_position_ids_raise_on_every_rank(rank_pools, fuse):
    """Rank 0 at a length it has run, rank 1 at a new one, position_ids given (the documented
    path): both ranks raise the shape error before any collective sized by a shard runs (no
    gloo abort). The next even step runs where both ranks still run one graph (plain); with
    fused blocks rank 1 recompiled with a dynamic length (plain loop) while rank 0 kept the
    fused block, and the shape check refuses the mismatch on both ranks, never a crash."""
    for rank, outcomes in enumerate(rank_pools(2).run(jobs.uneven_positions_case, fuse)):
        assert outcomes[0] == "ok", (rank, outcomes)
        assert "equal, contiguous shard" in outcomes[1] and "[[1, 16], [1, 20]]" in outcomes[1], (rank, outcomes)
        assert outcomes[2] == "ok" if not fuse else outcomes[2] == "ok" or "equal, contiguous shard" in outcomes[2]


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "plain"])
def test_llama_over_a_ring_by_all_to_all_mesh(rank_pools, fuse):
    """A transformers Llama given the 2 x 2 mesh layout's own positions (zigzag over the ring,
    not monotonic on a rank): one sequence, not packed documents; every rank's gathered
    logits and the summed gradients equal eager on the full sequence."""
    case = LlamaCase(world=4, kv_heads=2, heads_per_stage=2, batch=1, seq_local=8, fuse=fuse)
    ranks = rank_pools(4).run(jobs.mesh_llama_case, case, 2)
    logits, grads = eager_reference(case)
    for rank, (rank_logits, _) in enumerate(ranks):
        assert relative_error(rank_logits, logits) < TOLERANCE, rank
    for name, grad in grads.items():
        assert relative_error(sum(r[1][name] for r in ranks), grad) < TOLERANCE, name


@pytest.mark.parametrize("lengths", [(17, 15), (3, 1, 9, 12, 7)], ids=["two", "five-with-one-token"])
def test_packed_positions_over_a_ring_by_all_to_all_mesh(rank_pools, lengths):
    """Positions restarting per document (packed, fed as flash_attention_2 users feed them) over
    a 2 x 2 mesh: documents crossing the zigzag chunks and the ranks, one of a single token;
    equals each document run alone through the eager model."""
    from hf_llama_jobs import per_document_reference

    case = LlamaCase(world=4, kv_heads=2, heads_per_stage=2, batch=1, seq_local=8)
    ranks = rank_pools(4).run(jobs.mesh_llama_case, case, 2, lengths)
    logits, grads = per_document_reference(case, lengths)
    for rank, result in enumerate(ranks):
        assert not isinstance(result, str), result
        assert relative_error(result[0], logits) < TOLERANCE, rank
    for name, grad in grads.items():
        assert relative_error(sum(r[1][name] for r in ranks), grad) < TOLERANCE, name


def test_llama_over_a_4_by_2_mesh_with_and_without_packed_positions(rank_pools):
    """Four ring ranks of two all-to-all ranks (8 gloo ranks): the layout's positions equal eager
    on the full sequence; restarting positions (one document of a single token, documents
    crossing chunks and ring ranks) equal each document run alone."""
    from hf_llama_jobs import per_document_reference

    case = LlamaCase(world=8, kv_heads=2, heads_per_stage=2, batch=1, seq_local=4)
    pool = rank_pools(8)
    for lengths, (logits, grads) in ((None, eager_reference(case)),
                                     ((5, 1, 14, 12), per_document_reference(case, (5, 1, 14, 12)))):
        ranks = pool.run(jobs.mesh_llama_case, case, 4, lengths)
        for rank, result in enumerate(ranks):
            assert not isinstance(result, str), result
            assert relative_error(result[0], logits) < TOLERANCE, (rank, lengths)
        for name, grad in grads.items():
            assert relative_error(sum(r[1][name] for r in ranks), grad) < TOLERANCE, (name, lengths)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "plain"])
def test_keep_attention_under_gradient_checkpointing(rank_pools, fuse):
    """transformers' gradient checkpointing with upipe's keep_attention context_fn: each
    layer's attention op runs once per step (not again in the recompute), and every rank's
    logits and gradients equal plain checkpointing's (fp32, P = 2)."""
    import keep_attention_jobs

    op = "upipe::attention_block" if fuse else "upipe::attention"
    plain = rank_pools(2).run(keep_attention_jobs.checkpointed_step, False, fuse)
    kept = rank_pools(2).run(keep_attention_jobs.checkpointed_step, True, fuse)
    for (logits, grads, counts), (kept_logits, kept_grads, kept_counts) in zip(plain, kept):
        assert counts[op] == 2 * keep_attention_jobs.LAYERS, counts
        assert kept_counts[op] == keep_attention_jobs.LAYERS, kept_counts
        assert relative_error(kept_logits, logits) < 1e-6
        for name, grad in grads.items():
            assert relative_error(kept_grads[name], grad) < 1e-5, name
