"""File map of each prepared tree: ``python -m imagectl.treemap SRC_ROOT OUT_DIR``.

For every ``SRC_ROOT/<upstream>`` git tree made by ``distbuild patched``,
writes ``OUT_DIR/<upstream>.json``: the pristine and patched tree hashes, the
git blob id of every file of the patched tree, and for each file the series
changes, its pristine and patched blob ids. The self-test compares installed
files with these blob ids (a git blob id is computed without git, see
``blob_id``), so it can tell a patched install from a pristine one.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

PRISTINE_REF = "refs/dist/pristine"
PREPARED_REF = "refs/dist/prepared"


def blob_id(data: bytes) -> str:
    """git's object id of a blob with this content (SHA-1 object format)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, check=True).stdout


def ls_tree(tree: Path, ref: str) -> dict[str, str]:
    out = _git(tree, "ls-tree", "-r", "-z", ref)
    files = {}
    for entry in out.split("\0"):
        if not entry:
            continue
        meta, path = entry.split("\t", 1)
        mode, kind, oid = meta.split()
        if kind == "blob":
            files[path] = oid
    return files


def tree_map(tree: Path) -> dict:
    pristine = ls_tree(tree, PRISTINE_REF)
    patched = ls_tree(tree, PREPARED_REF)
    changed = {path: {"pristine": pristine.get(path), "patched": oid}
               for path, oid in patched.items() if pristine.get(path) != oid}
    for path in pristine.keys() - patched.keys():
        changed[path] = {"pristine": pristine[path], "patched": None}
    return {
        "upstream": tree.name,
        "pristine_tree": _git(tree, "rev-parse", f"{PRISTINE_REF}^{{tree}}").strip(),
        "patched_tree": _git(tree, "rev-parse", f"{PREPARED_REF}^{{tree}}").strip(),
        "files": patched,
        "changed": changed,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="imagectl.treemap", description=__doc__)
    p.add_argument("src_root", type=Path)
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for tree in sorted(d for d in args.src_root.iterdir() if (d / ".git").exists()):
        data = tree_map(tree)
        (args.out / f"{tree.name}.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"treemap  {tree.name}: {len(data['files'])} files, {len(data['changed'])} changed by the series, "
              f"patched tree {data['patched_tree']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
