"""`make chart`: the Helm chart of the cell as one self-contained package.

In the repository the chart's ``files/prefill`` and ``files/decode`` are links to
``configs/prefill`` and ``configs/decode`` (one copy of the engine configs). A GitOps
controller that reads a chart out of git may refuse links that leave the chart's folder, so
this writes, under ``<work>/chart``:

    glm53-cell/                   the chart, every link replaced by the files it names
    glm53-cell-<version>.tgz      ``helm package`` of that folder
    glm53-cell-<version>.tgz.sha256

and checks them: no symlink in the folder or in the package, and ``helm template`` of the
package renders exactly what the source chart renders (placeholder images; the defaults and
each values file of configs/deploy/examples). It prints the package's sha256.

Every file of the folder gets one fixed modification time (``SOURCE_DATE_EPOCH``, else
1980-01-01): ``helm package`` stores it, so the same chart gives the same package.

    PYTHONPATH=build python3 -m distbuild.chart --work work     (what `make chart` runs)
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from ..errors import DistBuildError
from ..paths import REPO_ROOT

CHART = Path("configs") / "deploy" / "chart"
EXAMPLES = Path("configs") / "deploy" / "examples"
FIXED_MTIME = 315532800   # 1980-01-01T00:00:00Z
# What the comparison renders with: the chart refuses to render without the two images.
PLACEHOLDERS = ("image=registry.example/glm53-b300@sha256:" + "0" * 64,
                "valkeySpec.image=valkey/valkey@sha256:" + "1" * 64)


def helm_binary(repo: Path = REPO_ROOT) -> str:
    """$DIST_HELM, else work/tools/bin/helm (make test installs it), else helm on PATH."""
    for candidate in (os.environ.get("DIST_HELM"), str(repo / "work" / "tools" / "bin" / "helm"),
                      shutil.which("helm")):
        if candidate and Path(candidate).is_file():
            return candidate
    raise DistBuildError("helm not found: set DIST_HELM, run `make test` once (it installs work/tools/bin/helm), "
                         "or put Helm 3.14+/4 on PATH")


def chart_version(chart: Path) -> tuple[str, str]:
    """name and version of Chart.yaml (top-level scalars; no YAML parser needed)."""
    text = (chart / "Chart.yaml").read_text()
    found = {}
    for key in ("name", "version"):
        match = re.search(rf"^{key}:\s*['\"]?([^'\"\s#]+)", text, re.MULTILINE)
        if not match:
            raise DistBuildError(f"{chart / 'Chart.yaml'}: no top-level {key}")
        found[key] = match.group(1)
    return found["name"], found["version"]


def stage(chart: Path, dest: Path, mtime: int) -> None:
    """Copy the chart to dest with every symlink resolved, all files at one mtime."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(chart, dest, symlinks=False, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for path in sorted(dest.rglob("*"), reverse=True):
        os.utime(path, (mtime, mtime), follow_symlinks=False)
    os.utime(dest, (mtime, mtime))


def symlinks_in_folder(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_symlink())


def symlinks_in_package(package: Path) -> list[str]:
    with tarfile.open(package) as tar:
        return sorted(m.name for m in tar.getmembers() if m.issym() or m.islnk())


def helm_template(helm: str, chart: Path, values: Path | None = None) -> str:
    cmd = [helm, "template", "glm53", str(chart), "--namespace", "vllm"]
    for assignment in PLACEHOLDERS:
        cmd += ["--set", assignment]
    if values is not None:
        cmd += ["--values", str(values)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise DistBuildError(f"helm template {chart}{' -f ' + str(values) if values else ''}: "
                             f"{done.stderr.strip()[-800:]}")
    return done.stdout


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def package(work: Path, repo: Path = REPO_ROOT, helm: str | None = None, log=print) -> Path:
    """Stage, package and check the chart under work/chart; the package's path."""
    helm = helm or helm_binary(repo)
    chart = repo / CHART
    name, version = chart_version(chart)
    out = work / "chart"
    out.mkdir(parents=True, exist_ok=True)
    mtime = int(os.environ.get("SOURCE_DATE_EPOCH") or FIXED_MTIME)
    folder = out / name
    stage(chart, folder, mtime)
    links = symlinks_in_folder(folder)
    if links:
        raise DistBuildError(f"{folder}: symlinks left after resolving: {', '.join(links)}")
    tgz = out / f"{name}-{version}.tgz"
    tgz.unlink(missing_ok=True)
    done = subprocess.run([helm, "package", str(folder), "--destination", str(out)], capture_output=True, text=True)
    if done.returncode != 0 or not tgz.is_file():
        raise DistBuildError(f"helm package {folder}: {done.stderr.strip()[-800:] or 'no ' + tgz.name}")
    links = symlinks_in_package(tgz)
    if links:
        raise DistBuildError(f"{tgz}: holds symlinks: {', '.join(links)}")
    cases = [None, *sorted((repo / EXAMPLES).glob("*.yaml"))]
    for values in cases:
        if helm_template(helm, tgz, values) != helm_template(helm, chart, values):
            raise DistBuildError(f"{tgz} renders differently from {chart}"
                                 f"{' with ' + str(values.relative_to(repo)) if values else ''}")
    digest = sha256_of(tgz)
    (out / f"{tgz.name}.sha256").write_text(f"{digest}  {tgz.name}\n")
    log(f"chart: {folder} (self-contained: no symlinks)")
    log(f"chart: renders as {CHART} (defaults and {len(cases) - 1} example values files)")
    log(f"chart: {tgz}")
    log(f"sha256: {digest}")
    return tgz


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m distbuild.chart",
                                 description="Package the Helm chart self-contained under WORK/chart "
                                 "and print its sha256.")
    ap.add_argument("--work", type=Path, default=REPO_ROOT / "work", help="the work folder (default: work/)")
    args = ap.parse_args(argv)
    try:
        package(args.work.resolve())
    except DistBuildError as exc:
        print(f"chart: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
