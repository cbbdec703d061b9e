"""The throughput benchmark's report: the markdown tables with their header, and the CSVs,
each starting with the command that made it."""

from __future__ import annotations

import csv
import datetime
import os
import platform
import shlex
import sys

import torch
from tabulate import tabulate

from benchmarks import deepspeed_ulysses
from benchmarks.throughput_methods import DEEPSPEED, RING, ULYSSES, UPIPE_P, UPIPE_P_UNFUSED
from benchmarks.throughput_run import PROFILE_COLUMNS

COLUMNS = ["case", "P", "seq", "method", "U", "median ms", "min ms", "tokens/s",
           "vs Ulysses", "vs DeepSpeed", "max rel. err", "note"]


def command_line() -> str:
    exe = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd() + os.sep) else "python"
    return shlex.join([exe, *sys.argv])


def fmt_rows(rows, header_notes=()):
    """Rows as table cells; a reason already given in the header is not repeated per row."""
    out = []
    for row in rows:
        if row.get("note") and row["note"] in header_notes:
            row = {**row, "note": "not run: see the header"}
        shown = {}
        for key in COLUMNS:
            value = row.get(key)
            if isinstance(value, float):
                value = (f"{value:.2e}" if key == "max rel. err" else f"{value:.3f}" if key.startswith("vs")
                         else f"{value:.0f}" if key == "tokens/s" else f"{value:.1f}")
            shown[key] = "" if value is None else value
        out.append(shown)
    return out


def targets(rows, seqs) -> list[str]:
    """At the largest length, against the targets: Ulysses (ours) >= 1.0x DeepSpeed; UPipe
    U=P >= 0.95x of both; the fused block >= 0.95x the unfused one (throughput ratios)."""
    lines = []
    largest = max(seqs)
    for case in ("op", "block"):
        for world in sorted({row["P"] for row in rows}):
            cell = {row["method"]: row for row in rows
                    if row["case"] == case and row["P"] == world and row["seq"] == largest}
            if not cell:
                continue
            ours, upipe, peer = cell[ULYSSES], cell[UPIPE_P], cell.get(DEEPSPEED, {"note": "not selected"})
            parts = [f"{case:5s} P={world} S={largest}:"]
            if "median ms" in peer:
                a = ours["vs DeepSpeed"]
                parts.append(f"Ulysses(ours)/DeepSpeed = {a:.3f}x (goal >= 1.0: {'met' if a >= 1.0 else 'MISSED'});")
                b = upipe["vs DeepSpeed"]
                parts.append(f"UPipe(U=P)/DeepSpeed = {b:.3f}x (goal >= 0.95: {'met' if b >= 0.95 else 'MISSED'});")
            else:
                parts.append(f"DeepSpeed: {peer.get('note', 'not run')};")
            c = upipe["vs Ulysses"]
            parts.append(f"UPipe(U=P)/Ulysses(ours) = {c:.3f}x (goal >= 0.95: {'met' if c >= 0.95 else 'MISSED'})")
            unfused = cell.get(UPIPE_P_UNFUSED, {})
            if case == "block" and unfused.get("median ms") and upipe.get("median ms"):
                d = unfused["median ms"] / upipe["median ms"]
                parts.append(f"; UPipe(U=P) fused/unfused = {d:.3f}x (goal >= 0.95: {'met' if d >= 0.95 else 'MISSED'})")
            lines.append(" ".join(parts))
    return lines


def _header(args, cfg, command, threads, reasons, tol, wall) -> list[str]:
    ds_reason, ring_reason = reasons.get(DEEPSPEED), reasons.get(RING)
    try:
        ds_text = f"deepspeed {deepspeed_ulysses.version()}" if ds_reason is None else "deepspeed not available"
    except Exception:
        ds_text = ds_reason or "deepspeed ?"
    cores = torch.get_num_threads()
    device_text = (f"{args.device} ({torch.cuda.get_device_name(0)}), NCCL" if args.device == "cuda"
                   else f"CPU ({cores} cores, {platform.processor() or platform.machine()}), gloo")
    threads_text = ", ".join(f"P={w}: {t}" for w, t in threads.items())
    return [
        f"$ {command}",
        "",
        f"# {datetime.datetime.now().isoformat(timespec='seconds')}; torch {torch.__version__}; {ds_text}; "
        f"device {device_text}; torch threads per rank {threads_text}"
        + (" (P ranks share the cores: oversubscribed when P > cores)" if args.device == "cpu" else ""),
        f"# attention ({args.model}): {cfg.q_heads} q / {cfg.kv_heads} KV heads, head_dim {cfg.head_dim}, causal, "
        f"batch 1, {args.dtype}" + (" (CPU flash kernel; bf16 runs on AMX where present)" if args.device == "cpu" else ""),
        f"# block: benchmarks/tiny_llama.Block ({cfg}), compiled with inner backend {args.inner_backend} "
        f"(ours: backend='upipe', options inner_backend={args.inner_backend!r}; peers: backend={args.inner_backend!r})",
        f"# timing: {args.warmup} warm-up step(s) (the first compiles and is checked), then the median of {args.repeats} "
        "forward+backward steps, methods interleaved step by step; a step = the slowest rank's time",
        "# vs Ulysses / vs DeepSpeed: throughput ratio (their median time / this one's; > 1 = faster)",
        f"# max rel. err: output and every gradient vs Ulysses (ours), max over tensors and ranks; tolerance {tol:g}",
        f"# torch ring CP: {'runs' if ring_reason is None else 'does not run here: ' + ring_reason}",
        f"# DeepSpeed Ulysses: {'runs' if ds_reason is None else 'does not run here: ' + ds_reason}",
        f"# wall time of this run: {wall:.0f} s",
    ]


def markdown(args, cfg, command, result, threads, reasons, tol, wall) -> tuple[str, bool]:
    """The report's text and whether every method matched our Ulysses within ``tol``."""
    rows, profile_rows, compile_rows = result["rows"], result["profile"], result["compile"]
    worst = max((row["max rel. err"] for row in rows if "max rel. err" in row), default=0.0)
    sections = []
    for case, title in (("op", "Attention op alone (forward + backward)"),
                        ("block", "Llama-style decoder block (forward + backward)")):
        case_rows = [row for row in rows if row["case"] == case]
        if case_rows:
            shown = fmt_rows(case_rows, header_notes=[n for n in reasons.values() if n])
            sections += [f"## {title}", "", tabulate(shown, headers="keys", tablefmt="github", disable_numparse=True), ""]
    if profile_rows:
        sections += [f"## Where the op's step goes (torch.profiler self time, mean over ranks and {args.profile} steps, "
                     f"S={max(args.seqs)})", "",
                     "collectives include waiting for the slowest peer; copies = packing/unpacking/accumulating "
                     "(copy_, index_select, index_copy_/add_, add_, fill_/zero_, cat/stack, clone); other = the "
                     "step's wall time minus those (allocation, autograd, Python).", "",
                     tabulate([{k: row[k] for k in PROFILE_COLUMNS} for row in profile_rows], headers="keys",
                              tablefmt="github", floatfmt=".1f"), ""]
    if compile_rows:
        sections += [f"## Compile time of the block: backend=\"upipe\" vs plain {args.compile_backend}", "",
                     "compile s = first call (trace, compile, run forward + backward) minus a steady step; cold: a "
                     "fresh inductor cache dir and cleared in-memory caches (torch._inductor.utils.fresh_cache), "
                     "warm: compiled again after torch._dynamo.reset() with that cache kept. The plain row is the "
                     "same block without context parallelism (attention over the local shard only), so its steady "
                     "step is not comparable; max over ranks.", "",
                     tabulate(compile_rows, headers="keys", tablefmt="github", floatfmt=".2f"), ""]
    ok = worst <= tol
    verdict = [f"CHECK {'OK' if ok else 'FAILED'}: every method's output and gradients match Ulysses (ours) "
               f"(max rel. err {worst:.2e}, tolerance {tol:g})"]
    header = _header(args, cfg, command, threads, reasons, tol, wall)
    goals = targets(rows, args.seqs)
    if len(compile_rows) > 1:
        e = compile_rows[1]["cold: compile vs plain"]
        goals.append(f"compile (cold) backend=\"upipe\" / plain {args.compile_backend} = {e:.2f}x "
                     f"(goal <= 1.15: {'met' if e <= 1.15 else 'MISSED'})")
    lines = header + [""] + sections + ["## Goals at the largest length", ""] + goals + [""] + verdict
    return "\n".join(lines) + "\n", ok


def write(out_dir: str, args, command: str, text: str, result) -> list[str]:
    """throughput.md, throughput.csv and (when profiled) throughput_profile.csv; their paths."""
    os.makedirs(out_dir, exist_ok=True)
    md_path, csv_path = os.path.join(out_dir, "throughput.md"), os.path.join(out_dir, "throughput.csv")
    with open(md_path, "w") as f:
        f.write(text)
    with open(csv_path, "w", newline="") as f:
        f.write(f"# $ {command}\n")
        writer = csv.DictWriter(f, fieldnames=COLUMNS + ["dtype", "inner backend", "device"])
        writer.writeheader()
        for row in result["rows"]:
            writer.writerow({**{k: row.get(k, "") for k in COLUMNS}, "dtype": args.dtype,
                             "inner backend": args.inner_backend if row["case"] == "block" else "",
                             "device": args.device})
        for row in result["compile"]:
            writer.writerow({"case": "compile", "P": row["P"], "seq": row["seq"], "method": row["compile"],
                             "median ms": row["cold: compile s"] * 1e3,
                             "note": f"cold compile (first call - steady step); warm {row['warm: compile s']:.2f} s",
                             "dtype": args.dtype, "inner backend": args.compile_backend, "device": args.device})
    written = [md_path, csv_path]
    if result["profile"]:
        profile_path = os.path.join(out_dir, "throughput_profile.csv")
        with open(profile_path, "w", newline="") as f:
            f.write(f"# $ {command}\n")
            writer = csv.DictWriter(f, fieldnames=PROFILE_COLUMNS)
            writer.writeheader()
            writer.writerows({k: row[k] for k in PROFILE_COLUMNS} for row in result["profile"])
        written.append(profile_path)
    return written
