"""One rank of a real torchtitan job on one device: step time of UPipe, UPipe + keep_attention
and Ulysses, and the device peak against the whole-step estimate of the same job.

    python benchmarks/gpu_rank.py [--layers 2] [--seqs 262144 524288 1048576] [--out FILE]
    python benchmarks/gpu_rank.py --tiny      # the debug model on CPU (what the tests run)

The job is the shipped Llama3-8B TOML (integrations/torchtitan/llama3_8b_upipe_5m.toml: CP = 8,
the long-context stack, full AC) with its real dimensions and ``--layers`` of its 32 layers.
This process is rank 0 of the job's 8 ranks over torch's fake process group: its collectives
move nothing (the other ranks' shares are whatever the buffers held), everything else is real —
the blocks compiled with ``backend="upipe"``, the device's attention kernels, FSDP's buffers,
the offload to pinned host memory. Per context and method: two steps (the first compiles),
the second timed, and ``torch.cuda.max_memory_allocated`` over it, against the estimate's
per-rank peak for the same job and layer count (on fake tensors, on the host's CPUs beside the
device runs; its reserve is not part of either). Without the other ranks nothing waits on a collective: the step time is one rank's
compute, the part the step-time model calls attention, linear algebra and loss.

Methods: UPipe (U = 8 = P), UPipe + keep_attention (its kept outputs offloaded beside the block
inputs) and Ulysses (U = 32). Each method runs in its own process (its own compiled graphs and
memory statistics).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

TOML = os.path.join(ROOT, "integrations", "torchtitan", "llama3_8b_upipe_5m.toml")
DEBUG_TOML = os.path.join(ROOT, "integrations", "torchtitan", "debug_model_upipe_cpu.toml")
FLAVOR = "gpu_rank"
GIB = 1 << 30
METHODS = {  # name -> overrides
    "UPipe (U = 8)": ["--upipe.heads_per_stage", "8"],
    "UPipe + keep_attention": ["--upipe.heads_per_stage", "8", "--upipe.keep_attention"],
    "Ulysses (U = 32)": ["--upipe.heads_per_stage", "32"],
}
TINY_METHODS = {  # the debug model: 16 heads over CP = 2
    "UPipe (U = 2)": ["--upipe.heads_per_stage", "2"],
    "UPipe + keep_attention": ["--upipe.heads_per_stage", "2", "--upipe.keep_attention"],
    "Ulysses (U = 16)": ["--upipe.heads_per_stage", "16"],
}
TINY_OVERRIDES = ["--activation_checkpoint.mode", "full", "--upipe.offload_block_inputs",
                  "--upipe.host_memory_reserve_gib", "0", "--compile.backend", "upipe"]


def job_config(tiny: bool, layers: int, seq_len: int, overrides: list[str]):
    """The job with the flavor FLAVOR: the TOML's model with ``layers`` layers."""
    import upipe_compile.integrations.torchtitan  # noqa: F401  (registers the specs)
    from torchtitan.protocols.train_spec import get_train_spec

    from upipe_compile.estimate.job import load_job_config

    base = load_job_config(DEBUG_TOML if tiny else TOML, [])
    args = get_train_spec(base.model.name).model_args
    args[FLAVOR] = dataclasses.replace(args[base.model.flavor], n_layers=layers,
                                       max_seq_len=max(seq_len, args[base.model.flavor].max_seq_len))
    extra = TINY_OVERRIDES if tiny else []
    return load_job_config(DEBUG_TOML if tiny else TOML, [
        "--model.flavor", FLAVOR, "--training.seq_len", str(seq_len), *extra, *overrides])


def train_step(job, device) -> None:
    """torchtitan 0.2.2's Trainer.train_step, one microbatch: rank 0's shard of a random row."""
    from torchtitan.train import prepare_context_parallel_input

    config = job.job_config
    job.optimizers.zero_grad()
    seq = config.training.seq_len
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, job.model_args.vocab_size, (1, seq), generator=gen).to(device)
    labels = torch.randint(0, job.model_args.vocab_size, (1, seq), generator=gen).to(device)
    inputs, labels, extra = prepare_context_parallel_input(
        inputs, labels, {}, job.parallel_dims.get_mesh("cp"), device, config.parallelism.context_parallel_load_balancer)
    loss = job.loss_fn(job.model(inputs, **extra), labels) / labels.numel()
    loss.backward()
    job.optimizers.step()


def _device(tiny: bool) -> torch.device:
    return torch.device("cpu" if tiny or not torch.cuda.is_available() else "cuda")


def estimate_method(tiny: bool, layers: int, seq: int, overrides: list[str]) -> dict:
    """The whole-step estimate of the same job (fake tensors, CPU)."""
    from upipe_compile.estimate import estimate

    cuda = _device(tiny).type == "cuda"
    result = estimate(job_config(tiny, layers, seq, overrides), cuda_kernel="flash-attn" if cuda else None)
    return {"estimated_peak_gib": result.peak_device_gib, "host_gib_per_rank": result.host_gib_per_rank,
            "modelled_step_s_h100": result.step_time["seconds"], "world_size": result.world_size}


def run_method(tiny: bool, layers: int, seqs: list[int], overrides: list[str]) -> list[dict]:
    """In this process: per seq_len, two real steps; the second timed."""
    from upipe_compile.estimate.job import build_real_job, world_size
    from upipe_compile.measure.memory import fake_process_group

    device = _device(tiny)
    rows = []
    for seq in seqs:
        config = job_config(tiny, layers, seq, overrides)
        world = world_size(config)
        with fake_process_group(world):
            job = build_real_job(config, device, world)
            train_step(job, device)  # compiles
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            train_step(job, device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else None
            del job
        torch._dynamo.reset()
        rows.append({"seq_len": seq, "step_s": seconds, "measured_peak_gib": peak, "device": _device_name(device)})
    return rows


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def _command(mode: str, overrides: list[str], layers: int, seqs: list[int], tiny: bool) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), mode, json.dumps(overrides), "--layers", str(layers),
            "--seqs", *map(str, seqs), *(["--tiny"] if tiny else [])]


def _result(process: subprocess.Popen, name: str, timeout_s: float):
    out, err = process.communicate(timeout=timeout_s)
    if process.returncode != 0:
        raise RuntimeError(f"{name}: {' '.join(process.args)} failed:\n{err[-4000:]}")
    return json.loads(out.strip().splitlines()[-1])


def run(tiny: bool, layers: int, seqs: list[int], timeout_s: float) -> list[dict]:
    """Each method's steps in its own process, one after another on the device; every
    estimate in its own process at once beside them (they run on the host's CPUs)."""
    methods = TINY_METHODS if tiny else METHODS
    popen = dict(cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    estimates = {(name, seq): subprocess.Popen(_command("--estimate-one", overrides, layers, [seq], tiny), **popen)
                 for name, overrides in methods.items() for seq in seqs}
    rows = []
    for name, overrides in methods.items():
        steps = subprocess.Popen(_command("--one", overrides, layers, seqs, tiny), **popen)
        for row in _result(steps, name, timeout_s):
            rows.append({"method": name, **row, **_result(estimates[name, row["seq_len"]], name, timeout_s)})
    return rows


def table(rows: list[dict]) -> str:
    ulysses = {r["seq_len"]: r["step_s"] for r in rows if r["method"].startswith("Ulysses")}
    out = []
    for r in rows:
        measured = r["measured_peak_gib"]
        out.append({
            "job seq_len": f"{r['seq_len']:,}", "method": r["method"], "step s": r["step_s"],
            "throughput vs Ulysses": ulysses[r["seq_len"]] / r["step_s"],
            "max_memory_allocated GiB": "n/a (CPU)" if measured is None else f"{measured:.2f}",
            "estimate GiB": f"{r['estimated_peak_gib']:.2f}",
            "measured / estimate": "" if measured is None else f"{measured / r['estimated_peak_gib']:.3f}",
            "host GiB (estimate)": f"{r['host_gib_per_rank']:.2f}",
        })
    return tabulate(out, headers="keys", tablefmt="github", floatfmt=".3f")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="layers of the model (the TOML's dims otherwise)")
    parser.add_argument("--seqs", type=int, nargs="+", default=[262144, 524288, 1048576], help="job seq_len values")
    parser.add_argument("--tiny", action="store_true", help="torchtitan's debug model on CPU, CP = 2 (the tests)")
    parser.add_argument("--timeout", type=float, default=420, help="seconds each process may take")
    parser.add_argument("--out", help="also write the table to this markdown file")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a method's overrides: run it here, print JSON rows
    parser.add_argument("--estimate-one", help=argparse.SUPPRESS)  # the same for its estimate at --seqs[0]
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(run_method(args.tiny, args.layers, args.seqs, json.loads(args.one))))
        return 0
    if args.estimate_one is not None:
        print(json.dumps(estimate_method(args.tiny, args.layers, args.seqs[0], json.loads(args.estimate_one))))
        return 0
    rows = run(args.tiny, args.layers, args.seqs, args.timeout)
    command = " ".join(["python benchmarks/gpu_rank.py", *(argv if argv is not None else sys.argv[1:])])
    text = (f"# {command}\n# one rank of the job on {rows[0]['device']}, fake process group for the others, "
            f"{args.layers} layers, torch {torch.__version__}\n\n{table(rows)}\n")
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
