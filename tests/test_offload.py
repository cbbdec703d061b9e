"""upipe_compile.stack.offload: the checkpointed input of each block, and nothing else, goes to host
memory after the block's forward and comes back for its recompute (the copy starts when the
gradient of the block's output arrives, not earlier); results are bit-identical to no
offload, eager or compiled; each block's host buffer is exactly its input's size and reused
every step; pinning and its fallback; the host memory arithmetic, the cgroup limit and the
node check; with kept_outputs, the attention outputs a block saves go to host too."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.multiprocessing.reductions import StorageWeakRef

from upipe_compile.stack.host_memory import (
    cgroup_memory_limit_bytes, host_memory_problem, host_reserve, ranks_per_node, total_host_memory_bytes,
    usable_host_memory,
)
from upipe_compile.stack.offload import BlockInputOffloader, host_bytes_per_rank

DIM = 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.up, self.down = nn.Linear(DIM, 3 * DIM), nn.Linear(3 * DIM, DIM)

    def forward(self, x, scale):
        return x + self.down(torch.relu(self.up(self.norm(x)) * scale))


def make_blocks(n, backend):
    torch.manual_seed(0)
    blocks = [checkpoint_wrapper(Block()) for _ in range(n)]
    if backend != "eager":
        blocks = [torch.compile(b, backend=backend, fullgraph=True) for b in blocks]
    return blocks


def run(blocks, x, scale, watch=None):
    """Forward through the blocks as torchtitan's model does, then backward; ``watch`` gets
    a weak reference to each block input's storage, taken after the forward."""
    x = x.clone().requires_grad_()
    h, inputs = x, []
    for block in blocks:
        inputs.append(StorageWeakRef(h.untyped_storage()))
        h = block(h, scale)
    if watch is not None:
        watch.extend(inputs)
    h.square().sum().backward()
    return h.detach(), x.grad, [p.grad.clone() for b in blocks for p in b.parameters()]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_offload_is_exact_and_moves_exactly_the_block_inputs(backend):
    x, scale = torch.randn(2, 12, DIM), torch.rand(3 * DIM)
    ref = run(make_blocks(4, backend), x, scale)
    blocks = make_blocks(4, backend)
    offloader = BlockInputOffloader(blocks)
    watch = []
    got = run(blocks, x, scale, watch)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], ref[2]))
    # One tensor per block, the block input: not `scale`, not the parameters.
    assert offloader.offloaded_last_step == 4
    assert offloader.offloaded_bytes_last_step == host_bytes_per_rank(4, 2 * 12, DIM, torch.float32)
    offloader.remove()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_block_inputs_are_released_after_forward(backend):
    """With offload, nothing keeps a block input's memory after the forward (blocks 1..n-1:
    their inputs are intermediate activations); without, the checkpoint keeps every one."""
    x, scale = torch.randn(1, 10, DIM), torch.rand(3 * DIM)

    def alive_after_forward(offload):
        blocks = make_blocks(3, backend)
        offloader = BlockInputOffloader(blocks) if offload else None
        h = x.clone().requires_grad_()
        refs = []
        for block in blocks:
            refs.append(StorageWeakRef(h.untyped_storage()))
            h = block(h, scale)
        alive = [not ref.expired() for ref in refs[1:]]
        h.sum().backward()
        if offloader:
            offloader.remove()
        return alive

    assert alive_after_forward(offload=False) == [True, True]
    assert alive_after_forward(offload=True) == [False, False]


def test_backward_fetches_each_input_when_its_blocks_backward_begins(monkeypatch):
    """Each copy back starts when the gradient of that block's output arrives: never while a
    later block's backward runs (that would hold two block inputs at the step's peak)."""
    from upipe_compile.stack import offload

    log = []
    original_unpack, original_prefetch = offload._OffloadedTensor.unpack, offload._OffloadedTensor.prefetch

    def unpack(self):
        log.append(("unpack", self.key[0]))
        return original_unpack(self)

    def prefetch(self):
        if self.fetched is None:
            log.append(("copy to device", self.key[0]))
        return original_prefetch(self)

    monkeypatch.setattr(offload._OffloadedTensor, "unpack", unpack)
    monkeypatch.setattr(offload._OffloadedTensor, "prefetch", prefetch)
    blocks = make_blocks(3, "eager")
    BlockInputOffloader(blocks)
    run(blocks, torch.randn(1, 5, DIM), torch.rand(3 * DIM))
    assert log == [
        ("copy to device", 2), ("unpack", 2),
        ("copy to device", 1), ("unpack", 1),
        ("copy to device", 0), ("unpack", 0),
    ]


def test_no_grad_forward_is_left_alone():
    blocks = make_blocks(2, "eager")
    offloader = BlockInputOffloader(blocks)
    with torch.no_grad():
        h = torch.randn(1, 4, DIM)
        for block in blocks:
            h = block(h, torch.ones(3 * DIM))
    assert offloader.offloaded_last_step == 0


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_one_exact_size_host_buffer_per_block_reused_every_step(backend):
    """Step 2 writes each block's input into the buffer step 1 made (same memory), which holds
    exactly the input's bytes; a new shape gets a new buffer; results stay exact every step."""
    scale = torch.rand(3 * DIM)
    blocks, plain = make_blocks(3, backend), make_blocks(3, backend)
    offloader = BlockInputOffloader(blocks)
    pointers = []
    for step, tokens in enumerate((12, 12, 7)):
        x = torch.randn(2, tokens, DIM)
        got, ref = run(blocks, x, scale), run(plain, x, scale)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        assert all(torch.equal(a, b) for a, b in zip(got[2], ref[2]))
        buffers = [offloader.host_buffer(i) for i in range(3)]
        assert [b.nbytes for b in buffers] == [2 * tokens * DIM * 4] * 3
        assert [b.untyped_storage().nbytes() for b in buffers] == [2 * tokens * DIM * 4] * 3
        assert sum(b.nbytes for b in buffers) == host_bytes_per_rank(3, 2 * tokens, DIM, torch.float32)
        pointers.append([b.data_ptr() for b in buffers])
    assert pointers[1] == pointers[0]  # reused
    assert offloader.host_buffer(0).shape == (2, 7, DIM)  # reallocated for the new shape
    offloader.remove()
    assert offloader.host_buffer(0) is None


def test_a_graph_still_alive_keeps_its_own_host_copies():
    """Two forwards before their backwards (both graphs alive): the second must not overwrite
    the first's host copies."""
    scale = torch.rand(3 * DIM)
    blocks, plain = make_blocks(2, "eager"), make_blocks(2, "eager")
    BlockInputOffloader(blocks)
    xs = [torch.randn(1, 6, DIM) for _ in range(2)]

    def two_forwards_then_backwards(model):
        outs = []
        for x in xs:
            h = x.clone().requires_grad_()
            outs.append((h, h))
            for block in model:
                outs[-1] = (outs[-1][0], block(outs[-1][1], scale))
        grads = []
        for h, out in outs:
            out.square().sum().backward()
            grads.append(h.grad)
        return grads

    assert all(torch.equal(a, b) for a, b in zip(two_forwards_then_backwards(blocks),
                                                 two_forwards_then_backwards(plain)))


def test_buffers_are_pinned_once_and_unpinned_when_dropped():
    """The pin function runs once per block buffer (not per step); the undo runs when the
    offloader drops the buffers."""
    pinned, unpinned = [], []

    def pin(tensor):
        pinned.append(tensor.data_ptr())
        return lambda: unpinned.append(tensor.data_ptr())

    blocks = make_blocks(3, "eager")
    offloader = BlockInputOffloader(blocks, pin=pin)
    for _ in range(2):
        run(blocks, torch.randn(1, 5, DIM), torch.rand(3 * DIM))
    assert pinned == [offloader.host_buffer(i).data_ptr() for i in range(3)]
    offloader.remove()
    import gc
    gc.collect()
    assert sorted(unpinned) == sorted(pinned)


def test_refused_pinning_falls_back_to_pageable_memory_said_once(caplog):
    calls = []

    def refuse(tensor):
        calls.append(tensor.nbytes)
        raise RuntimeError("cudaHostRegister of 320 B failed with cudaError 2")

    x, scale = torch.randn(2, 5, DIM), torch.rand(3 * DIM)
    plain = make_blocks(3, "eager")
    ref = [run(plain, x, scale) for _ in range(2)][-1]  # parameter gradients accumulate
    blocks = make_blocks(3, "eager")
    offloader = BlockInputOffloader(blocks, pin=refuse)
    with caplog.at_level("WARNING", logger="upipe_compile.stack.offload"):
        got = [run(blocks, x, scale) for _ in range(2)][-1]
    assert calls == [2 * 5 * DIM * 4]  # tried once, not for every block
    warnings = [r.getMessage() for r in caplog.records if "pageable" in r.getMessage()]
    assert len(warnings) == 1 and "cudaError 2" in warnings[0]
    assert all(not offloader._buffers[i, 0].pinned for i in range(3))
    assert torch.equal(got[0], ref[0]) and all(torch.equal(a, b) for a, b in zip(got[2], ref[2]))


def test_cgroup_limit_read_from_v2_and_v1_files(tmp_path):
    v2, v1, missing = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes", str(tmp_path / "none")
    v2.write_text("max\n")
    assert cgroup_memory_limit_bytes(str(v2), missing) is None  # "max": no limit
    v2.write_text("68719476736\n")
    assert cgroup_memory_limit_bytes(str(v2), missing) == 64 << 30
    v1.write_text("34359738368\n")
    assert cgroup_memory_limit_bytes(missing, str(v1)) == 32 << 30
    assert cgroup_memory_limit_bytes(str(v2), str(v1)) == 32 << 30  # the smaller
    assert cgroup_memory_limit_bytes(missing, missing) is None

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       134217728 kB\n")  # 128 GiB
    assert usable_host_memory(str(meminfo), str(v2), missing) == (64 << 30, "the job's cgroup allows")
    v1.write_text("9223372036854771712\n")  # cgroup v1's "no limit"
    assert usable_host_memory(str(meminfo), missing, str(v1)) == (128 << 30, "the node has")
    assert usable_host_memory(str(meminfo), missing, missing) == (128 << 30, "the node has")
    problem = host_memory_problem(40 << 30, 2, 64 << 30, 1 << 30, "the job's cgroup allows")
    assert problem.endswith("but the job's cgroup allows 64.0 GiB")


def test_host_memory_arithmetic_and_node_check(tmp_path, monkeypatch):
    gib = 1 << 30
    # Llama3-8B at 5M tokens on 8 ranks: 655360 tokens x 4096 x bf16 = 5 GiB per block, 32 blocks.
    per_rank = host_bytes_per_rank(32, 5242880 // 8, 4096, torch.bfloat16)
    assert per_rank == 160 * gib
    assert host_memory_problem(per_rank, 8, total_bytes=2048 * gib, reserve_bytes=64 * gib) is None
    problem = host_memory_problem(per_rank, 8, total_bytes=1024 * gib, reserve_bytes=64 * gib)
    assert "160.0 GiB of host memory per rank x 8 ranks per node = 1280.0 GiB" in problem
    assert "node has 1024.0 GiB" in problem

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       2113929216 kB\nMemFree:        1000 kB\n")
    assert total_host_memory_bytes(str(meminfo)) == 2113929216 * 1024
    assert total_host_memory_bytes(str(tmp_path / "missing")) > 0  # falls back to sysconf

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ranks_per_node(default=16) == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert ranks_per_node(default=16) == 16


def test_default_reserve_scales_with_the_machine():
    """A quarter of the memory, at most 64 GiB: a 24 GiB workstation keeps 6 GiB, a 256 GiB node
    and a "2 TB" one 64 GiB (the estimate's 2 TB budget stays 1,798 GiB); a reserve the job sets
    wins, and the refusal says which it was."""
    from upipe_compile.stack.host_memory import HOST_BUDGET_GIB, NODE_2TB_MEMTOTAL_GIB, default_host_reserve_gib

    gib = 1 << 30
    assert default_host_reserve_gib(24) == 6
    assert default_host_reserve_gib(256) == 64
    assert default_host_reserve_gib(NODE_2TB_MEMTOTAL_GIB) == 64
    assert HOST_BUDGET_GIB == 1798
    reserve, why = host_reserve(24 * gib)
    assert reserve == 6 * gib and why.startswith("the default: 25% of 24.0 GiB, at most 64 GiB")
    assert host_reserve(24 * gib, 0.5) == (gib // 2, "host_memory_reserve_gib=0.5, as set")
    # 0.1 MiB of offloaded inputs fit a 24 GiB machine by default; 20 GiB do not
    assert host_memory_problem(100 << 10, 1, 24 * gib, reserve, reserve_why=why) is None
    problem = host_memory_problem(20 * gib, 1, 24 * gib, reserve, reserve_why=why)
    assert "plus a reserve of 6.0 GiB (the default: 25% of 24.0 GiB, at most 64 GiB;" in problem


def test_with_fsdp2_inputs_are_released_and_results_exact(rank_pools):
    """torchtitan's order: checkpoint_wrapper -> per-block compile -> FSDP2 (blocks and root),
    hooks on the final block modules: FSDP's pre-forward alias of the input still matches,
    nothing else keeps the inputs, and results equal the same model without offload."""
    assert rank_pools(1).run(_fsdp_blocks_job) == [([True, True], [False, False], True)]


def _fsdp_blocks_job():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x, scale = torch.randn(1, 10, DIM), torch.rand(3 * DIM)

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(make_blocks(3, "aot_eager"))

        def forward(self, h, refs):
            for block in self.layers:
                refs.append(StorageWeakRef(h.untyped_storage()))
                h = block(h, scale)
            return h

    def run_model(offload):
        model = Stack()
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        offloader = BlockInputOffloader(list(model.layers)) if offload else None
        refs = []
        h = model(x.clone().requires_grad_(), refs)
        alive = [not ref.expired() for ref in refs[1:]]
        h.square().sum().backward()
        grads = [p.grad.full_tensor() for p in model.parameters()]
        if offloader:
            assert offloader.offloaded_last_step == 3
        return alive, h.detach(), grads

    alive_plain, out_plain, grads_plain = run_model(False)
    alive_offload, out_offload, grads_offload = run_model(True)
    exact = torch.equal(out_plain, out_offload) and all(torch.equal(a, b) for a, b in zip(grads_plain, grads_offload))
    return alive_plain, alive_offload, exact


class ReportingBlock(nn.Module):
    """Stands in for a block whose attention op reports its output (upipe's ops do, see
    upipe_compile.attention.op_outputs) before the rest of the block saves it: square saves its
    input."""

    def __init__(self, keep_alive: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(DIM) + 0.5)
        self.keep_alive, self.held = keep_alive, None

    def forward(self, x):
        from upipe_compile.attention import op_outputs

        out = x * self.weight  # saves x and the weight
        op_outputs.report(out)
        if self.keep_alive:  # held outside autograd, as an eager selective checkpoint's cache holds it
            self.held = out
            return out * 0.5
        return out.square() * 0.5


def test_kept_outputs_go_to_host_beside_the_block_input(caplog):
    """With kept_outputs, a saved tensor that an attention op reported during the block's
    forward is offloaded to its own host buffer too (not the parameters, not other saved
    tensors), fetched back for backward, and the gradients are exact; without, only the input."""
    x = torch.randn(2, 5, DIM)

    def run_blocks(kept_outputs, keep_alive=False):
        torch.manual_seed(0)
        blocks = [ReportingBlock(keep_alive) for _ in range(3)]
        offloader = BlockInputOffloader(blocks, kept_outputs=kept_outputs)
        h = x.clone().requires_grad_()
        leaf = h
        for block in blocks:
            h = block(h)
        h.sum().backward()
        counts = offloader.offloaded_last_step, offloader.offloaded_bytes_last_step
        offloader.remove()
        return counts, leaf.grad, [b.weight.grad for b in blocks]

    (plain_count, plain_bytes), plain_grad, plain_weights = run_blocks(kept_outputs=False)
    (count, moved), grad, weights = run_blocks(kept_outputs=True)
    assert (plain_count, count) == (3, 6)
    assert moved == 2 * plain_bytes == 2 * 3 * x.numel() * 4
    assert torch.equal(grad, plain_grad) and all(torch.equal(a, b) for a, b in zip(weights, plain_weights))
    assert not [r for r in caplog.records if "keeps an attention output" in r.getMessage()]
    with caplog.at_level("WARNING", logger="upipe_compile.stack.offload"):
        run_blocks(kept_outputs=True, keep_alive=True)
    said = [r.getMessage() for r in caplog.records if "keeps an attention output on the device" in r.getMessage()]
    assert len(said) == 1, said
