"""benchmarks/results/max_context_hf.md (the Trainer path's max-context table, which docs/results.md
quotes) states what its per-row JSON files hold, and only lengths that fit both budgets. Runs no
estimate: it reads the kept results."""

import importlib.util
import json
import os
import sys

import pytest

from upipe_compile.estimate.gpu import budget_gib
from upipe_compile.estimate import H100_80GB_GIB, HOST_BUDGET_GIB

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORT = os.path.join(ROOT, "benchmarks", "results", "max_context_hf.md")


def _benchmark():
    spec = importlib.util.spec_from_file_location("max_context_hf", os.path.join(ROOT, "benchmarks",
                                                                                  "max_context_hf.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(sys.modules[spec.name])
    module = sys.modules[spec.name]
    return module


def _tables(path: str) -> list[list[dict]]:
    """The markdown tables of ``path``, each a list of rows (header -> cell)."""
    tables, current = [], []
    with open(path) as f:
        for line in f:
            if line.startswith("|"):
                current.append([cell.strip() for cell in line.strip().strip("|").split("|")])
            elif current:
                tables.append(current)
                current = []
    if current:
        tables.append(current)
    return [[dict(zip(t[0], row)) for row in t[2:]] for t in tables]


@pytest.fixture(scope="module")
def kept():
    if not os.path.exists(REPORT):
        pytest.skip("benchmarks/results/max_context_hf.md not written")
    bench = _benchmark()
    results = []
    for row in bench.rows(None):
        if os.path.exists(row.path()):
            with open(row.path()) as f:
                results.append((row, json.load(f)))
    return bench, results


def test_report_tables_are_the_kept_json(kept):
    """The report's tables are what the kept JSON files hold (the report is regenerated from them:
    `python benchmarks/max_context_hf.py --report-only`), every kept JSON is in the report, and
    each searched length the report states is a JSON's."""
    from tabulate import tabulate

    bench, results = kept
    assert results
    with open(REPORT) as f:
        text = f.read()
    assert tabulate(bench.table(results), headers="keys", tablefmt="github") in text
    plain = bench.plain_table(results)
    if plain:
        assert tabulate(plain, headers="keys", tablefmt="github") in text
    for row, _ in results:
        assert " ".join(row.command()) in text
    stated = {int(row["max seq_len"].replace(",", "")) for row in _tables(REPORT)[0]}
    assert stated == {r["max_context"] for row, r in results if row.search}


def test_max_context_rows_fit_both_budgets(kept):
    """Each searched length fits the GPU budget with the device ratio applied and one node's host
    budget, and a bound stopped the search; every row was searched with the ratio but the one that
names ratio 1."""
    _, results = kept
    budget = budget_gib(H100_80GB_GIB)
    for row, r in results:
        assert r["fits"] and r["expected_device_peak_gib"] <= budget, row.describe()
        assert r["host_gib_per_node"] <= HOST_BUDGET_GIB, row.describe()
        if row.search:
            assert r["seq_len"] == r["max_context"], row.describe()
            assert r["bound"] in ("device", "host", "device and host"), row.describe()
            assert r["max_context"] % (1024 * row.model.cp * (2 if row.ring > 1 else 1)) == 0, row.describe()
        # the ratio the estimate applies by default, or the one the row names (1: the estimate's own peak)
        assert r["device_ratio"] > 1 if row.device_ratio is None else r["device_ratio"] == row.device_ratio, \
            row.describe()
        assert r["ring_degree"] == row.ring, row.describe()
        assert r["hf"]["config"] == row.model.key and r["hf"]["cp"] == row.model.cp, row.describe()
