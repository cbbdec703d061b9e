"""Single-process graph tests of the attention-block fusion pass (find_block ->
head_separable -> BlockMatch.replace) on Dynamo graphs of real models, over a FAKE process group.

For each model: the block is fused into one ``upipe::attention_block`` (or refused with the
node that blocks it), and the rewritten graph, with the op's call replaced by an unfused
reference that runs the extracted head fns with the real head count (projection, head fn,
SDPA, output projection), computes what the original graph computes. The head fns are also
run for a random subset of n < H heads against the original chain's output for those heads.

The fake group's collectives exchange no data, so the real op's numerics are tested on gloo
ranks elsewhere (tests/test_block_loop.py); here the reference stands in for it.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import operator
import weakref

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from upipe_compile import UPipeOptions, apply_upipe_passes
from upipe_compile.block import region as block_region_registry
from upipe_compile.block.region import region_by_id
from upipe_compile.passes import find_attention
from upipe_compile.passes.find_block import ROLES, BlockMatch, NotFusable, find_block
from upipe_compile.passes.block_match import block_region

WORLD = 2
BLOCK = torch.ops.upipe.attention_block.default
PLAIN = torch.ops.upipe.attention.default
REGION_ARG = 11  # upipe::attention_block(x, wq, bq, wk, bk, wv, bv, wo, bo, extras, cu_seqlens, region_id, ...)


# fake_world / world: tests/conftest.py, over this module's WORLD ranks


class Capture:
    """Keeps a copy of each Dynamo graph as traced, runs the upipe passes on the graph
    (fusion on), and runs the ORIGINAL graph (the fake group cannot run the real op)."""

    def __init__(self, **options):
        self.options = UPipeOptions(inner_backend="eager", fuse_projections=True, **options)
        self.originals, self.rewritten, self.inputs = [], [], []

    def __call__(self, gm, example_inputs):
        original = copy.deepcopy(gm)
        self.originals.append(original)
        self.inputs.append(list(example_inputs))
        self.rewritten.append(apply_upipe_passes(gm, self.options))
        return original.forward

    def one(self):
        assert len(self.rewritten) == 1, f"expected one Dynamo graph, got {len(self.rewritten)}"
        return self.originals[0], self.rewritten[0], self.inputs[0]


def modules(gm: fx.GraphModule) -> list[fx.GraphModule]:
    return [m for _, m in gm.named_modules() if isinstance(m, fx.GraphModule)]


def calls(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for m in modules(gm) for n in m.graph.nodes if n.op == "call_function" and n.target is target]


def unfused_block(x, wq, bq, wk, bk, wv, bv, wo, bo, extras, cu_seqlens, region_id, *settings):
    """The op's meaning on one process: each role's head fn with the real head count, and
    attention within the documents when the block has boundaries (cu_seqlens, or position
    ids as transformers models under register() pass them)."""
    from upipe_compile import document_sdpa

    region = region_by_id(region_id)
    q = region.q_fn(F.linear(x, wq, bq), region.q_heads, *extras)
    k = region.k_fn(F.linear(region.projection_input("k", x, extras), wk, bk), region.kv_heads, *extras)
    v = region.v_fn(F.linear(region.projection_input("v", x, extras), wv, bv), region.kv_heads, *extras)
    gqa = region.q_heads != region.kv_heads
    if cu_seqlens is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=region.is_causal, scale=region.scale, enable_gqa=gqa)
    else:
        o = document_sdpa(q, k, v, cu_seqlens, is_causal=region.is_causal, scale=region.scale, enable_gqa=gqa)
    o = o[..., :region.output_dim]
    batch, _, seq, _ = o.shape
    return F.linear(o.transpose(1, 2).reshape(batch, seq, -1), wo, bo), o, None


def run_unfused(rewritten: fx.GraphModule, inputs):
    gm = copy.deepcopy(rewritten)
    for m in modules(gm):
        for n in m.graph.nodes:
            if n.op == "call_function" and n.target is BLOCK:
                n.target = unfused_block
        m.recompile()
    with torch.no_grad():
        return gm(*inputs)


def assert_same_outputs(original, rewritten, inputs):
    with torch.no_grad():
        expected = original(*inputs)
    actual = run_unfused(rewritten, inputs)
    expected = [t for t in expected if isinstance(t, torch.Tensor)]
    actual = [t for t in actual if isinstance(t, torch.Tensor)]
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):  # the same fp32 ops in the same order: bitwise equal
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def assert_fused(capture: Capture, layers: int):
    original, rewritten, inputs = capture.one()
    refusals = [str(b) for b in map(find_block, find_attention(original)) if not isinstance(b, BlockMatch)]
    assert not refusals, refusals
    assert len(calls(rewritten, BLOCK)) == layers
    assert not calls(rewritten, PLAIN)
    assert not calls(rewritten, F.scaled_dot_product_attention)
    assert_same_outputs(original, rewritten, inputs)
    return original, rewritten, inputs


# --- the head fns for n < H heads ---------------------------------------------------------
class Recorder(fx.Interpreter):
    def run_node(self, n):
        value = super().run_node(n)
        self.values[n] = value
        return value


def check_head_subsets(original: fx.GraphModule, inputs, seed=0):
    """For each block in ``original`` (root graph only): fn(F.linear(x, W[rows], b[rows]), n, *extras)
    equals the original chain's output at those heads, for a random n-subset (n < H)."""
    recorder = Recorder(original)
    recorder.values = {}
    with torch.no_grad():
        recorder.run(*inputs)
    values = recorder.values
    gen = torch.Generator().manual_seed(seed)
    checked = 0
    for match in find_attention(original):
        if match.graph_module is not original:
            continue
        block = find_block(match)
        assert isinstance(block, BlockMatch), str(block)
        region = block_region(block)
        x = values[block.x]
        extras = [values[e] for e in block.extras]
        for role in ROLES:
            p = block.projections[role]
            heads = region.heads(role)
            w, b = values[p.weight], None if p.bias is None else values[p.bias]
            if p.rows is not None:
                w, b = w[slice(*p.rows)], None if b is None else b[slice(*p.rows)]
            n = max(1, heads // 2)
            idx = torch.randperm(heads, generator=gen)[:n].sort().values
            per_head = w.shape[0] // heads
            rows = (idx[:, None] * per_head + torch.arange(per_head)).reshape(-1)
            projected = F.linear(region.projection_input(role, x, extras), w[rows], None if b is None else b[rows])
            with torch.no_grad():
                got = region.head_fn(role)(projected, n, *extras)
            expected = values[block.chains[role].output][:, idx]
            # a row subset of the projection is another GEMM: equal up to rounding
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            checked += 1
    assert checked >= 3
    return checked


# --- transformers models --------------------------------------------------------------------
HF = {
    # model type: config changes
    "llama": {},
    "mistral": {},
    "qwen2": {"num_key_value_heads": 1},  # q/k/v biases, one KV head
    "qwen3": {},
    "phi3": {},  # fused qkv_proj
    "olmo2": {},
}


def hf_model(kind: str, checkpointing: bool, layers: int = 1):
    import transformers

    from upipe_compile.integrations.transformers import register

    settings = dict(vocab_size=64, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=64, head_dim=8, use_cache=False, pad_token_id=0,
                    bos_token_id=1, eos_token_id=2, attention_dropout=0.0, attn_implementation=register())
    settings.update(HF[kind])
    config = transformers.AutoConfig.for_model(kind, **settings)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # non-trivial biases and norm weights
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def compile_hf(kind: str, checkpointing: bool) -> Capture:
    model = hf_model(kind, checkpointing)
    capture = Capture()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.compile(model.model, backend=capture, fullgraph=True)(input_ids=ids)
    return capture


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ac"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "phi3"])
def test_hf_block_is_fused(world, kind, checkpointing):
    capture = compile_hf(kind, checkpointing)
    original, rewritten, inputs = assert_fused(capture, layers=1)
    if checkpointing:
        nested = [m for m in modules(rewritten) if m is not rewritten]
        assert any(n.target is BLOCK for m in nested for n in m.graph.nodes), "the block sits in the AC body"
    else:
        check_head_subsets(original, inputs)
    if kind == "phi3":  # three row-ranges of the fused weight go to the op
        op = calls(rewritten, BLOCK)[0]
        slices = [a for a in op.args[1:7:2] if isinstance(a, fx.Node)]
        assert [s.target for s in slices] == [operator.getitem] * 3
        assert [s.args[1] for s in slices] == [slice(0, 32), slice(32, 48), slice(48, 64)]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ac"])
def test_olmo2_is_refused_with_the_blocking_node(world, checkpointing, caplog):
    capture = compile_hf("olmo2", checkpointing)
    original, rewritten, inputs = capture.one()
    assert not calls(rewritten, BLOCK)
    assert len(calls(rewritten, PLAIN)) == 1  # falls back to the plain attention op
    (match,) = find_attention(original)
    refused = find_block(match)
    assert isinstance(refused, NotFusable)
    reason = str(refused)
    # the q_norm over the whole projection: mean over the fused heads x head_dim dim
    assert refused.node.name.startswith("variance") and "reduces over the head axis" in reason, reason
    assert "modeling_olmo2.py" in reason or "olmo2" in reason, reason


def test_backend_logs_each_block(world, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="upipe_compile.passes.pipeline"):
        compile_hf("olmo2", False)
        torch._dynamo.reset()
        compile_hf("llama", False)
    text = caplog.text
    assert "not fused: node variance" in text and "reduces over the head axis" in text, text
    assert "fused attention block at" in text, text


def test_fuse_projections_off_keeps_the_plain_op(world):
    model = hf_model("llama", False)
    capture = Capture()
    capture.options = dataclasses.replace(capture.options, fuse_projections=False)
    torch.compile(model.model, backend=capture, fullgraph=True)(input_ids=torch.randint(0, 64, (2, 16)))
    _, rewritten, _ = capture.one()
    assert not calls(rewritten, BLOCK) and len(calls(rewritten, PLAIN)) == 1


# --- MLA (DeepSeek-V3) ----------------------------------------------------------------------
def deepseek_model(q_lora_rank, checkpointing: bool):
    import transformers

    from upipe_compile.integrations.transformers import register

    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        moe_intermediate_size=32, n_shared_experts=1, use_cache=False, max_position_embeddings=64,
        attn_implementation=register())
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ac"])
@pytest.mark.parametrize("q_lora_rank", [None, 16], ids=["q_proj", "q_lora"])
def test_mla_block_is_fused(world, q_lora_rank, checkpointing):
    """DeepSeek-V3's attention (keys built by slice copies into an empty buffer, k and v from
    one kv_b_proj over the normalised KV latent, a head-shared rotary key part, v padded to
    q/k's head dim by upipe's attention function) becomes one fused op that computes what the
    graph computed; the op's region says how: k and v project an extra, 16 of 24 columns out."""
    capture = Capture()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.compile(deepseek_model(q_lora_rank, checkpointing).model, backend=capture, fullgraph=True)(input_ids=ids)
    original, rewritten, inputs = capture.one()
    (op,) = calls(rewritten, BLOCK)
    assert not calls(rewritten, PLAIN) and not calls(rewritten, torch.ops.upipe.document_sdpa.default)
    assert_same_outputs(original, rewritten, inputs)
    region = region_by_id(op.args[11])
    assert (region.head_dim, region.value_dim, region.q_heads, region.kv_heads) == (24, 16, 4, 4)
    kv_input = region.projection_inputs[1]
    assert kv_input >= 0 and region.projection_inputs == (-1, kv_input, kv_input)
    assert op.args[3] is op.args[5], "k and v read the same kv_b_proj weight"
    if not checkpointing:
        from upipe_compile.passes import concatenate_filled_buffers

        assert concatenate_filled_buffers(original) == 1
        check_head_subsets(original, inputs)


def _dynamo_graph(fn, *args) -> fx.GraphModule:
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=keep, fullgraph=True)(*args)
    (gm,) = graphs
    return gm


def _filled(a, b):
    buf = a.new_empty(2, 3, 5)
    buf[..., :2].copy_(a)
    buf[..., 2:].copy_(b)
    return buf * 2


def _read_before_filled(a, b):
    buf = a.new_empty(2, 3, 5)
    buf[..., :2].copy_(a)
    early = buf[..., :2] + 1
    buf[..., 2:].copy_(b)
    return buf * 2, early


def _partly_filled(a, b):
    buf = a.new_empty(2, 3, 5)
    buf[..., :2].copy_(a)
    buf[..., 3:].copy_(b[..., 1:])
    return buf * 2


def _broadcast_copy(a, b):
    buf = a.new_empty(2, 3, 5)
    buf[..., :2].copy_(a[:1])
    buf[..., 2:].copy_(b)
    return buf * 2


@pytest.mark.parametrize("fn, rewritten", [(_filled, 1), (_read_before_filled, 0), (_partly_filled, 0),
                                           (_broadcast_copy, 0)], ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_buffer_filled_by_slice_copies_becomes_a_cat_only_when_exact(fn, rewritten):
    from upipe_compile.passes import concatenate_filled_buffers

    a, b = torch.randn(2, 3, 2), torch.randn(2, 3, 3)
    gm = _dynamo_graph(fn, a, b)
    assert concatenate_filled_buffers(gm) == rewritten
    news = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "new_empty"]
    assert len(news) == 1 - rewritten
    if rewritten:
        torch.testing.assert_close(gm(a, b)[0], fn(a, b), rtol=0, atol=0)


# --- torchtitan blocks ----------------------------------------------------------------------
def torchtitan_block(name: str, checkpointing: bool):
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec(name)
    args = dataclasses.replace(spec.model_args["debugmodel"], n_layers=1)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    with torch.no_grad():
        model.init_weights()
        for p_name, p in model.named_parameters():
            if "norm" in p_name:
                p.add_(0.1 * torch.randn_like(p))
    rope = model.freqs_cis if hasattr(model, "freqs_cis") else model.rope_cache
    block = model.layers["0"]
    if checkpointing:  # what torchtitan's full AC wraps each block in
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        block = checkpoint_wrapper(block, preserve_rng_state=False)
    return block, rope, args


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ac"])
@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_torchtitan_block_is_fused(world, name, checkpointing):
    block, rope, args = torchtitan_block(name, checkpointing)
    seq = 16
    x = torch.randn(2, seq, args.dim, generator=torch.Generator().manual_seed(2))
    capture = Capture()
    torch.compile(block, backend=capture, fullgraph=True)(x, rope[:seq], None)
    original, rewritten, inputs = assert_fused(capture, layers=1)
    if not checkpointing:
        check_head_subsets(original, inputs)


# --- hand-written blocks: fused-qkv spellings and refusals ----------------------------------
class TinyBlock(torch.nn.Module):
    """A 4-head block whose q/k/v spelling ``variant`` chooses."""

    def __init__(self, variant: str, heads: int = 4, dim: int = 8):
        super().__init__()
        self.variant, self.heads, self.dim = variant, heads, dim
        d = heads * dim
        self.qkv = torch.nn.Linear(d, 3 * d, bias=True)
        self.q, self.k, self.v = (torch.nn.Linear(d, d, bias=False) for _ in range(3))
        self.o = torch.nn.Linear(d, d, bias=True)
        self.per_head = torch.nn.Parameter(torch.randn(heads, 1, 1))

    def heads_of(self, t):
        b, s, _ = t.shape
        return t.view(b, s, self.heads, self.dim).transpose(1, 2)

    def forward(self, x, other):
        v = self.variant
        if v == "chunk":
            q, k, val = self.qkv(x).chunk(3, dim=-1)
        elif v == "split":
            q, k, val = self.qkv(x).split(self.heads * self.dim, dim=-1)
        elif v == "narrow":
            p = self.qkv(x)
            d = self.heads * self.dim
            q, k, val = p.narrow(-1, 0, d), p.narrow(-1, d, d), p.narrow(-1, 2 * d, d)
        else:
            k_input = {"two_inputs": other, "fewer_keys": other[:, ::2]}.get(v, x)
            q, k, val = self.q(x), self.k(k_input), self.v(k_input if v == "fewer_keys" else x)
        q, k, val = self.heads_of(q), self.heads_of(k), self.heads_of(val)
        if v == "per_head_scale":
            q = q * self.per_head
        o = F.scaled_dot_product_attention(q, k, val, is_causal=True)
        y = self.o(o.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))
        if v == "attention_reused":
            y = y + o.sum(dim=(1, 3)).unsqueeze(-1)  # per token: a sum over tokens would be refused
        return y


def compile_tiny(variant: str) -> Capture:
    torch.manual_seed(0)
    block = TinyBlock(variant)
    x, other = torch.randn(2, 16, 32), torch.randn(2, 16, 32)
    capture = Capture()
    torch.compile(block, backend=capture, fullgraph=True)(x, other)
    return capture


class GroupedQKVBlock(torch.nn.Module):
    """q, k, v from one projection laid out per KV group (torchtitan 0.3's FusedQKVLinear):
    each group's 2 query heads, its key and its value, rows in that order."""

    def __init__(self, groups=2, heads_per_group=2, dim=8, d_model=32):
        super().__init__()
        self.groups, self.hpk, self.dim = groups, heads_per_group, dim
        self.wqkv = torch.nn.Linear(d_model, groups * (heads_per_group + 2) * dim)
        self.o = torch.nn.Linear(groups * heads_per_group * dim, d_model)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.wqkv(x).view(b, s, -1, self.hpk + 2, self.dim)
        xq, xk, xv = torch.split(qkv, [self.hpk, 1, 1], dim=-2)
        q, k, v = (t.reshape(b, s, -1, self.dim).transpose(1, 2) for t in (xq, xk, xv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(o.transpose(1, 2).reshape(b, s, -1))


def test_a_projection_laid_out_per_kv_group_is_read_per_role_and_fused(world):
    torch.manual_seed(0)
    capture = Capture()
    torch.compile(GroupedQKVBlock(), backend=capture, fullgraph=True)(torch.randn(2, 16, 32))
    original, rewritten, inputs = capture.one()
    (op,) = calls(rewritten, BLOCK)
    assert not calls(rewritten, PLAIN)
    # the op gets each role's rows of the fused weight: q (2 groups x 2 heads), k, v (2 groups)
    rows = [a for a in op.args[1:7:2]]
    assert [r.target for r in rows] == [torch.index_select] * 3
    tables = [r.args[2].args[0] for r in rows]
    group = lambda start: list(range(start, start + 8))  # noqa: E731  (one head's rows: D = 8)
    assert tables == [group(0) + group(8) + group(32) + group(40),  # q: each group's two heads
                      group(16) + group(48),  # k: each group's key
                      group(24) + group(56)]  # v: each group's value
    assert_same_outputs(original, rewritten, inputs)


class GroupsFirstQKV(GroupedQKVBlock):
    """The same projection read with its groups moved before the sequence: not a per-token
    reading of rows, so it is left as it is."""

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.wqkv(x).view(b, s, -1, self.hpk + 2, self.dim).transpose(1, 2)  # [b, G, s, r, D]
        xq, xk, xv = torch.split(qkv, [self.hpk, 1, 1], dim=-2)
        q, k, v = (t.transpose(1, 2).reshape(b, s, -1, self.dim).transpose(1, 2) for t in (xq, xk, xv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(o.transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("block, rewritten", [(GroupedQKVBlock, 1), (GroupsFirstQKV, 0)], ids=["per-token", "groups-first"])
def test_only_a_per_token_reading_of_grouped_rows_is_rewritten(block, rewritten):
    from upipe_compile.passes import split_grouped_projections

    torch.manual_seed(0)
    module, x = block(), torch.randn(2, 16, 32)
    graphs = []
    torch._dynamo.reset()
    torch.compile(module, backend=lambda gm, inputs: graphs.append((gm, inputs)) or gm.forward, fullgraph=True)(x)
    ((gm, inputs),) = graphs
    assert split_grouped_projections(gm) == rewritten
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs)[0], module(x), rtol=1e-6, atol=1e-6)


def test_k_may_project_another_input_of_the_same_tokens(world):
    """k from a second per-token input (as MLA's k and v from the KV latent): the op takes it
    as an extra and projects it for k."""
    original, rewritten, inputs = assert_fused(compile_tiny("two_inputs"), layers=1)
    region = region_by_id(calls(rewritten, BLOCK)[0].args[11])
    assert region.projection_inputs[0] == region.projection_inputs[2] == -1 and region.projection_inputs[1] >= 0
    check_head_subsets(original, inputs)


def test_a_projection_of_other_tokens_is_not_fused():
    """k and v over fewer tokens than x (cross-attention, which the backend refuses as a whole)
    are never taken for a second input of the same tokens."""
    torch.manual_seed(0)
    gm = _dynamo_graph(TinyBlock("fewer_keys"), torch.randn(2, 16, 32), torch.randn(2, 16, 32))
    (refused,) = [find_block(m) for m in find_attention(gm)]
    assert isinstance(refused, NotFusable) and refused.node.name == "k", str(refused)
    assert "whose tokens are not the block input x's" in str(refused), str(refused)


@pytest.mark.parametrize("variant", ["chunk", "split", "narrow"])
def test_fused_qkv_spellings_are_row_ranges(world, variant):
    original, rewritten, inputs = assert_fused(compile_tiny(variant), layers=1)
    op = calls(rewritten, BLOCK)[0]
    weights, biases = op.args[1:7:2], op.args[2:7:2]
    assert [w.args[1] for w in weights] == [slice(0, 32), slice(32, 64), slice(64, 96)]
    assert [b.args[1] for b in biases] == [slice(0, 32), slice(32, 64), slice(64, 96)]
    check_head_subsets(original, inputs)


@pytest.mark.parametrize("variant, node, why", [
    ("per_head_scale", "q_2", "per_head_ (computed outside the chain, shape [4, 1, 1]) is not 1 at the head axis"),
    ("attention_reused", "o", "the attention output is used by 2 nodes"),
])
def test_refusals_name_the_node(world, variant, node, why):
    capture = compile_tiny(variant)
    original, rewritten, _ = capture.one()
    assert not calls(rewritten, BLOCK) and len(calls(rewritten, PLAIN)) == 1
    (refused,) = [find_block(m) for m in find_attention(original)]
    assert isinstance(refused, NotFusable) and refused.node.name == node and why in str(refused), str(refused)
    assert "test_fuse_graph.py" in str(refused)  # the source line


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ac"])
def test_torchtitan_document_block_is_fused_with_its_boundaries(world, checkpointing):
    """The varlen flavor (upipe::document_sdpa, whose (out, lse) result leaves an unused lse
    item in checkpoint bodies): fused, and the op gets the boundaries. Numerics: the
    documents test in tests/test_torchtitan.py, on gloo ranks."""
    from torchtitan.models.attention import VarlenMetadata
    from torchtitan.protocols.train_spec import get_train_spec

    from upipe_compile.integrations.torchtitan.release_022.document_attention import use_document_attention

    spec = get_train_spec("llama3")
    args = dataclasses.replace(spec.model_args["debugmodel_varlen_attn"], n_layers=1)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    assert use_document_attention(model) == 1
    block = model.layers["0"]
    if checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        block = checkpoint_wrapper(block, preserve_rng_state=False)
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    capture = Capture()
    torch.compile(block, backend=capture, fullgraph=True)(torch.randn(1, 16, args.dim), model.freqs_cis[:16],
                                                          VarlenMetadata(cu, cu, 16, 16))
    _, rewritten, _ = capture.one()
    (op,) = calls(rewritten, BLOCK)
    assert not calls(rewritten, PLAIN) and not calls(rewritten, torch.ops.upipe.document_sdpa.default)
    cu_seqlens = op.args[10]
    assert isinstance(cu_seqlens, fx.Node) and tuple(example_shape(cu_seqlens)) == (3,)


def example_shape(node):
    return tuple(node.meta.get("example_value", node.meta.get("val")).shape)


# --- the region registry ----------------------------------------------------------------------
def test_a_fused_region_lives_as_long_as_its_compiled_graph(world):
    """The op finds its block's region (the extracted head fns) by id. The registry holds a
    region while the compiled graph that calls the op can run, and lets it go with that
    graph: recompiles leave nothing behind."""
    torch.manual_seed(0)
    x = torch.randn(2, 16, 32, requires_grad=True)
    registered_before = set(block_region_registry._REGIONS.keys())
    compiled = torch.compile(TinyBlock("chunk"), backend="upipe", fullgraph=True,
                             options={"cp_mesh": world, "inner_backend": "aot_eager"})
    compiled(x, x).sum().backward()
    (region_id,) = set(block_region_registry._REGIONS.keys()) - registered_before
    region = weakref.ref(region_by_id(region_id))

    gc.collect()
    assert region() is not None  # the compiled graph still runs, forward and backward
    compiled(x, x).sum().backward()

    del compiled
    torch._dynamo.reset()
    gc.collect()
    assert region() is None
    with pytest.raises(RuntimeError, match="not registered"):
        region_by_id(region_id)


# --- no state a compile inherits from what ran before ----------------------------------------
def graph_shape(gm: fx.GraphModule) -> list:
    """What a rewrite decided, module by module: each node's op, target and the shapes it carries.
    A block's region id (a counter, one per registered region) is left out: it names the
    region, it decides nothing."""
    def args(n):
        values = ["region" if n.target is BLOCK and i == REGION_ARG else a for i, a in enumerate(n.args)]
        return [fx.node.map_arg(a, lambda node: node.name) for a in values] + \
            [(k, fx.node.map_arg(v, lambda node: node.name)) for k, v in n.kwargs.items()]
    return [[(n.op, str(n.target), args(n), tuple(getattr(n.meta.get("val"), "shape", ())))
             for n in m.graph.nodes] for m in modules(gm)]


def test_a_model_compiles_the_same_after_another_model(world):
    """The same model compiled twice in one process after a different one (another family, a
    refused block, another shape) gives the same rewritten graph as when it is compiled first."""
    def rewritten(kind, length):
        torch._dynamo.reset()
        capture = Capture()
        ids = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(1))
        torch.compile(hf_model(kind, False).model, backend=capture, fullgraph=True)(input_ids=ids)
        return graph_shape(capture.one()[1])

    first = rewritten("llama", 16)
    rewritten("olmo2", 24)  # its block is refused: the plain op instead
    rewritten("qwen3", 8)
    assert rewritten("llama", 16) == first
    assert rewritten("llama", 16) == first
    assert rewritten("llama", 8) != first  # the comparison sees what differs
