"""Where the estimate's jobs come from: the integrations that build one register a command in
the entry-point group ``upipe_compile.estimate_jobs`` (pyproject.toml), so this package measures
and reports without importing any of them.

A command is ``command(args, unknown) -> int``: the parsed arguments of
``python -m upipe_compile.estimate`` (__main__.parse_args) and those it did not know; it builds
the job, measures it with this package and prints through cli_format.py; the int is the exit
status. A source whose framework is not installed is named with the extra that installs it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib.metadata import entry_points

GROUP = "upipe_compile.estimate_jobs"


@dataclass(frozen=True)
class JobSource:
    name: str
    """The entry point's name in GROUP."""
    needs: str
    """The top-level module the source's command imports: the framework that builds its jobs."""
    missing: str
    """What to say when ``needs`` is not installed."""


SOURCES = {
    "hf": JobSource("hf", "transformers",
                    'the transformers estimate (--hf) needs transformers: pip install "upipe-compile[hf]"'),
    "torchtitan": JobSource("torchtitan", "torchtitan",
                            'the torchtitan estimate needs torchtitan: pip install "upipe-compile[torchtitan]" (0.3) '
                            'or "upipe-compile[torchtitan022]" (0.2.2)'),
}


def run_source(name: str, args, unknown: list[str]) -> int:
    """Run the command of job source ``name`` on the parsed arguments; its exit status."""
    source = SOURCES[name]
    found = list(entry_points(group=GROUP, name=name))
    if not found:
        print(f"error: no {name!r} job source in the entry points {GROUP}: the package's metadata lacks it "
              "(reinstall upipe-compile, e.g. pip install -e .)", file=sys.stderr)
        return 2
    try:
        command = found[0].load()
        return command(args, unknown)
    except ModuleNotFoundError as error:
        # the framework, or a module of it (a release the integration does not know); a missing
        # module of anything else is a bug to see whole
        if (error.name or "").partition(".")[0] != source.needs:
            raise
        print(f"error: {source.missing}", file=sys.stderr)
        return 2
