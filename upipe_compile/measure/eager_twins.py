"""The "upipe" backend's rewrite with the custom ops swapped for their eager twins, for
fake-tensor memory measurement of compiled modules (the whole-step estimate).

Under FakeTensorMode a custom op runs only its fake kernel: ``upipe::attention_block`` would
allocate its outputs and nothing else, and the stage loops' buffers would never exist. This
backend runs the same passes as ``backend="upipe"`` (find, validate, fuse or rewrite, with
the same options), then points each ``upipe::attention`` / ``upipe::attention_block`` node at
the op's eager twin (:class:`~upipe_compile.measure.memory.StageLoopFunction`,
:class:`~upipe_compile.block.ops.BlockFunction`): the real loops, saving for backward what
the op saves. The graph is then run as it is (no inner compiler)::

    %y = upipe.attention_block(%x, %wq, ..., *BlockSettings(...).op_args())
      ->  %y = block_twin(%x, %wq, ..., *BlockSettings(...).op_args())
"""

from __future__ import annotations

import torch
import torch.fx as fx

from upipe_compile.backend import apply_upipe_passes
from upipe_compile.block.ops import BlockFunction
from upipe_compile.measure.memory import StageLoopFunction, count_eager_call
from upipe_compile.attention.ops import parse_op_arguments
from upipe_compile.block.ops import BlockSettings
from upipe_compile.options import UPipeOptions


def block_twin(x, wq, bq, wk, bk, wv, bv, wo, bo, extras, cu_seqlens, *settings):
    count_eager_call("fused block")
    y = BlockFunction.apply(x, wq, bq, wk, bk, wv, bv, wo, bo, BlockSettings.from_op_args(*settings), cu_seqlens,
                            *extras)
    return y, None, None  # the rewrite reads y only; o and lse stay inside the Function


def attention_twin(*args):
    q, k, v, settings, cu_seqlens, sinks, alibi_slopes = parse_op_arguments(args)
    return StageLoopFunction.apply(q, k, v, settings, sinks, alibi_slopes, cu_seqlens), None


TWINS = {
    torch.ops.upipe.attention_block.default: block_twin,
    torch.ops.upipe.attention.default: attention_twin,
}


def use_eager_twins(gm: fx.GraphModule) -> int:
    """Point every upipe op node of ``gm`` (nested bodies included) at its twin; how many."""
    swapped = 0
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op == "call_function" and node.target in TWINS:
                node.target = TWINS[node.target]
                swapped += 1
        module.recompile()
    return swapped


def eager_twin_backend(gm: fx.GraphModule, example_inputs, options=None):
    """``torch.compile(fn, backend=eager_twin_backend, options={...})``: the upipe passes with
    the same options as ``backend="upipe"``, then the eager twins; the graph runs as it is.
    One function for every call site, so that Dynamo shares one compiled graph between the
    blocks of a model (a new backend object per block would recompile per block)."""
    gm = apply_upipe_passes(gm, UPipeOptions.from_user(options))
    use_eager_twins(gm)
    return gm.forward
