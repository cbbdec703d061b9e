"""Throughput of context-parallel attention on real ranks: forward + backward time of
(a) the attention op alone and (b) a small Llama-style decoder block, for

  * Ulysses (ours)          upipe_compile with U = all query heads (the baseline)
  * UPipe U=P, UPipe U=2P   upipe_compile's stage loop (default prefetch: the next stage's
                            all-to-alls start during this stage's forward kernel)
  * UPipe U=P, no prefetch / prefetch both
                            the same loop with prefetch off / also in backward (A/B)
  * UPipe U=P, unfused      the block's SDPA alone in the stage loop (fuse_projections off)
  * UPipe U=P, output recomputed
                            the fused block keeping no attention output for backward
                            (recompute_attention_output; only with --methods)
  * DeepSpeed Ulysses       deepspeed.sequence.layer.DistributedAttention
  * torch ring CP           torch.distributed.tensor.experimental.context_parallel

over P ranks (gloo on CPU, NCCL when there is a GPU per rank), plus the compile time of
backend="upipe" against the plain inner backend on the same block.

    python benchmarks/throughput.py                       # P in {2, 4}, a few lengths, minutes on 2 cores
    python benchmarks/throughput.py --world 4 --seqs 4096 8192 --repeats 7
    python benchmarks/throughput.py --quick --out-dir /tmp/x   # tiny model, aot_eager: a smoke run

All methods run in one process group per P, interleaved step by step (so a noisy machine
slows all of them alike): warm-up, then the median of the repeats, each step timed as the
slowest rank's. A method that cannot run here (DeepSpeed not installed, torch's ring CP on
CPU, ...) gets the reason in the table instead of a number. Before timing, every method's
output and gradients are checked against our Ulysses (relative error in the table); the
run fails if any differs. At the largest length the op's step is also profiled and split
into attention kernels / collectives / copies / other (--profile). Results:
<out-dir>/throughput.md, throughput.csv and throughput_profile.csv, the exact command at
the top of each. The NCCL/GPU path is written against the same APIs but has only been run
on CPU.

Files: this one (options, launching the ranks for each P, progress), throughput_methods.py
(the named methods and their steps), throughput_run.py (what each rank measures),
throughput_report.py (tables and CSVs).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: make `benchmarks` and `upipe_compile` importable
    sys.path.append(ROOT)  # after site-packages: an installed upipe_compile wins over the bare checkout

import torch  # noqa: E402

from benchmarks import throughput_report  # noqa: E402
from benchmarks.throughput_methods import DTYPES, METHODS, NAMES, select_methods  # noqa: E402
from benchmarks.throughput_run import rank_job  # noqa: E402
from benchmarks.tiny_llama import LlamaConfig  # noqa: E402
from upipe_compile.launch import run_on_ranks  # noqa: E402

# Attention shapes: U = P, 2P and all heads must be distinct and divide the query heads, and
# DeepSpeed's Ulysses needs at least P KV heads (it refuses fewer).
MODELS = {
    # CPU default: 16 q / 4 KV heads of 64 (P = 2, 4)
    "tiny": LlamaConfig(vocab=512, hidden=1024, layers=1, q_heads=16, kv_heads=4, ffn=2048),
    # GPU default: Llama3-8B's block, 32 q / 8 KV heads of 128 (P = 2, 4, 8)
    "llama3-8b": LlamaConfig(vocab=512, hidden=4096, layers=1, q_heads=32, kv_heads=8, ffn=14336),
    # --quick: the tiny model's heads at head_dim 16
    "quick": LlamaConfig(vocab=512, hidden=256, layers=1, q_heads=16, kv_heads=4, ffn=512),
}
TOLERANCE = {"bf16": 3e-2, "fp32": 1e-4}


class Progress:
    """Steps done so far, on stderr: a tqdm bar, or a plain line per update without tqdm."""

    def __init__(self):
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        self.bar = tqdm(total=0, file=sys.stderr, unit="step", dynamic_ncols=True, mininterval=1.0) if tqdm else None
        self.done = self.total = 0

    def expect(self, steps: int) -> None:
        self.total += steps
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.refresh()

    def advance(self, steps: int, label: str) -> None:
        self.done += steps
        if self.bar is None:
            print(f"[{self.done}/{self.total}] {label}", file=sys.stderr, flush=True)
        else:
            self.bar.set_description(label, refresh=False)
            self.bar.update(steps)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4], help="context-parallel sizes P (default: 2 4)")
    parser.add_argument("--seqs", type=int, nargs="+", default=None,
                        help="full sequence lengths (default: 2048 4096 8192; --quick: 256)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per method (default 5; --quick: 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per method before timing; the first "
                                                               "compiles and is checked (default 1)")
    parser.add_argument("--cases", nargs="+", choices=["op", "block"], default=["op", "block"])
    parser.add_argument("--model", choices=sorted(MODELS), default=None,
                        help="attention heads and block size: tiny (CPU default), llama3-8b (GPU default), "
                             "quick (--quick)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="largest relative error vs Ulysses (ours) that passes (default 3e-2 for bf16, 1e-4 for "
                             "fp32; in bf16 the CPU kernel's own dK/dV error grows with the length, Ulysses' most: "
                             "1.4e-2 vs fp32 at 8192 tokens)")
    parser.add_argument("--inner-backend", default=None, choices=["inductor", "aot_eager", "eager"],
                        help="compiles the block (ours inside backend='upipe', the peers directly); "
                             "default inductor, --quick: aot_eager")
    parser.add_argument("--compile-time", action=argparse.BooleanOptionalAction, default=True,
                        help="measure compile time of backend='upipe' vs the plain inner backend (on the first P)")
    parser.add_argument("--compile-backend", default=None, choices=["inductor", "aot_eager"],
                        help="the inner backend for the compile-time comparison (default inductor; --quick: aot_eager)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: cuda with NCCL when there is a GPU per rank, else cpu with gloo")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores // P, at least 1)")
    parser.add_argument("--timeout", type=int, default=900, help="process-group timeout, seconds")
    parser.add_argument("--profile", type=int, default=2, metavar="STEPS",
                        help="profile STEPS steps of each op method at the largest length, per P, and split the "
                             "time into attention kernels / collectives / copies / other (default 2; 0: off)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: the quick model (hidden 256, 16 q / 4 KV heads of 16), aot_eager, "
                             "256 tokens, 2 repeats (explicit flags still win)")
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--methods", nargs="+", choices=NAMES, default=None,
                        help=f"only these methods ({NAMES[0]!r}, the reference, always runs)")
    args = parser.parse_args(argv)
    select_methods(args.methods)

    args.seqs = args.seqs or ([256] if args.quick else [2048, 4096, 8192])
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.inner_backend = args.inner_backend or ("aot_eager" if args.quick else "inductor")
    args.compile_backend = args.compile_backend or ("aot_eager" if args.quick else "inductor")
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (the first warm-up step is the correctness check)")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= max(args.world) else "cpu"
    args.model = args.model or ("quick" if args.quick else "llama3-8b" if args.device == "cuda" else "tiny")
    cfg = MODELS[args.model]
    for world in args.world:
        for seq in args.seqs:
            if seq % world:
                parser.error(f"sequence length {seq} is not divisible by P={world}")
        if cfg.q_heads % (2 * world):
            parser.error(f"P={world}: U=2P={2 * world} must divide the {cfg.q_heads} query heads")
    return args


def inductor_cache_dir(world: int) -> str:
    """One inductor cache per P. upipe's op takes P as an argument, so its compiled graphs
    cannot be served at another P; the peers' graphs (DeepSpeed, torch ring CP) are not known
    to key on P, and e.g. P = 2, S = 4096 has the same local shapes as P = 4, S = 8192."""
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not base:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        base = default_cache_dir()
    return os.path.join(base, f"upipe-throughput-P{world}")


def expected_steps(args, world: int, with_compile_time: bool) -> int:
    """How many progress steps the ranks of one P will report."""
    cells = len(METHODS) * len(args.cases) * len(args.seqs) * (args.warmup + args.repeats)
    profiled = sum(m.profiled for m in METHODS) * args.profile * ("op" in args.cases)
    return cells + profiled + (4 if with_compile_time else 0)


def main(argv=None):
    args = parse_args(argv)
    cfg = MODELS[args.model]
    cores = torch.get_num_threads()
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # P ranks compile at once: no worker pools
    command = throughput_report.command_line()

    started = time.perf_counter()
    result = {"rows": [], "profile": [], "compile": []}
    threads, reasons = {}, {}
    progress = Progress()
    try:
        for index, world in enumerate(args.world):
            with_compile_time = index == 0 and args.compile_time
            threads[world] = args.threads or max(1, cores // world)
            progress.expect(expected_steps(args, world, with_compile_time))
            world_result = run_on_ranks(
                world, rank_job, args, cfg, with_compile_time,
                on_report=lambda rank, message: progress.advance(*message),
                backend="nccl" if args.device == "cuda" else "gloo", threads=threads[world], timeout_s=None,
                group_timeout_s=args.timeout, env={"TORCHINDUCTOR_CACHE_DIR": inductor_cache_dir(world)},
            )[0]
            for key in result:
                result[key] += world_result[key]
            for name, reason in world_result["reasons"].items():
                reasons[name] = reasons.get(name) or reason  # the first P's reason where one did not run
    finally:
        progress.close()
    wall = time.perf_counter() - started

    tol = args.tolerance if args.tolerance is not None else TOLERANCE[args.dtype]
    text, ok = throughput_report.markdown(args, cfg, command, result, threads, reasons, tol, wall)
    written = throughput_report.write(args.out_dir, args, command, text, result)
    print(text)
    print("wrote " + ", ".join(written))
    if not ok or any(not math.isfinite(row.get("median ms", 1.0)) for row in result["rows"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
