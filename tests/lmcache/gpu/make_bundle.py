#!/usr/bin/env python3
"""Make work/lmcache-gpu-bundle/: what LMCache's gpu-marked tests need on a GPU
machine that has PyTorch and nvcc but no package index.

  work/venv/bin/python tests/lmcache/gpu/make_bundle.py [--dest DIR] [--pythons 3.12,3.11]

* lmcache-src.tar.gz: ``git archive`` of work/src/lmcache's HEAD (the patched
  tree; bundle.SOURCE_PATHS only), built on the machine by device_run.sh;
* wheels/: closure.DISTS with provider "bundle", each at the version the test
  venv (work/venv) has, fetched with ``pip download --no-deps``; native ones for
  every Python in --pythons (3.12: the GPU host's; 3.11: the build host's, for
  check_local.sh);
* leaveout/: the Python files of the leave-one-out variant the gpu test's
  proof names, from build/distbuild/host/leaveout.py, so that the GPU machine also
  runs the proof where it must fail (--leaveout '' leaves it out). The proof
  is of 0010's stream-order part, so the variant is the series with 0010 less
  that part (tests/parts/lmcache/0010-pcp-shard-sync-load.stream-order.diff):
  PATCH holds the variant's name, "0010-pcp-shard-sync-load.patch:stream-order"
  (device_run.sh runs the proofs with DIST_LMCACHE_TREE=without:<PATCH>),
  lmcache/ the files that differ from HEAD, DELETE the files it lacks, and
  part.diff the part's diff it was made with;
* manifest.json: files, sizes, sha256, dists (bundle.check_manifest).

The bundle is written beside DEST and renamed into place only when complete
and checked; a failure leaves no half-made bundle. The repository itself
travels with the device command (work/ is ignored, so the bundle is named in
its carry).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
if __package__:
    from . import bundle as b
    from .closure import DISTS, Dist
else:  # run as a script
    sys.path.insert(0, str(HERE))
    import bundle as b
    from closure import DISTS, Dist

MANYLINUX = [f"manylinux_2_{n}_x86_64" for n in range(17, 40)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]


def run(cmd: list[str], **kwargs) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise b.BundleError(f"command failed ({result.returncode}): {' '.join(cmd)}\n{result.stderr[-2000:]}")
    return result.stdout


def venv_versions(python: Path, dists: tuple[Dist, ...]) -> dict[str, str]:
    """The version of every dist installed in the test venv (exactly what the CPU tests ran with)."""
    script = ("import importlib.metadata as md, json, sys\n"
              "out = {}\n"
              "for n in sys.argv[1:]:\n"
              "    try: out[n] = md.version(n)\n"
              "    except md.PackageNotFoundError: out[n] = None\n"
              "print(json.dumps(out))")
    versions = json.loads(run([str(python), "-c", script, *(d.name for d in dists)]))
    missing = [n for n, v in versions.items() if v is None]
    if missing:
        raise b.BundleError(f"{python}: the test venv lacks {', '.join(missing)} (closure.DISTS names them)")
    return versions


def tracked_bytes(repo: Path) -> int:
    names = run(["git", "-C", str(repo), "ls-files", "-z"]).split("\0")
    return sum((repo / n).stat().st_size for n in names if n and (repo / n).is_file())


def archive_source(tree: Path, out: Path) -> dict:
    if not (tree / ".git").exists():
        raise b.BundleError(f"{tree}: not a git checkout (make patched prepares work/src/lmcache)")
    dirty = run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"]).strip()
    if dirty:
        raise b.BundleError(f"{tree}: uncommitted changes ({dirty.splitlines()[0]} ...): "
                            "only HEAD travels; commit them")
    head = run(["git", "-C", str(tree), "rev-parse", "HEAD"]).strip()
    run(["git", "-C", str(tree), "archive", "--format=tar.gz", "-o", str(out), "HEAD", "--", *b.SOURCE_PATHS])
    return {"tree": str(tree), "head": head,
            "tree_hash": run(["git", "-C", str(tree), "rev-parse", "HEAD^{tree}"]).strip(),
            "subject": run(["git", "-C", str(tree), "log", "-1", "--format=%s"]).strip(), "paths": list(b.SOURCE_PATHS)}


LEAVEOUT = "leaveout"
# The gpu test's proof: fixes("0010-pcp-shard-sync-load.patch", part="stream-order").
LEAVEOUT_VARIANT = "0010-pcp-shard-sync-load.patch:stream-order"
PARTS = REPO / "tests" / "parts" / "lmcache"


def leaveout_overlay(tree: Path, variant: str, dest: Path) -> dict:
    """The Python files in which a leave-one-out variant differs from HEAD, for
    device_run.sh's leave-one-out run: ``<patch file>`` is the series without
    that patch (and the patches the series leaves out with it),
    ``<patch file>:<part>`` the series with only that part of the patch
    removed (PARTS). Computed from HEAD now, as make test's leave-one-out
    phase does (build/distbuild/host/leaveout.py), so it cannot be stale."""
    sys.path.insert(0, str(REPO / "build"))
    from distbuild.host import leaveout
    from distbuild.errors import DistBuildError
    from distbuild.gitrepo import Repo
    from distbuild.series import series_entries

    series_file = REPO / "patches" / "lmcache" / "series"
    patches = series_entries(series_file)
    patch, _, part_name = variant.partition(":")
    if patch not in patches:
        raise b.BundleError(f"{series_file}: does not list {patch}")
    repo = Repo(tree)
    commits = leaveout.series_commits(repo, patches)
    index = patches.index(patch)
    part = None
    try:
        if part_name:
            part = next((p for p in leaveout.series_parts(PARTS, patches) if p.variant == variant), None)
            if part is None:
                raise b.BundleError(f"no {PARTS / f'{Path(patch).stem}.{part_name}.diff'}: {variant} names no part")
            tree_hash, dropped = leaveout.variant_tree(repo, commits, index, set(), part.path)
            if dropped:
                raise b.BundleError(f"with {variant} removed, {', '.join(patches[i] for i in dropped)} do not apply")
        else:
            with_it = leaveout.declared_dependents(series_file).get(patch, (set(), ""))[0]
            tree_hash, dropped = leaveout.variant_tree(repo, commits, index, {patches.index(n) for n in with_it})
    except DistBuildError as exc:
        raise b.BundleError(str(exc)) from None
    changed = leaveout.changed_paths(repo, repo.tree("HEAD"), tree_hash)
    package = [p for p in changed if p.startswith("lmcache/")]
    if any(not p.endswith(".py") for p in package):
        raise b.BundleError(f"without {patch} the tree differs in compiled sources ({package}): needs its own build")
    deleted = []
    for path in package:
        if repo.git("cat-file", "-e", f"{tree_hash}:{path}", check=False).returncode != 0:
            deleted.append(path)
            continue
        target = dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(repo.git("show", f"{tree_hash}:{path}").stdout)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "PATCH").write_text(variant + "\n")
    (dest / "DELETE").write_text("".join(p + "\n" for p in deleted))
    record = {"patch": patch, "part": part_name or None, "variant": variant, "tree_hash": tree_hash,
              "left_out_with_it": [patches[i] for i in dropped], "changed": list(package), "deleted": deleted}
    if part is not None:
        shutil.copyfile(part.path, dest / "part.diff")
        record["part_diff"] = str(part.path.relative_to(REPO))
    return record


def pip_download(pip: list[str], dest: Path, spec: str, python: str | None) -> None:
    cmd = [*pip, "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    if python is not None:
        cmd += ["--python-version", python, "--implementation", "cp"]
        for platform in MANYLINUX:
            cmd += ["--platform", platform]
    run([*cmd, spec])


def download_wheels(dist: Dist, version: str, wheels: Path, pythons: list[str], pip: list[str]) -> list[str]:
    """The dist's wheels, one per Python for native ones (an abi3 wheel serves several)."""
    targets: list[str | None] = list(pythons) if dist.kind == "native" else [None]
    before = set(p.name for p in wheels.glob("*.whl"))
    for python in targets:
        pip_download(pip, wheels, f"{dist.name}=={version}", python)
    got = sorted(set(p.name for p in wheels.glob("*.whl")) - before)
    mine = [n for n in got if b.normalize(b.parse_wheel_name(n).name) == b.normalize(dist.name)]
    if not mine or len(mine) != len(got):
        raise b.BundleError(f"{dist.name}=={version}: pip download gave {got or 'nothing'}")
    for name in mine:
        kind = b.wheel_kind(b.parse_wheel_name(name))
        if kind != dist.kind:
            raise b.BundleError(f"{name}: a {kind} wheel, but closure.py declares {dist.name} {dist.kind}")
    return [f"{b.WHEELS}/{n}" for n in mine]


def write_manifest(staging: Path, source: dict, dists: list[dict], pythons: list[str], repo_tracked: int) -> dict:
    files = {str(p.relative_to(staging)): {"bytes": p.stat().st_size, "sha256": b.sha256(p)}
             for p in sorted(staging.rglob("*")) if p.is_file() and p.name != b.MANIFEST}
    manifest = {
        "made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "lmcache": source,
        "pythons": pythons,
        "dists": dists,
        "files": files,
        "total_bytes": sum(f["bytes"] for f in files.values()),
        "repo_tracked_bytes": repo_tracked,
        "carry_limit_bytes": b.CARRY_LIMIT,
    }
    (staging / b.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def make(dest: Path, tree: Path, venv_python: Path, pythons: list[str],
         leaveout_variant: str | None = LEAVEOUT_VARIANT) -> dict:
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / b.WHEELS).mkdir(parents=True)
    try:
        source = archive_source(tree, staging / b.SOURCE_ARCHIVE)
        if leaveout_variant:
            source["leaveout"] = leaveout_overlay(tree, leaveout_variant, staging / LEAVEOUT)
        versions = venv_versions(venv_python, DISTS)
        pip = [sys.executable, "-m", "pip"]
        dists = []
        for dist in DISTS:
            entry = {"name": dist.name, "version": versions[dist.name], "modules": list(dist.modules),
                     "provider": dist.provider, "kind": dist.kind, "via": dist.via, "min_version": dist.min_version,
                     "wheels": []}
            if dist.provider == "bundle":
                entry["wheels"] = download_wheels(dist, versions[dist.name], staging / b.WHEELS, pythons, pip)
            dists.append(entry)
        manifest = write_manifest(staging, source, dists, pythons, tracked_bytes(REPO))
        problems = b.check_manifest(staging, manifest)
        if problems:
            raise b.BundleError("the bundle fails its own check:\n  " + "\n  ".join(problems))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=REPO / "work" / "lmcache-gpu-bundle")
    parser.add_argument("--lmcache-tree", type=Path, default=REPO / "work" / "src" / "lmcache")
    parser.add_argument("--venv-python", type=Path, default=REPO / "work" / "venv" / "bin" / "python",
                        help="the test venv whose versions the wheels pin")
    parser.add_argument("--pythons", default="3.12,3.11",
                        help="Pythons to carry native wheels for (3.12: the GPU host's; 3.11: the build host's)")
    parser.add_argument("--leaveout", default=LEAVEOUT_VARIANT,
                        help="also carry the Python overlay of this leave-one-out variant: a patch file (the series "
                             "without it) or <patch file>:<part> (the series less that part of it); '' for none")
    args = parser.parse_args(argv)
    pythons = [p.strip() for p in args.pythons.split(",") if p.strip()]
    try:
        manifest = make(args.dest, args.lmcache_tree, args.venv_python, pythons, args.leaveout or None)
    except b.BundleError as exc:
        print(f"make_bundle.py: {exc}", file=sys.stderr)
        return 1
    total, tracked = manifest["total_bytes"], manifest["repo_tracked_bytes"]
    wheels = [rel for rel in manifest["files"] if rel.startswith(b.WHEELS + "/")]
    print(f"{args.dest}: {len(manifest['files'])} files, {total / 2**20:.1f} MiB "
          f"({manifest['files'][b.SOURCE_ARCHIVE]['bytes'] / 2**20:.1f} MiB source "
          f"at {manifest['lmcache']['head'][:12]}, "
          f"{len(wheels)} wheels); with the repository's tracked files ({tracked / 2**20:.1f} MiB): "
          f"{(total + tracked) / 2**20:.1f} MiB of the {b.CARRY_LIMIT / 2**20:.0f} MiB carry limit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
