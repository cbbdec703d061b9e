"""What users read names no folder of the machine it was made on: committed results, the docs and
the README hold no absolute path into a venv, site-packages, a home or a scratch folder (a
message names a file from its package: ``upipe_compile.errors.display_path``)."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = [ROOT / "benchmarks" / "results", ROOT / "docs", ROOT / "README.md"]

# site-packages, a venv's folder, or an absolute path under a home or scratch folder
MACHINE_PATH = re.compile(r"site-packages|/\.?venv/|(?<![\w.~-])/(?:root|home|work|tmp)/")

# Files that still hold such paths, with why they are not regenerated yet (a glob from the repo
# root -> why). Remove an entry once its files are clean; never add one to make a new file pass.
KNOWN: dict[str, str] = {}


def _scanned_files() -> list[Path]:
    files = []
    for place in SCANNED:
        files += [place] if place.is_file() else sorted(p for p in place.rglob("*") if p.is_file())
    return files


def _machine_paths(path: Path) -> list[str]:
    """``file:line: text`` of each line naming a machine path."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:  # an image, a binary trace
        return []
    relative = path.relative_to(ROOT).as_posix()
    return [f"{relative}:{number}: {line.strip()[:160]}" for number, line in enumerate(lines, 1)
            if MACHINE_PATH.search(line)]


def _known(relative: str) -> bool:
    return any(fnmatch.fnmatch(relative, pattern) for pattern in KNOWN)


def test_results_docs_and_readme_name_no_machine_path():
    found = [hit for path in _scanned_files() if not _known(path.relative_to(ROOT).as_posix())
             for hit in _machine_paths(path)]
    assert not found, "absolute paths of the machine (write them from their package or the repo):\n" + \
        "\n".join(found)


def test_every_known_leftover_still_holds_one():
    """A KNOWN entry whose files are clean is removed, so the list only shrinks."""
    dirty = {path.relative_to(ROOT).as_posix() for path in _scanned_files() if _machine_paths(path)}
    stale = [pattern for pattern in KNOWN if not any(fnmatch.fnmatch(f, pattern) for f in dirty)]
    assert not stale, f"clean now, remove from KNOWN: {stale}"


def test_the_scan_finds_each_kind_of_machine_path():
    for line in ("/work/main/.venv/lib/python3.11/site-packages/x.py:3", "see /root/x", "/home/me/a.py",
                 "--out-dir /tmp/tp", "/opt/env/.venv/bin/python"):
        assert MACHINE_PATH.search(line), line
    for line in (".venv/bin/python benchmarks/hf_zoo.py", "transformers/models/jetmoe/modeling_jetmoe.py:326",
                 "upipe_compile/passes/graph_utils.py", "a tmp/ folder", "~/work/x"):
        assert not MACHINE_PATH.search(line), line
