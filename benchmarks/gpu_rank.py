"""One rank of a real torchtitan job on one device: step time of UPipe, UPipe + keep_attention
and Ulysses, and the device peak against the whole-step estimate of the same job.

    python benchmarks/gpu_rank.py [--layers 1 2] [--seqs 1048576 2097152] [--upipe-alone-seqs 5242880]
                                  [--timeout 420] [--out FILE]
    python benchmarks/gpu_rank.py --job 70b --layers 1 2 --seqs 1048576 2097152   # the 8-node 70B job's rank
    python benchmarks/gpu_rank.py --tiny      # the debug model on CPU (what the tests run)

The job is the shipped Llama3-8B TOML (integrations/torchtitan/llama3_8b_upipe_5m.toml: CP = 8,
the long-context stack, full AC) with its real dimensions and ``--layers`` of its 32 layers;
with ``--job 70b`` the shipped 8-node Llama-3.1-70B TOML (llama3_70b_upipe_8_nodes.toml: CP =
64 as UPipe 8 x ring 8, the stack) and ``--layers`` of its 80, against Ulysses (U = 64) there.
This process is rank 0 of the job's ranks over torch's fake process group: its collectives
move nothing (the other ranks' shares are whatever the buffers held), everything else is real —
the blocks compiled with ``backend="upipe"``, the device's attention kernels, FSDP's buffers,
the offload to pinned host memory. Per context and method: two steps (the first compiles),
the second timed, and ``torch.cuda.max_memory_allocated`` over it, against the estimate's
per-rank peak for the same job and layer count (on fake tensors, on the host's CPUs beside the
device runs; its reserve is not part of either). Without the other ranks nothing waits on a collective: the step time is one rank's
compute, the part the step-time model calls attention, linear algebra and loss.

Methods: UPipe (U = 8 = P), UPipe + keep_attention (its kept outputs offloaded beside the block
inputs) and Ulysses (U = 32). Each method runs in its own process (its own compiled graphs and
memory statistics), all at once: building and the first step (mostly compiling) overlap, the
timed steps take a file lock that keeps everything else off the device. Rows are kept as they
are measured; ``--timeout`` stops what is left and prints what finished. ``--estimates-only``
prints the estimates alone (e.g. here, beside a table measured on a GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.append(ROOT)  # after site-packages: an installed upipe_compile wins over the bare checkout

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

TOML = os.path.join(ROOT, "integrations", "torchtitan", "llama3_8b_upipe_5m.toml")
TOML_70B = os.path.join(ROOT, "integrations", "torchtitan", "llama3_70b_upipe_8_nodes.toml")
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
METHODS_70B = {  # 64 query heads over the 8 all-to-all ranks of each ring step
    "UPipe (U = 8)": ["--upipe.heads_per_stage", "8"],
    "Ulysses (U = 64)": ["--upipe.heads_per_stage", "64"],
}
TINY_OVERRIDES = ["--activation_checkpoint.mode", "full", "--upipe.offload_block_inputs",
                  "--upipe.host_memory_reserve_gib", "0", "--compile.backend", "upipe"]


@dataclasses.dataclass(frozen=True)
class Job:
    """A job this script runs one rank of: its TOML, the methods compared, what it adds."""
    toml: str
    methods: dict
    overrides: tuple = ()
    on_cpu: bool = False
    """Runs on the CPU even where CUDA is (the tests' size)."""


JOBS = {"8b": Job(TOML, METHODS), "70b": Job(TOML_70B, METHODS_70B),
        "tiny": Job(DEBUG_TOML, TINY_METHODS, tuple(TINY_OVERRIDES), on_cpu=True)}


def job_config(job: str, layers: int, seq_len: int, overrides: list[str]):
    """The job with the flavor FLAVOR: the TOML's model with ``layers`` layers."""
    import upipe_compile.integrations.torchtitan  # noqa: F401  (registers the specs)
    from torchtitan.protocols.train_spec import get_train_spec

    from upipe_compile.integrations.torchtitan.release_022.estimate import load_config

    toml = JOBS[job].toml
    base = load_config(toml, [])
    args = get_train_spec(base.model.name).model_args
    args[FLAVOR] = dataclasses.replace(args[base.model.flavor], n_layers=layers,
                                       max_seq_len=max(seq_len, args[base.model.flavor].max_seq_len))
    return load_config(toml, ["--model.flavor", FLAVOR, "--training.seq_len", str(seq_len), *JOBS[job].overrides,
                              *overrides])


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


def _device(job: str) -> torch.device:
    return torch.device("cpu" if JOBS[job].on_cpu or not torch.cuda.is_available() else "cuda")


def estimate_method(job: str, layers: int, seq: int, overrides: list[str], cuda_kernel: str | None) -> dict:
    """The whole-step estimate of the same job (fake tensors, CPU)."""
    from upipe_compile.integrations.torchtitan.estimate_run import estimate

    if cuda_kernel is None and _device(job).type == "cuda":
        cuda_kernel = _installed_cuda_kernel()
    result = estimate(job_config(job, layers, seq, overrides), cuda_kernel=cuda_kernel)
    return {"estimated_peak_gib": result.peak_device_gib, "host_gib_per_rank": result.host_gib_per_rank,
            "modelled_step_s_h100": result.step_time["seconds"], "model_flops": result.step_time["model_flops"],
            "world_size": result.world_size, "estimate_peak_phase": result.peak_phase,
            "estimate_breakdown": result.breakdown, "estimate_phase_peaks": result.phase_peaks,
            "estimate_block": result.block_recompute}


@contextlib.contextmanager
def _locked(lock_file, mode: int):
    fcntl.flock(lock_file, mode)
    try:
        yield
    finally:
        fcntl.flock(lock_file, fcntl.LOCK_UN)


def _installed_cuda_kernel() -> str:
    """The name of the CUDA kernel this machine runs (the estimate models its workspaces)."""
    from upipe_compile.attention import kernels

    installed = type(kernels.cuda_kernel())
    return next(name for name, kernel in kernels.CUDA_KERNELS.items() if kernel is installed)


def run_method(job_name: str, jobs: list[tuple[int, int]], overrides: list[str], lock_path: str, rows_path: str):
    """In this process: per (layers, seq_len) of ``jobs``, two real steps; the second timed (on
    CUDA under the allocator's history), its row appended to ``rows_path`` as one JSON line.
    The methods' processes run at once: building and the first step (mostly compiling) overlap
    under a shared lock on ``lock_path``; the timed step holds it exclusively, so nothing else
    runs on the device while it is timed."""
    from upipe_compile.integrations.torchtitan.estimate_job import world_size
    from upipe_compile.integrations.torchtitan.release_022.estimate import build_real_job
    from upipe_compile.measure.memory import fake_process_group

    device = _device(job_name)
    with open(lock_path, "a+") as lock:
        for layers, seq in jobs:
            config = job_config(job_name, layers, seq, overrides)
            world = world_size(config)
            with fake_process_group(world):
                with _locked(lock, fcntl.LOCK_SH):
                    job = build_real_job(config, device, world)
                    train_step(job, device)  # compiles
                    _synchronize(device)
                with _locked(lock, fcntl.LOCK_EX):
                    with _allocator_history(device) as history:
                        start = time.perf_counter()
                        train_step(job, device)
                        _synchronize(device)
                        seconds = time.perf_counter() - start
                cuda = device.type == "cuda"
                peak = torch.cuda.max_memory_allocated() / GIB if cuda else None
                reserved = torch.cuda.max_memory_reserved() / GIB if cuda else None
                del job
            torch._dynamo.reset()
            if cuda:
                torch.cuda.empty_cache()  # the next job starts from what it needs alone
            row = {"method": json.dumps(overrides), "seq_len": seq, "layers": layers, "step_s": seconds,
                   "measured_peak_gib": peak, "reserved_peak_gib": reserved, "device": _device_name(device),
                   **history}
            with _locked(lock, fcntl.LOCK_EX), open(rows_path, "a") as f:
                f.write(json.dumps(row) + "\n")


@contextlib.contextmanager
def _allocator_history(device: torch.device, top: int = 15):
    """On CUDA: the peak statistics reset, the allocator's history recorded (Python frames) while
    the block runs; after it the dict yielded holds what was live at the peak
    (:func:`peak_live_allocations`). Elsewhere an empty dict."""
    found: dict = {}
    if device.type != "cuda":
        yield found
        return
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, context="alloc", stacks="python")
    try:
        yield found
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    found.update(peak_live_allocations(snapshot, baseline, torch.cuda.current_device(), top))


def peak_live_allocations(snapshot: dict, baseline_bytes: int, device_index: int = 0, top: int = 15) -> dict:
    """What was live at the highest point of a recorded allocator trace (``torch.cuda.memory.
    _snapshot()``'s ``device_traces``). The allocator counts a block as allocated from its
    ``alloc`` to its ``free_requested`` (a later ``free_completed`` only returns it to the cache,
    after the streams that used it are done), as ``max_memory_allocated`` does; ``baseline_bytes``
    was allocated before the recording started (parameters, optimizer state). Returns the peak
    (baseline + the trace's highest rise), the ``top`` largest allocations live there with their
    frames, and the live bytes grouped by the frame that asked for them (:func:`_origin`)."""
    trace = snapshot["device_traces"][device_index]
    if any(event["action"] == "oom" for event in trace):
        raise RuntimeError("the recorded step ran out of memory")
    live, rise, best, best_at = {}, 0, 0, -1
    for i, event in enumerate(trace):  # pass 1: where the rise is highest
        if event["action"] == "alloc":
            live[event["addr"]] = event["size"]
            rise += event["size"]
        elif event["action"] == "free_requested" and event["addr"] in live:
            rise -= live.pop(event["addr"])
        if rise > best:
            best, best_at = rise, i
    live = {}
    for event in trace[:best_at + 1]:  # pass 2: the live set at that point
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_requested":
            live.pop(event["addr"], None)
    largest = sorted(live.values(), key=lambda e: -e["size"])[:top]
    by_origin: dict[str, int] = defaultdict(int)
    for event in live.values():
        by_origin[_origin(event.get("frames", []))] += event["size"]
    return {
        "history_peak_gib": (baseline_bytes + best) / GIB, "history_baseline_gib": baseline_bytes / GIB,
        "peak_allocations": [{"gib": e["size"] / GIB, "frames": [_frame(f) for f in e.get("frames", [])[:6]]}
                             for e in largest],
        "peak_by_origin": {k: v / GIB for k, v in sorted(by_origin.items(), key=lambda kv: -kv[1])[:top]},
    }


_OWN = ("upipe_compile/", "passes/", "integrations/torchtitan/", "torchtitan/", "torch/nn/", "torch/optim/",
        "torch/distributed/fsdp/", "torch/utils/checkpoint.py", "torchinductor_", "benchmarks/")


def _origin(frames: list[dict]) -> str:
    """The innermost frame in code that decides what to allocate (upipe, torchtitan, torch.nn and
    optim, FSDP, checkpoint, inductor's generated code), or the innermost frame at all."""
    for frame in frames:
        if any(part in frame["filename"] for part in _OWN):
            return _frame(frame)
    return _frame(frames[0]) if frames else "(no Python frame)"


def _frame(frame: dict) -> str:
    """A frame as the tables name it: the file by its import path, never the machine's folders
    (inductor's generated code, outside every import root, by its file name)."""
    from upipe_compile.errors import display_path

    name = display_path(frame["filename"])
    if os.path.isabs(name) and "torchinductor_" in name:
        name = "inductor/" + os.path.basename(name)
    for marker in ("site-packages/", ROOT + os.sep):  # a file no import root here holds (another machine's)
        if os.path.isabs(name) and marker in name:
            name = name.split(marker, 1)[1]
    return f"{name}:{frame['line']} ({frame['name']})"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def _command(mode: str, overrides: list[str], jobs: list[tuple[int, int]], job: str, *extra: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), mode, json.dumps(overrides),
            "--jobs", *(f"{layers}:{seq}" for layers, seq in jobs), "--job", job, *extra]


def method_jobs(layer_counts: list[int], seqs: list[int], alone_seqs: list[int], upipe: bool) -> list[tuple[int, int]]:
    """The (layers, seq_len) pairs one method runs, cheapest first so a deadline cuts the costly:
    every pair of ``layer_counts`` x ``seqs``, then (UPipe alone) ``alone_seqs`` at the fewest layers."""
    jobs = sorted(((layers, seq) for seq in seqs for layers in layer_counts), key=lambda job: (job[1] * job[0], job))
    return jobs + ([(min(layer_counts), seq) for seq in alone_seqs] if upipe else [])


def _finish(processes: dict, deadline: float) -> tuple[dict, dict]:
    """Wait for every process until ``deadline`` (time.monotonic()); kill what is left.
    Returns (name -> its standard output, name -> why it gave no complete result)."""
    outputs, failures = {}, {}
    for name, process in processes.items():
        try:
            out, err = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            _, err = process.communicate()
            failures[name] = "stopped at the deadline"
            continue
        if process.returncode != 0:
            failures[name] = f"failed: {err.strip().splitlines()[-1] if err.strip() else process.returncode}"
            print(f"{name}: {' '.join(process.args)} failed:\n{err[-4000:]}", file=sys.stderr)
        else:
            outputs[name] = out
    return outputs, failures


def run(job: str, layer_counts: list[int], seqs: list[int], timeout_s: float, cuda_kernel: str | None = None,
        measure: bool = True, alone_seqs: list[int] = ()) -> tuple[list[dict], dict[str, str]]:
    """Every method in its own process, all at once (see run_method for how their timed steps
    stay alone on the device), and every estimate in its own process beside them (host CPUs).
    After ``timeout_s`` what has not finished is stopped: the rows measured by then are kept.
    ``measure=False``: the estimates alone (a row per method and job, no step)."""
    kernel = ["--cuda-kernel", cuda_kernel] if cuda_kernel else []
    methods = JOBS[job].methods
    jobs = {name: method_jobs(layer_counts, seqs, alone_seqs, name.startswith("UPipe (")) for name in methods}
    deadline = time.monotonic() + timeout_s
    popen = dict(cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with tempfile.TemporaryDirectory() as tmp:
        lock_path, rows_path = os.path.join(tmp, "device.lock"), os.path.join(tmp, "rows.jsonl")
        estimates = {(name, *pair): subprocess.Popen(_command("--estimate-one", overrides, [pair], job, *kernel),
                                                     **popen)
                     for name, overrides in methods.items() for pair in jobs[name]}
        steps = {name: subprocess.Popen(_command("--one", overrides, jobs[name], job, "--lock", lock_path,
                                                 "--rows", rows_path), **popen)
                 for name, overrides in methods.items() if measure}
        _, failures = _finish(steps, deadline)
        estimated, estimate_failures = _finish(estimates, deadline)
        failures.update({f"estimate of {name} at {layers} layers, {seq:,}": why
                         for (name, layers, seq), why in estimate_failures.items()})
        measured = [] if measure else [
            {"method": json.dumps(methods[name]), "seq_len": seq, "layers": layers, "step_s": None,
             "measured_peak_gib": None, "device": "none (estimates only)"}
            for name in methods for layers, seq in jobs[name]]
        if os.path.exists(rows_path):
            with open(rows_path) as f:
                measured = [json.loads(line) for line in f if line.strip()]
    names = {json.dumps(overrides): name for name, overrides in methods.items()}
    rows = []
    for name, overrides in methods.items():  # the table's order: method, then job
        mine = [r for r in measured if r["method"] == json.dumps(overrides)]
        for row in sorted(mine, key=lambda r: (r["seq_len"], r["layers"])):
            out = estimated.get((name, row["layers"], row["seq_len"]))
            estimate = json.loads(out.strip().splitlines()[-1]) if out else {}
            rows.append({**row, "method": names[row["method"]], **estimate})
    return rows, failures


PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H20": 148e12, "B200": 2250e12, "A100": 312e12}
"""Dense bf16 tensor-core peak by device name (SXM parts; the first name found in the device's
name counts, longest first)."""


def peak_flops(device_name: str) -> float | None:
    for name in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if name in device_name:
            return PEAK_BF16_FLOPS[name]
    return None


def table(rows: list[dict]) -> str:
    """One line per measured (method, length, layers); a cell whose input is missing (Ulysses not
    measured at that job, an estimate that did not finish, a device of unknown peak) stays empty."""
    ulysses = {(r["seq_len"], r.get("layers")): r["step_s"] for r in rows if r["method"].startswith("Ulysses")}
    out = []
    for r in rows:
        measured, estimated = r["measured_peak_gib"], r.get("estimated_peak_gib")
        base = ulysses.get((r["seq_len"], r.get("layers")))
        peak = peak_flops(r.get("device", ""))
        mfu = (r["model_flops"] / r["step_s"] / peak
               if peak and r.get("model_flops") and r["step_s"] else None)
        reserved = r.get("reserved_peak_gib")
        out.append({
            "job seq_len": f"{r['seq_len']:,}", "layers": r.get("layers", ""), "method": r["method"],
            "step s": "" if r["step_s"] is None else f"{r['step_s']:.3f}",
            "throughput vs Ulysses": f"{base / r['step_s']:.3f}" if r["step_s"] is not None and base else "",
            "MFU": "" if mfu is None else f"{mfu:.3f}",
            "max_memory_allocated GiB": "n/a (CPU)" if measured is None else f"{measured:.2f}",
            "estimate GiB": "" if estimated is None else f"{estimated:.2f}",
            "measured / estimate": "" if measured is None or estimated is None else f"{measured / estimated:.3f}",
            "max_memory_reserved GiB": "" if reserved is None else f"{reserved:.2f}",
            "host GiB (estimate)": f"{r['host_gib_per_rank']:.2f}" if "host_gib_per_rank" in r else "",
            "model step s (H100)": f"{r['modelled_step_s_h100']:.2f}" if "modelled_step_s_h100" in r else "",
        })
    return tabulate(out, headers="keys", tablefmt="github", floatfmt=".3f")


def peak_details(rows: list[dict]) -> str:
    """Per measured job: what was live at the device's peak (from the allocator's history)
    beside the estimate's account of its own peak."""
    parts = []
    for r in rows:
        if "peak_allocations" not in r and "estimate_breakdown" not in r:
            continue
        parts.append(f"\n## {r['method']}, {r.get('layers', '?')} layers, {r['seq_len']:,} tokens\n")
        if "estimate_breakdown" in r:
            parts.append(f"Estimate: {r['estimated_peak_gib']:.2f} GiB, peak in `{r['estimate_peak_phase']}`; "
                         "at its peak, by kind (GiB): "
                         + ", ".join(f"{k} {v:.2f}" for k, v in r["estimate_breakdown"].items())
                         + ". Phase peaks: " + ", ".join(f"{k} {v:.2f}" for k, v in r["estimate_phase_peaks"].items())
                         + ". Block backward (above its start): "
                         + ", ".join(f"{k} {v}" for k, v in r["estimate_block"].items()) + ".\n")
        if "peak_allocations" in r:
            parts.append(f"Device: {r['history_peak_gib']:.2f} GiB at the recorded peak "
                         f"(max_memory_allocated {r['measured_peak_gib']:.2f}), "
                         f"{r['history_baseline_gib']:.2f} of it allocated before the step.\n\n"
                         "Live at the peak, by the frame that asked (GiB):\n\n"
                         + tabulate([{"GiB": f"{v:.3f}", "frame": k} for k, v in r["peak_by_origin"].items()],
                                    headers="keys", tablefmt="github")
                         + "\n\nLargest allocations live at the peak:\n\n"
                         + tabulate([{"GiB": f"{a['gib']:.3f}", "frames (innermost first)": " <- ".join(a["frames"])}
                                     for a in r["peak_allocations"]], headers="keys", tablefmt="github") + "\n")
    return "".join(parts)


def _job(text: str) -> tuple[int, int]:
    layers, seq = text.split(":")
    return int(layers), int(seq)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1],
                        help="layer counts of the model (the TOML's dims otherwise); 1 layer at 256K-1M runs in "
                        "3 minutes on one H200")
    parser.add_argument("--seqs", type=int, nargs="+", default=[262144, 524288, 1048576], help="job seq_len values")
    parser.add_argument("--upipe-alone-seqs", type=int, nargs="*", default=[],
                        help="lengths UPipe (without keep) runs alone after the rest, at the fewest layers")
    parser.add_argument("--job", choices=sorted(JOBS), default="8b",
                        help="the shipped 8B 5M TOML (default), the 8-node 70B TOML, or the debug model")
    parser.add_argument("--tiny", action="store_true", help="--job tiny: torchtitan's debug model on CPU, CP = 2 "
                        "(the tests)")
    parser.add_argument("--timeout", type=float, default=420,
                        help="seconds for the whole run; what has not finished by then is stopped and left out")
    parser.add_argument("--out", help="also write the table to this markdown file")
    parser.add_argument("--cuda-kernel", help="the CUDA kernel whose workspaces the estimate models (default: the "
                        "one this machine runs; none on a machine without CUDA)")
    parser.add_argument("--estimates-only", action="store_true",
                        help="no steps: the estimates of the same jobs alone (e.g. on a CPU machine, beside a "
                        "table measured on a GPU)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a method's overrides: run its --jobs here
    parser.add_argument("--estimate-one", help=argparse.SUPPRESS)  # the same for its estimate of --jobs[0]
    parser.add_argument("--jobs", type=_job, nargs="+", help=argparse.SUPPRESS)  # LAYERS:SEQ_LEN, with the two above
    parser.add_argument("--lock", help=argparse.SUPPRESS)  # with --one: the file lock the methods share
    parser.add_argument("--rows", help=argparse.SUPPRESS)  # with --one: the JSON-lines file of rows
    args = parser.parse_args(argv)
    job = "tiny" if args.tiny else args.job
    if args.one is not None:
        run_method(job, args.jobs, json.loads(args.one), args.lock, args.rows)
        return 0
    if args.estimate_one is not None:
        layers, seq = args.jobs[0]
        print(json.dumps(estimate_method(job, layers, seq, json.loads(args.estimate_one), args.cuda_kernel)))
        return 0
    rows, failures = run(job, args.layers, args.seqs, args.timeout, args.cuda_kernel, not args.estimates_only,
                         args.upipe_alone_seqs)
    given = argv if argv is not None else sys.argv[1:]
    shown = [os.path.basename(arg) if i and given[i - 1] == "--out" else arg for i, arg in enumerate(given)]
    command = " ".join(["python benchmarks/gpu_rank.py", *shown])  # no machine folders in a committed table
    device = rows[0]["device"] if rows else "the device"
    text = (f"# {command}\n# one rank of the job on {device}, fake process group for the others, "
            f"{' and '.join(map(str, args.layers))} layers, torch {torch.__version__}\n\n{table(rows)}\n")
    text += "".join(f"\nnot measured: {name}: {why}" for name, why in failures.items())
    text += "\n" + peak_details(rows)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
