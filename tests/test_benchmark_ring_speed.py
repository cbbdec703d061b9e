"""benchmarks/ring_speed.py runs both layouts on real gloo ranks and reports the ratio (a
smoke run at a small size; the figures are in benchmarks/results/ring_speed.md)."""

from __future__ import annotations

from benchmarks.ring_speed import run


def test_ring_speed_quick():
    rows = run(world=4, seq=256, steps=1, rings=[1, 2])
    assert [row["layout"] for row in rows] == ["UPipe (1-D)", "ring 2 x all-to-all 2"]
    assert rows[0]["vs UPipe"] == 1.0 and rows[0]["ring wait_ms"] == 0.0
    assert rows[1]["U"] == 2 and rows[1]["ring wait_ms"] >= 0 and rows[1]["step_ms"] > 0
