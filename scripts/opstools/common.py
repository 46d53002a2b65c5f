"""What every tool shares: exit codes, the error type, output folders, argument types."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path

EXIT_OK = 0
EXIT_FAILED = 1  # the tool ran, and what it checked did not pass
EXIT_ERROR = 2  # the tool could not do its job (bad input, dead endpoint, ...)
EXIT_INTERRUPTED = 130


class OpsError(Exception):
    """An error the operator can act on; its message names the bad file or value."""


def utc_stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%d-%H%M%S")


def utc_iso(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).isoformat(timespec="milliseconds")


def default_out_dir(tool: str) -> Path:
    """``work/ops/<tool>-<UTC timestamp>/`` under the current directory."""
    return Path("work") / "ops" / f"{tool}-{utc_stamp()}"


def prepare_out_dir(out: Path | None, tool: str) -> Path:
    """Create the output folder (default: :func:`default_out_dir`) and return it."""
    folder = out if out is not None else default_out_dir(tool)
    if folder.exists() and not folder.is_dir():
        raise OpsError(f"--out {folder}: exists and is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OpsError(f"--out {folder}: cannot create it: {exc.strerror or exc}") from exc
    return folder


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def fraction(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def fail(message: str, code: int = EXIT_ERROR, tool: str = "") -> int:
    prefix = f"{tool}: " if tool else ""
    print(f"{prefix}error: {message}", file=sys.stderr, flush=True)
    return code


def run_guarded(tool: str, action: Callable[[], int], interrupted: str = "interrupted") -> int:
    """Run one command of an ops tool: an OpsError or a Ctrl-C ends it with a one-line error and its exit code."""
    try:
        return action()
    except OpsError as exc:
        return fail(str(exc), EXIT_ERROR, tool)
    except KeyboardInterrupt:
        return fail(interrupted, EXIT_INTERRUPTED, tool)


def dispatch(tool: str, args: argparse.Namespace, commands: Mapping[str, Callable[[argparse.Namespace], int]]) -> int:
    """Run the subcommand ``args.command`` names, guarded as run_guarded does."""
    return run_guarded(tool, lambda: commands[args.command](args))


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the examples in the description as written and shows defaults."""
