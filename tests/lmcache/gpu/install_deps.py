#!/usr/bin/env python3
"""Install the bundle's wheels that an interpreter lacks, then import every dist.

  python3 tests/lmcache/gpu/install_deps.py --bundle DIR --python VENV/bin/python [--report F]

For each dist of the manifest: the interpreter's own copy is used when it has
one (at min_version or newer); else the bundle's wheel whose tags fit the
interpreter (``pip install --no-index --no-deps``). Exit 2, naming every dist
at fault, when a dist is missing and the bundle carries none, or carries none
for this Python (remake the bundle with make_bundle.py --pythons X.Y), or when
an import fails after the install. Stdlib only, plus pip's vendored packaging
in the target interpreter.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if __package__:
    from . import bundle as b
else:  # run as a script (on the GPU machine, before anything is installed)
    sys.path.insert(0, str(HERE))
    import bundle as b

PROBE = r"""
import importlib.metadata as md, json, platform, sys
from pip._vendor.packaging.tags import sys_tags
from pip._vendor.packaging.version import Version
names, mins = json.loads(sys.argv[1])
found = {}
for name in names:
    try:
        found[name] = md.version(name)
    except md.PackageNotFoundError:
        found[name] = None
old = {n: v for n, v in found.items()
       if v is not None and mins.get(n) and Version(v) < Version(mins[n])}
print(json.dumps({"python": platform.python_version(), "executable": sys.executable,
                  "libc": platform.libc_ver(), "tags": [str(t) for t in sys_tags()],
                  "found": found, "too_old": old}))
"""

IMPORTS = r"""
import importlib, json, sys
failed = {}
for m in json.loads(sys.argv[1]):
    try:
        importlib.import_module(m)
    except Exception as exc:
        failed[m] = f"{type(exc).__name__}: {exc}"
print(json.dumps(failed))
"""


def probe(python: str, dists: list[dict]) -> dict:
    arg = json.dumps([[d["name"] for d in dists], {d["name"]: d["min_version"] for d in dists if d.get("min_version")}])
    result = subprocess.run([python, "-c", PROBE, arg], capture_output=True, text=True)
    if result.returncode != 0:
        raise b.BundleError(f"{python}: cannot read its packages and tags: {result.stderr.strip()[-800:]}")
    return json.loads(result.stdout)


def plan(manifest: dict, env: dict) -> tuple[list[dict], list[str]]:
    """(one row per dist: where it comes from, the wheel to install), problems."""
    tags = set(env["tags"])
    rows: list[dict] = []
    problems: list[str] = []
    for dist in manifest["dists"]:
        have = env["found"].get(dist["name"])
        row = {"name": dist["name"], "device_version": have, "bundle_version": dist["version"], "wheel": None}
        if have is not None and dist["name"] not in env["too_old"]:
            row["source"] = "device"
        elif dist["provider"] != "bundle":
            row["source"] = "missing"
            why = "is missing" if have is None else f"is {have}, older than {dist['min_version']}"
            problems.append(f"{dist['name']}: {why} on this machine and the bundle does not carry it "
                            f"(closure.py: provider device; imported by {dist['via']})")
        else:
            fitting = [rel for rel in dist["wheels"] if b.parse_wheel_name(Path(rel).name).tags & tags]
            if not fitting:
                problems.append(
                    f"{dist['name']}: none of the carried wheels ({', '.join(Path(w).name for w in dist['wheels'])}) "
                    f"fits Python {env['python']} ({sorted(tags)[0] if tags else '?'}, ...); the bundle was made for "
                    f"Pythons {', '.join(manifest['pythons'])}: remake it with make_bundle.py --pythons "
                    f"{'.'.join(env['python'].split('.')[:2])}")
                row["source"] = "missing"
            else:
                row["source"] = "bundle"
                row["wheel"] = fitting[0]
        rows.append(row)
    return rows, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--python", required=True, help="the interpreter (venv) to install into")
    parser.add_argument("--report", type=Path, help="write the plan and the import results here (JSON)")
    parser.add_argument("--target", type=Path,
                        help="install into this folder (put on PYTHONPATH by the caller) "
                        "instead of the interpreter's site")
    args = parser.parse_args(argv)
    try:
        manifest = b.load_manifest(args.bundle)
        problems = b.check_manifest(args.bundle, manifest)
        if problems:
            raise b.BundleError(f"{args.bundle}: damaged bundle:\n  " + "\n  ".join(problems))
        env = probe(args.python, manifest["dists"])
        rows, problems = plan(manifest, env)
        report = {"python": env["python"], "executable": env["executable"], "libc": env["libc"], "dists": rows}
        for row in rows:
            print(f"  {row['name']:18} {row['source']:7} {row['device_version'] or '-':>12}  "
                  f"{Path(row['wheel']).name if row['wheel'] else ''}")
        if problems:
            raise b.BundleError("cannot install the test dependencies:\n  " + "\n  ".join(problems))
        wheels = [str(args.bundle / row["wheel"]) for row in rows if row["wheel"]]
        if wheels:
            cmd = [args.python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-cache-dir",
                   "--disable-pip-version-check", *(["--target", str(args.target)] if args.target else []), *wheels]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise b.BundleError(f"pip install failed ({result.returncode}):\n{result.stderr[-2000:]}")
        modules = [m for dist in manifest["dists"] for m in dist["modules"]]
        result = subprocess.run([args.python, "-c", IMPORTS, json.dumps(modules)], capture_output=True, text=True)
        failed = json.loads(result.stdout) if result.returncode == 0 else {"(import check)": result.stderr[-800:]}
        report["import_failures"] = failed
        if args.report:
            args.report.write_text(json.dumps(report, indent=1) + "\n")
        if failed:
            raise b.BundleError("installed, but these do not import:\n  "
                                + "\n  ".join(f"{m}: {e}" for m, e in failed.items()))
    except b.BundleError as exc:
        print(f"install_deps.py: {exc}", file=sys.stderr)
        return 2
    carried = sum(1 for row in rows if row["source"] == "bundle")
    print(f"install_deps.py: {len(rows)} dists import in Python {env['python']} "
          f"({carried} installed from the bundle, {len(rows) - carried} the machine's own)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
