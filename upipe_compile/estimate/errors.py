"""The one error the estimate reports as a message rather than a traceback."""

from __future__ import annotations


class JobError(ValueError):
    """The job cannot be estimated as configured; the message names the setting (a TOML key,
    a config field, a command-line flag)."""
