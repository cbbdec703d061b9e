"""Single-process graph tests of the upipe backend on a FAKE process group (no real ranks).

What the passes put in the graph (find / nested bodies / P=1), what they refuse and how they
say it, what AOT autograd makes of the custom op (forward and backward graphs), the op's fake
kernel, the public op's refusals, and the stage schedule (hypothesis).

Compiled functions here use a capturing backend with inner backend "eager", so a call runs
the real stage-loop op on real tensors over the fake group: its collectives return without
exchanging data, which is all a graph test needs (numerics are tests/test_numerics.py's job).
"""

from __future__ import annotations

import inspect
import json
import operator
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.exc import BackendCompilerFailed
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from upipe_compile import UnsupportedAttention, UPipeOptions, apply_upipe_passes, upipe_attention
from upipe_compile.attention.ops import parse_op_arguments
from upipe_compile.attention.schedule import ScheduleError, plan_stages

WORLD = 4
UPIPE_ATTENTION = torch.ops.upipe.attention.default
UPIPE_ATTENTION_BACKWARD = torch.ops.upipe.attention_backward.default
THIS_FILE = os.path.basename(__file__)


# --- fixtures and helpers ---------------------------------------------------------------
# fake_world / world: tests/conftest.py, over this module's WORLD ranks


class Capture:
    """A backend that runs the upipe passes, records the graph, and runs it eagerly."""

    def __init__(self, **options):
        self.options = UPipeOptions(inner_backend="eager", **options)
        self.graphs: list[fx.GraphModule] = []
        self.code_before: list[str] = []

    def __call__(self, gm, example_inputs):
        self.code_before.append(gm.code)
        gm = apply_upipe_passes(gm, self.options)
        self.graphs.append(gm)
        return gm.forward

    @property
    def graph(self) -> fx.GraphModule:
        assert len(self.graphs) == 1, f"expected one Dynamo graph (no graph breaks), got {len(self.graphs)}"
        return self.graphs[0]


def graph_modules(gm: fx.GraphModule) -> dict[str, fx.GraphModule]:
    """The root and every nested graph module (checkpoint bodies etc.), by qualified name."""
    return {name: m for name, m in gm.named_modules() if isinstance(m, fx.GraphModule)}


def calls(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def is_attention_kernel(node: fx.Node) -> bool:
    """Any flavour of aten/functional SDPA or flash attention (what UPipe must replace)."""
    if node.op != "call_function":
        return False
    name = getattr(node.target, "__name__", "") + str(node.target)
    return "scaled_dot_product" in name or "flash_attention" in name


def sdpa_nodes(gm: fx.GraphModule) -> list[str]:
    return [f"{name}:{n.format_node()}" for name, m in graph_modules(gm).items() for n in m.graph.nodes if is_attention_kernel(n)]


def example_shape(node) -> tuple[int, ...]:
    value = node.meta.get("example_value", node.meta.get("val"))
    return tuple(value.shape)


def sdpa_source(fn) -> tuple[int, str]:
    """(line number, stripped code) of the one SDPA call in ``fn``'s source."""
    lines, start = inspect.getsourcelines(fn)
    hits = [(start + i, line.strip()) for i, line in enumerate(lines) if "scaled_dot_product_attention(" in line]
    assert len(hits) == 1, hits
    return hits[0]


def refusal(fn, *args, options=None) -> str:
    """Compile ``fn`` with backend="upipe" and return the UnsupportedAttention message it raises.
    torch.compile wraps backend errors in BackendCompilerFailed; the original is inner_exception."""
    options = {"inner_backend": "eager", **(options or {})}
    with pytest.raises(BackendCompilerFailed) as info:
        torch.compile(fn, backend="upipe", options=options, fullgraph=True)(*args)
    inner = info.value.inner_exception
    assert type(inner) is UnsupportedAttention, repr(inner)
    assert "UnsupportedAttention" in str(info.value)  # the user sees the name in the message too
    return str(inner)


def rand(*shape, grad=False):
    return torch.randn(*shape, requires_grad=grad)


# --- 1. find: every spelling of SDPA becomes one upipe.attention -------------------------
class PositionalAndKeywordSDPA(torch.nn.Module):
    def forward(self, q, k, v, k_gqa, v_gqa):
        # positional spelling, MHA, not causal
        a = F.scaled_dot_product_attention(q, k, v, None, 0.0, False)
        # HF transformers' spelling, GQA (8 query heads, 2 KV heads)
        b = F.scaled_dot_product_attention(
            q, k_gqa, v_gqa, attn_mask=None, dropout_p=0.0, scale=0.125, is_causal=True, enable_gqa=True
        )
        return a + b


@pytest.mark.parametrize("heads_per_stage, expected_u", [(None, WORLD), (8, 8)])
def test_find_rewrites_positional_and_keyword_sdpa(world, heads_per_stage, expected_u):
    backend = Capture(heads_per_stage=heads_per_stage)
    q, k, v = rand(1, 8, 16, 8), rand(1, 8, 16, 8), rand(1, 8, 16, 8)
    k_gqa, v_gqa = rand(1, 2, 16, 8), rand(1, 2, 16, 8)
    out = torch.compile(PositionalAndKeywordSDPA(), backend=backend, fullgraph=True)(q, k, v, k_gqa, v_gqa)
    assert out.shape == q.shape

    gm = backend.graph
    assert sdpa_nodes(gm) == []
    ops = calls(gm, UPIPE_ATTENTION)
    assert len(ops) == 2
    positional, hf = ops  # graph order = source order
    # args: (q, k, v, is_causal, scale, heads_per_stage, world_size, group_name, prefetch, window_left,
    # window_right, softcap); the GQA call keeps its 2 KV heads
    assert [example_shape(a) for a in positional.args[:3]] == [(1, 8, 16, 8)] * 3
    assert positional.args[3:] == (False, None, expected_u, WORLD, world.group_name, "forward", -1, -1, 0.0, "")
    assert [example_shape(a) for a in hf.args[:3]] == [(1, 8, 16, 8), (1, 2, 16, 8), (1, 2, 16, 8)]
    assert hf.args[3:] == (True, 0.125, expected_u, WORLD, world.group_name, "forward", -1, -1, 0.0, "")
    assert positional.kwargs == {} and hf.kwargs == {}
    # each op's users read only its output (index 0), never the log-sum-exp
    for op in ops:
        assert [(u.target, u.args[1]) for u in op.users] == [(operator.getitem, 0)]
    # the rewritten graph is what runs: the code names the op
    assert gm.code.count("torch.ops.upipe.attention.default(") == 2


def test_one_kv_head_broadcast_without_enable_gqa_is_rewritten_as_gqa(world):
    """SDPA broadcasts a single KV head over every query head without ``enable_gqa`` (Falcon's
    multi-query call): GQA with one group, rewritten with its one KV head."""
    backend = Capture()
    q, k, v = rand(1, 8, 16, 8), rand(1, 1, 16, 8), rand(1, 1, 16, 8)
    torch.compile(sdpa_plain, backend=backend, fullgraph=True)(q, k, v)
    (op,) = calls(backend.graph, UPIPE_ATTENTION)
    assert [example_shape(a) for a in op.args[:3]] == [(1, 8, 16, 8), (1, 1, 16, 8), (1, 1, 16, 8)]


def test_graph_breaks_each_graph_rewritten(world):
    """A graph break splits the model into two Dynamo graphs; the backend sees and rewrites both."""

    def two_graphs(q):
        a = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        torch._dynamo.graph_break()
        return F.scaled_dot_product_attention(a, a, a)

    backend = Capture()
    torch.compile(two_graphs, backend=backend)(rand(1, 4, 8, 8))
    assert len(backend.graphs) == 2
    assert [len(calls(g, UPIPE_ATTENTION)) for g in backend.graphs] == [1, 1]
    assert all(sdpa_nodes(g) == [] for g in backend.graphs)


def test_options_instance_and_aten_level_graph(world):
    """torch.compile(options=UPipeOptions(...)) is accepted as is, and graphs traced below
    Dynamo (torch.export: aten.scaled_dot_product_attention.default) are rewritten too."""
    q = rand(1, 8, 16, 8)
    options = UPipeOptions(inner_backend="eager", heads_per_stage=8)
    assert torch.compile(sdpa_plain, backend="upipe", options=options)(q, q, q).shape == q.shape

    class Block(torch.nn.Module):
        def forward(self, q):
            return sdpa_plain(q, q, q)

    gm = torch.export.export(Block(), (q,)).module()
    assert len(calls(gm, torch.ops.aten.scaled_dot_product_attention.default)) == 1
    gm = apply_upipe_passes(gm, options)
    (op,) = calls(gm, UPIPE_ATTENTION)
    assert op.args[3:] == (True, None, 8, WORLD, world.group_name, "forward", -1, -1, 0.0, "")
    assert sdpa_nodes(gm) == []


def test_device_mesh_group_is_used(world):
    """cp_mesh=mesh['cp'] (a 1-D sub-mesh) runs over that sub-group: P=2, not the world's 4."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    with pytest.raises(UnsupportedAttention, match="1-D DeviceMesh"):
        UPipeOptions(cp_mesh=mesh).group
    backend = Capture(cp_mesh=mesh["cp"])
    torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q), backend=backend)(rand(1, 4, 8, 8))
    (op,) = calls(backend.graph, UPIPE_ATTENTION)
    cp_group = mesh["cp"].get_group()
    assert cp_group.size() == 2 and cp_group.group_name != world.group_name
    assert op.args[5:8] == (2, 2, cp_group.group_name)


# --- 2. nested: SDPA under activation checkpointing --------------------------------------
def _attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class CheckpointedLayers(torch.nn.Module):
    def forward(self, q, k, v):
        # two checkpointed attention layers, as torchtitan applies AC before compile
        h = checkpoint(_attend, q, k, v, use_reentrant=False)
        return checkpoint(_attend, h, k, v, use_reentrant=False)


def test_nested_checkpoint_body_is_rewritten(world):
    backend = Capture()
    q = rand(1, 8, 16, 8, grad=True)
    out = torch.compile(CheckpointedLayers(), backend=backend, fullgraph=True)(q, q, q)
    assert out.shape == q.shape

    gm = backend.graph
    modules = graph_modules(gm)
    # Dynamo puts each checkpointed region into a body called by tag_activation_checkpoint
    hops = calls(gm, torch.ops.higher_order.tag_activation_checkpoint)
    assert len(hops) == 2
    assert calls(gm, UPIPE_ATTENTION) == []  # nothing in the root: the ops live in the bodies
    per_body = {name: len(calls(m, UPIPE_ATTENTION)) for name, m in modules.items() if name}
    assert sum(per_body.values()) == 2 and all(n >= 1 for n in per_body.values()), per_body
    # each HOP calls a body that now holds the op (get_attr target -> nested module)
    for hop in hops:
        body = getattr(gm, hop.args[0].target)
        assert isinstance(body, fx.GraphModule) and len(calls(body, UPIPE_ATTENTION)) == 1
        assert "torch.ops.upipe.attention.default(" in body.code  # recompiled, not just re-graphed
    assert sdpa_nodes(gm) == []


def test_nested_refusal_names_the_body_source_line(world):
    def masked_attend(q, mask):
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    def model(q, mask):
        return checkpoint(masked_attend, q, mask, use_reentrant=False)

    line, code = sdpa_source(masked_attend)
    message = refusal(model, rand(1, 8, 16, 8), torch.ones(16, 16, dtype=torch.bool))
    assert f"{THIS_FILE}:{line} in masked_attend: {code}" in message
    assert "attn_mask" in message


# --- 3. refusals: source line + reason, at compile time ----------------------------------
def sdpa_with_mask(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def sdpa_with_dropout(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)


def sdpa_plain(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


REFUSALS = {
    "attn_mask tensor": (sdpa_with_mask, ((1, 8, 16, 8),) * 3 + ((16, 16),), {}, ["attn_mask"]),
    "dropout": (sdpa_with_dropout, ((1, 8, 16, 8),) * 3, {}, ["dropout_p=0.1", "dropout"]),
    "6 heads, P=4": (sdpa_plain, ((1, 6, 16, 8),) * 3, {}, ["6 query heads cannot be split", "heads_per_stage=4"]),
    "8 heads, U=12": (sdpa_plain, ((1, 8, 16, 8),) * 3, {"heads_per_stage": 12}, ["8 query heads cannot be split", "heads_per_stage=12"]),
    "3-D q/k/v": (sdpa_plain, ((8, 16, 8),) * 3, {}, ["4-D", "(8, 16, 8)"]),
    "cross-attention": (
        sdpa_plain, ((1, 8, 16, 8), (1, 8, 32, 8), (1, 8, 32, 8)), {}, ["self-attention"]
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusal_names_source_line_and_reason(world, case):
    fn, shapes, options, reasons = REFUSALS[case]
    args = [torch.randn(*s) if s != (16, 16) else torch.ones(s, dtype=torch.bool) for s in shapes]
    message = refusal(fn, *args, options=options)
    line, code = sdpa_source(fn)
    assert f"{THIS_FILE}:{line} in {fn.__name__}: {code}" in message
    assert f"P={WORLD}" in message
    for reason in reasons:
        assert reason in message


def test_refusal_lists_every_bad_call(world):
    """All problems at once, each under its own source line, not only the first."""

    def two_bad(q, k, v, mask):
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # bad: mask
        ok = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # fine
        return a + ok + F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)  # bad: dropout

    q = rand(1, 8, 16, 8)
    message = refusal(two_bad, q, q, q, torch.ones(16, 16, dtype=torch.bool))
    assert "cannot run 2 attention call(s)" in message
    lines, start = inspect.getsourcelines(two_bad)
    numbered = {line.strip().split("#")[-1].strip(): start + i for i, line in enumerate(lines)}
    mask_line, ok_line, dropout_line = numbered["bad: mask"], numbered["fine"], numbered["bad: dropout"]
    assert f"{THIS_FILE}:{mask_line} in two_bad" in message
    assert f"{THIS_FILE}:{dropout_line} in two_bad" in message
    assert f"{THIS_FILE}:{ok_line}" not in message
    # each reason sits under its own call
    assert message.index(f":{mask_line} ") < message.index("attn_mask") < message.index(f":{dropout_line} ")
    assert message.index(f":{dropout_line} ") < message.index("dropout_p=0.5")


def test_options_refused_directly(world):
    with pytest.raises(UnsupportedAttention, match=r"heads_per_stage=6 must be a positive multiple .* P=4"):
        UPipeOptions(heads_per_stage=6)
    for bad in (0, -4, True, "4", 4.0):
        with pytest.raises(UnsupportedAttention, match="heads_per_stage"):
            UPipeOptions(heads_per_stage=bad)
    with pytest.raises(UnsupportedAttention, match=r"inner_backend='tvm' is not one of"):
        UPipeOptions(inner_backend="tvm")
    with pytest.raises(UnsupportedAttention, match="recompute_attention_output must be True or False"):
        UPipeOptions(recompute_attention_output="yes")
    with pytest.raises(UnsupportedAttention, match="acts on fused attention blocks only"):
        UPipeOptions(fuse_projections=False, recompute_attention_output=True)
    with pytest.raises(UnsupportedAttention, match=r"unknown upipe option\(s\) \['bogus'\]"):
        UPipeOptions.from_user({"bogus": 1})
    with pytest.raises(UnsupportedAttention, match="cp_mesh must be a DeviceMesh, a ProcessGroup or None"):
        UPipeOptions(cp_mesh="cp").group
    assert UPipeOptions(heads_per_stage=8).stage_heads() == 8 and UPipeOptions().stage_heads() == WORLD
    with pytest.raises(UnsupportedAttention, match=r"prefetch='all' is not one of \('none', 'forward', 'both'\)"):
        UPipeOptions(prefetch="all")


def test_prefetch_option_reaches_the_op(world):
    backend = Capture(prefetch="both")
    q = rand(1, 8, 16, 8)
    torch.compile(sdpa_plain, backend=backend)(q, q, q)
    (op,) = calls(backend.graph, UPIPE_ATTENTION)
    assert parse_op_arguments(op.args)[3].prefetch == "both"


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"heads_per_stage": 6}, r"heads_per_stage=6 must be a positive multiple of the context-parallel size P=4"),
        ({"bogus": 1}, "unknown upipe option(s) ['bogus']"),
        ({"inner_backend": "tvm"}, "inner_backend='tvm' is not one of"),
    ],
)
def test_options_refused_by_torch_compile(world, options, expected):
    q = rand(1, 8, 16, 8)
    assert expected in refusal(sdpa_plain, q, q, q, options=options)


def test_mode_refused(world):
    q = rand(1, 8, 16, 8)
    with pytest.raises(BackendCompilerFailed) as info:
        torch.compile(sdpa_plain, backend="upipe", mode="reduce-overhead")(q, q, q)
    assert type(info.value.inner_exception) is UnsupportedAttention
    assert "not mode='reduce-overhead'" in str(info.value.inner_exception)


NO_PG_SCRIPT = r"""
import json, torch, torch.nn.functional as F
import torch.distributed as dist
from upipe_compile import UPipeOptions, UnsupportedAttention
assert not dist.is_initialized()
found = []
for make in (lambda: UPipeOptions().group, lambda: UPipeOptions(heads_per_stage=4)):
    try:
        make()
        found.append("no error")
    except UnsupportedAttention as error:
        found.append(str(error))
try:
    q = torch.randn(1, 4, 8, 8)
    torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q), backend="upipe")(q)
    found.append("no error")
except torch._dynamo.exc.BackendCompilerFailed as error:
    found.append(type(error.inner_exception).__name__ + ": " + str(error.inner_exception))
print(json.dumps(found))
"""


def test_no_process_group_refused():
    """No default group at all: a fresh interpreter, so this module's fake group cannot interfere."""
    result = subprocess.run([sys.executable, "-c", NO_PG_SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    group, options, compiled = json.loads(result.stdout.strip().splitlines()[-1])
    for message in (group, options, compiled):
        assert "no process group" in message and "init_process_group" in message, message
    assert compiled.startswith("UnsupportedAttention: ")


# --- 4. one context-parallel rank: nothing to do -----------------------------------------
def test_single_rank_leaves_graph_unchanged(world):
    one = dist.new_group(ranks=[0])
    assert one.size() == 1
    backend = Capture(cp_mesh=one)
    q = rand(1, 6, 16, 8)  # 6 heads and a mask/dropout would be refused at P=4; at P=1 SDPA stays
    torch.compile(sdpa_with_mask, backend=backend, fullgraph=True)(q, q, q, torch.ones(16, 16, dtype=torch.bool))
    gm = backend.graph
    assert gm.code == backend.code_before[0]
    assert len(sdpa_nodes(gm)) == 1
    assert calls(gm, UPIPE_ATTENTION) == []
    assert calls(gm, F.scaled_dot_product_attention)[0].kwargs.get("attn_mask") is not None


# --- 5. AOT autograd: the op owns its backward ------------------------------------------
class AttentionBlock(torch.nn.Module):
    """Projections -> GQA attention -> output projection (8 query heads, 2 KV heads)."""

    def __init__(self):
        super().__init__()
        self.wq = torch.nn.Linear(64, 64, bias=False)
        self.wkv = torch.nn.Linear(64, 2 * 16, bias=False)
        self.wo = torch.nn.Linear(64, 64, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, 8, 8).transpose(1, 2)
        k, v = self.wkv(x).view(b, s, 2, 2, 8).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, 64))


@pytest.mark.parametrize("partition_fn", [default_partition, min_cut_rematerialization_partition], ids=["default", "min_cut"])
def test_backward_graph_has_only_the_backward_op(world, partition_fn):
    recorded: dict[str, fx.GraphModule] = {}

    def recorder(kind):
        def compiler(gm, example_inputs):
            recorded[kind] = gm
            return make_boxed_func(gm.forward)

        return compiler

    aot = aot_autograd(fw_compiler=recorder("fw"), bw_compiler=recorder("bw"), partition_fn=partition_fn)

    def backend(gm, example_inputs):
        # a non-default prefetch, so that it must reach the backward op (defaults may be elided)
        return aot(apply_upipe_passes(gm, UPipeOptions(inner_backend="eager", prefetch="both")), example_inputs)

    x = rand(2, 16, 64, grad=True)
    out = torch.compile(AttentionBlock(), backend=backend, fullgraph=True)(x)
    out.sum().backward()  # AOT compiles the backward lazily: this triggers it
    assert x.grad is not None and x.grad.shape == x.shape
    fw, bw = recorded["fw"], recorded["bw"]

    assert len(calls(fw, UPIPE_ATTENTION)) == 1
    assert calls(fw, UPIPE_ATTENTION_BACKWARD) == []
    assert sdpa_nodes(fw) == []

    (backward_op,) = calls(bw, UPIPE_ATTENTION_BACKWARD)
    # no recomputed forward: neither the stage-loop op nor any aten attention kernel
    assert calls(bw, UPIPE_ATTENTION) == [], bw.code
    assert sdpa_nodes(bw) == [], bw.code
    # (dout, q, k, v, out, lse, is_causal, scale, heads_per_stage, world_size, group_name, prefetch)
    assert backward_op.args[6:] == (True, 0.25, WORLD, WORLD, world.group_name, "both")
    # out and lse reach the backward as saved forward outputs (placeholders or views of them)
    placeholders = {n.name for n in bw.graph.nodes if n.op == "placeholder"}

    def origin(node):
        while node.op == "call_function" and node.target in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            node = node.args[0]
        return node

    assert origin(backward_op.args[5]).name in placeholders  # lse saved, not recomputed
    # lse: [8 heads / U=4 stages, batch 2, 1 head per rank, 16 * P tokens]
    assert example_shape(backward_op.args[5]) == (2, 2, 1, 16 * WORLD)
    (fw_op,) = calls(fw, UPIPE_ATTENTION)
    assert fw_op.args[3:] == (True, 0.25, WORLD, WORLD, world.group_name, "both")


# --- 6. the fake kernel --------------------------------------------------------------------
@pytest.mark.parametrize(
    "q_heads, kv_heads, heads_per_stage, dtype",
    [(8, 8, 4, torch.float32), (8, 2, 4, torch.float32), (8, 2, 8, torch.bfloat16), (16, 4, 8, torch.float32), (4, 1, 4, torch.float32)],
)
def test_fake_kernel_shapes(world, q_heads, kv_heads, heads_per_stage, dtype):
    batch, s_local, dim = 2, 16, 8
    stages = q_heads // heads_per_stage
    with FakeTensorMode():
        q = torch.empty(batch, q_heads, s_local, dim, dtype=dtype)
        k = torch.empty(batch, kv_heads, s_local, dim, dtype=dtype)
        out, lse = UPIPE_ATTENTION(q, k, k, True, None, heads_per_stage, WORLD, world.group_name)
        assert isinstance(out, FakeTensor) and isinstance(lse, FakeTensor)
        assert out.shape == q.shape and out.dtype == dtype
        # one LSE row per stage: [num_stages, B, U/P heads per rank, full sequence]
        assert tuple(lse.shape) == (stages, batch, heads_per_stage // WORLD, s_local * WORLD)
        assert lse.dtype == torch.float32
        dq, dk, dv, dsinks = UPIPE_ATTENTION_BACKWARD(out, q, k, k, out, lse, True, None, heads_per_stage, WORLD,
                                                      world.group_name)
        assert (dq.shape, dk.shape, dv.shape, dsinks.shape) == (q.shape, k.shape, k.shape, (0,))
        sinks = torch.empty(q_heads, dtype=torch.float32)
        *_, dsinks = UPIPE_ATTENTION_BACKWARD(out, q, k, k, out, lse, True, None, heads_per_stage, WORLD,
                                              world.group_name, sinks=sinks)
        assert dsinks.shape == sinks.shape
    # torch.library.opcheck is deliberately not run: the real kernel needs live collectives.


# --- 7. the public op refuses bad input --------------------------------------------------
@pytest.mark.parametrize(
    "shapes, kwargs, expected",
    [
        (((8, 16, 8),) * 3, {}, "4-D"),
        (((1, 8, 16, 8), (1, 2, 16, 8), (1, 2, 16, 8)), {}, "8 query heads but 2 KV heads without enable_gqa=True: pass enable_gqa=True"),
        (((1, 6, 16, 8),) * 3, {}, "6 query heads cannot be split into stages of heads_per_stage=4"),
        (((1, 8, 16, 8),) * 3, {"heads_per_stage": 6}, "heads_per_stage=6 must be a positive multiple"),
        (((1, 8, 16, 8), (1, 8, 8, 8), (1, 8, 8, 8)), {}, "self-attention"),
        (((1, 8, 16, 8),) * 3, {"prefetch": "backward"}, "prefetch='backward' is not one of"),
    ],
)
def test_public_op_refusals(world, shapes, kwargs, expected):
    q, k, v = (torch.randn(*s) for s in shapes)
    with pytest.raises(UnsupportedAttention) as info:
        upipe_attention(q, k, v, is_causal=True, **kwargs)
    assert expected in str(info.value)


def test_public_op_fake_forward(world):
    """Valid input reaches the op: under FakeTensorMode only its fake kernel runs."""
    with FakeTensorMode():
        q, k = torch.empty(2, 8, 16, 8), torch.empty(2, 2, 16, 8)
        out = upipe_attention(q, k, k, is_causal=True, enable_gqa=True, heads_per_stage=8)
        assert isinstance(out, FakeTensor) and out.shape == q.shape


# --- 8. prefetch: the next stage's all-to-alls run during this stage's kernel -------------
class CollectivesInFlight(TorchDispatchMode):
    """At each attention kernel, how many all-to-alls have started and not been waited."""

    KERNELS = {
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: "forward",
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default: "backward",
    }

    def __init__(self):
        super().__init__()
        self.started: dict[int, torch.Tensor] = {}
        self.at_kernel: dict[str, list[int]] = {"forward": [], "backward": []}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.KERNELS:
            self.at_kernel[self.KERNELS[func]].append(len(self.started))
        if func is torch.ops._c10d_functional.wait_tensor.default:
            self.started.pop(id(args[0]), None)
        out = func(*args, **(kwargs or {}))
        if func is torch.ops._c10d_functional.all_to_all_single.default:
            self.started[id(out)] = out
        return out


@pytest.mark.parametrize("q_heads, kv_heads", [(16, 16), (16, 4)], ids=["MHA", "GQA"])
@pytest.mark.parametrize("prefetch", ["none", "forward", "both"])
def test_prefetch_overlaps_the_next_stage_with_the_kernel(world, prefetch, q_heads, kv_heads):
    """Each stage's kernel runs while the next stage's inputs are in flight in the loops that
    prefetch (K and V too where the next stage opens a KV group), and with nothing in
    flight in those that do not; the last stage has nothing to prefetch."""
    from upipe_compile.attention.stage_loop import StageLoopSettings, stage_loop_backward, stage_loop_forward

    settings = StageLoopSettings(True, None, WORLD, WORLD, world.group_name, prefetch)
    log = CollectivesInFlight()
    with FakeTensorMode():
        q, k = torch.empty(1, q_heads, 16, 8), torch.empty(1, kv_heads, 16, 8)
        with log:
            out, lse = stage_loop_forward(q, k, k, settings)
            stage_loop_backward(out, q, k, k, out, lse, settings)
        assert not log.started  # every collective was waited
    stages = q_heads // WORLD
    g = q_heads // kv_heads
    # the next stage's q (and in backward out, dout), plus K and V when it opens a KV group
    opens_group = [(s + 1) % g == 0 for s in range(stages - 1)]
    expected = {
        "forward": [1 + 2 * new for new in opens_group] + [0],
        "backward": [3 + 2 * new for new in opens_group] + [0],
    }
    for loop in ("forward", "backward"):
        prefetching = prefetch == "both" or prefetch == loop
        assert log.at_kernel[loop] == (expected[loop] if prefetching else [0] * stages), loop


# --- the stage schedule --------------------------------------------------------------------
@st.composite
def schedulable(draw):
    """(P, Hq, Hkv, U) that plan_stages must accept: Hkv | Hq, U a multiple of P dividing Hq."""
    world = draw(st.integers(1, 8))
    kv_heads = draw(st.integers(1, 16))
    g = draw(st.integers(1, 8))
    q_heads = kv_heads * g
    stage_sizes = [u for u in range(world, q_heads + 1, world) if q_heads % u == 0]
    assume(stage_sizes)
    return world, q_heads, kv_heads, draw(st.sampled_from(stage_sizes))


@settings(max_examples=300, deadline=None)
@given(schedulable())
def test_schedule_covers_heads_with_sdpa_gqa_rule(params):
    world, q_heads, kv_heads, u = params
    plan = plan_stages(q_heads, kv_heads, world, u)
    m, k = plan.q_per_rank, plan.kv_per_rank
    assert m * world == u
    assert len(plan.stages) == q_heads // u
    # every query head in exactly one stage
    seen = Counter(h for stage in plan.stages for h in stage.q_heads)
    assert sorted(seen) == list(range(q_heads)) and set(seen.values()) == {1}
    # KV is exchanged once per group: a group's stages are consecutive
    order = [stage.kv_group for stage in plan.stages]
    assert order == sorted(order) and set(order) == set(range(len(plan.kv_groups)))
    for group in plan.kv_groups:
        assert len(group) == world * k and all(0 <= h < kv_heads for h in group)
    for stage in plan.stages:
        assert len(stage.q_heads) == world * m and len(stage.kv_slots) == m
        assert all(0 <= slot < k for slot in stage.kv_slots)
        for r in range(world):
            for j in range(m):
                h = stage.q_heads[r * m + j]
                kv = plan.kv_groups[stage.kv_group][r * k + stage.kv_slots[j]]
                assert kv == h // (q_heads // kv_heads), (stage, r, j)
        # when the kernel is handed a slice instead of a gather, the slice must mean the same slots
        span = stage.kv_slot_range
        if span is not None:
            a, b = span
            per = m // (b - a)
            assert tuple(a + i // per for i in range(m)) == stage.kv_slots


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 4), st.integers(1, 8))
def test_schedule_matches_paper_formula_for_u_equal_p(world, kv_per_world, g):
    """U = P and P | Hkv: kv_head(s, r) = (s // g) * P + r, q_head(s, r) = kv_head * g + s % g."""
    kv_heads = kv_per_world * world
    q_heads = kv_heads * g
    plan = plan_stages(q_heads, kv_heads, world, world)
    assert (plan.q_per_rank, plan.kv_per_rank) == (1, 1)
    assert len(plan.stages) == q_heads // world
    for s, stage in enumerate(plan.stages):
        for r in range(world):
            kv_head = (s // g) * world + r
            assert plan.kv_groups[stage.kv_group][r] == kv_head
            assert stage.q_heads[r] == kv_head * g + s % g


@pytest.mark.parametrize(
    "q_heads, kv_heads, world, u, expected",
    [
        (6, 6, 4, 4, "6 query heads cannot be split"),
        (8, 8, 4, 6, "must be a positive multiple"),
        (8, 8, 4, 0, "must be a positive multiple"),
        (8, 3, 4, 4, "not a multiple of 3 KV heads"),
        (8, 8, 0, 4, "must be >= 1"),
    ],
)
def test_schedule_refusals(q_heads, kv_heads, world, u, expected):
    with pytest.raises(ScheduleError, match=expected):
        plan_stages(q_heads, kv_heads, world, u)
