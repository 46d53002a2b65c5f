"""Phase 4's results kept by what they are a function of, so an identical run is not run again.

LMCache's own CPU suite (phase 4) on one build gives the same results as long as nothing it
depends on changed: the LMCache tree (its code and its ``tests/``, named by git tree hash), the
pytest arguments, the interpreter and every distribution it imports (name and version, read
with the run's own environment, so the pristine build on ``PYTHONPATH`` counts), and the Valkey
it talks to. Those, hashed, are a run's key; its junit file is kept under that key. The pristine
run's key changes only with the pins, the patched run's with the series, so most ``make test``
runs read both from the store instead of spending ten minutes of CPU beside the other phases
(the way Bazel caches a test whose inputs did not change).

What is kept: a pristine run that completed (with or without failures: it is the baseline), and
a patched run only when it showed no regression against its pristine baseline and no failure in
the series' own test files. A reused result says so in the summary, with the date it was run.
``DIST_PEER_RESULTS=fresh`` runs both again (and keeps what they give).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import DistBuildError
from ..gitrepo import Repo

FRESH_ENV = "DIST_PEER_RESULTS"
# Part of every key: raise it when what a run means changes in a way the other inputs do not show.
FORMAT = 1
# The distributions the run's interpreter imports, as name==version, its version line first. Of two
# with one name (the pristine build on PYTHONPATH before the venv's patched one) the first on sys.path
# is the one imported, and the only one that counts.
_LIST_DISTRIBUTIONS = (
    "import sys, importlib.metadata as m\n"
    "seen = {}\n"
    "for d in m.distributions():\n"
    "    seen.setdefault(d.metadata['Name'].lower().replace('_', '-'), d.version)\n"
    "print(sys.version)\n"
    "print('\\n'.join(sorted(f'{n}=={v}' for n, v in seen.items())))\n"
)


@dataclass(frozen=True)
class Reused:
    """A result read from the store: when and on which tree it was run."""
    run_at: str
    tree: str

    def describe(self) -> str:
        return f"reused the result of an identical run (tree {self.tree[:12]}, run {self.run_at})"


def fresh_requested() -> bool:
    raw = os.environ.get(FRESH_ENV, "")
    if raw not in ("", "fresh", "reuse"):
        raise DistBuildError(f"{FRESH_ENV}={raw!r}: expected 'fresh' (run phase 4 again) or 'reuse' (the default)")
    return raw == "fresh"


def distributions(python: Path, env: dict[str, str]) -> str:
    """What the run's interpreter imports from: its version and every distribution it finds."""
    done = subprocess.run([str(python), "-c", _LIST_DISTRIBUTIONS], capture_output=True, text=True, env=env,
                          timeout=120)
    if done.returncode != 0:
        raise DistBuildError(f"phase 4: cannot list the distributions {python} imports: {done.stderr.strip()[-300:]}")
    return done.stdout


def valkey_version(valkey_server: Path) -> str:
    done = subprocess.run([str(valkey_server), "--version"], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise DistBuildError(f"phase 4: {valkey_server} --version exited {done.returncode}")
    return done.stdout.strip()


def run_inputs(tree_hash: str, args: list[str], dists: str, valkey: str) -> dict:
    """What a run is a function of, as its key hashes it and ``about.json`` keeps it."""
    return {"format": FORMAT, "tree": tree_hash, "args": args, "distributions": dists, "valkey": valkey}


def run_key(tree_hash: str, args: list[str], dists: str, valkey: str) -> str:
    return inputs_key(run_inputs(tree_hash, args, dists, valkey))


def inputs_key(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def inputs_differences(kept: dict, wanted: dict) -> list[str]:
    """What differs between two runs' inputs, one line per input; distributions line by line."""
    lines = []
    for name in sorted(set(kept) | set(wanted)):
        old, new = kept.get(name), wanted.get(name)
        if old == new:
            continue
        if name == "distributions" and isinstance(old, str) and isinstance(new, str):
            gone = sorted(set(old.splitlines()) - set(new.splitlines()))
            added = sorted(set(new.splitlines()) - set(old.splitlines()))
            lines.append(f"distributions: kept {', '.join(gone) or 'nothing else'}; "
                         f"now {', '.join(added) or 'nothing else'}")
        else:
            lines.append(f"{name}: kept {old!r}; now {new!r}")
    return lines


def tree_hash(tree: Path, rev: str) -> str:
    return Repo(tree).out("rev-parse", f"{rev}^{{tree}}").strip()


class PeerStore:
    """Junit files of phase-4 runs, one folder per key: ``junit.xml`` and ``about.json``."""

    def __init__(self, root: Path):
        self.root = root

    def lookup(self, key: str, junit: Path) -> Reused | None:
        """Copy the kept junit of ``key`` to ``junit``; None when there is none (or it is damaged)."""
        folder = self.root / key
        try:
            about = json.loads((folder / "about.json").read_text())
            kept = folder / "junit.xml"
            if hashlib.sha256(kept.read_bytes()).hexdigest() != about["junit_sha256"]:
                return None
        except (OSError, ValueError, KeyError):
            return None
        junit.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(kept, junit)
        return Reused(about["run_at"], about["tree"])

    def keep(self, key: str, junit: Path, tree: str, inputs: dict | None = None) -> None:
        """Keep ``junit`` under ``key`` with the ``inputs`` it is a function of, written whole or not at all."""
        folder = self.root / key
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        shutil.copyfile(junit, partial / "junit.xml")
        about = {"tree": tree, "run_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "junit_sha256": hashlib.sha256(junit.read_bytes()).hexdigest(),
                 **({"inputs": inputs} if inputs is not None else {})}
        (partial / "about.json").write_text(json.dumps(about, indent=1) + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(partial, folder)

    def why_missed(self, inputs: dict) -> str:
        """Why no kept run matches ``inputs``: how the newest kept run of the same tree differs, so a
        run that did not read back what an earlier one kept says which input moved."""
        same_tree = []
        for about_file in self.root.glob("*/about.json"):
            try:
                about = json.loads(about_file.read_text())
            except (OSError, ValueError):
                continue
            if about.get("tree") == inputs.get("tree") and isinstance(about.get("inputs"), dict):
                same_tree.append(about)
        if not same_tree:
            return f"no kept run of tree {str(inputs.get('tree'))[:12]}"
        newest = max(same_tree, key=lambda about: about.get("run_at", ""))
        differences = inputs_differences(newest["inputs"], inputs)
        if not differences:
            return f"the kept run of these inputs (run {newest.get('run_at')}) has a damaged or missing junit file"
        return (f"the kept run of tree {str(inputs.get('tree'))[:12]} (run {newest.get('run_at')}) differs in "
                + "; ".join(differences))
