"""The whole-step memory estimate checked against a measurement it shares no code with.

(a) ``upipe_compile.integrations.torchtitan.estimate_run.estimate`` for a CPU job, with CPU
kernels (``cuda_kernel=None``: no GPU workspace, RMSNorm and RoPE as eager CPU torch allocates
them), on fake tensors;
(b) the same job for real: torchtitan's debug Llama3 scaled up, on P gloo ranks
(:class:`upipe_compile.launch.RankPool`), the long-context stack on (full AC, block inputs
offloaded to host, tiled MLP, chunked loss), blocks compiled with the "upipe" backend
(aot_eager inside). One warm-up step (compile, optimizer state, the offloader's host
buffers), then one step under ``torch.profiler`` with ``profile_memory=True``.

What is measured, per rank: CPU has no caching allocator, so the allocator's peak is the
maximum of live bytes over the step. The profiler reports every CPU allocation and free of
the step as a ``[memory]`` event (bytes, negative for a free); their running sum is the live
bytes relative to the step's start, its maximum the step's rise. The bytes live at the step's
start are what persists between steps, counted from the real tensors: parameters (local
shards), optimizer state, model buffers and the offloader's host buffers (gradients are
dropped by ``zero_grad`` before the step, as the Trainer's step starts). Measured peak =
start + rise.

What it is compared with: on CPU the offloaded block inputs are CPU allocations too, so the
measured peak includes them; the estimate keeps them apart (host memory). The estimate's
figure for the same moment is therefore the device peak + the host bytes per rank (all host
buffers exist from the end of forward on, and every peak of these jobs is in backward).
The estimate's own rise is that figure less its parameters, optimizer state and model buffers
at the peak (constant through the step) and less the host buffers (measured from the start
in the real step, where they are reused from the warm-up step).

    python benchmarks/estimate_check.py            # the documented size (a few minutes)
    python benchmarks/estimate_check.py --small    # the test's size
    python benchmarks/estimate_check.py --inner-backend inductor   # the real step's blocks via inductor

``--inner-backend`` sets the real step's ``--upipe.inner_backend`` (what compiles each block
after the UPipe rewrite, and the loss): aot_eager (the default: AOTAutograd's default
partitioner, eager kernels), aot_eager_decomp_partition (torch's backend with inductor's
decompositions and the min-cut rematerialization partitioner, eager kernels: the
partitioner's effect without inductor's) or inductor (min-cut partitioner, C++ codegen,
inductor's scheduling, fusion and buffer reuse). The estimate is the same for all three: it
runs blocks through eager twins and never reads the inner backend.

Writes benchmarks/results/estimate_check.md (not with --small or --no-write); a run given
--inner-backend (aot_eager too) writes its section of
benchmarks/results/estimate_check_backends.md instead (the other sections and the account kept).
Each profiled step also reports the most live bytes during each block's attention recompute,
MLP backward and attention backward ("phase_peaks"), and the live set at the attention
backward's peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # run as a script: make `benchmarks` and `upipe_compile` importable
    sys.path.append(ROOT)  # after site-packages: an installed upipe_compile wins over the bare checkout

import torch  # noqa: E402

DEBUG_TOML = os.path.join(ROOT, "integrations", "torchtitan", "debug_model_upipe_cpu.toml")
FLAVOR = "estimate_check"
GIB = 1024 ** 3
DEFAULT_INNER_BACKEND = "aot_eager"  # debug_model_upipe_cpu.toml's [upipe] inner_backend
INNER_BACKENDS = ("aot_eager", "aot_eager_decomp_partition", "inductor")


@dataclasses.dataclass(frozen=True)
class Size:
    """The debug model scaled: model args changed and the job's sequence."""

    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    seq_len: int
    mlp_tile_tokens: int
    loss_chunk_tokens: int
    batch: int = 1
    cp: int = 2

    def overrides(self) -> list[str]:
        return [
            f"--model.flavor={FLAVOR}", f"--training.seq_len={self.seq_len}", f"--training.local_batch_size={self.batch}",
            f"--parallelism.context_parallel_degree={self.cp}", "--parallelism.data_parallel_shard_degree=1",
            "--activation_checkpoint.mode=full", "--upipe.offload_block_inputs",
            f"--upipe.mlp_tile_tokens={self.mlp_tile_tokens}", f"--upipe.loss_chunk_tokens={self.loss_chunk_tokens}",
            "--upipe.host_memory_reserve_gib=1",  # this machine's RAM is small, not the inputs
        ]


# Activations of a few GiB over the two ranks, in a few minutes on 2 shared CPU cores: many
# tokens per rank (48 rows x 1,024), a short sequence (attention's cost grows with it, its
# memory does not), a narrow model (the matmuls' cost grows with dim squared).
FULL = Size(dim=256, n_layers=4, n_heads=8, vocab_size=2048, seq_len=2048, batch=48, mlp_tile_tokens=8192,
            loss_chunk_tokens=8192)
# The test's size: seconds of compute; activations still dominate the peak.
SMALL = Size(dim=256, n_layers=4, n_heads=8, vocab_size=2048, seq_len=8192, mlp_tile_tokens=1024,
             loss_chunk_tokens=1024)


def register_flavor(size: Size) -> None:
    """Add the scaled debug model as the flavor FLAVOR of the integration's "llama3" spec."""
    import upipe_compile.integrations.torchtitan  # noqa: F401  (registers the specs)
    from torchtitan.protocols.train_spec import get_train_spec

    args = get_train_spec("llama3").model_args
    args[FLAVOR] = dataclasses.replace(args["debugmodel"], dim=size.dim, n_layers=size.n_layers,
                                       n_heads=size.n_heads, vocab_size=size.vocab_size,
                                       max_seq_len=max(size.seq_len, 2048))


def job_config(size: Size, inner_backend: str | None = None):
    """The job; ``inner_backend`` (None: the TOML's, aot_eager) overrides [upipe] inner_backend."""
    from upipe_compile.integrations.torchtitan.release_022.estimate import load_config

    register_flavor(size)
    overrides = size.overrides() + ([f"--upipe.inner_backend={inner_backend}"] if inner_backend else [])
    return load_config(DEBUG_TOML, overrides)


# --- (a) the estimate -------------------------------------------------------------------------

def estimated(size: Size, inner_backend: str | None = None) -> dict:
    """The estimate with CPU kernels, in bytes: device peak, host, and the step-constant terms.
    With inductor inside, RMSNorm and RoPE are counted as fused kernels (what inductor makes
    of them on CPU as on a GPU), as the GPU estimate counts them."""
    from upipe_compile.integrations.torchtitan.estimate_run import estimate

    result = estimate(job_config(size), cuda_kernel=None, fused_kernels=inner_backend == "inductor")
    b = result.breakdown
    constant = (b["sharded_params"] + b["optimizer_state"] + b["model_buffers"]) * GIB
    return {"device": result.peak_device_gib * GIB, "host": result.host_gib_per_rank * GIB, "constant": constant,
            "breakdown": b, "phase": result.peak_phase, "block": result.block_recompute,
            "phase_peaks": result.phase_peaks, "seconds": result.seconds}


# --- (b) the measurement, on each rank ----------------------------------------------------------

def _storages_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def live_bytes_timeline(prof) -> list[tuple[int, int]]:
    """(time ns, live CPU bytes relative to the profile's start) after each allocation or free
    the profiler saw, in time order."""
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and str(e.device_type()).endswith("CPU"))
    live, timeline = 0, []
    for t, nbytes in events:
        live += nbytes
        timeline.append((t, live))
    return timeline


INDUCTOR_GRAPH = "## Call CompiledFxGraph"  # inductor's record around a compiled graph's call (name + hash)


def _path(event, depth: int = 4) -> str:
    """The names of the ops around an allocation, outermost first (up to ``depth`` of them).
    Inductor's record around a compiled graph's call is left out (its hash differs from run to
    run, and it would push the op that allocated out of the path); an allocation its wrapper
    code makes itself (``empty_strided_cpu``, no op around it) ends in "inductor buffer"."""
    names = []
    while event is not None:
        names.append(event.name)
        event = event.parent
    names = [n for n in reversed(names) if n]
    if names and names[-1].startswith(INDUCTOR_GRAPH):
        names.append("inductor buffer")
    names = [n for n in names if not n.startswith(INDUCTOR_GRAPH)]
    return " > ".join(names[:depth]) + (f" > ... > {names[-1]}" if len(names) > depth else "")


def live_allocations(prof, at_ns: int | None) -> dict[tuple[int, int], tuple[int, str]]:
    """The CPU allocations of the profile still live at time ``at_ns`` (None: at its end):
    (address, time allocated) -> (bytes, the ops that made it)."""
    from torch._C._profiler import _EventType

    stack, events = list(prof.profiler.kineto_results.experimental_event_tree()), []
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag != _EventType.Allocation or (at_ns is not None and event.start_time_ns > at_ns):
            continue
        if str(event.extra_fields.device) == "cpu":
            events.append((event.start_time_ns, event.extra_fields.ptr, event.extra_fields.alloc_size, event))
    live: dict[int, tuple[int, int, str]] = {}
    for t, ptr, size, event in sorted(events, key=lambda e: e[0]):
        if size > 0:
            live[ptr] = (t, size, _path(event.parent))
        else:  # a free: of the latest allocation at this address
            live.pop(ptr, None)
    return {(ptr, t): (size, path) for ptr, (t, size, path) in live.items()}


def corrected_timeline(prof) -> list[tuple[int, int]]:
    """Live CPU bytes after each allocation or free (relative to the profile's start), where an
    allocation at an address still counted live first frees what was there (its free was not
    recorded)."""
    from torch._C._profiler import _EventType

    stack, events = list(prof.profiler.kineto_results.experimental_event_tree()), []
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and str(event.extra_fields.device) == "cpu":
            events.append((event.start_time_ns, event.extra_fields.ptr, event.extra_fields.alloc_size))
    live, total, timeline = {}, 0, []
    for t, ptr, size in sorted(events):
        total -= live.pop(ptr, 0)
        if size > 0:
            live[ptr] = size
            total += size
        timeline.append((t, total))
    return timeline


# The ops whose spans bound a block's backward phases: (op name, in backward only) -> label.
PHASE_OPS = {("upipe::attention_block", True): "attention recompute",
             ("upipe::tiled_swiglu_backward", False): "mlp backward",
             ("upipe::attention_block_backward", False): "attention backward"}


def op_spans(prof) -> dict[str, list[tuple[int, int]]]:
    """(start, end) ns of every call of the PHASE_OPS, by label (outermost calls only)."""
    stack, spans = list(prof.profiler.kineto_results.experimental_event_tree()), {}
    while stack:
        event = stack.pop()
        ancestors, parent = [], event.parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.parent
        in_backward = any("CompiledFunctionBackward" in name for name in ancestors)
        label = PHASE_OPS.get((event.name, True)) if in_backward else None
        label = label or PHASE_OPS.get((event.name, False))
        if label and event.name not in ancestors:
            spans.setdefault(label, []).append((event.start_time_ns, event.end_time_ns))
            continue
        stack.extend(event.children)
    return spans


def phase_peaks(timeline: list[tuple[int, int]], spans: dict) -> dict[str, tuple[int, int]]:
    """The most live bytes (relative to the step's start) while any call of each phase's op
    runs, and when: label -> (bytes, time ns)."""
    import bisect

    times = [t for t, _ in timeline]
    peaks = {}
    for label, windows in spans.items():
        best = (0, None)
        for start, end in windows:
            i, j = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
            entering = [(timeline[i - 1][1], start)] if i else []
            for live, t in entering + [(live, t) for t, live in timeline[i:j]]:
                best = max(best, (live, t), key=lambda b: b[0])
        peaks[label] = best
    return peaks


def by_op(allocations: dict) -> dict[str, int]:
    groups: dict[str, int] = {}
    for size, path in allocations.values():
        groups[path] = groups.get(path, 0) + size
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]))


def terms_at_peak(at_peak: dict, at_end: dict) -> dict[str, int]:
    """The measured rise at the peak by kind, as the estimate's breakdown names them (bytes):
    gradients (FSDP's reduce-scatter outputs: the sharded gradients), FSDP buffers (its
    all-gathers), and activations and temporaries (the rest), of which "retained" is what gloo
    holds past its use: allocated before the peak and still live at the step's end (not a
    gradient), or, when the peak falls outside the attention ops, an all-to-all's buffer (the
    stage loops keep none past their own op; gloo drops its reference late, on its threads)."""
    terms = {"sharded_grads": 0, "fsdp_buffers": 0, "activations_and_temps": 0, "retained": 0}
    newest = max(at_peak, key=lambda key: key[1], default=None)  # (address, time): what made the peak
    peak_in_attention = newest is not None and "upipe::attention" in at_peak[newest][1]
    for key, (size, path) in at_peak.items():
        if "FSDP::post_backward_reduce" in path:
            terms["sharded_grads"] += size
        elif "FSDP::" in path:
            terms["fsdp_buffers"] += size
        else:
            terms["activations_and_temps"] += size
            if key in at_end or (not peak_in_attention and "all_to_all_single" in path):
                terms["retained"] += size
    return terms


def step_start_bytes(model, optimizer_states: list, offloader=None) -> dict:
    """What is live at a step's start and persists between steps, counted from the real tensors
    (the gradients went with the previous step's zero_grad); the offloader's host buffers where
    the job offloads."""
    start = {
        "params": _storages_bytes(list(model.parameters())),
        "optimizer_state": _storages_bytes([v for s in optimizer_states for v in s.values()
                                            if isinstance(v, torch.Tensor)]),
        "buffers": _storages_bytes(list(model.buffers())),
    }
    if offloader is not None:
        start["host_buffers"] = _storages_bytes([offloader.host_buffer(i) for i in range(len(offloader.blocks))])
    return start


def profiled_step(train_step, seed: int):
    """``train_step(seed)`` on every rank at once under the profiler with memory events:
    (the profile, its return value, seconds)."""
    import torch.distributed as dist

    dist.barrier()
    start = time.time()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        result = train_step(seed)
    return prof, result, time.time() - start


def measure_step(size: Size, explain: bool = False, inner_backend: str | None = None) -> dict:
    """On every rank of the pool: build the job as the Trainer does, one warm-up step, then one
    profiled step. Returns bytes at the step's start (by kind), the step's rise, and more."""
    import torch.distributed as dist
    from torchtitan.distributed import utils as dist_utils
    import torchtitan.train  # its prepare_context_parallel_input, as the upipe import routes it
    from torchtitan.protocols.train_spec import get_train_spec

    from upipe_compile.integrations.torchtitan.release_022.estimate import build_real_job

    torch._dynamo.reset()
    config = job_config(size, inner_backend)
    compiled_before = _inductor_kernels()
    torch.manual_seed(0)
    job = build_real_job(config, torch.device("cpu"), dist.get_world_size())
    dims, model_args, model = job.parallel_dims, job.model_args, job.model
    optimizers, loss_fn = job.optimizers, job.loss_fn
    lr_schedulers = get_train_spec(config.model.name).build_lr_schedulers_fn(optimizers, config.lr_scheduler, 2)
    offloader = model.upipe_offloader

    def train_step(seed: int) -> float:
        # torchtitan 0.2.2's Trainer.train_step, one microbatch, no PP.
        optimizers.zero_grad()
        gen = torch.Generator().manual_seed(seed)
        inputs = torch.randint(0, model_args.vocab_size, (size.batch, size.seq_len), generator=gen)
        labels = torch.randint(0, model_args.vocab_size, (size.batch, size.seq_len), generator=gen)
        global_valid_tokens = labels.numel() * torch.ones((), dtype=torch.float32)
        inputs, labels, extra = torchtitan.train.prepare_context_parallel_input(
            inputs, labels, {}, dims.get_mesh("cp"), torch.device("cpu"), config.parallelism.context_parallel_load_balancer)
        pred = model(inputs, **extra)
        loss = loss_fn(pred, labels) / global_valid_tokens
        del pred
        loss.backward()
        dist_utils.clip_grad_norm_(list(model.parameters()), config.training.max_norm, foreach=True)
        optimizers.step()
        lr_schedulers.step()
        return float(loss.detach())

    start = time.time()
    train_step(1)  # compiles; creates the optimizer state and the host buffers
    warmup_s = time.time() - start
    compiled = {k: v - compiled_before.get(k, 0) for k, v in _inductor_kernels().items()}
    optimizers.zero_grad()  # the gradients of step 1 go, as the next step's zero_grad does
    gc.collect()
    params = list(model.parameters())
    start_bytes = step_start_bytes(model, [s for opt in optimizers.optimizers for s in opt.state.values()], offloader)
    prof, loss, step_s = profiled_step(train_step, 2)
    timeline = live_bytes_timeline(prof)
    # The running sum of [memory] events misses frees made on threads the profiler does not
    # follow (gloo's worker threads drop the last reference to an all-to-all's buffers): an
    # address handed out again proves its block was freed. The rise is the maximum of the live
    # bytes so corrected; "unrecorded_frees_rise" is the plain running sum's maximum.
    corrected = corrected_timeline(prof)
    rise, peak_ns = max(((live, t) for t, live in corrected), default=(0, None))
    uncorrected = max((live for _, live in timeline), default=0)
    grads = _storages_bytes([q.grad for q in params])
    at_peak, at_end = live_allocations(prof, peak_ns), live_allocations(prof, None)
    phases = phase_peaks(corrected, op_spans(prof))
    explained = {"at peak": by_op(at_peak), "at end": by_op(at_end)} if explain else {}
    if explain and phases.get("attention backward", (0, None))[1] is not None:
        explained["at the attention backward's peak"] = by_op(live_allocations(prof, phases["attention backward"][1]))
    return {"explain": explained, "terms": terms_at_peak(at_peak, at_end), "running_sum_rise": uncorrected,
            "start": start_bytes, "rise": rise, "end": corrected[-1][1] if corrected else 0, "grads": grads,
            "events": len(timeline), "loss": loss, "warmup_s": round(warmup_s, 1), "step_s": round(step_s, 1),
            "offloaded": offloader.offloaded_bytes_last_step, "inner_backend": config.upipe.inner_backend,
            "inductor_kernels": compiled, "phase_peaks": {k: v[0] for k, v in phases.items()}}


def _inductor_kernels() -> dict[str, int]:
    """Inductor's counts of the kernels it generated in this process (C++ on CPU), and of the
    graphs it compiled: whether the inner backend really compiled the blocks."""
    import torch._inductor.metrics as metrics
    from torch._dynamo.utils import counters

    return {"generated_kernel_count": metrics.generated_kernel_count,
            "generated_cpp_vec_kernel_count": metrics.generated_cpp_vec_kernel_count,
            "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
            "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"]}


def measured(size: Size, pool=None, explain: bool = False, inner_backend: str | None = None) -> list[dict]:
    from upipe_compile.launch import RankPool

    if pool is not None:
        return pool.run(measure_step, size, explain, inner_backend)
    with RankPool(size.cp, threads=1, timeout_s=1800) as own:
        return own.run(measure_step, size, explain, inner_backend)


# --- the comparison -----------------------------------------------------------------------------

def compare(size: Size, pool=None, explain: bool = False,
            inner_backend: str | None = None) -> tuple[dict, list[dict], list[dict]]:
    """Both sides and, per rank, the rows of the table (GiB; the terms in MiB). ``inner_backend``
    is the real step's (None: the TOML's); with inductor the estimate counts fused norms and RoPE."""
    est = estimated(size, inner_backend)
    ranks = measured(size, pool, explain, inner_backend)
    rows = []
    b = est["breakdown"]
    est_total = est["device"] + est["host"]
    est_rise = est_total - est["constant"] - est["host"]
    est_terms = {"sharded_grads": b["sharded_grads"] * GIB, "fsdp_buffers": b["fsdp_buffers"] * GIB,
                 "activations_and_temps": (b["activations_and_temps"] + b["inputs"]) * GIB}
    for rank, m in enumerate(ranks):
        start = sum(m["start"].values())
        total = start + m["rise"]
        retained = m["terms"]["retained"]
        row = {
            "rank": rank,
            "estimated peak (device + host)": est_total / GIB, "measured peak": total / GIB,
            "ratio": est_total / total,
            "retained by gloo": retained / GIB,
            "ratio without it": est_total / (total - retained),
            "estimated rise": est_rise / GIB, "measured rise": m["rise"] / GIB,
            "rise ratio without it": est_rise / (m["rise"] - retained),
        }
        for term, value in est_terms.items():  # term by term at the peak: estimated - measured (MiB)
            measured_term = m["terms"][term] - (retained if term == "activations_and_temps" else 0)
            row[f"{term} est./meas. (MiB)"] = f"{value / 2 ** 20:.1f} / {measured_term / 2 ** 20:.1f}"
        row["params+opt+buffers est./meas. (MiB)"] = (f"{est['constant'] / 2 ** 20:.1f} / "
                                                      f"{(start - m['start']['host_buffers']) / 2 ** 20:.1f}")
        row["host est./meas. (MiB)"] = f"{est['host'] / 2 ** 20:.1f} / {m['start']['host_buffers'] / 2 ** 20:.1f}"
        rows.append(row)
    return est, ranks, rows


def table(rows: list[dict], floatfmt: str = ".3f") -> str:
    from tabulate import tabulate

    return tabulate(rows, headers="keys", tablefmt="github", floatfmt=floatfmt)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="the test's size")
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/results/estimate_check.md")
    parser.add_argument("--inner-backend", choices=INNER_BACKENDS,
                        help=f"what compiles the real step's blocks and loss ([upipe] inner_backend; without it "
                             f"the TOML's, {DEFAULT_INNER_BACKEND}); given, the results go to "
                             "benchmarks/results/estimate_check_backends.md (its section for this backend), "
                             "not estimate_check.md")
    parser.add_argument("--json", help="also write both sides (estimate, per-rank measurement) to this JSON file")
    args = parser.parse_args(argv)
    size = SMALL if args.small else FULL
    t0 = time.time()
    backend = args.inner_backend or DEFAULT_INNER_BACKEND
    est, ranks, rows = compare(size, explain=True, inner_backend=backend)
    text = table(rows)
    print(text)
    print("estimate:", {k: v for k, v in est.items() if k not in ("device", "host", "constant")})
    for rank, m in enumerate(ranks):
        print(f"rank {rank}:", {k: v for k, v in m.items() if k != "explain"})
        print(explanation(m))
    if args.json:
        save_json(args.json, size, backend, est, ranks, rows, time.time() - t0)
    if not (args.small or args.no_write):
        if args.inner_backend is None:
            write_results(size, est, ranks, text, time.time() - t0)
        else:
            write_backend_section(size, backend, est, ranks, rows, time.time() - t0)
    return 0


def save_json(path: str, size: Size, inner_backend: str, est: dict, ranks: list[dict], rows: list[dict],
              seconds: float) -> None:
    import json

    with open(path, "w") as f:
        json.dump({"size": dataclasses.asdict(size), "inner_backend": inner_backend, "seconds": round(seconds),
                   "estimate": est, "ranks": ranks, "rows": rows}, f, default=str, indent=1)


def explanation(m: dict, top: int = 20) -> str:
    lines = []
    for when, groups in m.get("explain", {}).items():
        lines.append(f"live {when}: {sum(groups.values()) / 2 ** 20:.1f} MiB")
        lines += [f"  {b / 2 ** 20:9.2f}  {path}" for path, b in list(groups.items())[:top] if b >= 2 ** 16]
    return "\n".join(lines)


def write_results(size: Size, est: dict, ranks: list[dict], text: str, seconds: float) -> None:
    path = os.path.join(HERE, "results", "estimate_check.md")
    b = est["breakdown"]
    lines = [
        "# The estimate checked against a measured CPU step",
        "",
        "Made by `python benchmarks/estimate_check.py` (torch "
        f"{torch.__version__}, 2 shared CPU cores, {seconds:.0f} s in all). See docs/estimate.md, "
        "\"Checked against a measurement\", and the script's docstring for what is measured.",
        "",
        f"Job: `integrations/torchtitan/debug_model_upipe_cpu.toml`, its debug Llama3 scaled to dim {size.dim}, "
        f"{size.n_layers} layers, {size.n_heads} heads, vocab {size.vocab_size}; seq_len {size.seq_len:,} on "
        f"CP = {size.cp} gloo ranks (FSDP over them), fp32, full AC, block inputs offloaded, MLP tiles of "
        f"{size.mlp_tile_tokens} tokens, loss chunks of {size.loss_chunk_tokens}. Overrides: "
        f"`{' '.join(size.overrides())}`.",
        "",
        "Per rank, GiB. Estimated: `estimate(job, cuda_kernel=None)` (CPU kernels), device peak + host "
        "per rank. Measured: bytes live at the step's start (real tensors) + the step's rise "
        "(running sum of the profiler's CPU `[memory]` events).",
        "",
        text,
        "",
        f"Estimate: peak in `{est['phase']}`; at the peak {', '.join(f'{k} {v:.3f}' for k, v in b.items())}; "
        f"host {est['host'] / GIB:.3f}; phase peaks {est['phase_peaks']}; block {est['block']}; "
        f"{est['seconds']} s.",
        "",
        "Measured, per rank: " + "; ".join(
            f"rank {r}: start {', '.join(f'{k} {v / GIB:.3f}' for k, v in m['start'].items())}, rise "
            f"{m['rise'] / GIB:.3f}, live at the step's end {m['end'] / GIB:.3f} (gradients {m['grads'] / GIB:.3f}), "
            f"{m['events']} memory events, warm-up step {m['warmup_s']} s, profiled step {m['step_s']} s"
            for r, m in enumerate(ranks)) + ".",
        "",
        "What the measured rise is made of, per rank: the step's allocations live at the peak and at the "
        "step's end, by the ops that made them (MiB; the largest groups):",
        "",
        *(f"Rank {r}:\n\n```\n{explanation(m)}\n```\n" for r, m in enumerate(ranks)),
    ]
    with open(path, "w") as f:
        f.write("\n".join(lines))


BACKENDS_MD = os.path.join(HERE, "results", "estimate_check_backends.md")
BACKEND_COLUMNS = ("estimated peak (device + host)", "measured peak", "ratio", "ratio without it", "rise ratio without it")


def backend_rows(backend: str, rows: list[dict]) -> list[dict]:
    """The comparison's rows cut to the columns the backends' table shows, with the backend."""
    names = {"ratio without it": "ratio without gloo's buffers", "rise ratio without it": "rise ratio without them"}
    return [{"inner backend": backend, "rank": row["rank"],
             **{names.get(c, c): row[c] for c in BACKEND_COLUMNS}} for row in rows]


def write_backend_section(size: Size, backend: str, est: dict, ranks: list[dict], rows: list[dict],
                          seconds: float) -> None:
    """Replace (or add) this backend's section of estimate_check_backends.md, between its
    markers; the rest of the file (other backends' sections, the account) is kept."""
    begin, end = f"<!-- estimate_check --inner-backend {backend}: begin -->", \
        f"<!-- estimate_check --inner-backend {backend}: end -->"
    kernels = "; ".join(f"rank {r}: {m['inductor_kernels']}" for r, m in enumerate(ranks))
    section = "\n".join([
        begin,
        f"### `--inner-backend {backend}`",
        "",
        f"`python benchmarks/estimate_check.py --inner-backend {backend}` (torch {torch.__version__}, "
        f"{seconds:.0f} s in all; dim {size.dim}, {size.n_layers} layers, {size.batch} x {size.seq_len:,} tokens on "
        f"CP = {size.cp}: {size.batch * size.seq_len // size.cp:,} tokens per rank). GiB per rank.",
        "",
        table(backend_rows(backend, rows)),
        "",
        "Measured rise / estimated rise: " + ", ".join(
            f"rank {r}: {m['rise'] / GIB:.3f} / {row['estimated rise']:.3f}" for r, (m, row) in enumerate(zip(ranks, rows)))
        + f". Inductor's kernels generated during the warm-up step: {kernels}.",
        "",
        *(f"Rank {r}:\n\n```\n{explanation(m)}\n```\n" for r, m in enumerate(ranks)),
        end,
    ])
    text = open(BACKENDS_MD).read() if os.path.exists(BACKENDS_MD) else \
        "# The estimate against a measured CPU step, by inner backend\n\n## Runs\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    with open(BACKENDS_MD, "w") as f:
        f.write(text)


if __name__ == "__main__":
    sys.exit(main())
