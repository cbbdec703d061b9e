"""The whole-step memory estimate of torchtitan 0.3 jobs checked against a measured CPU step,
with tensor parallelism beside UPipe's CP and without it, and with expert parallelism on a
MoE model.

(a) ``estimate(job, cuda_kernel=None)`` (CPU kernels) on fake tensors over a fake process
group: 0.3's own TP (DTensor projections, sequence parallelism) and the attention through the
stage-loop op's eager twin;
(b) the same job for real: 0.3's debug Llama3 (``llama3_debugmodel_upipe_cpu``), or Qwen3's MoE
debug model (``qwen3_moe_debugmodel_upipe_cpu``, routed by torchtitan's balanced round-robin,
as the estimate sizes EP's token exchange), on gloo ranks
(:class:`upipe_compile.launch.RankPool`), built as 0.3's Trainer builds it
(``release_03.estimate.build_real_job``), each layer's attention compiled with the "upipe"
backend (aot_eager inside); one warm-up step on 1/16 of the sequence (it makes the optimizer
state), then one step under ``torch.profiler`` with ``profile_memory=True``.

The measurement and its comparison are estimate_check.py's (its docstring says what is
measured): peak = bytes live at the step's start (real tensors) + the step's rise (the
profiler's ``[memory]`` events, corrected for frees on gloo's threads), less the all-to-all
buffers gloo keeps past their use on a CPU run ("retained"). These jobs offload nothing.

    python benchmarks/estimate_check_03.py           # TP 2 x CP 2, CP 4 alone (4 ranks), EP 2 x CP 2 (2)
    python benchmarks/estimate_check_03.py --layout tp2-cp2 --no-write

Needs torchtitan 0.3 (``PYTHONPATH=.torchtitan03``, scripts/test_torchtitan03.sh --prepare).
Writes benchmarks/results/estimate_check_03.md (not with --no-write).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # run as a script: make `benchmarks` and `upipe_compile` importable
    sys.path.append(ROOT)  # after site-packages: an installed upipe_compile wins over the bare checkout

import torch  # noqa: E402

from benchmarks.estimate_check import (GIB, by_op, corrected_timeline, live_allocations,  # noqa: E402
                                       profiled_step, step_start_bytes, table, terms_at_peak)

MODULE = "upipe_compile.integrations.torchtitan"
CONFIG = "llama3_debugmodel_upipe_cpu"
SEQ_LEN = 16384
"""8,192 tokens per CP rank of the 2 x 2 layout: activations, not weights, make the peak."""


MOE_CONFIG = "qwen3_moe_debugmodel_upipe_cpu"


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    tp: int
    cp: int
    ep: int = 1
    """Expert parallelism, inside the CP ranks (0.3 borrows EP's ranks from dp_shard x cp)."""
    config: str = CONFIG

    @property
    def world(self) -> int:
        return self.tp * self.cp

    def overrides(self, seq_len: int) -> list[str]:
        moe = [f"--parallelism.expert_parallel_degree={self.ep}",
               # the estimate sends EP's tokens as a balanced router does: the measured step routes so
               "--debug.moe_force_load_balance"] if self.config == MOE_CONFIG else []
        return [f"--training.seq_len={seq_len}", f"--parallelism.context_parallel_degree={self.cp}",
                f"--parallelism.tensor_parallel_degree={self.tp}", "--upipe.no_fuse_projections", *moe]


LAYOUTS = {layout.name: layout for layout in (Layout("tp2-cp2", 2, 2), Layout("cp4", 1, 4),
                                              Layout("ep2-cp2", 1, 2, ep=2, config=MOE_CONFIG))}


def job_config(layout: Layout, seq_len: int = SEQ_LEN):
    from upipe_compile.integrations.torchtitan.release_03.estimate import load_config

    return load_config(layout.config, layout.overrides(seq_len), module=MODULE)


def estimated(layout: Layout, seq_len: int = SEQ_LEN) -> dict:
    """The estimate with CPU kernels, in bytes: the device peak and the step-constant terms."""
    from upipe_compile.integrations.torchtitan.estimate_run import estimate

    result = estimate(job_config(layout, seq_len), cuda_kernel=None)
    b = result.breakdown
    return {"device": result.peak_device_gib * GIB, "host": result.host_gib_per_rank * GIB,
            "constant": (b["sharded_params"] + b["optimizer_state"] + b["model_buffers"]) * GIB, "breakdown": b,
            "phase": result.peak_phase, "attention_calls": result.attention_calls, "seconds": result.seconds}


def measure_step(layout: Layout, seq_len: int = SEQ_LEN) -> dict:
    """On every rank of the pool: the job built as 0.3's Trainer builds it, one short warm-up
    step, then one profiled step (0.3's Trainer.train_step, one microbatch, upipe's input sharding)."""
    import torch.distributed as dist
    from torchtitan.components.loss import IGNORE_INDEX

    from upipe_compile.integrations.torchtitan.estimate_step import clip_and_step
    from upipe_compile.integrations.torchtitan.release_03.estimate import build_real_job
    from upipe_compile.integrations.torchtitan.release_03.trainer import shard_batch

    torch._dynamo.reset()
    config = job_config(layout, seq_len)
    torch.manual_seed(0)
    job = build_real_job(config, torch.device("cpu"), dist.get_world_size())
    vocab = job.model_args.vocab_size

    def train_step(seed: int, seq_len: int = seq_len) -> float:
        job.optimizers.zero_grad()
        gen = torch.Generator().manual_seed(seed)
        full = {"input": torch.randint(0, vocab, (1, seq_len), generator=gen),
                "positions": torch.arange(seq_len).expand(1, seq_len)}
        labels = torch.randint(0, vocab, (1, seq_len), generator=gen)
        inputs, local_labels, extra = shard_batch(config, job.parallel_dims, job.model, full, labels)
        global_valid_tokens = (labels != IGNORE_INDEX).sum().float()
        pred = job.model(inputs, **extra)
        loss, _ = job.loss_fn(pred, local_labels, global_valid_tokens, positions=extra["positions"])
        del pred
        loss.backward()
        clip_and_step(job, lambda name: None)
        return float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach())

    start = time.time()
    # The warm-up creates the optimizer state, on 1/16 of the sequence: the state is the
    # parameters' size whatever the length, and the step at full length costs minutes on a CPU.
    # Without automatic dynamic shapes the measured step recompiles the attention for its own
    # length, as the estimate compiles it: static shapes.
    with mock.patch.object(torch._dynamo.config, "automatic_dynamic_shapes", False):
        train_step(1, seq_len // 16)
        warmup_s = time.time() - start
        job.optimizers.zero_grad()
        gc.collect()
        start_bytes = step_start_bytes(job.model, [s for opt in job.optimizers.optimizers for s in opt.state.values()])
        prof, loss, step_s = profiled_step(train_step, 2)
    corrected = corrected_timeline(prof)
    rise, peak_ns = max(((live, t) for t, live in corrected), default=(0, None))
    at_peak, at_end = live_allocations(prof, peak_ns), live_allocations(prof, None)
    return {"start": start_bytes, "rise": rise, "terms": terms_at_peak(at_peak, at_end), "loss": loss,
            "warmup_s": round(warmup_s, 1), "step_s": round(step_s, 1), "at_peak": by_op(at_peak)}


def measured(layout: Layout, seq_len: int = SEQ_LEN, pool=None) -> list[dict]:
    from upipe_compile.launch import RankPool

    if pool is not None:
        return pool.run(measure_step, layout, seq_len)
    with RankPool(layout.world, threads=1, timeout_s=1800) as own:
        return own.run(measure_step, layout, seq_len)


def compare(layout: Layout, seq_len: int = SEQ_LEN, pool=None) -> tuple[dict, list[dict], list[dict]]:
    """Both sides and, per rank, the table's row (GiB)."""
    est = estimated(layout, seq_len)
    ranks = measured(layout, seq_len, pool)
    est_total = est["device"] + est["host"]
    est_rise = est_total - est["constant"]
    rows = []
    for rank, m in enumerate(ranks):
        start = sum(m["start"].values())
        total, retained = start + m["rise"], m["terms"]["retained"]
        rows.append({"layout": layout.name, "rank": rank, "estimated peak": est_total / GIB,
                     "measured peak": total / GIB, "retained by gloo": retained / GIB,
                     "ratio without it": est_total / (total - retained), "estimated rise": est_rise / GIB,
                     "measured rise": m["rise"] / GIB, "rise ratio without it": est_rise / (m["rise"] - retained)})
    return est, ranks, rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), action="append",
                        help="the layouts to check (default: all)")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/results/estimate_check_03.md")
    args = parser.parse_args(argv)
    t0 = time.time()
    rows, notes = [], []
    for name in args.layout or LAYOUTS:
        est, ranks, layout_rows = compare(LAYOUTS[name], args.seq_len)
        rows += layout_rows
        notes.append(f"{name}: estimate peak in `{est['phase']}`, attention ran as {est['attention_calls']}, "
                     f"{est['seconds']} s; measured warm-up / profiled step "
                     + ", ".join(f"{m['warmup_s']} / {m['step_s']} s" for m in ranks))
    text = table(rows)
    print(text)
    print("\n".join(notes))
    if not args.no_write:
        command = "python benchmarks/estimate_check_03.py" + ("" if args.seq_len == SEQ_LEN else
                                                               f" --seq-len {args.seq_len}")
        with open(os.path.join(HERE, "results", "estimate_check_03.md"), "w") as f:
            f.write("\n".join([
                "# The 0.3 estimate with tensor and expert parallelism, checked against a measured CPU step", "",
                f"Made by `PYTHONPATH=.torchtitan03 {command}` (torch {torch.__version__}, torchtitan 0.3, "
                f"2 shared CPU cores, {time.time() - t0:.0f} s in all), seq_len {args.seq_len:,}, fp32, full AC, "
                f"the attention as UPipe's stage-loop op (`upipe.no_fuse_projections`). tp2-cp2: `{CONFIG}` "
                "(0.3's debug Llama3) with 0.3's own TP and sequence parallelism beside UPipe's CP; cp4: the same "
                f"four ranks without TP; ep2-cp2: `{MOE_CONFIG}` (Qwen3's MoE debug model, 64 experts, 8 a token) "
                "on two CP ranks with its experts split over EP 2, routed by torchtitan's balanced round-robin "
                "(`--debug.moe_force_load_balance`), as the estimate sizes EP's token exchange. Per rank, GiB: "
                "estimated (`estimate(job, cuda_kernel=None)`) against measured (bytes live at the step's start + "
                "the step's rise, less the all-to-all buffers gloo keeps past their use; the script's docstring).",
                "",
                text, "", *(f"- {note}" for note in notes), "",
                "CP 4 runs its blocks compiled whole (the stage-loop op inside, AOTAutograd's partitioner around "
                "it), which saves less than the eager modules the estimate measures: its estimate is above the "
                "measurement. TP and the MoE model compile each layer's attention alone, the rest of the block "
                "eager, as the estimate runs it.", ""]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
