"""The tail the benchmarks share: print the report, and write the same text to ``--out``.

The results files under benchmarks/results/ are these texts plus one final newline; tests
(tests/test_readme_results.py) read them back, so the format must not drift between scripts."""

from __future__ import annotations


def write_out(text: str, out_path: str | None) -> None:
    """Write ``text`` and a final newline to ``out_path``; nothing when no path was given."""
    if out_path:
        with open(out_path, "w") as f:
            f.write(text + "\n")


def emit(text: str, out_path: str | None) -> None:
    """Print a benchmark's report and, when ``--out`` was given, write the same text there."""
    print(text)
    write_out(text, out_path)
