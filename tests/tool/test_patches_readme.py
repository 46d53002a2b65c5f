"""patches/README.md states facts that live elsewhere too: each base's sha256 (build/pins.toml),
each series' patches (``series``) and each LMCache patch's pull request (docs/pr-map.md). These
tests hold the copies equal, so a new patch, a new pin or a regrouped PR that the README does not
follow fails here, naming the row."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

from distbuild.prmap import pull_requests
from distbuild.series import series_entries

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "patches" / "README.md"
ROW = re.compile(r"^\|\s*(\d{4})\s*\|")


def section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def table_rows(text: str) -> dict[str, list[str]]:
    """Rows of the Markdown tables in ``text`` whose first cell is a patch number: number -> cells."""
    rows = {}
    for line in text.splitlines():
        match = ROW.match(line)
        if match:
            rows[match[1]] = [cell.strip() for cell in line.strip().strip("|").split("|")]
    return rows


def test_each_base_is_the_pinned_sdist():
    pins = tomllib.loads((ROOT / "build" / "pins.toml").read_text())["artifact"]
    for upstream in ("lmcache", "flashinfer"):
        [pin] = [p for p in pins if p.get("upstream") == upstream and p["kind"] == "sdist"]
        [row] = [line for line in README.read_text().splitlines() if line.startswith(f"| [`{upstream}/`]")]
        assert f"{pin['version']}, `{pin['filename']}`" in row and f"`{pin['sha256']}`" in row, (
            f"{README}: the {upstream} base row does not name {pin['filename']} {pin['sha256']} (build/pins.toml)")


def test_every_patch_of_each_series_has_a_row_and_no_other():
    for upstream, title in (("lmcache", "LMCache"), ("flashinfer", "FlashInfer")):
        listed = {entry[:4] for entry in series_entries(ROOT / "patches" / upstream / "series")}
        rows = set(table_rows(section(title)))
        assert rows == listed, f"{README} ## {title}: rows {sorted(rows - listed)} not in the series, " \
                               f"patches {sorted(listed - rows)} without a row"


def test_each_lmcache_patch_names_the_pull_request_the_pr_map_puts_it_in():
    prs = pull_requests(ROOT / "docs" / "pr-map.md")
    pr_of = {number: str(pr) for pr, numbers in prs.items() for number in numbers}
    rows = table_rows(section("LMCache"))
    assert pr_of.keys() == rows.keys(), "docs/pr-map.md and patches/README.md group different patches"
    wrong = {number: (cells[1], pr_of[number]) for number, cells in rows.items() if cells[1] != pr_of[number]}
    assert not wrong, f"{README}: patch -> (PR in the README, PR in docs/pr-map.md): {wrong}"


def test_each_patch_count_in_the_docs_is_the_series_length():
    """README.md, docs/pr-map.md and patches/README.md say how many LMCache patches there are; a
    count left behind when a patch is added reads as a different series to an operator or reviewer."""
    count = len(series_entries(ROOT / "patches" / "lmcache" / "series"))
    stale = []
    for doc in (ROOT / "README.md", ROOT / "docs" / "pr-map.md", README):
        for number in re.findall(r"\b(\d+) (?:LMCache )?patches\b", doc.read_text()):
            if int(number) != count:
                stale.append(f"{doc.relative_to(ROOT)}: {number}")
    assert not stale, f"patch counts that are not the {count} of patches/lmcache/series: {stale}"
