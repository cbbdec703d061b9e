"""The package as users install it (scripts/test_installed.sh): a wheel built from the checkout,
installed (not editable) into a clean venv with torch and the ``hf`` extra only, these checks run
from a folder outside the checkout. With ``UPIPE_INSTALLED_PHASE=torchtitan`` the same venv has
the ``torchtitan`` extra added and only the checks that need it run.

Named check_*.py so the checkout's own suite never collects it (it runs in the checkout's venv).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

CHECKOUT = Path(os.environ["UPIPE_CHECKOUT"]).resolve()
TORCHTITAN_PHASE = os.environ.get("UPIPE_INSTALLED_PHASE") == "torchtitan"
TORCHTITAN = "upipe_compile.integrations.torchtitan"
RTOL = 1e-4  # fp32 on CPU: the sharded step reorders sums (softmax, all-reduced gradients)


def _torchtitan_installed() -> bool:
    try:
        importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_the_installed_wheel_is_what_runs():
    import upipe_compile

    path = Path(upipe_compile.__file__).resolve()
    site_packages = Path(sysconfig.get_paths()["purelib"]).resolve()
    assert path == site_packages / "upipe_compile" / "__init__.py", f"upipe_compile imported from {path}, not the install"
    assert upipe_compile.__version__ == importlib.metadata.version("upipe-compile")
    direct_url = importlib.metadata.distribution("upipe-compile").read_text("direct_url.json") or "{}"
    assert not json.loads(direct_url).get("dir_info", {}).get("editable"), "an editable install"
    assert _torchtitan_installed() == TORCHTITAN_PHASE, "torchtitan is installed only in the torchtitan phase"


def test_every_module_imports():
    """Every module of the installed package (the torchtitan integration's only where
    torchtitan is installed) imports: a subpackage left out of the wheel fails here."""
    import upipe_compile

    installed = Path(upipe_compile.__file__).parent
    names = sorted(".".join(["upipe_compile", *p.relative_to(installed).with_suffix("").parts]).removesuffix(".__init__")
                   for p in installed.rglob("*.py"))
    assert "upipe_compile.attention.kernels.cpu" in names and f"{TORCHTITAN}.job_rules" in names
    failed = {}
    for name in names:
        if name.startswith(TORCHTITAN) and not TORCHTITAN_PHASE:
            continue
        try:
            importlib.import_module(name)
        except Exception as error:  # report every module, not the first
            failed[name] = f"{type(error).__name__}: {error}"
    assert not failed, failed


def test_shipped_configs_are_installed():
    """The job TOMLs and the estimate's Hugging Face configs are package data."""
    import upipe_compile

    installed = Path(upipe_compile.__file__).parent
    shipped = {p.relative_to(installed).as_posix() for p in installed.rglob("*") if p.suffix in (".toml", ".json")}
    assert "integrations/torchtitan/llama3_8b_upipe_5m.toml" in shipped, sorted(shipped)
    assert any(name.endswith("llama-3.1-8b.json") for name in shipped), sorted(shipped)


def test_backend_resolves_by_name():
    from torch._dynamo import lookup_backend

    from upipe_compile.backend import upipe_backend

    assert lookup_backend("upipe") is upipe_backend


def _ranks(job):
    from upipe_compile.launch import RankPool

    with RankPool(2, timeout_s=600) as pool:
        return pool.run(job)


def _assert_equal_to_eager(results):
    for rank, (logits, reference, grads, reference_grads) in enumerate(results):
        torch.testing.assert_close(logits, reference, rtol=RTOL, atol=RTOL, msg=lambda m: f"rank {rank} logits: {m}")
        assert grads.keys() == reference_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], reference_grads[name], rtol=RTOL, atol=RTOL,
                                       msg=lambda m: f"rank {rank} grad of {name}: {m}")


@pytest.mark.skipif(TORCHTITAN_PHASE, reason="runs in the hf phase")
def test_readme_use_snippet_on_two_ranks():
    import installed_jobs

    _assert_equal_to_eager(_ranks(installed_jobs.use_snippet))


@pytest.mark.skipif(TORCHTITAN_PHASE, reason="runs in the hf phase")
def test_transformers_model_through_register_on_two_ranks():
    import installed_jobs

    _assert_equal_to_eager(_ranks(installed_jobs.llama_through_register))


def _run(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    result = subprocess.run([*args], capture_output=True, text=True, timeout=timeout, cwd=os.getcwd())
    assert result.returncode == 0, f"{' '.join(args)} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


@pytest.mark.skipif(TORCHTITAN_PHASE, reason="runs in the hf phase")
def test_estimate_hf_without_torchtitan():
    result = _run(sys.executable, "-m", "upipe_compile.estimate", "--hf", "llama-3.1-8b", "--seq-len", "131072",
                  "--cp", "8", "--json")
    report = json.loads(result.stdout)
    assert report["seq_len"] == 131072 and report["cp"] == 8 and report["peak_device_gib"] > 0, report


@pytest.mark.skipif(TORCHTITAN_PHASE, reason="runs in the hf phase")
@pytest.mark.parametrize("example", ["sft_upipe.py", "grpo_upipe.py"])
def test_example_runs_under_torchrun(example):
    _run(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(CHECKOUT / "examples" / example))


@pytest.mark.skipif(not TORCHTITAN_PHASE, reason="needs the torchtitan extra")
def test_torchtitan_config_from_the_installed_package():
    result = _run(sys.executable, "-m", "upipe_compile.estimate", "--module", TORCHTITAN, "--config",
                  "llama3_debugmodel_upipe_cpu", "--json")
    report = json.loads(result.stdout)
    assert report["cp"] == 2 and report["peak_device_gib"] > 0, report
