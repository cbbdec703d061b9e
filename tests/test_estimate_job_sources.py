"""``python -m upipe_compile.estimate`` finds its jobs through the entry points of
``upipe_compile.estimate_jobs`` (upipe_compile/estimate/job_sources.py): a transformers user
without torchtitan gets the --hf estimate, and a source whose framework is missing is named
with the extra that installs it, in one line, not a traceback.

Each case runs the command line in a fresh interpreter with the framework blocked
(``sys.modules[name] = None`` makes ``import name`` raise ImportError), as if it were not
installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

from upipe_compile.estimate.job_sources import GROUP, SOURCES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_TOML = os.path.join(ROOT, "integrations", "torchtitan", "debug_model_upipe_cpu.toml")

# A two-layer Llama (the README's llama-3.1-8b at 131072 tokens takes minutes on a CPU).
TINY_LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 2048,
              "max_position_embeddings": 1 << 20, "tie_word_embeddings": False, "hidden_act": "silu",
              "rms_norm_eps": 1e-5}

# Blocks ``blocked``, runs the command line, then says which modules of ``watched`` were imported.
RUNNER = """
import json, sys
blocked, watched, argv = json.loads(sys.argv[1])
for name in blocked:
    sys.modules[name] = None
from upipe_compile.estimate.__main__ import main
status = main(argv)
imported = sorted(m for m in sys.modules if m.split(".")[0] in watched and sys.modules[m] is not None)
print(json.dumps({"status": status, "imported": imported}))
"""


def run_without(blocked: list[str], argv: list[str], watched: tuple[str, ...] = ()):
    """(the runner's last stdout line as a dict, stderr) of the command line with ``blocked``."""
    result = subprocess.run([sys.executable, "-c", RUNNER, json.dumps([blocked, list(watched), argv])],
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.stdout.strip(), result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def test_both_sources_are_registered():
    """pyproject.toml's entry-point table, as installed (pip install -e . after changing it)."""
    names = {point.name for point in entry_points(group=GROUP)}
    assert names >= set(SOURCES), f"{GROUP} lacks {set(SOURCES) - names}: reinstall the package"


def test_the_hf_estimate_runs_without_torchtitan(tmp_path):
    config = tmp_path / "tiny_llama.json"
    config.write_text(json.dumps(TINY_LLAMA))
    out, err = run_without(["torchtitan"], ["--hf", str(config), "--seq-len", "8192", "--cp", "2", "--json"],
                           watched=("torchtitan", "upipe_compile"))
    assert out["status"] == 0, err[-3000:]
    assert not [m for m in out["imported"] if m.startswith("torchtitan")]
    assert not [m for m in out["imported"] if m.startswith("upipe_compile.integrations.torchtitan")]
    assert "upipe_compile.integrations.hf_estimate" in out["imported"]


def test_the_torchtitan_source_without_torchtitan_names_its_extra():
    out, err = run_without(["torchtitan"], ["--config", DEBUG_TOML])
    assert out["status"] != 0
    assert err.strip() == f"error: {SOURCES['torchtitan'].missing}"
    assert 'upipe-compile[torchtitan]' in err and "Traceback" not in err


def test_the_hf_source_without_transformers_names_its_extra():
    out, err = run_without(["transformers"], ["--hf", "llama-3.1-8b", "--seq-len", "131072", "--cp", "8"])
    assert out["status"] != 0
    assert err.strip() == f"error: {SOURCES['hf'].missing}"
    assert 'upipe-compile[hf]' in err and "Traceback" not in err
