"""Smoke run of hybrid models on this machine's device: every hybrid family upipe routes (tiny
configs, loaded with register()) compiled with backend="upipe" over a FAKE process group of 2 ranks,
forward + backward in bf16 (CUDA if present). The collectives move nothing, so the values
mean nothing: it shows that the mixer stage loops and attention ops compile and run on the
device, and which upipe ops the graphs hold. Numerics are tests/test_hf_hybrid_numerics.py's.

    python benchmarks/hybrid_smoke.py
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

import upipe_compile  # noqa: E402
from upipe_compile.measure.memory import fake_process_group  # noqa: E402


def main() -> int:
    import hf_hybrids_jobs as jobs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"# torch {torch.__version__}, {name}")
    failed = 0
    with fake_process_group(2) as group:
        for family in jobs.FAMILIES:
            torch._dynamo.reset()
            start = time.perf_counter()
            ops: set[str] = set()

            def backend(gm, example_inputs):
                compiled = upipe_compile.upipe_backend(gm, example_inputs, options={"inner_backend": "aot_eager"})
                ops.update(str(n.target) for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
                           for n in m.graph.nodes if "upipe" in str(n.target))
                return compiled

            try:
                model = jobs.build_model(family, jobs.UPIPE).to(device, torch.bfloat16)
                ids = upipe_compile.shard_sequence(torch.randint(0, jobs.VOCAB, (1, 256), device=device), group)
                positions = upipe_compile.global_positions(ids.shape[1], group, device=device)
                logits = torch.compile(model, backend=backend)(input_ids=ids, position_ids=positions,
                                                               use_cache=False).logits
                logits.float().sum().backward()
                print(f"{family}: forward + backward ran, logits {tuple(logits.shape)}, ops {sorted(ops)}, "
                      f"{time.perf_counter() - start:.1f} s")
            except Exception as error:  # report and go on to the next family
                failed += 1
                print(f"{family}: FAILED {type(error).__name__}: {str(error)[:800]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
