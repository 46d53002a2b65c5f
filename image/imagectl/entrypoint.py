"""The image's entrypoint: the upstream vLLM OpenAI image's arguments, role presets and tools.

    IMAGE MODEL [vllm serve flags]          as the upstream image: vllm serve MODEL ...
    IMAGE --model MODEL [flags]             likewise (any leading flag)
    IMAGE vllm serve MODEL ...              any vllm command, as written
    IMAGE prefill|decode|aggregated MODEL [flags]
                                            the role preset from /etc/glm53/<role>/ (env + vllm.yaml),
                                            after the preflight (--skip-preflight or
                                            GLM53_SKIP_PREFLIGHT=1 skips it); prints the start of
                                            each cold-start phase and a summary (GLM53_PHASE_LOG=0:
                                            exec vLLM instead; =1: follow any command)
    IMAGE preflight ROLE [MODEL]            only the preflight: /dev/shm, /cache, JIT toolchain, NIXL,
                                            FlashInfer artifacts, GPU, the model's config.json
    IMAGE self-test [--json] [--strict]     check the image without a GPU (one-screen report)
    IMAGE manifest | sbom                   print /opt/glm53/manifest.json or sbom.cdx.json
    IMAGE pd-router [args]                  the P/D router the deployment runs (vllm-router:
                                            python3 -m vllm_router.launch_router args)
    IMAGE pd-proxy [args]                   vLLM's NIXL P/D toy proxy (toy_proxy_server.py of the pinned sdist)
    IMAGE replay|valkey-stats|needle|profile-capture|kv-sizing [args]   operator tools
    IMAGE bash|sh|python3|/abs/program ...  run that program

Every command runs with LMCACHE_KV_KEY_EPOCH, the image's KV key epoch (LMCache's chunk keys carry
it, so images of other builds sharing a Valkey keep their own chunks), unless it is set already
(empty: no epoch) or LMCACHE_CONFIG_FILE's file sets kv_key_epoch.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import identity, keyepoch, presets

HOME = Path(os.environ.get("GLM53_HOME", "/opt/glm53"))
CONFIG_ROOT = Path(os.environ.get("GLM53_CONFIGS", "/etc/glm53"))
TOOLS = ("replay", "valkey-stats", "needle", "profile-capture", "kv-sizing")
PASSTHROUGH = ("bash", "sh", "python", "python3", "pip", "vllm")
SKIP_FLAG = "--skip-preflight"
SKIP_ENV = "GLM53_SKIP_PREFLIGHT"
# Follow the command's output for its cold-start phases (imagectl/phases.py): on by default
# for a role preset, "0" turns it off; "1" turns it on for any command (e.g. a wrapper of vllm).
PHASE_ENV = "GLM53_PHASE_LOG"


@dataclass(frozen=True)
class Plan:
    """What to exec: argv and the environment updates (or text to print)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    text: str | None = None
    exit_code: int = 0
    preflight: tuple[str, str] | None = None   # (role, model) to check before exec
    follow: bool = False   # run it as a child and log its cold-start phases instead of exec


def _is_program(head: str) -> bool:
    """An absolute path to an executable file runs as itself; a model folder does not."""
    path = Path(head)
    return path.is_absolute() and path.is_file() and os.access(path, os.X_OK)


def plan(args: list[str], environ: dict[str, str], home: Path = HOME, config_root: Path = CONFIG_ROOT) -> Plan:
    if not args or args[0] in ("-h", "--help", "help"):
        return Plan([], text=__doc__)
    head, rest = args[0], args[1:]
    if head in presets.ROLES:
        skip = SKIP_FLAG in rest or environ.get(SKIP_ENV, "") not in ("", "0")
        rest = [a for a in rest if a != SKIP_FLAG]
        if not rest or rest[0].startswith("-"):
            model = environ.get("MODEL")
            if not model:
                return Plan([], text=f"{head}: give the model path first (or set MODEL): "
                                     f"{head} /models/GLM-5.3-FP8 [vllm serve flags]\n", exit_code=2)
        else:
            model, rest = rest[0], rest[1:]
        try:
            preset = presets.load(head, config_root)
            env = preset.env()
        except presets.PresetError as exc:
            return Plan([], text=f"{exc}\n", exit_code=2)
        updates = {k: v for k, v in env.items() if k not in environ}
        return Plan(preset.command(model, rest), env=updates, preflight=None if skip else (head, model),
                    follow=environ.get(PHASE_ENV, "1") != "0")
    if head == "preflight":
        return Plan([sys.executable, "-m", "imagectl.preflight", *rest])
    if head == "serve":
        return Plan(["vllm", "serve", *rest])
    if head == "self-test":
        return Plan([sys.executable, "-m", "imagectl.selftest", *rest])
    if head in ("manifest", "sbom"):
        path = home / ("manifest.json" if head == "manifest" else "sbom.cdx.json")
        return Plan(["cat", str(path)])
    if head == "pd-router":
        return Plan([sys.executable, "-m", "vllm_router.launch_router", *rest])
    if head == "pd-proxy":
        return Plan([sys.executable, str(home / "pd-proxy" / "toy_proxy_server.py"), *rest])
    if head in TOOLS:
        return Plan([str(home / "scripts" / head), *rest])
    if head in PASSTHROUGH or _is_program(head):
        return Plan(args)
    # The upstream vllm-openai image runs `vllm serve` with whatever it is given.
    return Plan(["vllm", "serve", *args])


def main(argv: list[str] | None = None) -> int:
    # Files in /cache stay group-writable for the group 0 every UID of this image runs with.
    os.umask(0o002)
    who = identity.identity_env(dict(os.environ))
    for key in sorted(who):
        print(f"entrypoint: {key}={who[key]} (uid {os.getuid()} has no usable passwd entry or HOME)", file=sys.stderr)
    os.environ.update(who)
    chosen = plan(list(sys.argv[1:] if argv is None else argv), dict(os.environ))
    if os.environ.get(PHASE_ENV) == "1" and chosen.argv:
        chosen = replace(chosen, follow=True)
    if chosen.text is not None:
        (sys.stderr if chosen.exit_code else sys.stdout).write(chosen.text)
        return chosen.exit_code
    env = {**os.environ, **chosen.env}
    for key in sorted(chosen.env):
        print(f"entrypoint: {key}={chosen.env[key]} (preset)", file=sys.stderr)
    # LMCache's chunk keys carry the image's KV key epoch unless the operator chose one (keyepoch.py).
    epoch, said = keyepoch.default_env(env, HOME / "manifest.json")
    print(f"entrypoint: {said}", file=sys.stderr)
    env.update(epoch)
    if chosen.preflight is not None:
        from . import preflight

        role, model = chosen.preflight
        if preflight.preflight(role, model, env, config_root=CONFIG_ROOT) != 0:
            print(f"entrypoint: the preflight failed; {role} not started (fix above, or {SKIP_FLAG})", file=sys.stderr)
            return 1
    if chosen.follow:
        from . import phases

        print(f"entrypoint: run {' '.join(chosen.argv)} (cold-start phases below; {PHASE_ENV}=0 execs it)",
              file=sys.stderr, flush=True)
        return phases.run(chosen.argv, env)
    print(f"entrypoint: exec {' '.join(chosen.argv)}", file=sys.stderr, flush=True)
    try:
        os.execvpe(chosen.argv[0], chosen.argv, env)
    except FileNotFoundError:
        print(f"entrypoint: {chosen.argv[0]}: not found", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
