"""The wheel holds the whole package: every module and every shipped config of the three source
folders that install as ``upipe_compile`` (setup.py), and nothing else. An editable install (what
the rest of the suite imports) cannot show a subpackage missing from the wheel; this builds one.
scripts/test_installed.sh then installs a wheel into a clean venv and runs it from outside."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_SUFFIXES = {".py", ".toml", ".json", ".md"}  # modules, job TOMLs, Hugging Face configs, READMEs


def source_folders() -> dict[str, str]:
    """setup.py's SOURCE_FOLDERS (package -> folder), read without running setup()."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SOURCE_FOLDERS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no SOURCE_FOLDERS")


def expected_wheel_files() -> set[str]:
    files = set()
    for package, folder in source_folders().items():
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in SHIPPED_SUFFIXES and "__pycache__" not in path.parts:
                files.add("/".join([*package.split("."), *path.relative_to(ROOT / folder).parts]))
    return files


def tree_copy(into: Path) -> Path:
    """The checkout's files as a fresh clone with this change has them (tracked and untracked,
    not ignored): an in-tree build reuses build/, which keeps files the tree no longer has."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    return into


def test_wheel_holds_every_module_and_config(tmp_path):
    source = tree_copy(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source),
                    "-w", str(tmp_path / "dist")], check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("upipe_compile-*.whl")
    names = {n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n}
    expected = expected_wheel_files()
    assert "upipe_compile/attention/kernels/cpu.py" in expected and "upipe_compile/passes/pipeline.py" in expected
    missing, extra = sorted(expected - names), sorted(names - expected)
    assert not missing, f"the wheel lacks {len(missing)} file(s) of the source tree: {missing}"
    assert not extra, f"the wheel has files the source tree does not: {extra}"


def test_version_is_readable():
    import importlib.metadata

    import upipe_compile

    assert upipe_compile.__version__ == importlib.metadata.version("upipe-compile")
