"""How the chart's pods start, stop, upgrade and survive disruption: the router's replicas,
disruption budget, spread and PodMonitor, its image of its own; the PriorityClass per release (two
cells render no common object); the decode pod's outage stated where its replicas are set; the
startup probe against VLLM_ENGINE_READY_TIMEOUT_S, read from the rendered objects; tini as PID 1."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.configs.support import CONFIGS, REPO
from tests.configs.test_deploy import _validate_all, no_network  # noqa: F401 (fixture)
from tests.deploy.cell import IMAGE, by, container, render, render_cell, sets

ROUTER_IMAGE = "registry.example/glm53-router@sha256:" + "fedc0987" * 8
VALUES = render.CHART / "values.yaml"


@pytest.fixture(scope="module")
def docs():
    return render_cell()


# --- the router ---------------------------------------------------------------------------------


def test_router_runs_two_replicas_spread_over_nodes_with_a_budget(docs):
    deployment = by(docs, "Deployment", "glm53-pd-proxy")
    spec = deployment["spec"]
    assert spec["replicas"] == 2
    # A rollout brings the new pod up before an old one leaves.
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    pod_labels = spec["template"]["metadata"]["labels"]
    (term,) = spec["template"]["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["weight"] == 100 and term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    selector = term["podAffinityTerm"]["labelSelector"]["matchLabels"]
    assert selector == {"app.kubernetes.io/name": "glm53", "app.kubernetes.io/component": "pd-proxy",
                        "glm53.io/cell": "cell-a"}
    assert all(pod_labels[k] == v for k, v in selector.items())
    pdb = by(docs, "PodDisruptionBudget", "glm53-pd-proxy")["spec"]
    assert pdb["maxUnavailable"] == 1 and pdb["selector"]["matchLabels"] == spec["selector"]["matchLabels"]


def test_router_options_render_valid_objects(no_network):
    """Every new option at once (router replicas, budget and image; a cache claim per pod; no huge
    pages; the cache-warming Job on a claim): still valid objects."""
    rendered = render_cell("router.replicas=3", "router.maxUnavailable=2", f"router.image={ROUTER_IMAGE}",
                           "cache.volume=null", "cache.claimTemplate.size=50Gi",
                           "cache.claimTemplate.accessModes={ReadWriteOncePod}", "hugepages2Mi=null",
                           "cacheWarming.enabled=true", "model.volume.hostPath=null",
                           "model.volume.persistentVolumeClaim.claimName=glm53-weights")
    assert _validate_all(rendered) >= {"Job", "PodDisruptionBudget", "Deployment", "StatefulSet"}
    assert by(rendered, "Deployment", "glm53-pd-proxy")["spec"]["replicas"] == 3
    assert by(rendered, "PodDisruptionBudget", "glm53-pd-proxy")["spec"]["maxUnavailable"] == 2


def _monitors(docs):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodMonitor"}


def test_router_pod_monitor_follows_the_monitoring_switch(docs):
    assert "glm53-pd-proxy" not in _monitors(docs)
    monitored = render_cell("monitoring.podMonitors=true", "monitoring.labels.release=kube-prometheus")
    monitor = _monitors(monitored)["glm53-pd-proxy"]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus"
    deployment = by(monitored, "Deployment", "glm53-pd-proxy")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    ports = {p["name"]: p["containerPort"]
             for c in deployment["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert [e["port"] for e in endpoints] == ["metrics", "metrics-retry"]
    assert [ports[e["port"]] for e in endpoints] == [29000, 29001]   # the routers' --prometheus-port
    alone = _monitors(render_cell("monitoring.podMonitors=true", "router.vllmRouter.prefillRetry.enabled=false"))
    assert [e["port"] for e in alone["glm53-pd-proxy"]["spec"]["podMetricsEndpoints"]] == ["metrics"]
    # The toy proxy exports no metrics.
    assert "glm53-pd-proxy" not in _monitors(render_cell("monitoring.podMonitors=true", "router.kind=toy-proxy"))


def test_router_may_run_an_image_of_its_own(docs):
    for c in by(docs, "Deployment", "glm53-pd-proxy")["spec"]["template"]["spec"]["containers"]:
        assert c["image"] == IMAGE   # the default: the serving image
    rendered = render_cell(f"router.image={ROUTER_IMAGE}", "router.kind=vllm-router")
    routers = by(rendered, "Deployment", "glm53-pd-proxy")["spec"]["template"]["spec"]["containers"]
    assert [c["image"] for c in routers] == [ROUTER_IMAGE, ROUTER_IMAGE]
    assert routers[0]["command"][:5] == ["/usr/bin/tini", "--", "python3", "-m", "vllm_router.launch_router"]
    for role in ("prefill", "decode"):
        assert container(by(rendered, "StatefulSet", f"glm53-{role}"))["image"] == IMAGE


def test_router_image_by_tag_is_refused_unless_unpinned_is_allowed():
    tag = "registry.example/glm53-router:1"
    with pytest.raises(render.RenderError) as err:
        render_cell(f"router.image={tag}")
    assert f'router.image "{tag}" is not pinned by digest' in str(err.value)
    rendered = render_cell(f"router.image={tag}", "allowUnpinnedImage=true")
    assert container(by(rendered, "Deployment", "glm53-pd-proxy"))["image"] == tag


# --- upgrades: the decode pod, the PriorityClass, two cells -------------------------------------


def test_the_decode_outage_is_stated_where_its_replicas_are_set():
    """One decode pod by design: values.yaml says, right above the value, that its restart is an outage."""
    lines = VALUES.read_text().splitlines()
    start = lines.index("decode:")
    replicas = next(i for i in range(start, len(lines)) if lines[i].strip().startswith("replicas:"))
    comment = " ".join(line.strip().lstrip("#") for line in lines[start + 1:replicas])
    assert lines[replicas].strip() == "replicas: 1"
    assert "OUTAGE" in comment and "Upgrading the cell" in comment
    assert "## Upgrading the cell" in (REPO / "docs" / "deploy.md").read_text()


def test_install_notes_name_the_decode_outage(tmp_path):
    env = {"HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "none"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([render.helm_binary(), "install", "glm53", str(render.CHART), "-n", "vllm", "--dry-run=client",
                          *[a for s in sets() for a in ("--set", s)]],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:", 1)[1]
    assert "One decode pod: its restart (rollout, drain, node loss) is an outage" in notes


def _identities(docs):
    """(kind, namespace or None for cluster-scoped, name) of every object."""
    return {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs}


@pytest.mark.parametrize("blue, green", [
    (("glm53", "vllm-blue"), ("glm53", "vllm-green")),    # an upgrade's second cell, same release name
    (("glm53", "vllm"), ("cell-b", "serving")),
])
def test_two_releases_render_no_common_object(blue, green):
    first = render.render(sets(), namespace=blue[1], release=blue[0])
    second = render.render(sets(), namespace=green[1], release=green[0])
    assert not _identities(first) & _identities(second)
    classes = [by(d, "PriorityClass")[0]["metadata"]["name"] for d in (first, second)]
    assert classes == [f"{blue[0]}.{blue[1]}", f"{green[0]}.{green[1]}"]
    for rendered, name in zip((first, second), classes):
        assert {d["spec"]["template"]["spec"]["priorityClassName"]
                for d in rendered if "template" in d.get("spec", {})} == {name}


def test_a_second_cell_may_share_an_existing_priority_class():
    rendered = render_cell("priorityClass.create=false", "priorityClass.name=glm53.vllm-blue")
    assert not [d for d in rendered if d["kind"] == "PriorityClass"]
    for d in rendered:
        if "template" in d.get("spec", {}):
            assert d["spec"]["template"]["spec"]["priorityClassName"] == "glm53.vllm-blue", d["metadata"]["name"]
    with pytest.raises(render.RenderError) as err:
        render_cell("priorityClass.create=false")
    assert "priorityClass.name: with priorityClass.create false, name the existing PriorityClass" in str(err.value)
    with pytest.raises(render.RenderError) as err:
        render_cell("priorityClass.name=Bad_Name")
    assert "priorityClass.name: 'Bad_Name' does not match pattern" in str(err.value)


# --- cold start: the startup probe and VLLM_ENGINE_READY_TIMEOUT_S ---------------------------------


def _budget(docs, role):
    c = container(by(docs, "StatefulSet", f"glm53-{role}"))
    probe = c["startupProbe"]
    timeout = int({e["name"]: e.get("value") for e in c["env"]}["VLLM_ENGINE_READY_TIMEOUT_S"])
    return probe["periodSeconds"] * probe["failureThreshold"], timeout, probe["periodSeconds"]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_startup_probe_outlasts_the_engines_ready_timeout(docs, role):
    """Read from the rendered objects: the probe's budget covers the timeout the container gets plus
    a margin, so vLLM's own timeout (which names what it waited for) fires first, and by no more
    than one period past engineStartup.marginSecs."""
    budget, timeout, period = _budget(docs, role)
    margin = yaml.safe_load(VALUES.read_text())["engineStartup"]["marginSecs"]
    assert timeout == 1800
    assert budget >= timeout + margin >= timeout + render.STARTUP_MARGIN_S
    assert budget - period < timeout + margin
    assert (budget, period) == (2400, 15)


def _configs_copy(tmp_path):
    copy = tmp_path / "configs"
    shutil.copytree(CONFIGS, copy, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_startup_probe_follows_the_env_files_timeout(tmp_path):
    configs = _configs_copy(tmp_path)
    env = configs / "decode" / "env"
    env.write_text(env.read_text().replace("VLLM_ENGINE_READY_TIMEOUT_S=1800", "VLLM_ENGINE_READY_TIMEOUT_S=3000"))
    rendered = render_cell("engineStartup.probePeriodSecs=20", chart=configs / "deploy" / "chart")
    assert _budget(rendered, "decode") == (3600, 3000, 20)   # (3000 + 600) / 20 periods
    assert _budget(rendered, "prefill") == (2400, 1800, 20)
    env.write_text(env.read_text().replace("VLLM_ENGINE_READY_TIMEOUT_S=3000", "VLLM_ENGINE_READY_TIMEOUT_S=30m"))
    with pytest.raises(render.RenderError) as err:
        render_cell(chart=configs / "deploy" / "chart")
    assert "configs/decode/env: VLLM_ENGINE_READY_TIMEOUT_S=30m: expected whole seconds" in str(err.value)


def test_an_env_file_without_the_timeout_gets_vllms_default(tmp_path):
    configs = _configs_copy(tmp_path)
    env = configs / "prefill" / "env"
    env.write_text("\n".join(line for line in env.read_text().splitlines()
                             if not line.startswith("VLLM_ENGINE_READY_TIMEOUT_S=")) + "\n")
    c = container(by(render_cell(chart=configs / "deploy" / "chart"), "StatefulSet", "glm53-prefill"))
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] == 600 + 600


def test_check_rendered_refuses_a_probe_shorter_than_the_timeout(docs):
    tampered = list(yaml.safe_load_all(render.dump(docs)))
    container(by(tampered, "StatefulSet", "glm53-decode"))["startupProbe"]["failureThreshold"] = 120   # 1800 s
    with pytest.raises(render.RenderError) as err:
        render.check_rendered(tampered)
    assert "glm53-decode: the startup probe gives 1800 s" in str(err.value)


def test_margin_below_a_minute_is_refused():
    with pytest.raises(render.RenderError) as err:
        render_cell("engineStartup.marginSecs=10")
    assert "engineStartup.marginSecs: minimum: got 10, want 60" in str(err.value)


# --- tini as PID 1 ------------------------------------------------------------------------------


def _entrypoint():
    line = next(line for line in (REPO / "Dockerfile").read_text().splitlines() if line.startswith("ENTRYPOINT "))
    return json.loads(line[len("ENTRYPOINT "):])


def _image_entrypoint_plan():
    sys.path.insert(0, str(REPO / "image"))
    try:
        from imagectl import entrypoint
    finally:
        sys.path.pop(0)
    return entrypoint.plan


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engines_run_under_the_images_tini(docs, role):
    """No `command` on the engine containers: the image's ENTRYPOINT runs, tini first (PID 1: it
    reaps vLLM's children and passes SIGTERM on), then the image's entrypoint, which execs the
    rendered arguments unchanged."""
    assert _entrypoint()[:2] == ["/usr/bin/tini", "--"]
    spec = by(docs, "StatefulSet", f"glm53-{role}")["spec"]["template"]["spec"]
    plan = _image_entrypoint_plan()
    for c in [*spec["initContainers"], *spec["containers"]]:
        assert "command" not in c, c["name"]
    engine = spec["containers"][0]
    chosen = plan(engine["args"], {}, home=REPO, config_root=CONFIGS)
    assert chosen.argv == engine["args"] and chosen.env == {} and chosen.preflight is None
    assert not getattr(chosen, "follow", False)   # exec'd: no process of the entrypoint's stays between


@pytest.mark.parametrize("values", [(), ("router.kind=toy-proxy",)])
def test_the_routers_run_under_the_images_tini(values):
    """The router containers set their command (a program of the image, not its entrypoint): it starts
    with the ENTRYPOINT's tini, so the router is not PID 1."""
    tini = _entrypoint()[:2]
    pod = by(render_cell(*values), "Deployment", "glm53-pd-proxy")["spec"]["template"]["spec"]
    for c in pod["containers"]:
        assert c["command"][:2] == tini, (c["name"], c["command"][:4])
        assert c["command"][2] == "python3", c["name"]


def test_the_cache_warming_job_runs_under_the_images_tini():
    rendered = render_cell("cacheWarming.enabled=true", "model.volume.hostPath=null",
                           "model.volume.persistentVolumeClaim.claimName=glm53-weights")
    c = container(by(rendered, "Job")[0])
    assert "command" not in c
    assert _image_entrypoint_plan()(c["args"], {}, home=REPO, config_root=CONFIGS).argv == c["args"]


def test_values_and_schema_name_the_same_keys():
    """Every value in values.yaml is in the schema, and every schema property of a top-level
    section is in values.yaml (documented where it is set)."""
    values = yaml.safe_load(VALUES.read_text())
    schema = json.loads((render.CHART / "values.schema.json").read_text())
    assert set(values) <= set(schema["properties"])
    for key in ("cache", "router", "engineStartup", "cacheWarming", "priorityClass"):
        props = set(schema["properties"][key]["properties"])
        assert props == set(values[key]), key
    lines = VALUES.read_text().splitlines()
    for key in ("hugepages2Mi", "engineStartup", "cacheWarming"):
        line = lines.index(next(line for line in lines if line.startswith(f"{key}:")))
        assert lines[line - 1].startswith("#"), f"{key}: no comment above it"


# --- a development image -------------------------------------------------------------------------


def test_a_development_image_starts_only_with_the_download_accepted(docs):
    """flashinferDownloadAtFirstUse passes GLM53_FLASHINFER_DOWNLOAD=1 to the preflight and the
    engine (the preflight then asks FlashInfer's store); by default neither has it, so a
    development image's preflight fails the pod instead of the first fused-MoE call."""
    def download_env(rendered, role: str) -> dict[str, str]:
        pod = by(rendered, "StatefulSet", f"glm53-{role}")["spec"]["template"]["spec"]
        return {c["name"]: next((e["value"] for e in c["env"] if e["name"] == "GLM53_FLASHINFER_DOWNLOAD"), None)
                for c in pod["initContainers"] + pod["containers"]}

    for role in ("prefill", "decode"):
        assert download_env(docs, role) == {"preflight": None, "vllm": None}
    accepted = render_cell("flashinferDownloadAtFirstUse=true")
    for role in ("prefill", "decode"):
        assert download_env(accepted, role) == {"preflight": "1", "vllm": "1"}
