"""Every attention kernel this machine has, against SDPA's math on the same inputs.

    python benchmarks/kernel_check.py                 # CPU, and CUDA kernels if a GPU is visible

For each kernel pair (CPU: aten's CPU flash; CUDA: aten's flash and, if installed,
flash-attn through upipe_compile.kernels.FlashAttnKernels), on GQA and MHA shapes, causal
and not, bf16: forward output, log-sum-exp and dq/dk/dv against
``F.scaled_dot_product_attention`` computed in float32 with the math backend. Exits
non-zero when any relative error passes the bf16 tolerance, so a GPU session's first
command shows whether the CUDA path works.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from tabulate import tabulate

from upipe_compile import kernels

TOLERANCE = 2e-2  # bf16
SHAPES = [  # batch, q heads, kv heads, seq, head_dim (seq / 16 on CPU, where it is only a smoke test)
    (1, 4, 1, 1024, 128),
    (2, 8, 8, 512, 64),
    (1, 2, 1, 4096, 128),
]


def available_kernels() -> list[tuple[str, torch.device, object]]:
    found = [("aten-cpu", torch.device("cpu"), kernels.CpuKernels())]
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        found.append(("aten-flash", cuda, kernels.AtenCudaKernels()))
        interface = kernels._flash_attn_interface()
        if interface is not None:
            import flash_attn

            found.append((f"flash-attn {flash_attn.__version__}", cuda, kernels.FlashAttnKernels(interface)))
    return found


def relative_error(actual, expected) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def check(pair, device, shape, is_causal: bool) -> dict:
    batch, q_heads, kv_heads, seq, dim = shape
    if device.type == "cpu":
        seq //= 16
        shape = (batch, q_heads, kv_heads, seq, dim)
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(batch, q_heads, seq, dim, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, seq, dim, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    out, lse = pair.forward(q, k, v, is_causal, None)
    dq, dk, dv = pair.backward(dout, q, k, v, out, lse, is_causal, None)

    ref = [t.float().requires_grad_(True) for t in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(*ref, is_causal=is_causal, enable_gqa=True)
    expected.backward(dout.float())
    scores = ref[0].detach() @ ref[1].detach().repeat_interleave(q_heads // kv_heads, 1).transpose(-1, -2) * dim**-0.5
    if is_causal:
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1), float("-inf"))
    errors = {
        "out": relative_error(out, expected), "lse": relative_error(lse, scores.logsumexp(-1)),
        "dq": relative_error(dq, ref[0].grad), "dk": relative_error(dk, ref[1].grad), "dv": relative_error(dv, ref[2].grad),
    }
    return {"shape B,Hq,Hkv,S,D": ",".join(map(str, shape)), "causal": is_causal, **errors,
            "ok": max(errors.values()) < TOLERANCE}


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    rows = []
    for name, device, pair in available_kernels():
        for shape in SHAPES:
            for is_causal in (True, False):
                rows.append({"kernel": name, **check(pair, device, shape, is_causal)})
    print(tabulate(rows, headers="keys", floatfmt=".1e", tablefmt="github"))
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
