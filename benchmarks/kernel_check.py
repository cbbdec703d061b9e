"""Every attention kernel this machine has, against SDPA's math on the same inputs.

    python benchmarks/kernel_check.py                 # CPU, and CUDA kernels if a GPU is visible

For each kernel pair (CPU: aten's CPU flash, and the blocked kernel for variants; CUDA:
every kernel of upipe_compile.attention.kernels.CUDA_KERNELS that is installed and usable on
this GPU: FlashAttention-3 and -4, cuDNN attention (sm90+), flash-attn, aten's flash),
on GQA and MHA shapes, causal and not, bf16, dense and with each attention variant (a
sliding window of S/8 either side, softcap 30), and with fewer or more queries than keys (a
ring's chunk pair under packed documents: the window aligned at the last query and key):
forward output, log-sum-exp and dq/dk/dv against the attention math in float32 (masked,
soft-capped scores, autograd). A variant
the kernel refuses (aten's CUDA flash has no softcap; cuDNN has no window or softcap) is
listed as refused, with the reason. Exits non-zero when any relative error passes the bf16 tolerance, so a GPU
session's first command shows whether the CUDA path works.
"""

from __future__ import annotations

import argparse
import sys

import torch
from tabulate import tabulate

from upipe_compile.attention import kernels

TOLERANCE = 2e-2  # bf16
SHAPES = [  # batch, q heads, kv heads, seq, head_dim (seq / 16 on CPU, where it is only a smoke test)
    (1, 4, 1, 1024, 128),
    (2, 8, 8, 512, 64),
    (1, 2, 1, 4096, 128),
]
UNEQUAL = [  # batch, q heads, kv heads, queries, keys, head_dim: a ring's chunk pair, not causal
    (1, 4, 2, 384, 1024, 128),
    (1, 4, 1, 1024, 640, 64),
]
VARIANTS = {"-": (None, 0.0), "window S/8": ("eighth", 0.0), "softcap 30": (None, 30.0)}
"""name -> (window, softcap); the window is (S/8, S/8), causal cutting its right edge to 0."""


def available_kernels() -> list[tuple[str, torch.device, object]]:
    """The CPU kernel and, on a GPU, every CUDA kernel of the registry that is installed."""
    found = [("aten-cpu", torch.device("cpu"), kernels.CpuKernels())]
    if torch.cuda.is_available():
        for name, kernel in kernels.CUDA_KERNELS.items():
            installed = kernel.installed()
            if installed is not None:
                found.append((name, torch.device("cuda"), installed))
    return found


def relative_error(actual, expected) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def reference(q, k, v, dout, is_causal: bool, window, softcap: float):
    """(out, lse, dq, dk, dv) of the attention math in float32 on the whole score matrix
    (query i's window centred on key i + keys - queries)."""
    q, k, v = (t.float().requires_grad_(True) for t in (q, k, v))
    group, q_len, k_len = q.shape[1] // k.shape[1], q.shape[2], k.shape[2]
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(q_len, device=q.device).unsqueeze(-1) + (k_len - q_len)
    j = torch.arange(k_len, device=q.device)
    left, right = window
    hidden = torch.zeros(q_len, k_len, dtype=torch.bool, device=q.device)
    if is_causal:
        hidden |= j > i
    if left >= 0:
        hidden |= j < i - left
    if right >= 0:
        hidden |= j > i + right
    scores = scores.masked_fill(hidden, float("-inf"))
    out = scores.softmax(-1) @ v.repeat_interleave(group, 1)
    out.backward(dout.float())
    return out.detach(), scores.detach().logsumexp(-1), q.grad, k.grad, v.grad


def check(pair, device, shape, is_causal: bool, variant: str = "-") -> dict:
    """One kernel call against the math; ``shape`` is (B, Hq, Hkv, S, D), or (B, Hq, Hkv,
    queries, keys, D) for unequal lengths."""
    batch, q_heads, kv_heads, *lengths, dim = shape
    if device.type == "cpu":
        lengths = [n // 16 for n in lengths]
    q_len, k_len = lengths[0], lengths[-1]
    window, softcap = VARIANTS[variant]
    # with more queries than keys the first rows' window must reach the first key, as in the ring's calls
    edge = k_len // 8 + max(0, q_len - k_len)
    window = (edge, edge) if window == "eighth" else (-1, -1)
    row = {"shape B,Hq,Hkv,S,D": ",".join(map(str, (batch, q_heads, kv_heads, "/".join(map(str, lengths)), dim))),
           "causal": is_causal, "variant": variant}
    refused = pair.variant_problems(window, softcap)
    if refused:
        return {**row, "ok": "refused: " + "; ".join(refused)}
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(batch, q_heads, q_len, dim, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, k_len, dim, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    out, lse = pair.forward(q, k, v, is_causal, None, window, softcap)
    grads = pair.backward(dout, q, k, v, out, lse, is_causal, None, window, softcap)
    expected = reference(q, k, v, dout, is_causal, window, softcap)
    errors = {name: relative_error(actual, wanted)
              for name, actual, wanted in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), expected)}
    return {**row, **errors, "ok": max(errors.values()) < TOLERANCE}


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    rows = []
    for name, device, pair in available_kernels():
        for shape in SHAPES:
            for is_causal in (True, False):
                for variant in VARIANTS:
                    rows.append({"kernel": name, **check(pair, device, shape, is_causal, variant)})
        for shape in UNEQUAL:
            for variant in VARIANTS:
                rows.append({"kernel": name, **check(pair, device, shape, False, variant)})
    print(tabulate(rows, headers="keys", floatfmt=".1e", tablefmt="github"))
    failed = [r for r in rows if r["ok"] is False]
    refused = [r for r in rows if isinstance(r["ok"], str)]
    print(f"{len(rows) - len(failed) - len(refused)} passed, {len(failed)} failed, {len(refused)} refused")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
