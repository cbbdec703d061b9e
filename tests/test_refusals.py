"""Attention upipe does not rewrite is refused at compile time, never run on the local shard.

FlexAttention and hand-written attention (softmax over the product of two activations,
times a third) would each attend over this rank's shard of the sequence only: a silent wrong
answer. The backend raises UnsupportedAttention naming each call's source line and the fix.
A softmax that is not attention (an MoE router, a loss) and plain SDPA are left alone.

Single process on a FAKE process group of P=2 ranks (no real ranks): a refusal happens
before anything runs, and a call that is accepted runs the real op over the fake group.
"""

from __future__ import annotations

import inspect
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.exc import BackendCompilerFailed
from torch.utils.checkpoint import checkpoint

from upipe_compile import UnsupportedAttention, UPipeOptions, apply_upipe_passes
from upipe_compile.passes import find_unsupported_attention

WORLD = 2
THIS_FILE = os.path.basename(__file__)
HAND_WRITTEN_FIX = "call torch.nn.functional.scaled_dot_product_attention (upipe rewrites it)"
FLEX_FIX = ("use scaled_dot_product_attention (or register() for transformers models); "
            "FlexAttention is not supported under upipe")
TRANSFORMERS_FIX = "load the model with attn_implementation=upipe_compile.integrations.transformers.register()"
UPIPE_ATTENTION = torch.ops.upipe.attention.default


# --- fixtures and helpers ---------------------------------------------------------------
# fake_world / world: tests/conftest.py, over this module's WORLD ranks


def refusal(fn, *args, group) -> str:
    """Compile ``fn`` with backend="upipe", call it once, and return the UnsupportedAttention
    message (torch.compile wraps it in BackendCompilerFailed)."""
    compiled = torch.compile(fn, backend="upipe", options={"cp_mesh": group, "inner_backend": "eager"})
    with pytest.raises(BackendCompilerFailed) as info:
        compiled(*args)
    inner = info.value.inner_exception
    assert type(inner) is UnsupportedAttention, repr(inner)
    return str(inner)


class Capture:
    """A backend that runs the upipe passes (P=WORLD), records the graphs, and runs them eagerly."""

    def __init__(self, group):
        self.options = UPipeOptions(cp_mesh=group, inner_backend="eager")
        self.graphs: list[fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(apply_upipe_passes(gm, self.options))
        return gm.forward


def accepted(fn, *args, group) -> list[fx.GraphModule]:
    """Compile and run ``fn`` under the upipe passes (no refusal); the rewritten graphs."""
    backend = Capture(group)
    torch.compile(fn, backend=backend)(*args)
    assert backend.graphs
    return backend.graphs


def softmax_line(fn) -> str:
    """``file:line in function: code`` of the one softmax call in ``fn``'s source."""
    lines, start = inspect.getsourcelines(fn)
    hits = [(start + i, line.strip()) for i, line in enumerate(lines) if "softmax(" in line]
    assert len(hits) == 1, hits
    line, code = hits[0]
    return f"{THIS_FILE}:{line} in {fn.__name__}: {code}"


def rand(*shape):
    return torch.randn(*shape)


B, H, S, D = 1, 4, 16, 8  # S is the local shard's length


# --- 1. hand-written attention, every spelling -------------------------------------------
def matmul_attention(q, k, v, mask):
    """transformers' eager_attention_forward."""
    attn_weights = torch.matmul(q, k.transpose(2, 3)) * D**-0.5
    attn_weights = attn_weights + mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
    attn_weights = F.dropout(attn_weights, p=0.1, training=True)
    return torch.matmul(attn_weights, v)


def einsum_attention(q, k, v):
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(D)
    return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(dim=-1), v)


def bmm_attention(q, k, v):
    """GPT-2 style: baddbmm into a preallocated buffer, heads flattened into the batch."""
    q, k, v = (x.reshape(B * H, S, D) for x in (q, k, v))
    scores = torch.baddbmm(torch.empty(B * H, S, S), q, k.transpose(1, 2), beta=0, alpha=D**-0.5)
    probs = torch.softmax(scores.view(B, H, S, S), dim=-1).type(v.dtype)
    return torch.bmm(probs.view(B * H, S, S), v).view(B, H, S, D)


def operator_attention(q, k, v):
    return (q @ k.transpose(-2, -1)).softmax(-1) @ v


class SinkAttention(torch.nn.Module):
    """GPT-OSS's eager attention: a learned sink column joins the softmax, then is sliced off."""

    def __init__(self):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.zeros(H))

    def forward(self, q, k, v):
        attn_weights = torch.matmul(q, k.transpose(2, 3)) * D**-0.5
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
        combined = torch.cat([attn_weights, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1, dtype=combined.dtype)
        scores = probs[..., :-1]
        attn_weights = torch.nn.functional.dropout(scores, p=0.0, training=False)
        return torch.matmul(attn_weights, v)


def softcap_attention(q, k, v):
    """Gemma 2: scores soft-capped with tanh before the softmax."""
    attn_weights = torch.matmul(q, k.transpose(2, 3)) * D**-0.5
    attn_weights = attn_weights / 50.0
    attn_weights = torch.tanh(attn_weights)
    attn_weights = attn_weights * 50.0
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(attn_weights, v)


def checkpointed_attention(q, k, v):
    return checkpoint(softcap_attention, q, k, v, use_reentrant=False)


MASK = torch.zeros(S, S).masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
HAND_WRITTEN = {
    "matmul, scale, mask, float32 softmax, .to, dropout": (matmul_attention, matmul_attention, (MASK,)),
    "einsum": (einsum_attention, einsum_attention, ()),
    "baddbmm / bmm": (bmm_attention, bmm_attention, ()),
    "@ and Tensor.softmax": (operator_attention, operator_attention, ()),
    "GPT-OSS sink column": (SinkAttention(), SinkAttention.forward, ()),
    "Gemma 2 softcap": (softcap_attention, softcap_attention, ()),
    "inside torch.utils.checkpoint": (checkpointed_attention, softcap_attention, ()),
}


@pytest.mark.parametrize("case", list(HAND_WRITTEN))
def test_hand_written_attention_refused(world, case):
    fn, source, extra = HAND_WRITTEN[case]
    q, k, v = rand(B, H, S, D).requires_grad_(), rand(B, H, S, D), rand(B, H, S, D)
    message = refusal(fn, q, k, v, *extra, group=world)
    assert f"cannot run 1 attention call(s) with context parallelism over P={WORLD} ranks" in message
    assert softmax_line(source) in message
    assert "hand-written attention is not rewritten by upipe" in message
    assert HAND_WRITTEN_FIX in message


def test_every_call_in_one_error_with_sdpa_problems(world):
    """Hand-written attention twice and an SDPA with a mask: one error lists all three."""

    def model(q, mask):
        a = operator_attention(q, q, q)
        b = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        return softcap_attention(a, b, q)

    message = refusal(model, rand(B, H, S, D), torch.ones(S, S, dtype=torch.bool), group=world)
    assert "cannot run 3 attention call(s)" in message
    assert softmax_line(operator_attention) in message and softmax_line(softcap_attention) in message
    assert "attn_mask" in message
    assert message.count(HAND_WRITTEN_FIX) == 2


def test_single_rank_not_refused(world):
    """With P = 1 nothing is sharded: the graph is left as it is, hand-written attention included."""
    one = dist.new_group(ranks=[0])
    out = torch.compile(matmul_attention, backend="upipe", options={"cp_mesh": one, "inner_backend": "eager"})(
        rand(B, H, S, D), rand(B, H, S, D), rand(B, H, S, D), MASK)
    assert out.shape == (B, H, S, D)


# Every combination of the spellings, as the pass sees them (Dynamo graphs, no error raised).
SCORES = {
    "matmul": lambda q, k: torch.matmul(q, k.transpose(2, 3)),
    "@": lambda q, k: q @ k.transpose(-1, -2),
    "Tensor.matmul": lambda q, k: q.matmul(k.transpose(-1, -2)),
    "einsum": lambda q, k: torch.einsum("bhqd,bhkd->bhqk", q, k),
    "bmm": lambda q, k: torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2)).view(B, H, S, S),
    "baddbmm": lambda q, k: torch.baddbmm(torch.zeros(B * H, S, S), q.flatten(0, 1),
                                          k.flatten(0, 1).transpose(1, 2)).view(B, H, S, S),
}
SCORE_OPS = {
    "scale": lambda s, mask: s * 0.3,
    "divide": lambda s, mask: s / 3.0,
    "mask add": lambda s, mask: s + mask,
    "masked_fill": lambda s, mask: s.masked_fill(mask < 0, -1e4),
    "where": lambda s, mask: torch.where(mask < 0, torch.finfo(s.dtype).min, s),
    "softcap": lambda s, mask: torch.tanh(s / 30.0) * 30.0,
    "float": lambda s, mask: s.float(),
}
SOFTMAX = {
    "F.softmax": lambda s: F.softmax(s, dim=-1),
    "F.softmax float32": lambda s: F.softmax(s, dim=-1, dtype=torch.float32),
    "torch.softmax": lambda s: torch.softmax(s, -1),
    "Tensor.softmax": lambda s: s.softmax(-1),
    "nn.Softmax": lambda s: torch.nn.Softmax(dim=-1)(s),
}
PROB_OPS = {
    ".to": lambda p, v: p.to(v.dtype),
    ".type": lambda p, v: p.type(v.dtype),
    "F.dropout": lambda p, v: F.dropout(p, p=0.1, training=True),
    "nn.functional.dropout": lambda p, v: torch.nn.functional.dropout(p, p=0.0),
    "contiguous": lambda p, v: p.contiguous(),
}
OUTPUTS = {
    "matmul": lambda p, v: torch.matmul(p, v),
    "@": lambda p, v: p @ v,
    "einsum": lambda p, v: torch.einsum("bhqk,bhkd->bhqd", p, v),
    "bmm": lambda p, v: torch.bmm(p.flatten(0, 1), v.flatten(0, 1)),
}


@settings(max_examples=30, deadline=None)
@given(scores=st.sampled_from(list(SCORES)), score_ops=st.lists(st.sampled_from(list(SCORE_OPS)), max_size=3),
       softmax=st.sampled_from(list(SOFTMAX)), prob_ops=st.lists(st.sampled_from(list(PROB_OPS)), max_size=2),
       output=st.sampled_from(list(OUTPUTS)))
def test_every_spelling_is_found(fake_world, scores, score_ops, softmax, prob_ops, output):
    def attention(q, k, v, mask):
        s = SCORES[scores](q, k)
        for op in score_ops:
            s = SCORE_OPS[op](s, mask)
        p = SOFTMAX[softmax](s)
        for op in prob_ops:
            p = PROB_OPS[op](p, v)
        return OUTPUTS[output](p, v)

    found = []

    def backend(gm, example_inputs):
        found.extend(find_unsupported_attention(gm))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(attention, backend=backend, fullgraph=True)(rand(B, H, S, D), rand(B, H, S, D), rand(B, H, S, D),
                                                             MASK)
    assert [m.kind for m in found] == ["hand-written attention"]
    match = found[0]
    assert "softmax" in str(match.node.target)
    assert match.scores is not None and match.output is not None


def test_aten_level_graph(world):
    """Graphs traced below Dynamo (torch.export: aten.matmul / bmm, aten.softmax / _softmax)."""

    class Block(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return matmul_attention(q, k, v, mask)

    args = (rand(B, H, S, D), rand(B, H, S, D), rand(B, H, S, D), MASK)
    program = torch.export.export(Block(), args)
    for gm in (program.module(), program.run_decompositions().module()):
        (match,) = find_unsupported_attention(gm)
        assert match.kind == "hand-written attention"
        assert match.node.target in (torch.ops.aten.softmax.int, torch.ops.aten._softmax.default)
        with pytest.raises(UnsupportedAttention, match="hand-written attention"):
            apply_upipe_passes(gm, UPipeOptions(cp_mesh=world, inner_backend="eager"))


# --- 2. FlexAttention ---------------------------------------------------------------------
def flex(q, k, v, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block_mask)


def test_flex_attention_refused(world):
    """The flex_attention higher-order op, named at the model's line (not inside torch).
    CPU flex has no backward (torch refuses requires_grad inputs before any backend runs),
    so this runs under no_grad; on GPUs the graph is the same."""
    from torch.nn.attention.flex_attention import create_block_mask

    block_mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 128, 128, device="cpu")
    q = rand(B, H, 128, D)
    with torch.no_grad():
        message = refusal(flex, q, q, q, block_mask, group=world)
    lines, start = inspect.getsourcelines(flex)
    (line,) = [start + i for i, text in enumerate(lines) if "return flex_attention(" in text]
    assert f"{THIS_FILE}:{line} in flex: return flex_attention(q, k, v, block_mask=block_mask)" in message
    assert "flex_attention is not rewritten by upipe" in message
    assert FLEX_FIX in message
    assert "torch/nn/attention" not in message


# --- 3. transformers models -----------------------------------------------------------------
@pytest.mark.parametrize("attn_implementation, file, code", [
    ("eager", "modeling_llama.py", "attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32)"),
    ("flex_attention", "integrations/flex_attention.py", "flex_attention_compiled("),
])
def test_transformers_model_refused_with_register_fix(world, attn_implementation, file, code):
    import transformers
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation)
    ids = torch.randint(0, 128, (1, 128))
    with torch.set_grad_enabled(attn_implementation != "flex_attention"):  # CPU flex: forward only
        message = refusal(model, ids, group=world)
    assert f"cannot run {config.num_hidden_layers} attention call(s)" in message
    assert message.count(file) == config.num_hidden_layers and code in message
    assert message.count(TRANSFORMERS_FIX) == config.num_hidden_layers


# --- 4. not attention: never refused -------------------------------------------------------
class Router(torch.nn.Module):
    """A mixture-of-experts layer: softmax router (F.linear or x @ W.T), top-k, and the soft
    weights combined with the expert outputs by einsum and matmul."""

    def __init__(self, d=8, experts=4):
        super().__init__()
        self.gate = torch.nn.Linear(d, experts, bias=False)
        self.weight = torch.nn.Parameter(torch.randn(experts, d))
        self.experts = torch.nn.Parameter(torch.randn(experts, d, d))

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32).to(x.dtype)
        top, index = torch.topk(probs, 2, dim=-1)
        expert_out = torch.einsum("td,edf->tef", x, self.experts)
        mixed = torch.einsum("te,tef->tf", probs, expert_out)
        probs2 = (x @ self.weight.T).softmax(-1)
        mixed2 = torch.matmul(probs2.unsqueeze(1), expert_out).squeeze(1)
        return mixed + mixed2 + top.sum() + index.sum()


class Loss(torch.nn.Module):
    def __init__(self, d=8, vocab=32):
        super().__init__()
        self.unembed = torch.nn.Parameter(torch.randn(d, vocab))

    def forward(self, h, labels):
        logits = h @ self.unembed
        probs = logits.softmax(-1)
        expected = probs @ self.unembed.T  # a product, but with a parameter
        return (F.cross_entropy(logits, labels) + F.log_softmax(logits, -1).mean() + expected.sum()
                + torch.log_softmax(logits, -1).mean())


NOT_ATTENTION = {
    "MLP": (torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)), (rand(16, 8),)),
    "loss": (Loss(), (rand(16, 8), torch.randint(0, 32, (16,)))),
    "MoE router": (Router(), (rand(16, 8),)),
    "MoE router, checkpointed": (lambda x, m=Router(): checkpoint(m, x, use_reentrant=False),
                                 (rand(16, 8).requires_grad_(),)),
}


@pytest.mark.parametrize("case", list(NOT_ATTENTION))
def test_not_attention_not_refused(world, case):
    fn, args = NOT_ATTENTION[case]
    for gm in accepted(fn, *args, group=world):
        assert find_unsupported_attention(gm) == []


def test_sdpa_still_rewritten(world):
    def model(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    (gm,) = accepted(model, rand(B, H, S, D), group=world)
    assert [n.target for n in gm.graph.nodes if n.target is UPIPE_ATTENTION] == [UPIPE_ATTENTION]
    assert find_unsupported_attention(gm) == []


def test_router_weight_must_be_a_parameter(world):
    """The rule itself: the same graph with the router weight passed as an activation (a graph
    input that is no parameter) is attention-shaped and refused; as a parameter it is not."""

    def soft_moe(x, weight, expert_out):
        return torch.einsum("te,tef->tf", (x @ weight.T).softmax(-1), expert_out)

    x, expert_out = rand(16, 8), rand(16, 4, 8)
    message = refusal(soft_moe, x, rand(4, 8), expert_out, group=world)
    assert softmax_line(soft_moe) in message

    class SoftMoE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4, 8))

        def forward(self, x, expert_out):
            return soft_moe(x, self.weight, expert_out)

    accepted(SoftMoE(), x, expert_out, group=world)


# --- 5. transformers models through register(): what the attention function refuses ---------
def _unsupported_from(call) -> str:
    """Run ``call``; the UnsupportedAttention it raises (directly or as a compile failure's cause)."""
    with pytest.raises(Exception) as info:
        call()
    error = info.value
    while error is not None and not isinstance(error, UnsupportedAttention):
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    assert error is not None, repr(info.value)
    return str(error)


def _tiny_llama(**extra):
    import transformers

    from upipe_compile.integrations.transformers import register

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128, **extra)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation=register())


def test_unknown_attention_keyword_refused_with_line(world):
    """A keyword the attention function does not understand is refused, not dropped: the
    message names the model's attention forward (file:line) and what to do."""
    import transformers.models.llama.modeling_llama as llama

    model = _tiny_llama()
    compiled = torch.compile(model, backend="upipe", options={"cp_mesh": world, "inner_backend": "eager"})
    ids = torch.randint(0, 128, (1, 16))
    message = _unsupported_from(lambda: compiled(ids, position_ids=torch.arange(16)[None], attention_bias_scale=2.0))
    line = llama.LlamaAttention.forward.__code__.co_firstlineno
    assert f"modeling_llama.py:{line} (LlamaAttention.forward)" in message
    assert "['attention_bias_scale']" in message and "refuses rather than drop" in message


def test_window_mask_disagreeing_with_layer_refused():
    from upipe_compile.integrations.transformers_attention import SlidingWindowMask, _upipe_attention_forward

    q = torch.randn(1, 4, 8, 16)
    module = torch.nn.Module()
    message = _unsupported_from(lambda: _upipe_attention_forward(module, q, q, q, SlidingWindowMask(4),
                                                                 sliding_window=6, scaling=0.25))
    assert "sliding_window=6" in message and "window of 4" in message


def test_chunked_mask_told_from_a_window_by_the_config():
    """transformers hands both a chunk size and a window to the mask function as local_size:
    the config says which; where both are the same size upipe cannot tell and refuses."""
    from upipe_compile.integrations.transformers_attention import ChunkedMask, SlidingWindowMask, _causal_sdpa_mask

    config = type("Config", (), {"attention_chunk_size": 8192, "sliding_window": 4096})()
    assert _causal_sdpa_mask(config=config, local_size=8192) == ChunkedMask(8192)
    assert _causal_sdpa_mask(config=config, local_size=4096) == SlidingWindowMask(4096)
    assert _causal_sdpa_mask(config=config) is None
    config.sliding_window = 8192
    message = _unsupported_from(lambda: _causal_sdpa_mask(config=config, local_size=8192))
    assert "attention_chunk_size and config.sliding_window are both 8192" in message


def test_chunked_layer_without_positions_refused():
    from upipe_compile.integrations.transformers_attention import ChunkedMask, _upipe_attention_forward

    q = torch.randn(1, 4, 8, 16)
    message = _unsupported_from(lambda: _upipe_attention_forward(torch.nn.Module(), q, q, q, ChunkedMask(4),
                                                                 scaling=0.25))
    assert "chunks of 4 tokens" in message and "position_ids" in message


def test_sliding_window_reaches_the_op_from_the_mask_alone(world):
    """A layer that relies on its mask for the window (passes no sliding_window=) still gets it."""
    from upipe_compile.integrations.transformers_attention import SlidingWindowMask, _upipe_attention_forward

    backend = Capture(world)

    def layer(q):
        module = torch.nn.Module()
        return _upipe_attention_forward(module, q, q, q, SlidingWindowMask(5), scaling=0.25)[0]

    torch.compile(layer, backend=backend)(rand(1, 4, 8, 16))
    (op,) = [n for g in backend.graphs for n in g.graph.nodes if n.target is torch.ops.upipe.attention.default]
    from upipe_compile.attention.ops import parse_op_arguments

    settings = parse_op_arguments(op.args)[3]
    assert (settings.window_left, settings.window_right, settings.is_causal) == (4, 4, True)


def test_bad_variant_arguments_refused_at_compile_time(world):
    """Under torch.compile document_sdpa's checks are the pass's: sinks of the wrong shape
    are refused with the call's line, before anything runs."""
    from upipe_compile import document_sdpa

    def model(q, sinks):
        return document_sdpa(q, q, q, None, is_causal=True, window=(3, 0), sinks=sinks)

    message = refusal(model, rand(1, 4, 8, 8), torch.zeros(3), group=world)
    assert "sinks must have shape [4]" in message
    assert f"{THIS_FILE}:" in message and "return document_sdpa(q, q, q, None" in message


# --- dynamo's fallbacks to running a frame uncompiled ------------------------------------------
def _sdpa_model(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_recompile_limit_is_an_error_not_an_uncompiled_frame(world):
    """Past the recompile limit dynamo would run the frame as written: SDPA on the local
    shard. Under backend="upipe" (P > 1) that is an error."""
    limit = torch._dynamo.config.recompile_limit
    fail = torch._dynamo.config.fail_on_recompile_limit_hit
    torch._dynamo.config.recompile_limit = 2
    try:
        compiled = torch.compile(_sdpa_model, backend="upipe", dynamic=False, options={"cp_mesh": world})
        for s_local in (4, 6):
            compiled(*(rand(1, 2, s_local, 8) for _ in range(3)))
        with pytest.raises(Exception, match="recompile"):
            compiled(*(rand(1, 2, 8, 8) for _ in range(3)))
    finally:
        torch._dynamo.config.recompile_limit = limit
        torch._dynamo.config.fail_on_recompile_limit_hit = fail


def test_suppressed_compile_errors_still_refuse(world):
    """suppress_errors=True would run a refused frame uncompiled (hand-written attention on
    the local shard): the refusal still reaches the user."""
    suppress, fail = torch._dynamo.config.suppress_errors, torch._dynamo.config.fail_on_recompile_limit_hit
    # as before any upipe compile in this process (dynamo refuses both flags at once)
    torch._dynamo.config.fail_on_recompile_limit_hit = False
    torch._dynamo.config.suppress_errors = True
    try:
        q, k, v = rand(B, H, S, D), rand(B, H, S, D), rand(B, H, S, D)
        with pytest.raises(Exception, match="hand-written attention is not rewritten by upipe"):
            torch.compile(bmm_attention, backend="upipe", options={"cp_mesh": world})(q, k, v)
    finally:
        torch._dynamo.config.suppress_errors = suppress
        torch._dynamo.config.fail_on_recompile_limit_hit = fail
