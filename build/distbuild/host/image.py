"""``make image``: build the Dockerfile stage by stage, then the self-test and the arch audit.

1. a container engine (``engine.py``: docker, podman or buildah; installs
   podman/buildah with apt on a Debian machine that has none);
2. the base image (``baseimage.py``: debootstrap bookworm + python3), unless
   ``--base-image`` names one;
3. every stage up to ``--target`` in order, each tagged
   ``localhost/glm53-stage:<stage>``, its log in ``work/image/logs/`` and its
   wall time printed; a failing stage stops the build naming the stage and the
   lines that say why;
4. the runtime stage gets the provenance labels (``imagectl.labels``) computed
   from the manifest the ``sources`` stage wrote and the AOT status the
   ``flashinfer-wheel`` stage wrote; after the build the labels are checked
   against the manifest inside the image;
5. the image's self-test in a container, and ``distbuild audit`` of its
   filesystem for ``sm_103`` with ``build/audit-allowlist.txt``.

A release (``--release``, ``make image RELEASE=1``) must carry FlashInfer's
artifact set: it fails at once without a complete cached set, after the
``sources`` stage when the set was fetched for other pins than the patched
tree's, and after ``flashinfer-wheel`` unless the modules were compiled; each
failure names what is missing. Without ``--release`` the same image is a
development image (``imagectl.labels``: it needs FlashInfer's artifact store at
first use).

A report (stage times, image size, self-test output, audit summary) goes to
``work/image/report.json``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from . import baseimage, engine as engine_step
from ..errors import DistBuildError
from .lock import check_host  # noqa: F401  (re-exported for tests)
from ..paths import REPO_ROOT, Layout
from ..pins import load as load_pins, normalize_name

STAGES = ("base", "build-base", "toolchain", "sources", "libfabric", "build-env", "lmcache-wheel", "flashinfer-wheel",
          "router", "runtime")
STAGE_TAG = "localhost/glm53-stage:{stage}"
# The P/D router's own image (the router stage), built after the runtime with the serving image's version.
ROUTER_TAG = "localhost/glm53-b300-router:{version}"
# SOURCE_DATE_EPOCH of the stages: the commit time of the last change to what they read. Only
# these paths: a change to configs/ or the operator tools rebuilds the runtime's tail, not the
# compile stages (a new epoch would). The runtime's labels carry HEAD's commit time.
BUILD_INPUTS = ("Dockerfile", ".dockerignore", "build", "patches", "image/imagectl/__init__.py",
                "image/imagectl/aptpin.py", "image/imagectl/cudastub.py", "image/imagectl/treemap.py",
                "image/imagectl/flashinfer_aot.py", "image/imagectl/layers.py",
                "image/imagectl/debsource.py")
BASE_INPUTS = ("build/lock/debian.txt", "build/distbuild/host/baseimage.py", "image/imagectl/aptpin.py")
ERROR_HINTS = re.compile(r"(error|Error|ERROR|failed|FAILED|does not apply|not found|No such file)")


@dataclass
class Options:
    engine: str | None = None
    tag: str = "localhost/glm53-b300-serving:dev"
    target: str = "runtime"
    base_image: str | None = None
    selftest: bool = True
    audit: bool = True
    audit_target: str = "sm_103"
    max_jobs: int = 2
    release: bool = False  # fail unless the image carries FlashInfer's artifact set and AOT modules
    layers: bool = True    # compress each layer (gzip, as a registry push would) for the layer table
    extra_args: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Options":
        return cls(engine=args.engine, tag=args.tag, target=args.target, base_image=args.base_image,
                   selftest=not args.no_selftest, audit=not args.no_audit, audit_target=args.audit_target,
                   max_jobs=int(os.environ.get("MAX_JOBS", "2")), release=getattr(args, "release", False),
                   layers=not getattr(args, "no_layer_sizes", False))


def stages_until(target: str) -> list[str]:
    """The stages ``target`` needs, in build order. The router stage needs only the base, and no other
    stage needs it: a runtime build makes the router's image afterwards (``build_router``)."""
    if target not in STAGES:
        raise DistBuildError(f"--target {target}: not a stage of the Dockerfile ({', '.join(STAGES)})")
    if target == "router":
        return ["base", "router"]
    return [stage for stage in STAGES[: STAGES.index(target) + 1] if stage != "router"]


def router_tag(serving_tag: str) -> str:
    """The router image's tag for a serving image's: the same version (``dev`` when it has none)."""
    name = serving_tag.rsplit("/", 1)[-1]
    return ROUTER_TAG.format(version=name.rsplit(":", 1)[-1] if ":" in name else "dev")


def dockerfile_args(dockerfile: Path) -> dict[str, str]:
    """ARG defaults declared before the first FROM (the Dockerfile's version table)."""
    out: dict[str, str] = {}
    for line in dockerfile.read_text().splitlines():
        if line.startswith("FROM "):
            break
        m = re.match(r"ARG\s+([A-Z0-9_]+)=(\S+)", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def check_inputs(layout: Layout) -> None:
    """Fail early, naming what is missing: the pins, the locks, a Dockerfile version that disagrees."""
    pins = load_pins(layout.pins_file)
    dockerfile = layout.repo / "Dockerfile"
    if not dockerfile.is_file():
        raise DistBuildError(f"{dockerfile}: missing")
    for name in ("image.txt", "builder.txt"):
        if not (layout.repo / "build" / "lock" / name).is_file():
            raise DistBuildError(f"build/lock/{name}: missing; "
                                 "run `make lock` (resolves the image's dependencies by hash)")
    declared = dockerfile_args(dockerfile)
    by_name = {normalize_name(p.name): p for p in pins if p.role in ("image", "upstream")}
    wanted = {"VLLM_VERSION": "vllm", "TORCH_VERSION": "torch", "LMCACHE_VERSION": "lmcache",
              "FLASHINFER_VERSION": "flashinfer-python", "NIXL_VERSION": "nixl-cu13"}
    for arg, project in wanted.items():
        pin = by_name.get(project)
        if pin is None:
            raise DistBuildError(f"build/pins.toml: no pin for {project} (the Dockerfile's {arg} needs one); "
                                 "add it with make pin")
        if declared.get(arg) != pin.version:
            raise DistBuildError(f"Dockerfile ARG {arg}={declared.get(arg)} "
                                 f"but build/pins.toml pins {project} {pin.version}")
    _imagectl()
    from imagectl.locks import entries_from_lock
    lock = entries_from_lock((layout.repo / "build" / "lock" / "image.txt").read_text())
    for pin in pins:
        if pin.role == "image":
            got = lock.get(normalize_name(pin.name))
            if got is None or got != (pin.version, pin.sha256):
                raise DistBuildError(f"build/lock/image.txt: {pin.name} is {got}, pins.toml pins {pin.version} "
                                     f"sha256 {pin.sha256}; rerun `make lock`")


CA_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem")


def build_ca_bundle() -> Path:
    """The builder's CA bundle, handed to download steps as a build secret (``build/with-build-ca``)."""
    chosen = os.environ.get("SSL_CERT_FILE") or os.environ.get("PIP_CERT")
    for candidate in ([chosen] if chosen else []) + list(CA_BUNDLES):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise DistBuildError("no CA bundle found (SSL_CERT_FILE or /etc/ssl/certs/ca-certificates.crt); "
                         "the build's download steps need one")


def _stream(cmd: list[str], log_path: Path, prefix: str) -> tuple[int, list[str]]:
    """Run ``cmd``, echo its output (prefixed) and keep it in ``log_path``; return rc and the tail."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    tail: list[str] = []
    with log_path.open("w") as log, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                     text=True, errors="replace", bufsize=1) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            tail.append(line.rstrip("\n"))
            del tail[:-400]
            print(f"{prefix} {line}", end="", flush=True)
        rc = proc.wait()
    return rc, tail


def failure_summary(tail: list[str], limit: int = 15) -> str:
    hits = [line for line in tail if ERROR_HINTS.search(line)]
    chosen = (hits or tail)[-limit:]
    return "\n".join("    " + line for line in chosen)


class Builder:
    def __init__(self, layout: Layout, engine: engine_step.Engine, options: Options,
                 log: Callable[[str], None] = print) -> None:
        self.layout = layout
        self.engine = engine
        self.options = options
        self.log = log
        self.out = layout.work / "image"
        self.times: dict[str, float] = {}

    def build_stage(self, stage: str, args: dict[str, str], tag: str | None = None) -> str:
        tag = tag or STAGE_TAG.format(stage=stage)
        cmd = timestamped(self.engine, self.engine.build_cmd(self.layout.repo, self.layout.repo / "Dockerfile", stage,
                                                             tag, args, {"build-ca": build_ca_bundle()}),
                          args.get("SOURCE_DATE_EPOCH"))
        n = STAGES.index(stage) + 1
        self.log(f"stage    [{n}/{len(STAGES)}] {stage}: {' '.join(cmd[:4])} ... --target {stage}")
        started = time.monotonic()
        rc, tail = _stream(["nice", "-n", "19", *cmd], self.out / "logs" / f"{stage}.log", f"  {stage} |")
        took = time.monotonic() - started
        self.times[stage] = round(took, 1)
        if rc != 0:
            raise DistBuildError(f"stage {stage} failed after {took:.0f} s "
                                 f"(full log: {self.out / 'logs' / (stage + '.log')}):\n"
                                 f"{failure_summary(tail)}")
        self.log(f"stage    [{n}/{len(STAGES)}] {stage} done in {took:.0f} s")
        return tag

    def run(self, image: str, argv: list[str], env: dict[str, str] | None = None,
            entrypoint: str | None = None, volumes: dict[Path, str] | None = None) -> subprocess.CompletedProcess:
        env = env or {}
        mounts = [f"--volume={host}:{inside}:ro" for host, inside in (volumes or {}).items()]
        if self.engine.name == "buildah":
            ctr = subprocess.run([self.engine.binary, "from", "--quiet", image], capture_output=True, text=True,
                                 check=True).stdout.strip()
            try:
                envs = [f"--env={k}={v}" for k, v in env.items()]
                prog = [entrypoint] if entrypoint else ["/usr/bin/tini", "--", "/opt/glm53/scripts/entrypoint"]
                return subprocess.run([self.engine.binary, "run", *envs, *mounts, ctr, "--", *prog, *argv],
                                      capture_output=True, text=True)
            finally:
                subprocess.run([self.engine.binary, "rm", ctr], capture_output=True)
        envs = [f"--env={k}={v}" for k, v in env.items()]
        ep = [f"--entrypoint={entrypoint}"] if entrypoint else []
        return subprocess.run([self.engine.binary, "run", "--rm", "--network=none", *envs, *mounts, *ep, image, *argv],
                              capture_output=True, text=True)

    def read_json(self, image: str, path: str) -> dict:
        result = self.run(image, [path], entrypoint="cat")
        if result.returncode != 0:
            raise DistBuildError(f"{image}: cannot read {path}: {result.stderr.strip()[-500:]}")
        return json.loads(result.stdout)

    def labels(self, image: str) -> dict[str, str]:
        fmt = "{{json .Config.Labels}}" if self.engine.name != "buildah" else "{{json .OCIv1.Config.Labels}}"
        cmd = [self.engine.binary, "inspect", "--format", fmt, image] if self.engine.name == "buildah" else \
            [self.engine.binary, "image", "inspect", "--format", fmt, image]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        return json.loads(out) or {}

    def size(self, image: str) -> int | None:
        if self.engine.name == "buildah":
            return None
        out = subprocess.run([self.engine.binary, "image", "inspect", "--format", "{{.Size}}", image],
                             capture_output=True, text=True).stdout.strip()
        return int(out) if out.isdigit() else None


def timestamped(engine: engine_step.Engine, cmd: list[str], epoch: str | None) -> list[str]:
    """The build command with the engine's timestamp rewriting: podman/buildah ``--timestamp``
    (podman >= 2.0, buildah >= 1.15; measured here with podman 4.3.1) sets the config's and
    history's created time and every committed file's mtime. Docker: BuildKit reads the
    SOURCE_DATE_EPOCH build arg (>= 0.11) for created/history; file mtimes need its
    ``rewrite-timestamp`` exporter option (>= 0.13), which ``make image`` does not pass."""
    if not epoch or engine.name not in ("podman", "buildah"):
        return cmd
    return [*cmd[:2], f"--timestamp={epoch}", *cmd[2:]]   # after `<binary> build|bud`


def git_out(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def dockerignore_excludes(repo: Path) -> list[str]:
    """git pathspecs leaving out what .dockerignore keeps out of the build context: a file no
    stage can read (the build tool's host-side modules) must not move the stages' epoch, or
    editing it would rebuild every stage through SOURCE_DATE_EPOCH."""
    try:
        lines = (repo / ".dockerignore").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith(("#", "!")):
            continue
        out.append(f":(exclude,glob){line.rstrip('/')}" + ("/**" if line.endswith("/") else ""))
    return out


def input_epoch(repo: Path, paths: tuple[str, ...], in_build_context: bool = True) -> int:
    """Commit time of the last commit touching ``paths`` (SOURCE_DATE_EPOCH env overrides it). For the
    stages' inputs (``in_build_context``) less what .dockerignore leaves out of the context; the base is
    made on the host by code outside the context, so its inputs count whole."""
    if os.environ.get("SOURCE_DATE_EPOCH", "").isdigit():
        return int(os.environ["SOURCE_DATE_EPOCH"])
    excludes = dockerignore_excludes(repo) if in_build_context else []
    value = git_out(repo, "log", "-1", "--format=%ct", "--", *paths, *excludes)
    if not value.isdigit():
        raise DistBuildError(f"{repo}: no git history for {', '.join(paths[:3])}...: the build's SOURCE_DATE_EPOCH "
                             "comes from the commit (or set SOURCE_DATE_EPOCH)")
    return int(value)


def provenance(repo: Path) -> dict[str, str]:
    """HEAD's commit, its commit time (the `created` label) and where the source lives."""
    rev = git_out(repo, "rev-parse", "HEAD") or "unknown"
    dirty = git_out(repo, "status", "--porcelain", "--untracked-files=no")
    ct = git_out(repo, "log", "-1", "--format=%ct")
    created = datetime.fromtimestamp(int(ct), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if ct.isdigit() else ""
    source = os.environ.get("DIST_IMAGE_SOURCE") or git_out(repo, "remote", "get-url", "origin") or "unknown"
    return {"IMAGE_REVISION": rev + ("-dirty" if rev != "unknown" and dirty else ""),
            "IMAGE_CREATED": created or "unknown", "IMAGE_SOURCE": source}


def _imagectl():
    return _imagectl_module("labels")


def _imagectl_module(name: str):
    """A module of the image's own code (image/imagectl), which the build tool reads too."""
    scripts = str(REPO_ROOT / "image")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    return importlib.import_module(f"imagectl.{name}")


def run(layout: Layout, options: Options, log: Callable[[str], None] = print,
        engine: engine_step.Engine | None = None, report_dir: Path | None = None) -> int:
    """Build up to ``options.target``; ``engine`` (make image-repro: one on clean storage) and
    ``report_dir`` (default work/image) override the defaults."""
    started = time.monotonic()
    stages = stages_until(options.target)
    check_inputs(layout)
    staged = _stage_flashinfer_artifacts(layout, options, log)
    engine = engine or engine_step.ensure_engine(options.engine, log)
    builder = Builder(layout, engine, options, log)
    if report_dir is not None:
        builder.out = report_dir
    report: dict = {"engine": engine.name, "tag": options.tag, "stages": builder.times}
    epoch = input_epoch(layout.repo, BUILD_INPUTS)
    base_ref, base_name = _base_image(builder, report)
    report["base"] = base_ref
    report["source_date_epoch"] = epoch
    args = {"BASE_IMAGE": base_ref, "MAX_JOBS": str(options.max_jobs), "SOURCE_DATE_EPOCH": str(epoch),
            **options.extra_args}
    log(f"image    SOURCE_DATE_EPOCH={epoch} (last commit touching the build inputs), base {base_name} {base_ref[:12]}")
    _build_stages(builder, stages, args, base_ref, base_name, staged, report)
    final = {"runtime": options.tag, "router": router_tag(options.tag)}.get(options.target,
                                                                           STAGE_TAG.format(stage=options.target))
    report["image"] = final
    if options.target == "runtime":
        _check_runtime_image(builder, final, report, started)
        build_router(builder, args, base_ref, base_name, report)
    _write_report(builder.out, report, started)
    log(f"image    {final} ready in {time.monotonic() - started:.0f} s; report: {builder.out / 'report.json'}")
    return 0


def _base_image(builder: Builder, report: dict) -> tuple[str, str]:
    """The base's reference and the name the labels give it: ``--base-image``, else the debootstrap base
    (built when missing, its time in the report)."""
    options, layout = builder.options, builder.layout
    if options.base_image:
        return options.base_image, options.base_image
    base_started = time.monotonic()
    base_ref = baseimage.ensure_base(builder.engine, layout.work / "image", builder.log,
                                     lock=layout.repo / "build" / "lock" / "debian.txt",
                                     epoch=input_epoch(layout.repo, BASE_INPUTS, in_build_context=False))
    report["base_seconds"] = round(time.monotonic() - base_started, 1)
    return base_ref, baseimage.TAG


def _build_stages(builder: Builder, stages: list[str], args: dict[str, str], base_ref: str, base_name: str,
                  staged, report: dict) -> None:
    """Every stage in order. The sources and flashinfer-wheel stages are checked once built: what they
    wrote (the trees' manifest, FlashInfer's AOT status) labels the runtime stage."""
    manifest: dict | None = None
    aot: dict | None = None
    for stage in stages:
        if stage == "router":
            build_router(builder, args, base_ref, base_name, report)
            continue
        if stage == "runtime":
            assert manifest is not None and aot is not None
            runtime_args = _runtime_args(builder, args, manifest, aot, base_ref, base_name)
            report["labels_args"] = {k: runtime_args[k] for k in ("IMAGE_REVISION", "IMAGE_CREATED", "IMAGE_SOURCE",
                                                                  "BASE_NAME", "BASE_DIGEST")}
            builder.build_stage(stage, runtime_args, tag=builder.options.tag)
            continue
        tag = builder.build_stage(stage, args)
        if stage == "sources":
            manifest = _check_sources_stage(builder, tag, staged, report)
        if stage == "flashinfer-wheel":
            aot = _flashinfer_aot_status(builder, tag)


def build_router(builder: Builder, args: dict[str, str], base_ref: str, base_name: str, report: dict) -> str:
    """The router stage as the P/D router's own image, labelled as the serving image is, then checked:
    its entrypoint's vllm-router takes the chart's flags as the image's user."""
    tag = router_tag(builder.options.tag)
    builder.build_stage("router", {**args, **provenance(builder.layout.repo), "BASE_NAME": base_name,
                                   "BASE_DIGEST": baseimage.digest(builder.engine, base_ref) or "unknown",
                                   "IMAGE_VERSION": tag.rsplit(":", 1)[-1]}, tag=tag)
    report["router"] = check_router_image(builder, tag)
    size = report["router"]["size_bytes"]
    builder.log(f"router   {tag}: {size / 1e6:.0f} MB, digest {report['router']['digest']}" if size else
                f"router   {tag}: digest {report['router']['digest']}")
    return tag


def check_router_image(builder: Builder, tag: str) -> dict:
    """``python3 -m vllm_router.launch_router --help`` under the image's tini, as its user: every flag the
    chart passes must be there (the serving image's self-test asks the same of its copy)."""
    selftest = _imagectl_module("selftest")
    help_run = builder.run(tag, ["--", "python3", "-m", "vllm_router.launch_router", "--help"],
                           entrypoint="/usr/bin/tini")
    if help_run.returncode != 0:
        raise DistBuildError(f"{tag}: vllm_router.launch_router --help exited {help_run.returncode}: "
                             f"{(help_run.stderr or help_run.stdout).strip()[-800:]}")
    missing = [flag for flag in selftest.ROUTER_FLAGS if flag not in help_run.stdout]
    if missing:
        raise DistBuildError(f"{tag}: its vllm-router lacks {', '.join(missing)}, which the chart passes")
    user = builder.run(tag, ["-u"], entrypoint="id").stdout.strip()
    if user != "1000":
        raise DistBuildError(f"{tag}: runs as uid {user or '?'}, the chart's router runs as 1000")
    builder.log(f"router   {tag}: vllm-router takes the chart's {len(selftest.ROUTER_FLAGS)} flags, as uid 1000")
    return {"tag": tag, "size_bytes": builder.size(tag), "digest": baseimage.digest(builder.engine, tag),
            "image_id": baseimage.image_id(builder.engine, tag)}


def _runtime_args(builder: Builder, args: dict[str, str], manifest: dict, aot: dict, base_ref: str,
                  base_name: str) -> dict[str, str]:
    """The runtime stage's build args: the provenance labels, FlashInfer's AOT status and the base's digest."""
    return {**args, **_imagectl().build_args(manifest, aot.get("status", "unknown")),
            "FLASHINFER_CUBIN_DIR": aot.get("cubin_dir", ""),
            "VLLM_HAS_FLASHINFER_CUBIN": "1" if aot.get("status") == "built" else "0",
            **provenance(builder.layout.repo),
            "BASE_NAME": base_name, "BASE_DIGEST": baseimage.digest(builder.engine, base_ref) or "unknown",
            "IMAGE_VERSION": builder.options.tag.rsplit(":", 1)[-1]}


def _check_sources_stage(builder: Builder, tag: str, staged, report: dict) -> dict:
    """A release's artifact pins, then the sources stage's self-test; the trees' manifest the stage wrote."""
    if builder.options.release:
        _check_release_pins(builder, tag, staged)
    manifest = builder.read_json(tag, "/work/trees/manifest.json")
    # The checker is the repository's (mounted read-only), so editing it never rebuilds the stage.
    check = builder.run(tag, ["-m", "imagectl.selftest", "--stage", "sources"],
                        env={"PYTHONPATH": "/selftest"}, entrypoint="python3",
                        volumes={builder.layout.repo / "image": "/selftest"})
    print(check.stdout + check.stderr, end="")
    report["sources_selftest"] = check.stdout
    if check.returncode != 0:
        raise DistBuildError("the sources stage's self-test failed (above)")
    return manifest


def _flashinfer_aot_status(builder: Builder, tag: str) -> dict:
    """What the flashinfer-wheel stage compiled ahead of time; a release stops when it compiled nothing."""
    aot = builder.read_json(tag, "/out/flashinfer-aot.json")
    if aot.get("status") != "built":
        builder.log(f"image    NOTE: FlashInfer {aot.get('module')} was NOT compiled ahead of time: "
                    f"{aot.get('reason')}")
        builder.log(f"image    NOTE: {aot.get('consequence')}")
        if builder.options.release:
            raise DistBuildError(f"RELEASE=1: the flashinfer-wheel stage compiled no FlashInfer module "
                                 f"({aot.get('reason')}); missing: {', '.join(aot.get('missing', [])[:5])}")
    return aot


def _check_runtime_image(builder: Builder, final: str, report: dict, started: float) -> None:
    """The runtime image's labels, size and ids (the report is written then), its self-test, the arch
    audit and the layer table, each as the options ask."""
    _check_labels(builder, final)
    _record_size_and_ids(builder, final, report)
    _write_report(builder.out, report, started)
    if builder.options.selftest:
        _run_selftest(builder, final, report, started)
    if builder.options.audit:
        _run_audit(builder, final, report, started)
    if builder.options.layers:
        from . import layertable
        report["release_digest"], report["layers"] = layertable.release(builder.engine, final, builder.out / "oci",
                                                                        builder.log)
        builder.log(layertable.format_table(report["layers"]))


def _check_labels(builder: Builder, final: str) -> None:
    """The image's labels must agree with the manifest inside it."""
    inside = builder.read_json(final, "/opt/glm53/manifest.json")
    wrong = _imagectl().mismatches(builder.labels(final), inside,
                                   inside["outputs"]["flashinfer-fused-moe-aot"]["status"])
    if wrong:
        raise DistBuildError("image labels disagree with its manifest: " + "; ".join(wrong))
    builder.log("image    labels agree with /opt/glm53/manifest.json")


def _record_size_and_ids(builder: Builder, final: str, report: dict) -> None:
    report["size_bytes"] = builder.size(final)
    if report["size_bytes"]:
        builder.log(f"image    {final}: {report['size_bytes'] / 1e9:.2f} GB")
    report["image_id"] = baseimage.image_id(builder.engine, final)
    report["digest"] = baseimage.digest(builder.engine, final)
    builder.log(f"image    {final} digest {report['digest']} (image id sha256:{report['image_id']})")


def _run_selftest(builder: Builder, final: str, report: dict, started: float) -> None:
    """The image's self-test in a container; a failure is in the report before it stops the build."""
    result = builder.run(final, ["self-test"])
    print(result.stdout, end="")
    print(result.stderr, end="", file=sys.stderr)
    report["selftest"] = result.stdout
    report["selftest_rc"] = result.returncode
    if result.returncode != 0:
        _write_report(builder.out, report, started)
        raise DistBuildError("the image's self-test failed (above)")


def _run_audit(builder: Builder, final: str, report: dict, started: float) -> None:
    """The arch audit of the image's filesystem; a failure is in the report before it stops the build."""
    target = builder.options.audit_target
    report["audit"] = audit_image(builder.layout, builder.engine, final, target, builder.log)
    if not report["audit"]["passed"]:
        _write_report(builder.out, report, started)
        raise DistBuildError(f"the arch audit failed for {target} "
                             "(above; JSON in work/image/audit.json)")


def lock_debian(layout: Layout, options: Options, log: Callable[[str], None] = print) -> int:
    """``make lock-debian``: build/lock/debian.txt from the live suites (base, then each stage's closure)."""
    engine = engine_step.ensure_engine(options.engine, log)
    lock = layout.repo / "build" / "lock" / "debian.txt"
    epoch = input_epoch(layout.repo, BASE_INPUTS, in_build_context=False)
    baseimage.write_lock(engine, layout.work / "image", lock, log, epoch=epoch)
    log(f"lock     wrote {lock}; `make image` now builds the base and every stage from it")
    return 0


FETCH_HINT = "run `make flashinfer-artifacts [FLASHINFER_MIRROR=url-or-folder]`"


def _stage_flashinfer_artifacts(layout: Layout, options: Options, log: Callable[[str], None]):
    """The cached FlashInfer artifact set into the build context (flashinfer_artifacts.stage);
    a release without a complete set stops here, before any stage is built."""
    from .. import flashinfer_artifacts as fa

    status = fa.stage(layout.cache / fa.CACHE_SUBDIR, layout.repo / "build" / fa.CACHE_SUBDIR, log)
    if not status.complete:
        log(f"image    NOTE: no complete FlashInfer artifact set in {status.root}: {status.missing[0]}"
            f"{f' and {len(status.missing) - 1} more' if len(status.missing) > 1 else ''}; this will be a "
            f"{_imagectl().DEVELOPMENT} (no AOT FlashInfer modules, no cubins; `make flashinfer-artifacts` "
            "fetches them)")
        if options.release:
            raise DistBuildError(f"RELEASE=1: no complete FlashInfer artifact set in {status.root} "
                                 f"({len(status.missing)} missing: {', '.join(status.missing[:5])}); {FETCH_HINT}")
    return status


# The files of the patched FlashInfer tree that carry the artifact pins (flashinfer_artifacts.read_pins).
PIN_FILES = ("flashinfer/artifacts.py", "flashinfer/jit/cubin_loader.py")


def _check_release_pins(builder: "Builder", sources_tag: str, staged) -> None:
    """A release's staged set against the pins of the patched tree the sources stage made: a set
    fetched for another FlashInfer would leave the flashinfer-wheel stage nothing to compile."""
    import tempfile

    from .. import flashinfer_artifacts as fa

    with tempfile.TemporaryDirectory(prefix="glm53-flashinfer-pins-") as tmp:
        for name in PIN_FILES:
            done = builder.run(sources_tag, [f"/work/src/flashinfer/{name}"], entrypoint="cat")
            if done.returncode != 0:
                raise DistBuildError(f"{sources_tag}: cannot read /work/src/flashinfer/{name}: "
                                     f"{done.stderr.strip()[-300:]}")
            (Path(tmp) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / name).write_text(done.stdout)
        pins = fa.read_pins(Path(tmp))
    problems = fa.release_problems(staged, pins)
    if problems:
        raise DistBuildError(f"RELEASE=1: the staged FlashInfer artifact set does not match the patched tree: "
                             f"{'; '.join(problems)}; {FETCH_HINT}")
    builder.log(f"image    release: the staged artifact set matches the patched tree's pins "
                f"({', '.join(a.key for a in pins.artifacts)})")


def _write_report(out: Path, report: dict, started: float) -> None:
    report["total_seconds"] = round(time.monotonic() - started, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")


def audit_image(layout: Layout, engine: engine_step.Engine, image: str, target: str,
                log: Callable[[str], None]) -> dict:
    """Run the audit gate on the image's filesystem (mounted when the engine can, else a saved archive)."""
    from . import audit as audit_step
    from ..cli import _client
    from ..toolchain import ensure_toolchain

    def cuda_home() -> Path:
        return ensure_toolchain(load_pins(layout.pins_file), layout.cache, layout.work / "toolchain", _client)

    tool = audit_step.find_cuobjdump(None, cuda_home)
    allow = audit_step.load_allowlist(layout.repo / "build" / "audit-allowlist.txt")
    out = layout.work / "image"
    archive = None
    if engine.name in ("podman", "buildah") and os.geteuid() == 0:
        sub = [engine.binary, "image", "mount", image] if engine.name == "podman" else None
        if sub is None:
            ctr = subprocess.run([engine.binary, "from", "--quiet", image],
                                 capture_output=True, text=True, check=True).stdout.strip()
            root = subprocess.run([engine.binary, "mount", ctr],
                                  capture_output=True, text=True, check=True).stdout.strip()
            unmount = [engine.binary, "rm", ctr]
        else:
            root = subprocess.run(sub, capture_output=True, text=True, check=True).stdout.strip()
            unmount = [engine.binary, "image", "unmount", image]
    else:
        archive = out / "image.tar"
        log(f"audit    saving {image} to {archive}")
        subprocess.run([engine.binary, "save", "-o", str(archive), image], check=True)
        root, unmount = str(archive), None
    log(f"audit    {image} ({root}) for {target} with build/audit-allowlist.txt "
        "(cuobjdump on every CUDA object: minutes)")
    started = time.monotonic()
    try:
        report = audit_step.audit(Path(root), target, tool, allow)
    finally:
        if unmount:
            subprocess.run(unmount, capture_output=True)
        if archive:
            archive.unlink(missing_ok=True)
    text = audit_step.format_report(report)
    print(text)
    audit_step.write_json(report, out / "audit.json")
    (out / "audit.txt").write_text(text + "\n")
    return {"passed": report.passed, "seconds": round(time.monotonic() - started, 1), "summary": text.splitlines()[-3:]}
