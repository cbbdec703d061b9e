"""A refusal names the model's line: frames of torch's and upipe's own modules are skipped, found
by module name rather than by folder, so that the answer is the same in a checkout (where
``upipe_compile.passes`` and ``upipe_compile.integrations.torchtitan`` live in folders beside
``upipe_compile/``) and in a wheel (where everything is under ``site-packages/upipe_compile/``)."""

from __future__ import annotations

import sys
import types

import pytest
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


# --- a refusal's fix is chosen by the module the op comes from, never by folder names ------------
def _called(*frames: tuple[str, str]) -> fx.Node:
    """A graph node whose stack trace runs through ``(file, function)`` frames, outermost first."""
    graph = fx.Graph()
    node = graph.placeholder("x")
    node.meta["stack_trace"] = "".join(f'  File "{path}", line {10 + i}, in {fn}\n    line_{i}()\n'
                                       for i, (path, fn) in enumerate(frames))
    return node


def _fixes(node: fx.Node) -> tuple[str, str, str]:
    """The fix each refusal names for an op at ``node``: flex_attention, hand-written attention, token mixing."""
    from upipe_compile.passes.find_unsupported import flex_fix, hand_written_fix
    from upipe_compile.passes.token_mixing_refusal import TokenMixing

    line = find.source_line(node)
    mixing = TokenMixing(node, "aten.cat.default", "reads the sequence", line).reason
    return flex_fix(node), hand_written_fix(node, line), mixing.partition("reads the sequence; ")[2]


SITE_PACKAGES = "env/lib/python3.11/site-packages"


@pytest.mark.parametrize("layout", ["checkout", "site-packages"])
def test_the_fix_is_chosen_by_the_module_the_op_comes_from(monkeypatch, tmp_path, layout):
    """transformers and torchtitan from a checkout (``src/`` on sys.path) or installed as wheels
    (site-packages): their code is known by the module its file is, so each refusal names the
    fix for where the op comes from."""
    from upipe_compile.passes import find_unsupported as fu
    from upipe_compile.passes.token_mixing_refusal import CACHE_FIX, SEQUENCE_FIX

    roots = {package: tmp_path / (f"{package}/src" if layout == "checkout" else SITE_PACKAGES)
             for package in ("transformers", "torchtitan")}
    for root in roots.values():
        root.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(sys, "path", [*map(str, roots.values()), *sys.path])
    transformers, torchtitan = roots["transformers"] / "transformers", roots["torchtitan"] / "torchtitan"
    modeling = str(transformers / "models" / "llama" / "modeling_llama.py")
    cache, flex = str(transformers / "cache_utils.py"), str(transformers / "integrations" / "flex_attention.py")
    titan = str(torchtitan / "models" / "llama3" / "model" / "model.py")
    assert find.module_of(modeling) == "transformers.models.llama.modeling_llama"
    assert find.module_of(cache) == "transformers.cache_utils"
    assert find.module_of(str(torchtitan / "__init__.py")) == "torchtitan"

    in_the_layer = _fixes(_called((USER, "train"), (modeling, "forward")))
    assert in_the_layer == (fu.TRANSFORMERS_FIX, fu.OWN_ATTENTION_FIX, SEQUENCE_FIX)
    eager_function = _fixes(_called((USER, "train"), (modeling, "forward"), (modeling, "eager_attention_forward")))
    assert eager_function[1] == fu.TRANSFORMERS_FIX
    assert _fixes(_called((USER, "train"), (modeling, "forward"), (flex, "flex_attention_forward")))[0] == \
        fu.TRANSFORMERS_FIX
    assert _fixes(_called((USER, "train"), (modeling, "forward"), (cache, "update")))[2] == CACHE_FIX
    assert _fixes(_called((USER, "train"), (titan, "forward")))[:2] == (fu.TORCHTITAN_FLEX_FIX, fu.HAND_WRITTEN_FIX)


def test_a_folder_named_like_a_package_is_not_the_package(monkeypatch, tmp_path):
    """A user's project folder called ``transformers`` (the script's folder on sys.path), and
    upipe's own ``integrations/torchtitan/`` in a checkout (upipe_compile.integrations.torchtitan),
    are neither transformers nor torchtitan: the plain fixes."""
    from upipe_compile.passes import find_unsupported as fu
    from upipe_compile.passes.token_mixing_refusal import SEQUENCE_FIX

    project = tmp_path / "home" / "transformers"
    project.mkdir(parents=True)
    monkeypatch.setattr(sys, "path", [str(project), *sys.path])
    script, cache = str(project / "train.py"), str(project / "cache_utils.py")
    assert find.module_of(script) == "train" and find.module_of(cache) == "cache_utils"
    assert _fixes(_called((script, "train"), (cache, "update"))) == (fu.FLEX_FIX, fu.HAND_WRITTEN_FIX, SEQUENCE_FIX)

    ours = str(tmp_path / "upipe-compile" / "integrations" / "torchtitan" / "probe.py")
    module = types.ModuleType("upipe_compile.integrations.torchtitan._folder_probe")
    module.__file__ = ours
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert find.module_of(ours) == module.__name__
    assert _fixes(_called((USER, "train"), (ours, "forward")))[0] == fu.FLEX_FIX
