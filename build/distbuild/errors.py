"""The one exception type the CLI turns into a clear message and exit code."""
from __future__ import annotations


class DistBuildError(Exception):
    """A failure the user can act on; the message names the file or value at fault."""

    exit_code = 2
