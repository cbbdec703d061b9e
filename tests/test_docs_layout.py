"""docs/design.md's "Code layout" block agrees with the tree.

The block names one path per line: a name starting before column 24, indented two spaces per
folder level below the last folder (a name ending in "/") at a smaller indent; what follows it,
and every line starting at column 24 or later, is description. Every module file under
upipe_compile/ (subpackages included), passes/ and integrations/torchtitan/ must be named, and
every path named must exist.
"""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DESIGN = os.path.join(ROOT, "docs", "design.md")
MODULE_ROOTS = ("upipe_compile", "passes", os.path.join("integrations", "torchtitan"))
NAME_COLUMN = 24


def layout_block(text: str) -> list[str]:
    section = text[text.index("## Code layout"):]
    match = re.search(r"```\n(.*?)```", section, re.S)
    assert match, "no code block under '## Code layout'"
    return match.group(1).splitlines()


def named_paths(lines: list[str]) -> list[str]:
    """Each named path, relative to the repository root (folders end in "/")."""
    paths, folders = [], []  # folders: (indent, path) of the enclosing folders
    for line in lines:
        stripped = line.lstrip(" ")
        indent = len(line) - len(stripped)
        if not stripped or indent >= NAME_COLUMN:
            continue
        name = stripped.split()[0]
        while folders and folders[-1][0] >= indent:
            folders.pop()
        path = (folders[-1][1] if folders else "") + name
        paths.append(path)
        if name.endswith("/"):
            folders.append((indent, path))
    return paths


def module_files(root: str = ROOT) -> set[str]:
    found = set()
    for top in MODULE_ROOTS:
        for folder, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in files:
                if name.endswith(".py"):
                    found.add(os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/"))
    return found


def _paths() -> list[str]:
    with open(DESIGN) as f:
        return named_paths(layout_block(f.read()))


def test_every_module_is_in_the_layout():
    missing = sorted(module_files() - set(_paths()))
    assert not missing, f"docs/design.md's layout does not name: {missing}"


def test_every_path_in_the_layout_exists():
    absent = [p for p in _paths() if not os.path.exists(os.path.join(ROOT, p.rstrip("/")))]
    assert not absent, f"docs/design.md's layout names paths that do not exist: {absent}"


def test_the_parser_sees_nesting_and_skips_descriptions():
    lines = ["a/                        x",
             "  b.py                    y",
             "                          c.py continues y",
             "  d/                      z",
             "    e.py",
             "  f.py",
             "g.py"]
    assert named_paths(lines) == ["a/", "a/b.py", "a/d/", "a/d/e.py", "a/f.py", "g.py"]
