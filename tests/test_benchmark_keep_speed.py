"""benchmarks/keep_speed.py runs every method on real gloo ranks and reports the ratios (a
smoke run at a small size; the figures are in benchmarks/results/keep_speed*.md)."""

from __future__ import annotations

from benchmarks.keep_speed import METHODS, run


def test_keep_speed_quick():
    rows = run(world=2, seq=256, layers=1, steps=1)
    methods, calibration = rows[:len(METHODS)], rows[len(METHODS):]
    assert [row["method"] for row in methods] == list(METHODS)
    assert methods[0]["throughput vs Ulysses"] == 1.0
    assert all(row["step_s"] > 0 and "model: throughput vs Ulysses" in row for row in methods)
    assert [row["method"].split(",")[0] for row in calibration] == ["(ulysses", "(upipe", "(deepspeed"]
