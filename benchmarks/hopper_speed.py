"""Stage-loop time of each usable CUDA kernel against aten flash, on this device.

    python benchmarks/hopper_speed.py                      # 1M tokens, every installed kernel
    python benchmarks/hopper_speed.py --seq 65536 --deadline 60
    python benchmarks/hopper_speed.py --quick              # CPU smoke test (aten's CPU kernel only)

One rank of Llama3-8B's attention at U = 8 over P = 8 (32 q heads, 8 KV heads, head_dim 128,
bf16, causal): the stage loop's forward + backward (``stage_loop_forward`` /
``stage_loop_backward``, 4 stages of one q head over the full sequence) on real device
tensors over a fake process group (the collectives move nothing: the kernels and copies
alone). Each kernel of :data:`upipe_compile.attention.kernels.CUDA_KERNELS` that is installed
and usable here is forced in turn; the first call (FA4 compiles then) is not timed; best of
``--reps``. Prints a table with the ratio to aten flash; each row is printed (and appended
to ``--out``) as soon as it is measured, and kernels not reached by ``--deadline`` seconds
are listed as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)  # after site-packages: an installed upipe_compile wins over the bare checkout

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

from upipe_compile.attention import kernels  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, WORLD, U = 32, 8, 128, 8, 8


@contextlib.contextmanager
def forced(kernel):
    """The registry's pick replaced by ``kernel`` while timing it."""
    previous = kernels._cuda_kernels
    kernels._cuda_kernels = lambda: kernel
    try:
        yield
    finally:
        kernels._cuda_kernels = previous


def usable_kernels(device) -> list[tuple[str, object]]:
    if device.type != "cuda":
        return [("aten-cpu", None)]
    found = []
    for name, kernel_type in kernels.CUDA_KERNELS.items():
        try:
            kernel = kernel_type.installed()
        except Exception as error:  # a broken install is reported, not fatal
            print(f"# {name}: not usable ({type(error).__name__}: {error})", flush=True)
            continue
        if kernel is not None:
            found.append((name, kernel))
    return found


def time_stage_loop(device, seq: int, reps: int) -> tuple[float, float]:
    """(best forward seconds, best backward seconds) of one rank's stage loop."""
    from upipe_compile.attention.stage_loop import StageLoopSettings, stage_loop_backward, stage_loop_forward
    from upipe_compile.measure.memory import fake_process_group

    s_local = seq // WORLD
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, Q_HEADS, s_local, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, KV_HEADS, s_local, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
    v, dout = torch.randn_like(k), torch.randn_like(q)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fwd, bwd = [], []
    with fake_process_group(WORLD) as group:
        settings = StageLoopSettings(True, None, U, WORLD, group.group_name, "forward")
        for rep in range(reps + 1):  # the first is a warm-up (kernel selection, JIT)
            sync()
            start = time.perf_counter()
            out, lse = stage_loop_forward(q, k, v, settings)
            sync()
            middle = time.perf_counter()
            stage_loop_backward(dout, q, k, v, out, lse, settings)
            sync()
            if rep:
                fwd.append(middle - start)
                bwd.append(time.perf_counter() - middle)
    return min(fwd), min(bwd)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=2**20, help="full sequence length (default 1,048,576)")
    parser.add_argument("--reps", type=int, default=2, help="timed repetitions per kernel (best is kept)")
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds; kernels not started by then are "
                        "skipped")
    parser.add_argument("--quick", action="store_true", help="CPU smoke test: --seq 2048 --reps 1 on the CPU")
    parser.add_argument("--out", help="also append each row (markdown) to this file")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    seq, reps = (2048, 1) if args.quick or device.type == "cpu" else (args.seq, args.reps)
    start = time.monotonic()
    found = usable_kernels(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# {where}, torch {torch.__version__}; Llama3-8B 32q/8kv D128 bf16 causal, S={seq}, one rank of "
          f"P={WORLD}, U={U}; usable: {[name for name, _ in found]}", flush=True)
    rows, baseline = [], None
    # aten flash first, so that every later row has its ratio
    for name, kernel in sorted(found, key=lambda item: item[0] not in ("aten-flash", "aten-cpu")):
        if time.monotonic() - start > args.deadline:
            rows.append({"kernel": name, "note": f"skipped: past the {args.deadline:.0f} s deadline"})
            print(f"# {name}: skipped (deadline)", flush=True)
            continue
        try:
            with forced(kernel) if kernel is not None else contextlib.nullcontext():
                fwd, bwd = time_stage_loop(device, seq, reps)
        except Exception as error:
            row = {"kernel": name, "note": f"failed: {type(error).__name__}: {str(error)[:160]}"}
        else:
            baseline = baseline or fwd + bwd
            row = {"kernel": name, "fwd_s": fwd, "bwd_s": bwd, "fwd+bwd_s": fwd + bwd,
                   "vs aten flash": (fwd + bwd) / baseline}
        rows.append(row)
        line = tabulate([row], headers="keys", floatfmt=".3f", tablefmt="github")
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as file:
                file.write(line + "\n")
    print(tabulate(rows, headers="keys", floatfmt=".3f", tablefmt="github"))
    return 1 if any("failed" in row.get("note", "") for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
