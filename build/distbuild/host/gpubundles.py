"""The GPU checks' bundles: made in one step from the trees under test, stamped with the
sources they hold, and checked against the carried tree before a GPU run uses them.

A GPU machine without the upstream trees runs the checks from two bundles (the files the
activation harness builds from, and LMCache's patched source with the wheels its tests need).
A bundle made from other sources than the tree it travels with would time an old kernel or
test an old series without a word, so each bundle holds ``SOURCES.json``:

* ``series``: per upstream, the version and ``series_sha256`` of the patch series the bundle's
  trees were made from (the manifest's hash: ordered patch names and contents), ``parts_sha256``
  of the patch parts its leave-out variants remove (``tests/parts/<upstream>/``), and the
  patched tree's git tree hash;
* ``files``: the sha256 of the sources a reader cares about (the activation kernel file, the
  LMCache source archive);
* ``content_sha256``: one hash over every other file of the bundle (relative path and bytes).

``check`` (stdlib only: it runs on the GPU machine before anything is installed) recomputes
the series hashes from the carried ``patches/`` and the bundle's content hash, prints what the
bundle holds, and refuses a bundle whose series or content differ, naming which.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..errors import DistBuildError
from ..paths import REPO_ROOT
from ..manifest import series_hash
from ..series import load_series

STAMP = "SOURCES.json"
ACTIVATION_BUNDLE = "activation-bundle"
LMCACHE_BUNDLE = "lmcache-gpu-bundle"
# What each bundle is made from, and the files of it worth naming in the stamp.
BUNDLE_UPSTREAMS = {ACTIVATION_BUNDLE: ("flashinfer",), LMCACHE_BUNDLE: ("lmcache",)}
NAMED_FILES = {
    ACTIVATION_BUNDLE: ("patched/csrc/fused_moe/trtllm_backend/trtllm_fused_moe_dev_kernel.cu",
                        "pristine/csrc/fused_moe/trtllm_backend/trtllm_fused_moe_dev_kernel.cu"),
    LMCACHE_BUNDLE: ("lmcache-src.tar.gz",),
}


class StaleBundle(DistBuildError):
    """A bundle that does not hold the sources of the tree it travels with."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def content_sha256(bundle: Path) -> str:
    """One hash over every file of the bundle but the stamp: relative path, then bytes."""
    digest = hashlib.sha256()
    for path in sorted(p for p in bundle.rglob("*") if p.is_file() and p.name != STAMP):
        digest.update(path.relative_to(bundle).as_posix().encode() + b"\0")
        digest.update(sha256_file(path).encode() + b"\0")
    return digest.hexdigest()


def carried_series(repo: Path, upstream: str) -> str:
    return series_hash(load_series(repo / "patches" / upstream))


def carried_parts(repo: Path, upstream: str) -> str:
    """One hash over the patch parts a leave-out variant removes (names and contents)."""
    digest = hashlib.sha256()
    folder = repo / "tests" / "parts" / upstream
    for path in sorted(folder.glob("*.diff")) if folder.is_dir() else []:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, check=True).stdout.strip()


def stamp(bundle: Path, repo: Path, work: Path | None, versions: dict[str, str],
          trees: dict[str, Path] | None = None) -> dict:
    """Write ``SOURCES.json`` into a finished bundle, from the trees it was made from
    (``trees``, else ``work/src/<upstream>``)."""
    kind = bundle.name
    series = {}
    for upstream in BUNDLE_UPSTREAMS[kind]:
        tree = (trees or {}).get(upstream) or Path(work or ".") / "src" / upstream
        series[upstream] = {"version": versions[upstream], "series_sha256": carried_series(repo, upstream),
                            "parts_sha256": carried_parts(repo, upstream),
                            "patched_tree": _git(tree, "rev-parse", "HEAD^{tree}")}
    record = {
        "bundle": kind,
        "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "series": series,
        "files": {rel: sha256_file(bundle / rel) for rel in NAMED_FILES[kind]},
        "content_sha256": content_sha256(bundle),
    }
    (bundle / STAMP).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


def check(bundle: Path, repo: Path) -> list[str]:
    """The lines that say what the bundle holds; StaleBundle if it is not this tree's."""
    path = bundle / STAMP
    if not bundle.is_dir():
        raise StaleBundle(f"no bundle at {bundle} (make it with `make gpu-bundles`)")
    if not path.is_file():
        raise StaleBundle(f"{bundle}: no {STAMP}; it was not made by `make gpu-bundles` (run it)")
    try:
        record = json.loads(path.read_text())
        series, files, content = record["series"], record["files"], record["content_sha256"]
    except (ValueError, KeyError, TypeError) as exc:
        raise StaleBundle(f"{path}: unreadable stamp ({exc}); run `make gpu-bundles`") from exc
    lines = [f"{bundle.name}: made {record.get('made_at', '?')}"]
    for upstream, made in sorted(series.items()):
        lines.append(f"  {upstream} {made.get('version', '?')}: series {made['series_sha256'][:16]}, "
                     f"patched tree {made.get('patched_tree', '?')}")
    for rel, digest in sorted(files.items()):
        lines.append(f"  {rel}: sha256 {digest[:16]}")
    for upstream, made in sorted(series.items()):
        here = carried_series(repo, upstream)
        if here != made["series_sha256"]:
            raise StaleBundle(f"{bundle}: made from {upstream} series {made['series_sha256'][:16]}, but "
                              f"{repo / 'patches' / upstream} is series {here[:16]}: a stale bundle; "
                              "run `make gpu-bundles`")
        parts = carried_parts(repo, upstream)
        if made.get("parts_sha256", parts) != parts:
            raise StaleBundle(f"{bundle}: made from other {upstream} patch parts than "
                              f"{repo / 'tests' / 'parts' / upstream} holds: a stale bundle; run `make gpu-bundles`")
    actual = content_sha256(bundle)
    if actual != content:
        raise StaleBundle(f"{bundle}: its files changed after it was made (content {actual[:16]}, "
                          f"stamped {content[:16]}); run `make gpu-bundles`")
    for rel, digest in files.items():
        if sha256_file(bundle / rel) != digest:  # covered by the content hash; named for the reader
            raise StaleBundle(f"{bundle / rel}: sha256 differs from its stamp; run `make gpu-bundles`")
    lines.append(f"  matches the carried series; content {content[:16]}")
    return lines


def make(repo: Path, work: Path, python: Path, cuda: Path, versions: dict[str, str]) -> list[Path]:
    """Make both bundles from work/src (prepared by the caller) into work/, then stamp them."""
    made = []
    env = {**os.environ, "DIST_CUDA_HOME": str(cuda), "DIST_WORK": str(work)}
    env.pop("DIST_FLASHINFER_TREE", None)  # the trees of work/src, which the stamp names
    steps = [
        (ACTIVATION_BUNDLE, [sys.executable, str(repo / "tests/flashinfer/gpu/run.py"), "--work", str(work),
                             "--make-bundle", str(work / ACTIVATION_BUNDLE),
                             "--out", str(work / "tmp" / "activation-bundle")]),
        (LMCACHE_BUNDLE, [str(python), str(repo / "tests/lmcache/gpu/make_bundle.py"), "--dest",
                          str(work / LMCACHE_BUNDLE), "--lmcache-tree", str(work / "src" / "lmcache"),
                          "--venv-python", str(python)]),
    ]
    for name, cmd in steps:
        bundle = work / name
        _build(bundle, cmd, repo, env)
        print(_stamped(bundle, stamp(bundle, repo, work, versions)), flush=True)
        made.append(bundle)
    return made


def _build(bundle: Path, cmd: list[str], repo: Path, env: dict[str, str]) -> None:
    (bundle / STAMP).unlink(missing_ok=True)
    print(f"making  {bundle}", flush=True)
    done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise DistBuildError(f"{bundle.name}: {' '.join(cmd[:2])} failed ({done.returncode}):\n"
                             f"{(done.stdout + done.stderr)[-3000:]}")


def _stamped(bundle: Path, record: dict) -> str:
    size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    return f"stamped {bundle}: {size / 2**20:.1f} MiB, content {record['content_sha256'][:16]}"


def make_activation(repo: Path, tree: Path, version: str, cuda: Path, dest: Path) -> list[str]:
    """The activation bundle from another prepared FlashInfer tree (``make forward BUNDLE=1``): the
    same files and stamp as ``make gpu-bundles`` makes from work/src/flashinfer. ``dest`` must be
    named activation-bundle; tests/device_run.sh takes it as ACTIVATION_BUNDLE=dest."""
    if dest.name != ACTIVATION_BUNDLE:
        raise DistBuildError(f"{dest}: an activation bundle's folder must be named {ACTIVATION_BUNDLE}")
    env = {**os.environ, "DIST_CUDA_HOME": str(cuda), "DIST_FLASHINFER_TREE": str(tree)}
    _build(dest, [sys.executable, str(repo / "tests/flashinfer/gpu/run.py"), "--make-bundle", str(dest),
                  "--out", str(dest.parent / "activation-bundle-scratch")], repo, env)
    return [_stamped(dest, stamp(dest, repo, None, {"flashinfer": version}, {"flashinfer": tree})),
            f"on a GPU machine: ACTIVATION_BUNDLE={dest} tests/device_run.sh"]


def main(argv: list[str]) -> int:
    """``python -m distbuild.gpubundles check BUNDLE...`` (what tests/device_run.sh calls)."""
    if len(argv) < 2 or argv[0] != "check":
        print("usage: python -m distbuild.gpubundles check BUNDLE...", file=sys.stderr)
        return 2
    repo = REPO_ROOT
    status = 0
    for name in argv[1:]:
        try:
            print("\n".join(check(Path(name), repo)), flush=True)
        except DistBuildError as exc:
            print(f"REFUSED {exc}", file=sys.stderr, flush=True)
            status = 2
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
