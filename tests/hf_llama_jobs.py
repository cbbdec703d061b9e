"""A tiny transformers Llama under backend="upipe": model, inputs, reference and rank jobs.

Everything here is module-level so that spawned RankPool workers can unpickle the jobs;
importing this module (which unpickling a job does) also registers the attention
implementation below in the worker.

Why ``upipe_compile.integrations.transformers.register()`` instead of "sdpa"
--------------------------------------------------------------------------
With plain ``"sdpa"`` transformers 5.x always builds a local boolean mask under
torch.compile (see that module's docstring), and upipe refuses it
(``test_plain_sdpa_is_refused_under_compile`` pins this down). The registered
implementation gives SDPA ``attn_mask=None, is_causal=True, enable_gqa=True``.

Nothing in the mask path then depends on the local shard's positions: with
``use_cache=False`` there is no cache, hence ``q_offset = 0`` and ``kv_length = S_local``,
but those only feed the mask function, which returns None. RoPE gets the GLOBAL
``position_ids`` the caller passes, so each shard is rotated as in the full sequence.
(transformers 5.x Llama no longer has a ``cache_position`` argument.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tests_support import attention_events, per_document_logits  # noqa: E402
import upipe_compile  # noqa: E402
from upipe_compile.integrations.transformers import register  # noqa: E402

CAUSAL_SDPA = register()


@dataclass(frozen=True)
class LlamaCase:
    world: int
    kv_heads: int
    heads_per_stage: int
    q_heads: int = 8
    hidden: int = 64
    layers: int = 2
    vocab: int = 128
    intermediate: int = 128
    batch: int = 2
    seq_local: int = 16
    seed: int = 0
    fuse: bool = True
    """UPipeOptions.fuse_projections: the whole block as upipe::attention_block, or only SDPA."""

    @property
    def seq(self) -> int:
        return self.seq_local * self.world


def seeded_weights(model: torch.nn.Module, seed: int) -> None:
    """Every weight drawn from a seeded generator (the same on every process), larger than
    HF's init (std 0.02) so that attention is not near-uniform."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * noise)
            elif p.dim() == 2 and "embed_tokens" not in name:
                p.copy_(noise / p.shape[1] ** 0.5)
            else:
                p.copy_(noise)


def build_model(case: LlamaCase, attn_implementation: str) -> LlamaForCausalLM:
    """Random fp32 weights from a seeded generator: identical on every process and for every
    attention implementation. Larger than HF's init (std 0.02) so attention is not near-uniform."""
    config = LlamaConfig(
        vocab_size=case.vocab, hidden_size=case.hidden, num_hidden_layers=case.layers,
        num_attention_heads=case.q_heads, num_key_value_heads=case.kv_heads,
        intermediate_size=case.intermediate, max_position_embeddings=4 * case.seq,
        attention_dropout=0.0, attention_bias=False, tie_word_embeddings=False,
        use_cache=False, attn_implementation=attn_implementation, dtype=torch.float32,
    )
    torch.manual_seed(case.seed)
    model = LlamaForCausalLM(config).float()
    assert model.config._attn_implementation == attn_implementation
    seeded_weights(model, case.seed + 1)
    model.train()  # dropout is 0 anyway; training mode is what context parallelism is for
    return model


def make_inputs(case: LlamaCase):
    """Full-sequence token ids and the weights ``dout`` of the loss sum(logits * dout)."""
    gen = torch.Generator().manual_seed(case.seed + 2)
    ids = torch.randint(0, case.vocab, (case.batch, case.seq), generator=gen)
    dout = torch.randn(case.batch, case.seq, case.vocab, generator=gen)
    return ids, dout


def _grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def eager_reference(case: LlamaCase):
    """Uncompiled, unsharded Llama with transformers' stock "sdpa": (logits, param grads)."""
    model = build_model(case, "sdpa")
    ids, dout = make_inputs(case)
    logits = model(input_ids=ids, use_cache=False).logits
    (logits * dout).sum().backward()
    return logits.detach(), _grads(model)




def compiled_llama_case(case: LlamaCase):
    """This rank's shard through the compiled model, forward and backward of
    sum(logits * dout): (local logits, param grads, counts of attention ops that ran)."""
    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == case.world
    model = build_model(case, CAUSAL_SDPA)
    ids, dout = (upipe_compile.shard_sequence(t, dim=1) for t in make_inputs(case))
    positions = upipe_compile.global_positions(case.seq_local)
    assert positions[0, 0].item() == rank * case.seq_local
    compiled = torch.compile(
        model, backend="upipe",
        options={"heads_per_stage": case.heads_per_stage, "inner_backend": "aot_eager",
                 "fuse_projections": case.fuse},
    )

    def step():
        logits = compiled(input_ids=ids, position_ids=positions, use_cache=False).logits
        (logits * dout).sum().backward()
        return logits.detach()

    step()  # compiles (the profiler would also record the ops traced with fake tensors)
    model.zero_grad(set_to_none=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        logits = step()
    return logits, _grads(model), dict(attention_events(prof))


def refused_llama_case(case: LlamaCase, attn_implementation: str, with_padding: bool):
    """Compile and run a shard that upipe must refuse at compile time (before any collective).
    Returns the exception chain's type names and the UnsupportedAttention message; anything
    else (no error, or a different one) is raised."""
    torch._dynamo.reset()
    model = build_model(case, attn_implementation)
    ids, _ = (upipe_compile.shard_sequence(t, dim=1) for t in make_inputs(case))
    positions = upipe_compile.global_positions(case.seq_local)
    kwargs = {}
    if with_padding:
        mask = torch.ones_like(ids)
        mask[0, 0] = 0  # one padded token on every rank
        kwargs["attention_mask"] = mask
    compiled = torch.compile(
        model, backend="upipe",
        options={"heads_per_stage": case.heads_per_stage, "inner_backend": "aot_eager"},
    )
    try:
        compiled(input_ids=ids, position_ids=positions, use_cache=False, **kwargs)
    except Exception as error:
        chain, seen, current = [], set(), error
        while current is not None and id(current) not in seen:
            seen.add(id(current))
            chain.append(current)
            current = current.__cause__ or current.__context__
        unsupported = [e for e in chain if isinstance(e, upipe_compile.UnsupportedAttention)]
        if not unsupported:
            raise
        return {"chain": [type(e).__name__ for e in chain], "message": str(unsupported[0])}
    raise AssertionError(f"{attn_implementation} with padding={with_padding} compiled and ran without UnsupportedAttention")


def packed_inputs(case: LlamaCase, lengths: tuple[int, ...]):
    """One packed row of documents of ``lengths`` (summing to case.seq): token ids, position
    ids restarting at 0 per document (as DataCollatorWithFlattening makes them), dout."""
    assert sum(lengths) == case.seq
    ids, dout = make_inputs(case)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return ids[:1], positions, dout[:1]


def per_document_reference(case: LlamaCase, lengths: tuple[int, ...]):
    """Each document alone through the uncompiled, unsharded stock "sdpa" model:
    (logits laid end to end, param grads of the summed loss)."""
    model = build_model(case, "sdpa")
    ids, _, dout = packed_inputs(case, lengths)
    return per_document_logits(model, ids, dout, lengths), _grads(model)


def packed_llama_case(case: LlamaCase, lengths: tuple[int, ...], attention_mask: bool = False,
                      via: str = "packed_batch"):
    """This rank's shard of one packed row through the compiled model, with boundaries from
    packed_batch, or (``via="position_ids"``) only this rank's shard of the restarting
    position_ids, as flash_attention_2 users feed packed rows: (local logits, param grads,
    attention op counts of the second step, how often the second step (the same tensors) and
    a third (new tensors of the same values) derived documents from positions)."""
    import upipe_compile.attention.document_boundaries as documents_module
    from upipe_compile.integrations.transformers import packed_batch

    torch._dynamo.reset()
    model = build_model(case, CAUSAL_SDPA)
    ids, positions, dout = packed_inputs(case, lengths)
    extra = {"attention_mask": torch.ones_like(ids)} if attention_mask else {}
    if via == "packed_batch":
        inputs = packed_batch(ids, positions, **extra)
    else:
        inputs = {name: upipe_compile.shard_sequence(t, dim=1)
                  for name, t in dict(input_ids=ids, position_ids=positions, **extra).items()}
    dout = upipe_compile.shard_sequence(dout, dim=1)
    derived = []
    original = documents_module.documents_from_positions

    def counted(*args, **kwargs):
        derived.append(1)
        return original(*args, **kwargs)

    documents_module.documents_from_positions = counted
    compiled = torch.compile(
        model, backend="upipe", options={"heads_per_stage": case.heads_per_stage, "inner_backend": "aot_eager"},
    )

    def step():
        logits = compiled(**inputs, use_cache=False).logits
        (logits * dout).sum().backward()
        return logits.detach()

    step()
    model.zero_grad(set_to_none=True)
    derived.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        logits = step()
    grads, reads = _grads(model), [len(derived)]
    derived.clear()
    clones = {}  # new tensors, the same values (one clone per tensor: cu_seq_lens_k is cu_seq_lens_q): read again
    inputs = {name: clones.setdefault(id(t), t.clone()) for name, t in inputs.items()}
    step()
    reads.append(len(derived))
    documents_module.documents_from_positions = original
    return logits, grads, dict(attention_events(prof)), tuple(reads)


def bad_positions_case():
    """Rank 1 passes float positions to the documents lookup: the error message each rank raises."""
    from upipe_compile.attention.document_boundaries import documents_from_positions

    rank = dist.get_rank()
    positions = torch.arange(8).unsqueeze(0) + 8 * rank
    if rank == 1:
        positions = positions.float()
    try:
        documents_from_positions(positions, 16, dist.group.WORLD, torch.device("cpu"))
    except upipe_compile.UnsupportedAttention as e:
        return str(e)
    raise AssertionError("float position_ids were accepted")


def uneven_positions_case(fuse: bool):
    """A Llama given position_ids, compiled with backend="upipe": step 1 both ranks at 16
    tokens, step 2 rank 0 at its seen length and rank 1 at a new one (20), step 3 even
    again. Per step "ok" or the error this rank raised (never a crash in the collectives)."""
    case = LlamaCase(world=dist.get_world_size(), kv_heads=2, heads_per_stage=2, batch=1, fuse=fuse)
    torch._dynamo.reset()
    model = build_model(case, CAUSAL_SDPA)
    compiled = torch.compile(model, backend="upipe", options={"fuse_projections": fuse, "inner_backend": "eager"})
    outcomes = []
    for lengths in ([16, 16], [16, 20], [16, 16]):
        seq_local = lengths[dist.get_rank()]
        ids = torch.randint(0, case.vocab, (1, seq_local), generator=torch.Generator().manual_seed(seq_local))
        positions = upipe_compile.global_positions(seq_local)
        try:
            compiled(input_ids=ids, position_ids=positions).logits.sum().backward()
            outcomes.append("ok")
        except upipe_compile.UnsupportedAttention as error:
            outcomes.append(str(error))
    return outcomes


def mesh_llama_case(case: LlamaCase, ring: int, lengths: tuple[int, ...] | None = None):
    """The Llama compiled over a ("cp_ring", "cp_a2a") mesh of ``ring`` x world/ring ranks:
    inputs sharded by the mesh's layout (zigzag over the ring), the layout's positions as
    ``position_ids`` (``lengths``: packed documents' positions, restarting at each, instead).
    Returns (full logits, param grads) gathered back in order, or the error."""
    from torch.distributed.device_mesh import init_device_mesh

    from upipe_compile.sharding import gather_sequence, shard_sequence

    torch._dynamo.reset()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ring, world // ring), mesh_dim_names=("cp_ring", "cp_a2a"))
    model = build_model(case, CAUSAL_SDPA)
    ids, dout = (shard_sequence(t, mesh, dim=1) for t in make_inputs(case))
    positions = upipe_compile.global_positions(ids.shape[1], mesh)
    if lengths is not None:
        positions = shard_sequence(torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0), mesh, dim=1)
    compiled = torch.compile(model, backend="upipe",
                             options={"cp_mesh": mesh, "heads_per_stage": case.heads_per_stage,
                                      "inner_backend": "aot_eager", "fuse_projections": case.fuse})
    try:
        logits = compiled(input_ids=ids, position_ids=positions, use_cache=False).logits
    except upipe_compile.UnsupportedAttention as error:
        return str(error)
    (logits * dout).sum().backward()
    return gather_sequence(logits.detach(), mesh, dim=1), _grads(model)
