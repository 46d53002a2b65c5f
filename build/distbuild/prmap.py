"""docs/pr-map.md's table: which patches of the LMCache series each upstream pull request groups.

The table's rows start ``| <PR> | <title> | <patches> |``, the patches as numbers and ranges
(``0001-0004, 0018``). The map is read here, not copied: the checks that pick one proof per pull
request (host/forward_picks.py) and the patches README's test hold their data to it.
"""
from __future__ import annotations

from pathlib import Path

from .errors import DistBuildError

PR_MAP = Path("docs") / "pr-map.md"


def expand(numbers: str) -> set[str]:
    """'0001-0004, 0018' -> {'0001', '0002', '0003', '0004', '0018'}."""
    found: set[str] = set()
    for part in numbers.split(","):
        low, _, high = part.strip().partition("-")
        if not low.isdigit() or not (high or low).isdigit() or int(high or low) < int(low):
            raise DistBuildError(f"{numbers!r}: not patch numbers and ranges such as '0001-0004, 0018'")
        found.update(f"{n:04d}" for n in range(int(low), int(high or low) + 1))
    return found


def pull_requests(path: Path) -> dict[int, set[str]]:
    """{PR number: the four-digit numbers of its patches}, from the map's table."""
    if not path.is_file():
        raise DistBuildError(f"{path}: no such file (the pull requests of the LMCache series)")
    found: dict[int, set[str]] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or not cells[0].isdigit() or len(cells) < 3:
            continue
        pr = int(cells[0])
        if pr in found:
            raise DistBuildError(f"{path}:{number}: PR {pr} has a second row")
        try:
            found[pr] = expand(cells[2])
        except DistBuildError as exc:
            raise DistBuildError(f"{path}:{number}: PR {pr}: {exc}") from None
    if not found:
        raise DistBuildError(f"{path}: no table row '| <PR> | <title> | <patches> | ...'")
    return found


def pull_request_of(patch: str, prs: dict[int, set[str]]) -> int | None:
    """The PR that groups ``patch`` (a patch file name, ``0013-...patch``), None when none does."""
    return next((pr for pr, numbers in sorted(prs.items()) if patch[:4] in numbers), None)
