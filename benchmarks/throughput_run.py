"""What each rank of the throughput benchmark does: for every length and case, check every
method against our Ulysses, time them interleaved, then profile the op's step and time
compilation. :func:`rank_job` is the job the launcher runs on every rank."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from benchmarks.throughput_methods import (
    DEEPSPEED, METHODS, ULYSSES, Rank, block_inputs, first_line, load_block, op_inputs, select_methods,
    unavailable_reasons,
)
from benchmarks.tiny_llama import Block
from upipe_compile.launch import report

PROFILE_COLUMNS = ["case", "P", "seq", "method", "U", "step ms", "attention kernels ms", "collectives ms",
                   "copies ms", "other ms", "collective calls", "copy calls"]


def tick(r: Rank, label: str, n: int = 1) -> None:
    """Progress: ``n`` more steps done (sent by rank 0 only)."""
    if r.rank == 0:
        report((n, label))


def build_steps(r: Rank, case: str, seq: int, reasons: dict, methods=METHODS) -> dict:
    """name -> (U, step) for each method that can run here, name -> reason for the others."""
    inputs = op_inputs(r, seq) if case == "op" else block_inputs(r, seq)
    steps = {}
    for method in methods:
        if reasons.get(method.name):
            steps[method.name] = reasons[method.name]
            continue
        u = method.heads_per_stage(r.cfg.q_heads, r.world)
        build = method.op if case == "op" else method.block
        steps[method.name] = (u, build(r, inputs, u))
    return steps


# --- one (case, P, seq) cell --------------------------------------------------------------
def measure_cell(r: Rank, case: str, seq: int, steps: dict) -> list[dict]:
    """Warm up every runnable method (the first warm-up compiles, where there is anything to
    compile, and is checked against our Ulysses), then time the repeats interleaved."""
    args = r.args
    rows, runnable, errors, check = {}, {}, {}, {}
    for method in METHODS:
        name, entry = method.name, steps[method.name]
        rows[name] = {"case": case, "P": r.world, "seq": seq, "method": name,
                      "U": entry[0] if isinstance(entry, tuple) else None}
        if isinstance(entry, str):
            rows[name]["note"] = entry
            tick(r, f"P={r.world} S={seq} {case}", args.warmup + args.repeats)
            continue
        _, step = entry
        reason, done = None, 0
        try:
            for i in range(args.warmup):
                _, results = step(check=(i == 0))
                if i == 0:
                    check[name] = results
                done += 1
                tick(r, f"P={r.world} S={seq} {case} {name} warm-up")
        except Exception as error:  # a peer that fails here is reported; ours must run
            if method.ours:
                raise
            reason = first_line(error)
        if not r.all_agree(reason is None):
            reason = reason or "failed on another rank"
        if reason is not None:
            rows[name]["note"] = reason
            check.pop(name, None)
            tick(r, f"P={r.world} S={seq} {case}", args.warmup + args.repeats - done)
            continue
        runnable[name] = step

    reference = check[ULYSSES]
    for name in [m.name for m in METHODS if m.name in check]:  # the same order on every rank
        errors[name] = r.relative_error(check[name], reference)
    del check, reference

    times = {name: [] for name in runnable}
    for _ in range(args.repeats):
        for name, step in runnable.items():  # interleaved: every method once per round
            seconds, _ = step()
            times[name].append(seconds)
            tick(r, f"P={r.world} S={seq} {case} {name}")
    for name in runnable:
        slowest = r.all_max(times[name])  # a step takes as long as its slowest rank
        median, best = statistics.median(slowest), min(slowest)
        rows[name].update({"median ms": 1e3 * median, "min ms": 1e3 * best, "tokens/s": seq / median,
                           "max rel. err": errors[name]})
    base = rows[ULYSSES]["median ms"]
    peer = rows.get(DEEPSPEED, {}).get("median ms")  # absent when --methods leaves it out
    for name in runnable:
        rows[name]["vs Ulysses"] = base / rows[name]["median ms"]
        if peer is not None:
            rows[name]["vs DeepSpeed"] = peer / rows[name]["median ms"]
    return [rows[m.name] for m in METHODS]


# --- where a step's time goes --------------------------------------------------------------
def _category(name: str) -> str | None:
    if name == "c10d::barrier":
        return None  # the timing barrier, outside the timed step
    if name.startswith("aten::_scaled_dot_product"):
        return "attention kernels ms"
    if ("c10d" in name or "wait_tensor" in name or "all_to_all" in name or "alltoall" in name
            or name.startswith("_SeqAllToAll")):
        return "collectives ms"  # includes waiting for the slowest peer
    if name in ("aten::copy_", "aten::index_select", "aten::index_copy_", "aten::index_add_", "aten::add_",
                "aten::fill_", "aten::zero_", "aten::cat", "aten::stack", "aten::scatter_add_", "aten::clone",
                "aten::contiguous"):
        return "copies ms"
    return "other ms"


def profile_cell(r: Rank, case: str, seq: int, reasons: dict, steps: int) -> list[dict]:
    """Each runnable method's step split by torch.profiler self time (mean over ranks and
    ``steps`` interleaved steps): attention kernels, collectives (including waiting for
    peers), copies (packing, unpacking, accumulating), other (allocation, autograd, Python)."""
    from torch.profiler import ProfilerActivity, profile

    profiled = [m for m in METHODS if m.profiled]
    built = build_steps(r, case, seq, reasons, profiled)
    names = [m.name for m in profiled if isinstance(built[m.name], tuple)]
    tick(r, f"profile P={r.world} S={seq} {case}", (len(profiled) - len(names)) * steps)  # not run
    sums = {n: {c: 0.0 for c in PROFILE_COLUMNS[5:]} for n in names}
    for n in names:
        built[n][1]()  # one untimed step (compiles where needed)
    for _ in range(steps):
        for n in names:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                seconds, _ = built[n][1]()
            acc = sums[n]
            acc["step ms"] += 1e3 * seconds
            for event in prof.key_averages():
                category = _category(event.key)
                if category is None:
                    continue
                acc[category] += event.self_cpu_time_total / 1e3
                if category == "collectives ms" and ("alltoall" in event.key or "allgather" in event.key):
                    acc["collective calls"] += event.count
                if category == "copies ms":
                    acc["copy calls"] += event.count
            tick(r, f"profile P={r.world} S={seq} {case} {n}")
    rows = []
    for n in names:
        acc = sums[n]
        measured = sum(acc[c] for c in ("attention kernels ms", "collectives ms", "copies ms", "other ms"))
        acc["other ms"] += acc["step ms"] - measured  # Python and anything the profiler does not see
        t = torch.tensor([acc[c] / steps for c in PROFILE_COLUMNS[5:]], dtype=torch.float64, device=r.device)
        dist.all_reduce(t)
        row = {"case": case, "P": r.world, "seq": seq, "method": n, "U": built[n][0]}
        row.update(dict(zip(PROFILE_COLUMNS[5:], (t / r.world).tolist())))
        rows.append(row)
    return rows


# --- compile time -------------------------------------------------------------------------
def measure_compile_time(r: Rank, seq: int) -> list[dict]:
    """First call (compile + run) minus a steady step, for torch.compile(backend="upipe")
    and the plain inner backend on the same block and the same local shard. Cold: a fresh
    inductor cache dir and cleared in-memory caches (torch._inductor.utils.fresh_cache);
    warm: compiled again after torch._dynamo.reset() with that cache kept."""
    from torch._inductor.utils import fresh_cache

    world, backend = r.world, r.args.compile_backend
    inputs = block_inputs(r, seq, seed=3000)
    x, dy, positions = inputs.x.requires_grad_(), inputs.dy, inputs.positions

    def one(name):
        torch._dynamo.reset()
        model = load_block(r, Block(r.cfg), inputs)
        if name == "upipe":
            compiled = torch.compile(model, backend="upipe", dynamic=False, options={
                "cp_mesh": r.mesh, "heads_per_stage": world, "inner_backend": backend})
        else:
            compiled = torch.compile(model, backend=backend, dynamic=False)

        def run():
            model.zero_grad(set_to_none=True)
            compiled(x, positions).backward(dy)

        first, _ = r.timed(run)
        steady = statistics.median(r.timed(run)[0] for _ in range(2))
        return r.all_max([first, steady])

    # Load the compiler's modules once, so that neither measurement pays for importing them.
    with fresh_cache():
        torch._dynamo.reset()
        warm_up = torch.compile(lambda t: (t.sin() * 2).sum(), backend=backend)
        warm_up(torch.randn(8, device=r.device, requires_grad=True)).backward()
    rows = []
    label = {"upipe": f'backend="upipe" (inner {backend}, U=P={world})', backend: f'backend="{backend}" (no CP)'}
    for name in (backend, "upipe"):
        with fresh_cache():
            cold_first, cold_steady = one(name)
            tick(r, f"compile time {name} cold")
            warm_first, warm_steady = one(name)
            tick(r, f"compile time {name} warm")
        rows.append({"compile": label[name], "P": world, "seq": seq,
                     "cold: first call s": cold_first, "cold: compile s": cold_first - cold_steady,
                     "warm: first call s": warm_first, "warm: compile s": warm_first - warm_steady,
                     "steady step ms": 1e3 * min(cold_steady, warm_steady)})
    torch._dynamo.reset()
    base = rows[0]["cold: compile s"]
    rows[1]["cold: compile vs plain"] = rows[1]["cold: compile s"] / base
    rows[0]["cold: compile vs plain"] = 1.0
    return rows


# --- a rank -------------------------------------------------------------------------------
def rank_job(args, cfg, with_compile_time: bool) -> dict:
    """Everything one P measures, on every rank; every rank returns the same tables."""
    select_methods(args.methods)  # a spawned rank imports the full list again
    device = torch.device("cpu" if args.device == "cpu" else f"cuda:{dist.get_rank()}")
    r = Rank(device, args, cfg)
    reasons = unavailable_reasons(r)
    rows = []
    for seq in args.seqs:
        if "op" in args.cases:
            rows += measure_cell(r, "op", seq, build_steps(r, "op", seq, reasons))
        if "block" in args.cases:
            torch._dynamo.reset()  # drop the previous length's graphs
            rows += measure_cell(r, "block", seq, build_steps(r, "block", seq, reasons))
    profile_rows = []
    if args.profile and "op" in args.cases:
        torch._dynamo.reset()
        profile_rows = profile_cell(r, "op", max(args.seqs), reasons, args.profile)
    compile_rows = measure_compile_time(r, args.seqs[0]) if with_compile_time else []
    dist.barrier()
    return {"rows": rows, "profile": profile_rows, "compile": compile_rows, "reasons": reasons}
