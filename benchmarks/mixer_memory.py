"""Peak memory of a hybrid layer's mixers under UPipe vs the whole-head all-to-all, at real scale.

    python benchmarks/mixer_memory.py                          # P=8, 1M tokens, bf16
    python benchmarks/mixer_memory.py --out benchmarks/results/mixer_memory.md

One rank's peak over forward + backward of ``upipe::head_mixer_loop``'s loops beyond the
mixer's own inputs, output and input gradients, measured on fake tensors over a fake
process group (torch's MemTracker), for Qwen3-Next-80B's Gated DeltaNet layer (its short
causal conv over 8192 channels, then the gated delta rule over 32 value heads of 128, whose
16 q/k heads each serve two: a stage gets the q/k heads its value heads share) at the default
stage count and at one
stage (every local head exchanged at once: what a Ulysses-style all-to-all holds). The conv
is transformers' own torch implementation; the gated delta rule is a stand-in of the same
inputs and output with no workspace of its own (the torch fallback's Python loop over 64-token
chunks is too slow to trace at 1M tokens; fla's kernel keeps O(chunk) state per head on top):
its rows measure the stage loop's exchange buffers, which are what the stage count changes.
Bamba-9B's Mamba2 scan (128 heads of 64, one group of B/C with state 128) is measured the same
way with a workspace-free stand-in (transformers' torch scan materialises chunk-by-chunk
score tensors that a CUDA kernel does not): B and C travel once per rank per stage (every
head of the rank shares the one group).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: make `benchmarks` importable
    sys.path.append(ROOT)  # after site-packages: an installed upipe_compile wins over the bare checkout

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker  # noqa: E402

from benchmarks.report import emit  # noqa: E402
from upipe_compile.measure.memory import fake_process_group, tracker_peak_bytes  # noqa: E402
from upipe_compile.mixers.loop import loop_backward, loop_forward  # noqa: E402
from upipe_compile.mixers.registry import KINDS  # noqa: E402
from upipe_compile.passes.mixer_match import mixer_stages  # noqa: E402

CONV_CHANNELS, CONV_KERNEL = 8192, 4  # 2 x 16 key heads x 128 + 32 value heads x 128
VALUE_HEADS, KEY_HEADS, HEAD_DIM = 32, 16, 128
MAMBA2_HEADS, MAMBA2_HEAD_DIM, MAMBA2_GROUPS, MAMBA2_STATE = 128, 64, 1, 128  # Bamba-9B's Mamba2 layer


def _conv(x, weight, bias, activation=None):
    padding = weight.shape[-1] - 1
    out = torch.nn.functional.conv1d(x, weight.unsqueeze(1), bias, padding=padding, groups=x.shape[1])
    return torch.nn.functional.silu(out[..., : x.shape[-1]])


def _delta_stand_in(q, k, v, g=None, beta=None, **unused):
    """Same inputs and output as the gated delta rule, no workspace: the loop's buffers alone."""
    return v * (beta * g.exp()).unsqueeze(-1), None


def _mamba2_stand_in(x, dt, A, B, C, D=None, dt_bias=None, **unused):
    """Same inputs and output as Mamba2's SSD scan, no workspace: the loop's buffers alone."""
    heads, groups = x.shape[2], B.shape[2]
    mix = (B * C).sum(-1).repeat_interleave(heads // groups, dim=2)
    return x.float() * (dt.float() * A + D + dt_bias + mix).unsqueeze(-1)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def measure(kind: str, group, seq: int, stages: int) -> tuple[int, int]:
    world, s_local, dtype = group.size(), seq // group.size(), torch.bfloat16
    spec = KINDS[kind]
    with FakeTensorMode():
        if kind == "causal_conv1d":
            full = [torch.empty(1, CONV_CHANNELS, s_local, dtype=dtype), torch.empty(CONV_CHANNELS, CONV_KERNEL,
                                                                                       dtype=dtype), None]
            implementation, settings = _conv, {}
        elif kind == "mamba2_chunk_scan":
            full = [torch.empty(1, s_local, MAMBA2_HEADS, MAMBA2_HEAD_DIM, dtype=dtype),
                    torch.empty(1, s_local, MAMBA2_HEADS, dtype=dtype), torch.empty(MAMBA2_HEADS)]
            full += [torch.empty(1, s_local, MAMBA2_GROUPS, MAMBA2_STATE, dtype=dtype) for _ in range(2)]
            full += [torch.empty(MAMBA2_HEADS), torch.empty(MAMBA2_HEADS)]
            implementation, settings = _mamba2_stand_in, {"chunk_size": 256}
        else:
            qk = [torch.empty(1, s_local, KEY_HEADS, HEAD_DIM, dtype=dtype) for _ in range(2)]
            full = qk + [torch.empty(1, s_local, VALUE_HEADS, HEAD_DIM, dtype=dtype)]
            full += [torch.empty(1, s_local, VALUE_HEADS, dtype=torch.float32) for _ in range(2)]
            implementation, settings = _delta_stand_in, {}
        forward = MemTracker()
        forward.track_external(*[t for t in full if t is not None])
        with forward:
            out = loop_forward(spec, implementation, full, settings, group.group_name, world, stages)
            forward_bytes = tracker_peak_bytes(forward) - _nbytes(full) - _nbytes([out])
        dout = torch.empty_like(out)
        backward = MemTracker()
        backward.track_external(*[t for t in full if t is not None], out, dout)
        with backward:
            grads = loop_backward(spec, implementation, full, settings, group.group_name, world, stages, dout)
            backward_bytes = tracker_peak_bytes(backward) - _nbytes(full) - _nbytes([out, dout]) - _nbytes(grads)
    return forward_bytes, backward_bytes


def run(world: int, seq: int) -> list[dict]:
    rows = []
    with fake_process_group(world) as group:
        for kind, heads, label in [("causal_conv1d", CONV_CHANNELS, "short conv, 8192 channels"),
                                   ("gated_delta_rule", VALUE_HEADS, "gated delta rule, 32 heads (stand-in)"),
                                   ("mamba2_chunk_scan", MAMBA2_HEADS, "Mamba2 scan, 128 heads (stand-in)")]:
            results = {}
            for stages in (mixer_stages(heads, world), 1):
                results[stages] = measure(kind, group, seq, stages)
            whole = max(results[1])
            for stages, (fwd, bwd) in results.items():
                rows.append({"mixer": label, "method": "UPipe" if stages > 1 else "whole-head all-to-all",
                             "stages": stages, "fwd_GiB": fwd / 2**30, "bwd_GiB": bwd / 2**30,
                             "peak_GiB": max(fwd, bwd) / 2**30, "ratio": max(fwd, bwd) / whole})
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2**20)
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)
    rows = run(args.world, args.seq)
    text = "\n".join([
        f"# python benchmarks/mixer_memory.py --world {args.world} --seq {args.seq}",
        f"# Qwen3-Next-80B Gated DeltaNet mixers and Bamba-9B's Mamba2 scan: peak beyond inputs/output/grads "
        f"per rank, fwd and bwd, bf16, "
        f"P={args.world}, {args.seq} tokens (fake tensors + fake process group)",
        tabulate(rows, headers="keys", floatfmt=".3f", tablefmt="github"),
    ])
    emit(text, args.out)


if __name__ == "__main__":
    sys.exit(main())
