"""Starts a tool's ``main`` and turns a missing third-party package into a clear error."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

REQUIREMENTS = Path(__file__).resolve().parent.parent / "requirements.txt"


def run_tool(tool: str, module_name: str, argv: list[str] | None = None) -> int:
    try:
        module = importlib.import_module(module_name)
        return module.main(argv)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] == "opstools":
            raise
        print(
            f"{tool}: error: the Python package {exc.name!r} is missing; "
            f"install the tools' dependencies: python3 -m pip install -r {REQUIREMENTS}",
            file=sys.stderr,
        )
        return 2
