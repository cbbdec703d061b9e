"""benchmarks/keep_speed.py runs every method on real gloo ranks and reports the ratios (a
smoke run at a small size; the figures are in benchmarks/results/keep_speed*.md)."""

from __future__ import annotations

from benchmarks.keep_speed import METHODS, run


def test_keep_speed_quick():
    rows = run(world=2, seq=256, layers=1, steps=1)
    assert [row["method"] for row in rows] == list(METHODS)
    assert rows[0]["throughput vs Ulysses, full AC"] == 1.0
    assert all(row["step_s"] > 0 for row in rows)
