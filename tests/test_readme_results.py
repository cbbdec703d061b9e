"""docs/results.md's measured tables, and the README's headline figures, agree with the
results files they cite.

A table cites the last `benchmarks/results/<name>.md` named in the text between the previous
table (or heading) and itself. Every row of a citing table must be a row of a table in that
file: equal cells in every column the table shows. A column the file's table lacks must equal
the title of the section the file's table sits under (for example memory.md's "### Llama3-8B"
tables, shown in docs/results.md with a "preset" column). Tables that cite nothing (the
README's options table) are not checked. The citing text must also name, in the same section,
the script that wrote the file (from the command on the file's first line). The README and
docs/results.md are checked by the same rules.

Each bullet of the README's "Headline numbers" cites one results file, names the script that
wrote it (same rule) and links to docs/results.md; every measured figure it quotes (a number
with a decimal point or thousands commas, outside `code`) stands in that file.
"""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
RESULTS = os.path.join(ROOT, "docs", "results.md")
FIGURE = re.compile(r"\d{1,3}(?:,\d{3})+|\d+\.\d+")
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


def disagreements(text: str, root: str = ROOT) -> tuple[list[str], set[str]]:
    """What a document's citing tables get wrong, and which results files they cite."""
    problems, cited = [], set()
    for before, in_section, _, header, rows in tables(text):
        citations = CITATION.findall(before)
        if not citations:
            continue
        path = citations[-1]
        cited.add(path)
        with open(os.path.join(root, path)) as f:
            source = f.read()
        script = SCRIPT.search(source.splitlines()[0])
        if script and script.group(0) not in in_section:
            problems.append(f"{path}: the text does not name {script.group(0)}, which wrote it")
        # The file's tables that have every column shown but (at most) the section one.
        candidates = [(section, file_rows) for _, _, section, file_header, file_rows in tables(source)
                      if sum(column not in file_header for column in header) <= 1]
        if not candidates:
            problems.append(f"{path}: no table of the file has the columns {header}")
        for row in rows:
            if not any(all(file_row.get(column, section) == value for column, value in row.items())
                       for section, file_rows in candidates for file_row in file_rows):
                problems.append(f"{path}: no row of the file matches {row}")
    return problems, cited


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_results_tables_match_their_results_files():
    problems, cited = disagreements(_read(RESULTS))
    assert not problems, "\n".join(problems)
    assert cited == {f"benchmarks/results/{name}.md"
                     for name in ("op_memory", "memory", "fused_block_memory", "window_memory", "mixer_memory", "max_context",
                                  "throughput", "ring_speed", "keep_speed_16k", "demo", "fits_70b",
                                  "fits_moe")}


def test_readme_tables_match_their_results_files():
    """The README keeps no measured table (they are in docs/results.md); any that cites a file is checked."""
    problems, _ = disagreements(_read(README))
    assert not problems, "\n".join(problems)


def headline_bullets(readme_text: str) -> list[str]:
    section = readme_text[readme_text.index("\n## Headline numbers\n"):]
    section = section[:section.index("\n## ", 1)]
    return [bullet.strip() for bullet in re.split(r"\n- ", section)[1:]]


def headline_problems(readme_text: str, root: str = ROOT) -> list[str]:
    problems = []
    for bullet in headline_bullets(readme_text):
        citations = CITATION.findall(bullet)
        if len(set(citations)) != 1:
            problems.append(f"a headline cites {sorted(set(citations))}, not one results file: {bullet!r}")
            continue
        path = citations[0]
        source = _read(os.path.join(root, path))
        script = SCRIPT.search(source.splitlines()[0])
        if script and script.group(0) not in bullet:
            problems.append(f"{path}: the headline does not name {script.group(0)}, which wrote it")
        if "](docs/results.md#" not in bullet:
            problems.append(f"{path}: the headline does not link to its table in docs/results.md")
        for figure in FIGURE.findall(re.sub(r"`[^`]*`", "", bullet)):
            if figure not in source:
                problems.append(f"{path}: the headline's {figure} is not in the file")
    return problems


def test_readme_headline_figures_stand_in_their_results_files():
    text = _read(README)
    assert len(headline_bullets(text)) >= 3
    problems = headline_problems(text)
    assert not problems, "\n".join(problems)


def test_an_edited_headline_figure_is_caught():
    text = _read(README)
    start = text.index("\n## Headline numbers\n")
    at = start + text[start:].index("5,128,192")
    problems = headline_problems(text[:at] + "5,128,193" + text[at + len("5,128,192"):])
    assert any("5,128,193" in p for p in problems), problems


@pytest.mark.parametrize("path", ["op_memory", "memory", "fused_block_memory", "window_memory", "max_context", "throughput", "demo"])
def test_an_edited_number_is_caught(path):
    """Change one number in the first docs/results.md table citing each file: the check must fail."""
    text = _read(RESULTS)
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
