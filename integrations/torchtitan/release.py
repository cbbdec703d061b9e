"""Which torchtitan release is installed: the one place the integration asks.

0.2.x jobs are TOML files (``custom_config_module`` + ``custom_import``, TrainSpecs); 0.3
jobs are Python functions returning ``Trainer.Config`` (``--module`` / ``--config``,
ModelSpecs). The package serves whichever is installed.
"""

from __future__ import annotations

import functools
import importlib.metadata


@functools.lru_cache(maxsize=None)
def torchtitan_release() -> tuple[int, int] | None:
    """(major, minor) of the installed torchtitan, None when it is not installed."""
    try:
        version = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return None
    major, minor = (int("".join(c for c in part if c.isdigit()) or 0) for part in version.split(".")[:2])
    return major, minor


def python_configs() -> bool:
    """torchtitan 0.3 or later: Python job configs and ModelSpecs (no TOML, no TrainSpec)."""
    release = torchtitan_release()
    return release is not None and release >= (0, 3)
