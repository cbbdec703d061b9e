"""The shape of the graph passes (passes/, upipe_compile.passes): one ordered pipeline, match
types that own their problems and their replacement, passes that share only public names, a
thin backend, and run-time code that never loads the passes."""

from __future__ import annotations

import ast
import inspect
import pathlib
import subprocess
import sys

import upipe_compile.backend as backend
import upipe_compile.passes as passes
from upipe_compile.passes import pipeline
from upipe_compile.passes.attention_match import AttentionMatch
from upipe_compile.passes.block_match import BlockMatch
from upipe_compile.passes.context import Refusal, RefusedOp
from upipe_compile.passes.find_unsupported import UnsupportedMatch
from upipe_compile.passes.mixer_match import MixerMatch
from upipe_compile.passes.token_mixing_refusal import TokenMixing

PASSES_DIR = pathlib.Path(passes.__file__).parent


def test_every_match_type_has_problems_and_replace():
    protocol = sorted(name for name in vars(passes.context.Match) if not name.startswith("_"))
    assert protocol == ["problems", "replace", "source_line"]  # passes.context.Match, what the refusal reads
    for match_type in (AttentionMatch, MixerMatch, UnsupportedMatch, TokenMixing, Refusal):
        for method in ("problems", "replace"):
            assert callable(getattr(match_type, method, None)), (match_type, method)
            assert list(inspect.signature(getattr(match_type, method)).parameters) == ["self", "ctx"], match_type
        assert getattr(match_type, "refusal_kind", None) in passes.context.REFUSAL_KINDS, match_type
    for refused in (UnsupportedMatch, TokenMixing, Refusal):
        assert issubclass(refused, RefusedOp)
    # a block is found by the replace pass, after the refusal its attention passed: it only replaces itself
    assert list(inspect.signature(BlockMatch.replace).parameters) == ["self", "ctx"]
    assert not hasattr(BlockMatch, "problems") and not hasattr(BlockMatch, "refusal_kind")
    assert "find_block" in inspect.getsource(pipeline._replace)


def test_the_passes_run_in_one_ordered_list_with_one_signature():
    names = [name for name, _ in pipeline.PASSES]
    assert len(set(names)) == len(names)
    assert names.index("refuse") == len(names) - 2 and names[-1] == "replace"  # nothing refusable found after it
    for name, run in pipeline.PASSES:
        assert list(inspect.signature(run).parameters) == ["gm", "ctx"], name


def test_no_pass_imports_another_passs_private_name():
    for path in PASSES_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("upipe_compile.passes"):
                private = [alias.name for alias in node.names if alias.name.startswith("_")]
                assert not private, f"{path.name} imports {private} from {node.module}"


def test_the_backend_is_options_then_pipeline_then_inner_backend():
    source = pathlib.Path(backend.__file__).read_text()
    assert len(source.splitlines()) < 80
    assert "run_passes" in source and "find_attention" not in source


def test_a_training_steps_modules_do_not_load_the_passes():
    """What a step runs (the ops the rewrite inserts, sharding and its marks, the stack, the
    trainer's batch layout) imports no module of passes/: the passes run when a graph compiles."""
    runtime = ["upipe_compile", "upipe_compile.sharding", "upipe_compile.sequence_marks", "upipe_compile.api",
               "upipe_compile.attention.ops", "upipe_compile.block.ops", "upipe_compile.mixers.ops",
               "upipe_compile.mixers.loop", "upipe_compile.packed.document_sdpa", "upipe_compile.stack.offload",
               "upipe_compile.stack.tiled_mlp", "upipe_compile.stack.chunked_loss",
               "upipe_compile.stack.keep_attention", "upipe_compile.integrations.hf_batch"]
    code = ("import importlib, sys\n"
            f"for name in {runtime!r}: importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m.startswith('upipe_compile.passes')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", loaded
