#!/usr/bin/env python3
"""Render the GLM-5.3 P/D cell with Helm and check the rendered objects.

    python3 configs/deploy/render.py -f my-cell.yaml --out rendered/
    python3 configs/deploy/render.py --set image=REGISTRY/glm53-b300@sha256:... \\
        --set valkeySpec.image=valkey/valkey@sha256:... > cell.yaml

A thin wrapper: the cell is the Helm chart in configs/deploy/chart (values.yaml, its
values.schema.json, and the `fail` checks of templates/_helpers.tpl enforce the invariants);
this runs `helm template` on it and then check_rendered() re-reads the rendered objects:
remote_url's {rank} expansions and the shard Services must match one to one, and each engine's
startup probe outlasts its VLLM_ENGINE_READY_TIMEOUT_S. `helm install` or Argo CD/Flux can use
the chart directly (or its self-contained package: `make chart`); this is for CI and for a look
before applying.

Helm: $DIST_HELM, else work/tools/bin/helm (make test installs it), else helm on PATH.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
CHART = HERE / "chart"
REPO = HERE.parent.parent
CELL = "glm53"
RELEASE = "glm53"
VALKEY = "valkey-lmcache"
DEFAULT_NAMESPACE = "vllm"
# The least the startup probe must outlast VLLM_ENGINE_READY_TIMEOUT_S by (the schema's minimum of
# engineStartup.marginSecs): the API server's own start before and after the engine core's.
STARTUP_MARGIN_S = 60
SCHEMA_LINE = re.compile(r"^- at '(?P<path>[^']*)': (?P<why>.+)$", re.MULTILINE)


class RenderError(Exception):
    """Values or configs that would produce a broken cell (Helm's or our own check)."""


def helm_binary() -> str:
    for candidate in (os.environ.get("DIST_HELM"), str(REPO / "work" / "tools" / "bin" / "helm"), shutil.which("helm")):
        if candidate and Path(candidate).is_file():
            return candidate
    raise RenderError("helm not found: set DIST_HELM, run `make test` once (it installs work/tools/bin/helm), "
                      "or put Helm 3.14+/4 on PATH")


def _helm_error(stderr: str) -> str:
    """Helm's error without its prefixes: the message our checks wrote, or the schema's."""
    lines = [line for line in stderr.splitlines()
             if line.strip() and "found symbolic link" not in line and not line.startswith("Use --debug")]
    text = "\n".join(lines)
    if "execution error at" in text:
        return text.split("execution error at", 1)[1].split("): ", 1)[-1].strip()
    # values.schema.json: "- at '/prefill/replicas': minimum: got 0, want 1" -> one line per value
    found = [f"{m['path'].strip('/').replace('/', '.') or 'values'}: {m['why']}" for m in SCHEMA_LINE.finditer(text)]
    if found:
        return "; ".join(found) + " (configs/deploy/chart/values.schema.json)"
    return text.removeprefix("Error: ").strip()


def helm_template(sets: list[str] = (), values: list[Path] = (), namespace: str = DEFAULT_NAMESPACE,
                  chart: Path = CHART, release: str = RELEASE) -> str:
    cmd = [helm_binary(), "template", release, str(chart), "--namespace", namespace]
    for path in values:
        cmd += ["--values", str(path)]
    for assignment in sets:
        cmd += ["--set", assignment]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RenderError(_helm_error(result.stderr))
    return result.stdout


def render(sets: list[str] = (), values: list[Path] = (), namespace: str = DEFAULT_NAMESPACE,
           chart: Path = CHART, release: str = RELEASE) -> list[dict]:
    """All objects of the cell, as Helm renders them, checked."""
    docs = [d for d in yaml.safe_load_all(helm_template(sets, values, namespace, chart, release)) if d]
    check_rendered(docs)
    return docs


def _ranks(vllm_cfg: dict) -> int:
    ranks = 1
    for name in ("pipeline-parallel-size", "prefill-context-parallel-size", "tensor-parallel-size"):
        ranks *= int(vllm_cfg.get(name, vllm_cfg.get(name.replace("-", "_"), 1)))
    return ranks


def check_rendered(docs: list[dict]) -> None:
    """remote_url's {rank} expansions and the shard Services match one to one, and the shard
    StatefulSet has one pod per rank."""
    cms = [d for d in docs if d.get("kind") == "ConfigMap" and "lmcache.yaml" in (d.get("data") or {})]
    if len(cms) != 1:
        raise RenderError(f"expected one ConfigMap with lmcache.yaml, found {len(cms)}")
    lmcache = yaml.safe_load(cms[0]["data"]["lmcache.yaml"])
    ranks = _ranks(yaml.safe_load(cms[0]["data"]["vllm.yaml"]))
    url = lmcache.get("remote_url", "")
    wanted = {url.format(rank=r).split("://", 1)[1].rsplit(":", 1)[0] for r in range(ranks)}
    services = {f"{d['metadata']['name']}.{d['metadata']['namespace']}.svc.cluster.local"
                for d in docs if d.get("kind") == "Service" and d["metadata"]["name"].startswith(f"{VALKEY}-")}
    if wanted != services:
        missing = sorted(wanted - services)
        extra = sorted(services - wanted)
        raise RenderError(
            f"remote_url {url!r} over ranks 0..{ranks - 1} and the rendered Valkey Services differ: "
            f"no Service for {missing or 'none'}; Services no rank reads: {extra or 'none'}"
        )
    shards = [d for d in docs if d.get("kind") == "StatefulSet" and d["metadata"]["name"] == VALKEY]
    if len(shards) != 1 or shards[0]["spec"]["replicas"] != ranks:
        raise RenderError(f"expected one StatefulSet {VALKEY} with {ranks} replicas (one per prefill rank)")
    for name, budget, timeout in startup_budgets(docs):
        if budget < timeout + STARTUP_MARGIN_S:
            raise RenderError(f"{name}: the startup probe gives {budget} s, not more than VLLM_ENGINE_READY_TIMEOUT_S "
                              f"({timeout} s) + {STARTUP_MARGIN_S} s: the kubelet would restart the engine before "
                              "vLLM's own timeout names what it waited for")


def startup_budgets(docs: list[dict]) -> list[tuple[str, int, int]]:
    """(StatefulSet, startup probe periodSeconds x failureThreshold, the container's
    VLLM_ENGINE_READY_TIMEOUT_S or vLLM's default 600) of each engine role, from the rendered objects."""
    found = []
    for doc in docs:
        if doc.get("kind") != "StatefulSet" or doc["metadata"]["name"] == VALKEY:
            continue
        for c in doc["spec"]["template"]["spec"]["containers"]:
            probe = c.get("startupProbe")
            if not probe:
                continue
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            timeout = int(env.get("VLLM_ENGINE_READY_TIMEOUT_S") or 600)
            found.append((doc["metadata"]["name"], probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3),
                          timeout))
    return found


# --------------------------------------------------------------------------
# output


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)

FILES = ["00-cluster.yaml", "01-config.yaml", "10-valkey.yaml", "15-cache-warming.yaml", "20-prefill.yaml",
         "30-decode.yaml", "40-proxy.yaml", "50-monitoring.yaml"]


def dump(docs: list[dict]) -> str:
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)


def split(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {name: [] for name in FILES}
    for doc in docs:
        labels = doc["metadata"].get("labels", {})
        if doc["kind"] == "PriorityClass":
            out["00-cluster.yaml"].append(doc)
        elif doc["apiVersion"].startswith("monitoring.coreos.com/"):
            out["50-monitoring.yaml"].append(doc)
        elif doc["kind"] == "ConfigMap":
            out["01-config.yaml"].append(doc)
        elif labels.get("app.kubernetes.io/name") == VALKEY:
            out["10-valkey.yaml"].append(doc)
        else:
            component = labels.get("app.kubernetes.io/component")
            name = {"prefill": "20-prefill.yaml", "decode": "30-decode.yaml", "pd-proxy": "40-proxy.yaml",
                    "cache-warming": "15-cache-warming.yaml"}[component]
            out[name].append(doc)
    return {name: part for name, part in out.items() if part}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Render the GLM-5.3 P/D cell (Helm chart configs/deploy/chart) "
                                 "and check it.")
    ap.add_argument("-f", "--values", dest="values", action="append", default=[], type=Path,
                    help="a values file over the chart's values.yaml (repeatable)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY.PATH=VALUE",
                    help="one value, Helm's --set syntax, e.g. --set prefill.replicas=2")
    ap.add_argument("-n", "--namespace", default=DEFAULT_NAMESPACE, help="the cell's namespace (default: vllm)")
    ap.add_argument("--release", default=RELEASE, help="the Helm release's name (default: glm53); the PriorityClass "
                    "is named <release>.<namespace>")
    ap.add_argument("--chart", type=Path, default=CHART, help="the chart (default: configs/deploy/chart)")
    ap.add_argument("--configs", type=Path, help="a configs/ folder: render its deploy/chart (whose files/ link "
                    "to its prefill/ and decode/)")
    ap.add_argument("--out", type=Path, help="write one file per component here (default: stdout)")
    args = ap.parse_args(argv)
    try:
        chart = args.configs / "deploy" / "chart" if args.configs is not None else args.chart
        docs = render(args.sets, args.values, args.namespace, chart, args.release)
    except RenderError as e:
        print(f"render: error: {e}", file=sys.stderr)
        return 2
    unpinned = sorted({d["spec"]["template"]["spec"]["containers"][0]["image"] for d in docs
                       if "glm53.io/image-unpinned" in d.get("spec", {}).get("template", {}).get("metadata", {}).get(
                           "annotations", {})})
    for image in unpinned:
        print(f"render: WARNING: image {image} is NOT pinned by digest (allowUnpinnedImage=true): development only",
              file=sys.stderr)
    if args.out is None:
        sys.stdout.write(dump(docs))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, part in split(docs).items():
        (args.out / name).write_text(dump(part))
        print(f"wrote {args.out / name} ({len(part)} objects)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
