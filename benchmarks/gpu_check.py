"""The first command on a GPU node: does the CUDA path work, and does the memory model hold?

    python benchmarks/gpu_check.py                 # one GPU, about 3 minutes on an H100
    python benchmarks/gpu_check.py --quick         # small shapes; also runs on CPU (a smoke test)

Eight sections, each a table; a section that fails prints its traceback and the others still
run; the exit status is non-zero when any check failed.

1. kernels: benchmarks/kernel_check.py's checks on this device's kernels (aten flash;
   flash-attn if installed) against SDPA's float32 math.
2. stage-loop memory: one rank's forward + backward of the stage loops
   (``stage_loop_forward`` / ``stage_loop_backward``) on real device tensors over a *fake*
   process group of P ranks (Llama3-8B heads: 32 q, 8 kv, head_dim 128, bf16, causal). The
   collectives move nothing (their outputs are uninitialised) but every allocation is real,
   so ``torch.cuda.max_memory_allocated`` is the real peak. Measured: the peak beyond the op's
   inputs and outputs (fwd: q, k, v, out, lse; bwd: also dout, dq, dk, dv), against
   ``upipe_compile.measure.memory.measure_op_memory(..., cuda_kernel=<this kernel>)`` on fake
   tensors, which is what benchmarks/op_memory.py reports. U = P (UPipe) and U = Hq (Ulysses).
3. stage-loop time: the same calls timed (no communication: the stage loop's kernels and
   copies alone), UPipe over Ulysses.
4. offload: 8 checkpointed MLP blocks (d 4096, bf16) with and without
   ``upipe_compile.stack.offload.BlockInputOffloader``: gradients equal, peak memory saved vs the
   block inputs' size, step time. Weight gradients go to the host as they are made (as a
   sharded gradient would leave), so the peak is the activations'.
5. packed sequences: the kernels' varlen path (``Documents`` boundaries, single-token
   documents included) against SDPA run per document: out, lse, dq, dk, dv.
6. offload host buffers: two steps of 2 offloaded blocks whose input is not a power of two
   in bytes: each block's host buffer holds exactly the input's bytes, is pinned (CUDA), is
   the same memory in step 2, and torch's pinned allocator (which rounds up to a power of
   two) grew by nothing.
7. varlen host syncs (CUDA): a second packed forward + backward (and a ``document_sdpa``
   layer) under ``torch.cuda.set_sync_debug_mode("error")``: no blocking host<->device copy.
8. fused block bf16: the fused attention block (one head a stage) on a one-rank group against
   the plain block, both bf16, errors against float32: within 1.5x of the plain block's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)  # after site-packages: an installed upipe_compile wins over the bare checkout

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

# The sections live in two modules, grouped by what they check.
from benchmarks.gpu_check_kernels import (  # noqa: E402
    section_fused_block_bf16, section_kernels, section_packed, section_varlen_syncs,
)
from benchmarks.gpu_check_memory import (  # noqa: E402
    GiB, section_offload, section_offload_host_buffers, section_stage_loop,
)
from benchmarks.report import write_out  # noqa: E402


def device_line(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (f"{props.name}, {props.total_memory / GiB:.1f} GiB, {props.multi_processor_count} SMs, "
                f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    return f"CPU, torch {torch.__version__}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke test; runs on CPU too)")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--seqs", default=None, help="comma-separated full sequence lengths for sections 2-3 "
                        "(default 262144,524288,1048576; --quick: 1024)")
    parser.add_argument("--only", default=None, help="comma-separated section numbers to run (default all)")
    parser.add_argument("--out", help="also write the tables to this markdown file")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    seqs = [int(s) for s in args.seqs.split(",")] if args.seqs else ([1024] if args.quick else [2**18, 2**19, 2**20])
    only = None if args.only is None else {int(s) for s in args.only.split(",")}
    sections = [
        (1, lambda: section_kernels(device, args.quick)),
        (2, lambda: section_stage_loop(device, args.quick, args.world, seqs, reps=2)),
        (4, lambda: section_offload(device, args.quick, 8 if not args.quick else 3, 4096 if not args.quick else 128,
                                    32768 if not args.quick else 256, reps=3)),
        (5, lambda: section_packed(device, args.quick)),
        (6, lambda: section_offload_host_buffers(device, args.quick)),
        (7, lambda: section_varlen_syncs(device, args.quick)),
        (8, lambda: section_fused_block_bf16(device, args.quick)),
    ]
    lines = [f"# device: {device_line(device)}", f"# command: python benchmarks/gpu_check.py {' '.join(argv or sys.argv[1:])}".rstrip()]
    print("\n".join(lines), flush=True)
    failed = []
    for number, run in sections:
        if only is not None and number not in only:
            continue
        start = time.perf_counter()
        try:
            tables, ok = run()
        except Exception:  # each section reports its own failure and the rest still run
            text = f"\n## section {number}: FAILED with an exception\n```\n{traceback.format_exc()}```"
            tables, ok = [], False
            print(text, flush=True)
            lines.append(text)
        for title, rows in tables:
            text = f"\n## {title}\n\n" + tabulate(rows, headers="keys", floatfmt=".3g", tablefmt="github")
            print(text, flush=True)
            lines.append(text)
        status = f"\nsection {number}: {'ok' if ok else 'FAILED'} ({time.perf_counter() - start:.1f} s)"
        print(status, flush=True)
        lines.append(status)
        if not ok:
            failed.append(number)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    summary = f"\n{'all sections passed' if not failed else f'FAILED sections: {failed}'}"
    print(summary)
    lines.append(summary)
    write_out("\n".join(lines), args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
