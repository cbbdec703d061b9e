"""The ``--hf`` whole-step estimate checked against a real step on CPU, for two families.

(a) :func:`upipe_compile.integrations.hf_estimate.estimate_hf` for a CPU job (``cuda_kernel=None``: no GPU
workspace, RMSNorm as eager CPU torch allocates it; device ratio 1), on fake tensors;
(b) the same job for real on P gloo ranks (:class:`upipe_compile.launch.RankPool`), built as
``UPipeTrainer`` builds it on GPUs: the model from the same config with upipe's attention, the
long-context stack (chunked loss, tiled MLP, block inputs offloaded to host), gradient
checkpointing (non-reentrant), each decoder layer compiled with ``backend="upipe"`` (aot_eager
inside; the offloader's hooks outside), FSDP2 as accelerate prepares it (bf16 mixed precision,
fp32 master weights), fused AdamW; the Trainer's step on one row (``upipe_batch``: rank r's
shard, shifted labels), the loss over ``num_items_in_batch`` times the processes, backward,
clipping, the optimizer step. One warm-up step, then one step under ``torch.profiler`` with
``profile_memory=True``, measured as ``estimate_check.py`` measures the torchtitan job (its
helpers: the live bytes' running sum corrected for frees on gloo's threads; what persists
between steps counted from the real tensors).

The estimate's figure for the same moment is its device peak + its host bytes per rank (on CPU
the offloaded inputs are CPU allocations too). "rise": that figure less parameters, optimizer
state, model buffers and the host buffers (which exist from the warm-up step on).

    python benchmarks/estimate_check_hf.py             # writes benchmarks/results/estimate_check_hf.md
    python benchmarks/estimate_check_hf.py --no-write  # print only
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: make `benchmarks` and `upipe_compile` importable
    sys.path.append(ROOT)  # after site-packages: an installed upipe_compile wins over the bare checkout

import torch  # noqa: E402

from benchmarks.estimate_check import (  # noqa: E402
    GIB, by_op, corrected_timeline, live_allocations, profiled_step, step_start_bytes, table, terms_at_peak,
)

RESULTS = os.path.join(ROOT, "benchmarks", "results", "estimate_check_hf.md")
TOLERANCE = {"llama": 0.05, "qwen3": 0.10}
"""What tests/test_estimate_check_hf.py holds each family's peak to. Llama measures 2.2 % over the
estimate; Qwen3 (QK-norm, wider heads) 5-8 %, varying by 2 MiB from run to run: the estimate
misses a few MiB the real step keeps live in the attention block's backward (not explained yet,
docs/estimate.md)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """A tiny transformers config and the job: activations set the peak, seconds of compute."""

    family: str
    extra: tuple = ()
    hidden: int = 256
    layers: int = 2
    heads: int = 8
    kv_heads: int = 2
    vocab: int = 2048
    seq_len: int = 8192
    cp: int = 2
    loss_chunk_tokens: int = 1024
    mlp_tile_tokens: int = 1024

    def config(self) -> dict:
        return {"model_type": self.family, "hidden_size": self.hidden, "intermediate_size": 2 * self.hidden,
                "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "vocab_size": self.vocab, "max_position_embeddings": 1 << 20,
                "tie_word_embeddings": False, "hidden_act": "silu", **dict(self.extra)}

    def job(self, path: str):
        from upipe_compile.integrations.hf_estimate import HFJob

        return HFJob(path, seq_len=self.seq_len, cp=self.cp, loss_chunk_tokens=self.loss_chunk_tokens,
                     mlp_tile_tokens=self.mlp_tile_tokens, offload_block_inputs=True)


CASES = {
    "llama": Case("llama", (("rms_norm_eps", 1e-5),)),
    # QK-norm, heads wider than hidden / heads, GQA 2
    "qwen3": Case("qwen3", (("head_dim", 64), ("rms_norm_eps", 1e-6)), kv_heads=4),
}


def write_config(case: Case, folder: str) -> str:
    path = os.path.join(folder, f"{case.family}.json")
    with open(path, "w") as f:
        json.dump(case.config(), f)
    return path


# --- (a) the estimate -------------------------------------------------------------------------

def estimated(case: Case, path: str) -> dict:
    from upipe_compile.integrations.hf_estimate import estimate_hf

    result = estimate_hf(case.job(path), cuda_kernel=None, device_ratio=1.0, host_gib=1e6)
    b = result.breakdown
    return {"device": result.peak_device_gib * GIB, "host": result.host_gib_per_rank * GIB,
            "constant": (b["sharded_params"] + b["optimizer_state"] + b["model_buffers"]) * GIB,
            "breakdown": b, "phase": result.peak_phase, "seconds": result.seconds}


# --- (b) the real step -----------------------------------------------------------------------

def measure_step(case: Case, path: str, explain: bool = False) -> dict:
    """On every rank of the pool: the job built for real, a warm-up step, one profiled step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from upipe_compile.integrations.hf_estimate import _shard, load_config
    from upipe_compile.integrations.hf_stack import StackSettings, apply_stack, compile_layers
    from upipe_compile.integrations.hf_batch import upipe_batch
    from upipe_compile.integrations.transformers import register

    torch._dynamo.reset()
    job, world = case.job(path), dist.get_world_size()
    config = load_config(path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register(), dtype=torch.float32)
    model.train()
    settings = StackSettings(job.loss_chunk_tokens, job.mlp_tile_tokens, True, host_memory_reserve_gib=0)
    arguments = argparse.Namespace(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    offloader = apply_stack(model, settings, arguments)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    compile_layers(model, backend="upipe", options={"cp_mesh": mesh, "inner_backend": "aot_eager"})
    _shard(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def train_step(seed: int) -> float:
        optimizer.zero_grad()
        gen = torch.Generator().manual_seed(seed)
        full = {"input_ids": torch.randint(0, case.vocab, (1, case.seq_len), generator=gen),
                "labels": torch.randint(0, case.vocab, (1, case.seq_len), generator=gen)}
        batch = upipe_batch(full, mesh, world=world)
        outputs = model(**batch, num_items_in_batch=torch.tensor(float(case.seq_len - 1)), use_cache=False)
        loss = outputs.loss * world  # the Trainer scales it by the processes
        del outputs
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        optimizer.step()
        return float(loss.detach())

    start = time.time()
    train_step(1)  # compiles; creates the optimizer state and the host buffers
    warmup_s = time.time() - start
    optimizer.zero_grad()
    gc.collect()
    start_bytes = step_start_bytes(model, list(optimizer.state.values()), offloader)
    prof, loss, step_s = profiled_step(train_step, 2)
    corrected = corrected_timeline(prof)
    rise, peak_ns = max(((live, t) for t, live in corrected), default=(0, None))
    at_peak = live_allocations(prof, peak_ns)
    terms = terms_at_peak(at_peak, live_allocations(prof, None))
    explained = dict(list(by_op(at_peak).items())[:25]) if explain else {}
    return {"explain": explained, "start": start_bytes, "rise": rise, "terms": terms, "loss": loss,
            "warmup_s": round(warmup_s, 1), "step_s": round(step_s, 1),
            "offloaded": offloader.offloaded_bytes_last_step}


def measured(case: Case, path: str, pool=None, explain: bool = False) -> list[dict]:
    from upipe_compile.launch import RankPool

    if pool is not None:
        return pool.run(measure_step, case, path, explain)
    with RankPool(case.cp, threads=1, timeout_s=1800) as own:
        return own.run(measure_step, case, path, explain)


# --- the comparison -----------------------------------------------------------------------------

def compare(case: Case, pool=None, explain: bool = False) -> tuple[dict, list[dict], list[dict]]:
    """Both sides and the table's rows, one a rank (GiB)."""
    with tempfile.TemporaryDirectory() as folder:
        path = write_config(case, folder)
        est = estimated(case, path)
        ranks = measured(case, path, pool, explain)
    est_total = est["device"] + est["host"]
    est_rise = est_total - est["constant"] - est["host"]
    rows = []
    for rank, m in enumerate(ranks):
        total = sum(m["start"].values()) + m["rise"]
        retained = m["terms"]["retained"]  # what gloo holds past its use (estimate_check.py)
        rows.append({
            "model": case.family, "rank": rank, "estimated peak (device + host)": est_total / GIB,
            "measured peak": total / GIB, "ratio": est_total / total,
            "ratio without gloo's retained": est_total / (total - retained),
            "estimated rise": est_rise / GIB, "measured rise": m["rise"] / GIB,
            "rise ratio": est_rise / (m["rise"] - retained),
            "host est. / meas. (MiB)": f"{est['host'] / 2 ** 20:.1f} / {m['start']['host_buffers'] / 2 ** 20:.1f}",
            "estimated at": est["phase"],
        })
    return est, ranks, rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--only", choices=sorted(CASES), help="one family")
    parser.add_argument("--explain", action="store_true",
                        help="also print what was live at rank 0's measured peak, by the op that allocated it")
    args = parser.parse_args(argv)
    start = time.time()
    rows = []
    for case in CASES.values():
        if args.only and case.family != args.only:
            continue
        est, ranks, case_rows = compare(case, explain=args.explain)
        rows += case_rows
        if args.explain:
            print(f"{case.family}: estimate at its peak (GiB) {est['breakdown']}")
            for path, size in ranks[0]["explain"].items():
                print(f"  {size / 2 ** 20:9.2f} MiB  {path}")
    text = table(rows, floatfmt=".4f")  # GiB of a tiny job
    print(text)
    if not args.no_write:
        sizes = "; ".join(f"{c.family}: {json.dumps(c.config())}, seq_len {c.seq_len}, P = {c.cp}, "
                          f"loss_chunk_tokens {c.loss_chunk_tokens}, mlp_tile_tokens {c.mlp_tile_tokens}, "
                          "offload_block_inputs" for c in CASES.values())
        with open(RESULTS, "w") as f:
            f.write("# The `--hf` estimate against a real step on CPU\n\n"
                    "`python benchmarks/estimate_check_hf.py` (2 gloo ranks on a 2-core CPU, torch "
                    f"{torch.__version__}, {time.time() - start:.0f} s). What each side is and how the real step "
                    "is measured: the script's docstring. Jobs: " + sizes + ".\n\n"
                    "\"ratio\": the estimate's peak (device + host per rank) over the measured one; "
                    "\"rise\": the peak less what persists between steps (parameters, optimizer state, buffers, "
                    "the host buffers), the part activations make; \"gloo's retained\": buffers gloo frees late "
                    "on its own threads, which a GPU's NCCL does not hold.\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
