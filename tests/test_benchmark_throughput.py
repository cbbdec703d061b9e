"""benchmarks/throughput.py runs end to end at a tiny setting (2 gloo ranks, 64 tokens,
aot_eager) and writes its tables, so that it cannot rot. DeepSpeed is optional: without it
the DeepSpeed row must say why instead of showing a number."""

import csv
import importlib.util
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--world", "2", "--seqs", "64", "--repeats", "1", "--quick"]
OURS = (
    "Ulysses (ours)", "UPipe U=P", "UPipe U=P, unfused", "UPipe U=P, no prefetch", "UPipe U=P, prefetch both", "UPipe U=2P",
)


def _rows(path):
    with open(path) as f:
        command = f.readline()
        return command, list(csv.DictReader(f))


def _deepspeed_importable() -> bool:
    """Whether DeepSpeed's Ulysses can be imported here (checked in a subprocess: importing
    deepspeed picks an accelerator and configures logging)."""
    if importlib.util.find_spec("deepspeed") is None:
        return False
    check = subprocess.run([sys.executable, "-c", "import deepspeed.sequence.layer"], capture_output=True, timeout=300)
    return check.returncode == 0


def test_throughput_quick(tmp_path):
    result = subprocess.run(
        [sys.executable, "benchmarks/throughput.py", *ARGS, "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-5000:]
    command = "benchmarks/throughput.py " + " ".join(ARGS)

    markdown = (tmp_path / "throughput.md").read_text()
    assert markdown.startswith("$ ") and command in markdown.splitlines()[0]
    assert "CHECK OK" in markdown
    for title in ("## Attention op alone", "## Llama-style decoder block", "## Compile time", "## Where the op's step goes"):
        assert title in markdown

    first_line, rows = _rows(tmp_path / "throughput.csv")
    assert first_line.startswith("# $ ") and command in first_line
    has_deepspeed = _deepspeed_importable()
    for case in ("op", "block"):
        by_method = {row["method"]: row for row in rows if row["case"] == case}
        assert set(by_method) == set(OURS) | {"DeepSpeed Ulysses", "torch ring CP"}
        for name, row in by_method.items():
            timed = row["median ms"] != ""
            if name in OURS or (name == "DeepSpeed Ulysses" and has_deepspeed):
                assert timed, (case, name, row["note"])
            if timed:
                assert math.isfinite(float(row["median ms"])) and float(row["median ms"]) > 0, row
                assert float(row["tokens/s"]) > 0 and float(row["vs Ulysses"]) > 0, row
                assert float(row["max rel. err"]) <= 3e-2, row  # bf16; the run itself fails above this
            else:
                assert row["note"].strip(), (case, name)  # the reason it did not run
        assert float(by_method["Ulysses (ours)"]["vs Ulysses"]) == 1.0
        if has_deepspeed:  # same kernel, same inputs: DeepSpeed's Ulysses matches ours (bitwise on CPU)
            assert float(by_method["DeepSpeed Ulysses"]["max rel. err"]) <= 1e-3
    compile_rows = [row for row in rows if row["case"] == "compile"]
    assert len(compile_rows) == 2 and all(float(row["median ms"]) > 0 for row in compile_rows)

    profile_line, profile = _rows(tmp_path / "throughput_profile.csv")
    assert command in profile_line
    assert {row["method"] for row in profile} >= set(OURS)
    assert all(float(row["step ms"]) > 0 for row in profile)
