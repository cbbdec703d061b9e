"""A refusal names the model's line: frames of torch's and upipe's own modules are skipped, found
by module name rather than by folder, so that the answer is the same in a checkout (where
``upipe_compile.passes`` and ``upipe_compile.integrations.torchtitan`` live in folders beside
``upipe_compile/``) and in a wheel (where everything is under ``site-packages/upipe_compile/``)."""

from __future__ import annotations

import sys
import types

import torch.fx as fx

import upipe_compile.passes.graph_utils as find

USER = "/home/someone/project/model.py"


def _node(*files: str) -> fx.Node:
    """A graph node whose stack trace runs through ``files``, outermost first."""
    graph = fx.Graph()
    node = graph.placeholder("x")
    node.meta["stack_trace"] = "".join(
        f'  File "{path}", line {10 + i}, in fn{i}\n    line_{i}()\n' for i, path in enumerate(files))
    return node


def test_a_checkout_module_outside_the_package_folder_is_upipes():
    # passes/graph_utils.py is upipe_compile.passes.graph_utils, mapped in from a folder beside upipe_compile/
    # in a checkout: the model's line is named, not ours
    line = find.source_line(_node(USER, find.__file__))
    assert line.startswith(f"{USER}:10 in fn0: line_0()"), line


def test_a_wheel_module_is_upipes_and_a_lookalike_folder_is_not(monkeypatch):
    wheel = "/opt/env/site-packages/upipe_compile/integrations/transformers.py"
    lookalike = "/opt/env/site-packages/upipe_compile_examples/model.py"  # not a module of ours
    module = types.ModuleType("upipe_compile._wheel_probe")
    module.__file__ = wheel
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert find.source_line(_node(USER, wheel)).startswith(f"{USER}:10 in fn0"), "wheel frame taken as the user's"
    assert find.source_line(_node(USER, lookalike, wheel)).startswith(f"{lookalike}:11 in fn1")


def test_torch_frames_are_skipped_and_an_all_library_trace_keeps_its_innermost_frame():
    import torch.nn.functional as F

    assert find.source_line(_node(USER, F.__file__)).startswith(f"{USER}:10")
    assert find.source_line(_node(find.__file__, F.__file__)).startswith("torch/nn/functional.py:11")


def test_a_file_is_named_from_the_import_root_that_holds_it_never_by_the_machines_folders(monkeypatch, tmp_path):
    """site-packages' files from site-packages (the longest sys.path entry holding them), upipe's
    checkout folders as the package they map to, a user's file under the working directory
    from there, anything else as it is."""
    import torch.nn.functional as F

    from upipe_compile.errors import display_path

    assert display_path(F.__file__) == "torch/nn/functional.py"
    assert display_path(find.__file__) == "upipe_compile/passes/graph_utils.py"
    nested = tmp_path / "env" / "lib"
    (nested / "pkg").mkdir(parents=True)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "env"), str(nested), *sys.path])
    assert display_path(str(nested / "pkg" / "mod.py")) == "pkg/mod.py"
    monkeypatch.chdir(tmp_path)
    assert display_path(str(tmp_path / "train.py")) == "train.py"
    assert display_path(USER) == USER and display_path("<eval_with_key>.3") == "<eval_with_key>.3"
    assert find.source_line(_node(str(tmp_path / "train.py"), find.__file__)).startswith("train.py:10 in fn0")
