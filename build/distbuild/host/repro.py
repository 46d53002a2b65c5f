"""``make image-repro``: build twice on clean storage, compare every stage's digest, name what differs.

Each build runs in its own, empty containers-storage (podman/buildah
``--root``/``--runroot`` under ``work/repro/``), base image included, one
after the other; only the first build's per-layer file listing is kept
between them (path, type, mode, owner, size, mtime, sha256), so the disk
holds one build at a time. Where a stage's digest differs, the layers are
compared in order and each differing layer's files are listed with what
differs, so a regression names itself. The download cache (sha256-checked
inputs) and the engine's build-cache mounts (pip's, whose files pip re-checks)
are shared: they hold inputs, not outputs.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Callable

from . import baseimage
from . import engine as engine_step
from ..errors import DistBuildError

Listing = dict[str, list]


def wrapper(folder: Path, binary: str, root: Path) -> Path:
    """A script running ``binary`` against the storage at ``root`` (what ``Engine.binary`` calls)."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / Path(binary).name
    script.write_text(f'#!/bin/sh\nexec {binary} --root "{root / "storage"}" --runroot "{root / "run"}" "$@"\n')
    script.chmod(0o755)
    return script


def clean_engine(engine: engine_step.Engine, root: Path) -> tuple[engine_step.Engine, Path | None]:
    if engine.name not in ("podman", "buildah"):
        raise DistBuildError("make image-repro needs podman or buildah (a separate clean storage per build)")
    shutil.rmtree(root, ignore_errors=True)
    bins = root / "bin"
    main = wrapper(bins, engine.binary, root)
    buildah = shutil.which("buildah")
    return engine_step.Engine(engine.name, str(main)), (wrapper(bins, buildah, root) if buildah else None)


def _entry(path: Path) -> list:
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        kind, content = "link", os.readlink(path)
    elif stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
        kind, content = "whiteout", ""
    elif stat.S_ISREG(st.st_mode):
        h = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        kind, content = "file", h.hexdigest()
    elif stat.S_ISDIR(st.st_mode):
        kind, content = "dir", ""
    else:
        kind, content = "other", str(st.st_rdev)
    return [kind, oct(stat.S_IMODE(st.st_mode)), st.st_uid, st.st_gid, st.st_size if kind == "file" else 0,
            int(st.st_mtime), content]


def list_tree(root: Path) -> Listing:
    out: Listing = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames) + sorted(filenames):
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = _entry(p)
    return out


FIELDS = ("type", "mode", "uid", "gid", "size", "mtime", "content")


# The listing reads the engine's on-disk layer (overlay diff), where a directory a step changed and
# a whiteout keep the time of the build; the layer tar the digest is over clamps both to
# SOURCE_DATE_EPOCH under --timestamp (measured with podman 4.3.1: two builds of steps that delete
# and touch inside a directory gave equal layer digests). Such a difference alone is not a cause.
_TAR_CLAMPED = ("dir", "whiteout")


def _mtime_only_on_disk(x: list, y: list) -> bool:
    return x[0] == y[0] and x[0] in _TAR_CLAMPED and [v for i, v in enumerate(x) if i != 5] == \
        [v for i, v in enumerate(y) if i != 5]


def diff_listings(a: Listing, b: Listing, limit: int = 60) -> list[str]:
    """What differs between two layer listings, one line per path: added, removed, or the fields.
    A directory's or whiteout's mtime alone is counted on one closing line, not listed."""
    lines = []
    on_disk_only = 0
    for path in sorted(set(a) | set(b)):
        if path not in a:
            lines.append(f"only in build 2: {path}")
        elif path not in b:
            lines.append(f"only in build 1: {path}")
        elif a[path] != b[path] and _mtime_only_on_disk(a[path], b[path]):
            on_disk_only += 1
        elif a[path] != b[path]:
            what = [f"{f} {x!r} != {y!r}" if f != "content" else "content (sha256/target) differs"
                    for f, x, y in zip(FIELDS, a[path], b[path]) if x != y]
            lines.append(f"{path}: {', '.join(what)}")
    # bytecode last and counted: one stray .pyc writer changes hundreds of them
    pyc = [line for line in lines if ".pyc" in line.split(":")[0] or line.endswith(".pyc")]
    rest = [line for line in lines if line not in pyc]
    lines = rest + pyc
    if pyc:
        lines.insert(len(rest), f"{len(pyc)} .pyc file(s) differ, e.g.:")
    lines = lines if len(lines) <= limit else lines[:limit] + [f"... and {len(lines) - limit} more"]
    if on_disk_only:
        lines.append(f"(and {on_disk_only} directory or whiteout mtime(s) that differ only on disk: the layer tar "
                     "clamps them to SOURCE_DATE_EPOCH)")
    return lines


def _run(engine: engine_step.Engine, *args: str) -> str:
    done = subprocess.run([engine.binary, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise DistBuildError(f"{engine.name} {' '.join(args[:3])}: {done.stderr.strip()[-800:]}")
    return done.stdout.strip()


def layer_listings(engine: engine_step.Engine, root: Path, image: str) -> list[dict]:
    """The image's layers in order: diff digest and the files of each layer's own diff."""
    diff_ids = json.loads(_run(engine, "image", "inspect", "--format", "{{json .RootFS.Layers}}", image)
                          if engine.name == "podman" else
                          _run(engine, "inspect", "--format", "{{json .OCIv1.RootFS.DiffIDs}}", image))
    layers = json.loads((root / "storage" / "overlay-layers" / "layers.json").read_text())
    by_digest = {}
    for layer in layers:
        by_digest.setdefault(layer.get("diff-digest"), layer["id"])
    out = []
    for diff_id in diff_ids:
        if diff_id not in _LISTED:
            layer_id = by_digest.get(diff_id)
            diff = root / "storage" / "overlay" / str(layer_id) / "diff"
            _LISTED[diff_id] = list_tree(diff) if layer_id and diff.is_dir() else {}
        out.append({"diff_id": diff_id, "files": _LISTED[diff_id]})
    return out


_LISTED: dict[str, Listing] = {}   # per build: stages share their lower layers


# History comments naming the intermediate image a step ran on ("FROM 928999b0f3ce"): those ids are
# the docker-format config's digests, which carry buildah's build-container id (below).
_INTERMEDIATE = re.compile(r"^FROM [0-9a-f]{12,64}$")


def canonical_config(inspect: dict) -> dict:
    """The image config as content: what the image runs and is made of, without the build
    container's id. podman 4.3 / buildah 1.28 write the docker format's ``container`` field (the
    random id of the container the step ran in) even under ``--timestamp`` (newer buildah clears
    it there), so the engine's image id and digest differ per build while every layer, the
    created times, the environment and the labels are equal; this digest is over the rest."""
    history = []
    for h in inspect.get("History") or []:
        entry = {k: h[k] for k in ("created", "created_by", "empty_layer") if k in h}
        comment = h.get("comment")
        if comment:
            entry["comment"] = "FROM <intermediate>" if _INTERMEDIATE.match(comment) else comment
        history.append(entry)
    return {"architecture": inspect.get("Architecture"), "os": inspect.get("Os"), "created": inspect.get("Created"),
            "config": inspect.get("Config"), "diff_ids": (inspect.get("RootFS") or {}).get("Layers"),
            "history": history}


def content_digest(config: dict) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def inspect_image(engine: engine_step.Engine, ref: str) -> dict:
    if engine.name == "buildah":
        raw = json.loads(_run(engine, "inspect", "--type", "image", ref)).get("OCIv1", {})
        return {"Architecture": raw.get("architecture"), "Os": raw.get("os"), "Created": raw.get("created"),
                "Config": raw.get("config"), "RootFS": {"Layers": (raw.get("rootfs") or {}).get("diff_ids")},
                "History": raw.get("history")}
    return json.loads(_run(engine, "image", "inspect", ref))[0]


def stage_digests(engine: engine_step.Engine, refs: list[str]) -> dict[str, dict]:
    out = {}
    for ref in refs:
        config = canonical_config(inspect_image(engine, ref))
        out[ref] = {"content": content_digest(config), "id": baseimage.image_id(engine, ref),
                    "digest": baseimage.digest(engine, ref), "config": config}
    return out


def compare(first: dict, second: dict) -> dict:
    """Both builds' digests per stage and, where they differ, the differing layers and files."""
    result: dict = {"stages": {}, "same": True}
    for ref in first["digests"]:
        a, b = first["digests"][ref], second["digests"].get(ref, {})
        same = a.get("content") is not None and a.get("content") == b.get("content")
        entry: dict = {"build1": {k: v for k, v in a.items() if k != "config"},
                       "build2": {k: v for k, v in b.items() if k != "config"}, "same": same,
                       "engine_digest_same": a.get("digest") is not None and a.get("digest") == b.get("digest")}
        if same and not entry["engine_digest_same"]:
            entry["note"] = ("same content digest; the engine's image ids differ only by the docker-format "
                             "'container' field (buildah's build-container id)")
        if not same:
            result["same"] = False
            la, lb = first["layers"].get(ref, []), second["layers"].get(ref, [])
            layers = []
            for n in range(max(len(la), len(lb))):
                x = la[n] if n < len(la) else {"diff_id": None, "files": {}}
                y = lb[n] if n < len(lb) else {"diff_id": None, "files": {}}
                if x["diff_id"] != y["diff_id"]:
                    layers.append({"layer": n + 1, "build1": x["diff_id"], "build2": y["diff_id"],
                                   "files": diff_listings(x["files"], y["files"])})
            entry["layers"] = layers
            ca, cb = a.get("config") or {}, b.get("config") or {}
            entry["config_fields"] = sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k))
            if not layers:
                entry["note"] = f"every layer is equal; the config differs in {', '.join(entry['config_fields'])}"
        result["stages"][ref] = entry
    return result


def format_result(result: dict) -> str:
    lines = []
    for ref, entry in result["stages"].items():
        mark = "SAME" if entry["same"] else "DIFFERS"
        lines.append(f"repro    {mark:8} {ref}: content {entry['build1'].get('content')} / "
                     f"{entry['build2'].get('content')}")
        for layer in entry.get("layers", []):
            lines.append(f"repro      layer {layer['layer']}: {layer['build1']} != {layer['build2']}")
            lines += [f"repro        {line}" for line in layer["files"]]
        if entry.get("note"):
            lines.append(f"repro      {entry['note']}")
    lines.append("repro    " + ("PASS: both clean builds gave the same content digest for every stage" if result["same"]
                              else "FAIL: the builds differ (above: the layers and files)"))
    return "\n".join(lines)


def run(layout, options, log: Callable[[str], None] = print) -> int:
    from . import image as image_step

    engine = engine_step.ensure_engine(options.engine, log)
    stages = image_step.stages_until(options.target)
    refs = [image_step.STAGE_TAG.format(stage=s) for s in stages if s not in ("runtime", "router")]
    if options.target == "runtime":
        refs.append(options.tag)
    if options.target in ("runtime", "router"):
        refs.append(image_step.router_tag(options.tag))
    refs.insert(0, baseimage.TAG)
    out = layout.work / "repro"
    builds = []
    for n in (1, 2):
        root = out / f"build-{n}"
        clean, buildah = clean_engine(engine, root)
        log(f"repro    build {n} of 2 in the clean storage {root} (target {options.target})")
        env_before = os.environ.get("DIST_BUILDAH")
        if buildah:
            os.environ["DIST_BUILDAH"] = str(buildah)
        try:
            image_step.run(layout, replace(options, selftest=False, audit=False, layers=False), log, engine=clean,
                           report_dir=out / f"report-{n}")
        finally:
            if env_before is None:
                os.environ.pop("DIST_BUILDAH", None)
            else:
                os.environ["DIST_BUILDAH"] = env_before
        _LISTED.clear()
        record = {"digests": stage_digests(clean, refs),
                  "layers": {ref: layer_listings(clean, root, ref) for ref in refs}}
        (out / f"build-{n}.json").write_text(json.dumps(record["digests"], indent=1, sort_keys=True) + "\n")
        builds.append(record)
        # Only the listing stays: the next build starts from empty storage, and the disk holds one at a time.
        subprocess.run([clean.binary, "rmi", "--all", "--force"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    result = compare(*builds)
    (out / "report.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    log(format_result(result))
    return 0 if result["same"] else 1
