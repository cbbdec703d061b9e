"""The README's measured tables agree with the results files they cite.

A README table cites the last `benchmarks/results/<name>.md` named in the text between the
previous table (or heading) and itself. Every row of a citing table must be a row of a
table in that file: equal cells in every column the README shows. A README column the
file's table lacks must equal the title of the section the file's table sits under (for
example memory.md's "### Llama3-8B" tables, shown in the README with a "preset" column).
Tables that cite nothing (the options table) are not checked. The citing text must also
name, in the same README section, the script that wrote the file (from the command on
the file's first line).
"""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
CITATION = re.compile(r"benchmarks/results/[\w.-]+\.md")
SCRIPT = re.compile(r"[\w/.-]+\.py\b")


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _is_rule(line: str) -> bool:
    return bool(re.fullmatch(r"\|[\s|:-]+\|", line.strip()))


def tables(text: str):
    """Each markdown table as (the text since the previous table or heading, the text since
    the heading, section title, header, rows); rows are dicts by column name."""
    found, before, in_section, section = [], [], [], ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("|") and i + 1 < len(lines) and _is_rule(lines[i + 1]):
            header = _cells(line)
            i += 2
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(dict(zip(header, _cells(lines[i]))))
                i += 1
            found.append(("\n".join(before), "\n".join(in_section), section, header, rows))
            before = []
            continue
        if line.startswith("#") and not line.startswith("# "):  # "## x" headings; "# ..." are comment lines
            section, before, in_section = line.lstrip("#").strip(), [], []
        else:
            before.append(line)
            in_section.append(line)
        i += 1
    return found


def disagreements(readme_text: str, root: str = ROOT) -> tuple[list[str], set[str]]:
    """What the README's citing tables get wrong, and which results files they cite."""
    problems, cited = [], set()
    for before, in_section, _, header, rows in tables(readme_text):
        citations = CITATION.findall(before)
        if not citations:
            continue
        path = citations[-1]
        cited.add(path)
        with open(os.path.join(root, path)) as f:
            source = f.read()
        script = SCRIPT.search(source.splitlines()[0])
        if script and script.group(0) not in in_section:
            problems.append(f"{path}: the README does not name {script.group(0)}, which wrote it")
        # The file's tables that have every README column but (at most) the section one.
        candidates = [(section, file_rows) for _, _, section, file_header, file_rows in tables(source)
                      if sum(column not in file_header for column in header) <= 1]
        if not candidates:
            problems.append(f"{path}: no table of the file has the README's columns {header}")
        for row in rows:
            if not any(all(file_row.get(column, section) == value for column, value in row.items())
                       for section, file_rows in candidates for file_row in file_rows):
                problems.append(f"{path}: no row of the file matches the README's {row}")
    return problems, cited


def test_readme_tables_match_their_results_files():
    with open(README) as f:
        problems, cited = disagreements(f.read())
    assert not problems, "\n".join(problems)
    assert cited == {f"benchmarks/results/{name}.md"
                     for name in ("op_memory", "memory", "fused_block_memory", "max_context", "throughput", "demo")}


@pytest.mark.parametrize("path", ["op_memory", "memory", "throughput", "demo"])
def test_an_edited_number_is_caught(path):
    """Change one number in the first README table citing each file: the check must fail."""
    with open(README) as f:
        text = f.read()
    start = text.index(f"benchmarks/results/{path}.md")
    table_at = text.index("\n|", start) + 1
    row_at = text.index("\n", text.index("\n", table_at) + 1) + 1  # first row after the rule
    row_end = text.index("\n", row_at)
    number = re.search(r"\d+\.\d+", text[row_at:row_end])
    assert number, text[row_at:row_end]
    digits = number.group(0)
    edited = digits[:-1] + ("1" if digits[-1] != "1" else "2")
    a, b = row_at + number.start(), row_at + number.end()
    problems, _ = disagreements(text[:a] + edited + text[b:])
    assert any(path in p for p in problems), problems
