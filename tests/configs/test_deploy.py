"""The Kubernetes deployment of the P/D cell: the Helm chart configs/deploy/chart rendered by the
real Helm (configs/deploy/render.py wraps `helm template` and checks the output), offline
schema validation, shard/remote_url consistency, the invariants the chart refuses to break.
The shards' arguments, auth and probes on real Valkey: tests/deploy/test_valkey_shard.py."""
from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys

import pytest
import yaml

from tests.configs.support import CONFIGS, DEPLOY
from tests.deploy.cell import IMAGE, VALKEY_IMAGE, by, container, render, render_cell, sets

# Kubernetes version the manifests are validated against (EKS/kubeadm 1.34);
# kubernetes-validate 1.37.0 ships schemas for 1.25 .. 1.37 inside the package.
K8S_VERSION = "1.34.0"
ENGINE_KINDS = {"ConfigMap", "Service", "Deployment", "StatefulSet", "NetworkPolicy", "PodDisruptionBudget",
                "PriorityClass", "ServiceAccount", "Role", "RoleBinding"}


@pytest.fixture(scope="module")
def docs():
    return render_cell()


def test_helm_is_the_real_one():
    """The renderer runs Helm itself (make test installs it; no stand-in)."""
    out = subprocess.run([render.helm_binary(), "version", "--short"], capture_output=True, text=True, check=True)
    assert re.match(r"v[34]\.\d+\.\d+", out.stdout), out.stdout


# --- offline schema validation ----------------------------------------------------------------


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt fails the test: validation must be offline."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access during validation: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def _validate_all(docs):
    import kubernetes_validate

    kinds = set()
    for doc in docs:
        # Through YAML and back, as kubectl would read the rendered files.
        doc = yaml.safe_load(render.dump([doc]))
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        kinds.add(doc["kind"])
    return kinds


def test_rendered_manifests_validate_offline(docs, no_network):
    assert _validate_all(docs) == ENGINE_KINDS


def test_every_option_renders_valid_manifests(no_network):
    """Exporter sidecar, UCX without the node's libfabric, a PVC cache: still valid objects
    (the Prometheus Operator's kinds are checked in tests/deploy/test_alerts.py)."""
    rendered = render_cell("monitoring.valkeyExporter.enabled=true", f"monitoring.valkeyExporter.image={VALKEY_IMAGE}",
                           "cell.nodeLabel=", "priorityClass.create=false", "priorityClass.name=shared-gpu-serving")
    assert _validate_all(rendered) == ENGINE_KINDS - {"PriorityClass"}
    assert container(by(rendered, "StatefulSet", "valkey-lmcache"), "exporter")["ports"][0]["containerPort"] == 9121


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["spec"].__setitem__("replicas", "four"), "replicas"),
    (lambda d: d["spec"]["template"]["spec"].__setitem__("nodeSelectr", {}), "nodeSelectr"),
    (lambda d: container(d)["resources"].__setitem__("limit", {}), "limit"),
])
def test_validation_catches_a_broken_manifest(docs, no_network, mutate, field):
    """The validator is not a rubber stamp: a wrong type or an unknown field fails."""
    import kubernetes_validate

    doc = yaml.safe_load(render.dump([by(docs, "StatefulSet", "glm53-prefill")]))
    mutate(doc)
    with pytest.raises(kubernetes_validate.ValidationError) as err:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert field in str(err.value)


# --- the Valkey tier ----------------------------------------------------------------------------


def test_one_statefulset_pod_and_service_per_shard(docs):
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"
                and d["metadata"]["name"].startswith("valkey-lmcache-")}
    assert services == {f"valkey-lmcache-{i}" for i in range(8)}
    sts = by(docs, "StatefulSet", "valkey-lmcache")
    assert sts["spec"]["replicas"] == 8
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    for i in range(8):
        selector = by(docs, "Service", f"valkey-lmcache-{i}")["spec"]["selector"]
        # The StatefulSet controller labels pod i with statefulset.kubernetes.io/pod-name.
        assert selector == {"app.kubernetes.io/name": "valkey-lmcache",
                            "statefulset.kubernetes.io/pod-name": f"valkey-lmcache-{i}"}
        assert all(pod_labels[k] == v for k, v in selector.items() if k != "statefulset.kubernetes.io/pod-name")
    assert by(docs, "Service", "valkey-lmcache")["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == "valkey-lmcache"


def test_shards_roll_one_at_a_time_and_one_may_be_drained(docs):
    sts = by(docs, "StatefulSet", "valkey-lmcache")["spec"]
    assert sts["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}}
    assert sts["minReadySeconds"] == 30
    pdb = by(docs, "PodDisruptionBudget", "valkey-lmcache")["spec"]
    assert pdb["maxUnavailable"] == 1
    assert pdb["selector"]["matchLabels"] == sts["selector"]["matchLabels"]


def test_shards_spread_across_the_cells_nodes(docs):
    spec = by(docs, "StatefulSet", "valkey-lmcache")["spec"]["template"]["spec"]
    (spread,) = spec["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["maxSkew"] == 1
    assert spread["whenUnsatisfiable"] == "DoNotSchedule"
    assert spread["nodeAffinityPolicy"] == "Honor"
    assert spread["labelSelector"]["matchLabels"] == {"app.kubernetes.io/name": "valkey-lmcache",
                                                      "glm53.io/cell": "cell-a"}
    # Only the cell's nodes are eligible, so only they count in the skew.
    assert spec["nodeSelector"] == {"node.kubernetes.io/instance-type": "p6-b300.48xlarge", "glm53.io/cell": "cell-a"}
    anti = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    for role in ("prefill", "decode"):
        assert (by(docs, "StatefulSet", f"glm53-{role}")["spec"]["template"]["spec"]["nodeSelector"]["glm53.io/cell"]
                == "cell-a")


def test_valkey_runs_without_root_and_with_a_password_from_a_secret(docs):
    pod = by(docs, "StatefulSet", "valkey-lmcache")["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 999, "runAsGroup": 999, "fsGroup": 999,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    c = container(by(docs, "StatefulSet", "valkey-lmcache"), "valkey")
    assert c["image"] == VALKEY_IMAGE
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/run/valkey", "/data"}
    # The password reaches Valkey through a file in memory, never through its arguments.
    assert not any("requirepass" in a for a in c["args"]) and "requirepass" in c["command"][2]
    assert c["args"][c["args"].index("--protected-mode") + 1] == "yes"
    (auth,) = [e for e in c["env"] if e["name"] == "REDISCLI_AUTH"]
    prefill_env = {e["name"]: e for e in container(by(docs, "StatefulSet", "glm53-prefill"))["env"]}
    # The same Secret and key for the shards' requirepass and LMCache's client.
    assert prefill_env["LMCACHE_RESP_PASSWORD"]["valueFrom"] == auth["valueFrom"] == {
        "secretKeyRef": {"name": "glm53-valkey-auth", "key": "password"}}
    for probe in ("readinessProbe", "livenessProbe"):
        assert "valkey-cli -p 6379 ping" in " ".join(c[probe]["exec"]["command"])


def test_valkey_reachable_only_from_prefill(docs):
    policy = by(docs, "NetworkPolicy", "valkey-lmcache")
    sources = policy["spec"]["ingress"][0]["from"]
    assert {"app.kubernetes.io/name": "glm53", "app.kubernetes.io/component": "prefill"} in [
        s["podSelector"]["matchLabels"] for s in sources]
    prefill_labels = by(docs, "StatefulSet", "glm53-prefill")["spec"]["template"]["metadata"]["labels"]
    assert all(prefill_labels[k] == v for k, v in sources[0]["podSelector"]["matchLabels"].items())
    assert len(policy["spec"]["ingress"]) == 1  # no exporter port unless the exporter is on


def test_valkey_memory_limit_covers_maxmemory(docs):
    c = container(by(docs, "StatefulSet", "valkey-lmcache"), "valkey")
    assert c["resources"]["limits"]["memory"] == "180Gi"  # > 150 GiB maxmemory
    assert c["args"][c["args"].index("--maxmemory") + 1] == "150gb"


# --- disruption and priority --------------------------------------------------------------------


def test_engines_have_disruption_budgets_and_every_pod_a_priority(docs):
    for kind, name, budget in (("StatefulSet", "glm53-prefill", 1), ("StatefulSet", "glm53-decode", 1),
                               ("Deployment", "glm53-pd-proxy", 1)):
        pdb = by(docs, "PodDisruptionBudget", name)["spec"]
        assert pdb["maxUnavailable"] == budget
        assert pdb["selector"]["matchLabels"] == by(docs, kind, name)["spec"]["selector"]["matchLabels"]
    pc = by(docs, "PriorityClass", "glm53.vllm")   # <release>.<namespace>: cluster-scoped, one per cell
    assert pc["value"] == 1000000 and pc["globalDefault"] is False
    for doc in docs:
        if doc["kind"] in ("StatefulSet", "Deployment"):
            assert doc["spec"]["template"]["spec"]["priorityClassName"] == "glm53.vllm", doc["metadata"]["name"]


# --- shard count and {rank}: consistent by construction, checked ------------------------------


def test_remote_url_addresses_the_rendered_services(docs):
    cm = by(docs, "ConfigMap", "glm53-prefill-config")
    url = yaml.safe_load(cm["data"]["lmcache.yaml"])["remote_url"]
    assert url == "resp://valkey-lmcache-{rank}.vllm.svc.cluster.local:6379"
    for rank in range(8):
        host = url.format(rank=rank).split("//")[1].split(":")[0]
        name, namespace = host.split(".")[:2]
        assert by(docs, "Service", name)["metadata"]["namespace"] == namespace


def test_namespace_follows_into_remote_url():
    docs = render_cell(namespace="glm-prod")
    url = yaml.safe_load(by(docs, "ConfigMap", "glm53-prefill-config")["data"]["lmcache.yaml"])["remote_url"]
    assert url == "resp://valkey-lmcache-{rank}.glm-prod.svc.cluster.local:6379"
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "PriorityClass"} == {"glm-prod"}
    # Only the URL changed in the shipped LMCache file.
    original = (CONFIGS / "prefill" / "lmcache.yaml").read_text()
    rendered = by(docs, "ConfigMap", "glm53-prefill-config")["data"]["lmcache.yaml"]
    assert rendered == original.replace(".vllm.svc", ".glm-prod.svc")


def test_default_cell_leaves_the_key_epoch_to_the_image(docs):
    """kvKeyEpoch "" writes nothing: the image's entrypoint gives LMCache the image's own epoch."""
    rendered = by(docs, "ConfigMap", "glm53-prefill-config")["data"]["lmcache.yaml"]
    assert "kv_key_epoch" not in yaml.safe_load(rendered)


@pytest.mark.lmcache
@pytest.mark.parametrize("value, epoch", [("shared-2026.1", "shared-2026.1"), ("3f9a07c2e1d4", "3f9a07c2e1d4"),
                                          ("2026", "2026"), ("none", "")])
def test_key_epoch_goes_into_the_prefill_lmcache_config(validate, tmp_path, value, epoch):
    """A chosen epoch (or none: no epoch) in the ConfigMap's lmcache.yaml, the file LMCache and the
    entrypoint read; the rest of the file is the shipped one, and LMCache's own loader accepts it."""
    docs = render_cell(f"kvKeyEpoch={value}")
    rendered = by(docs, "ConfigMap", "glm53-prefill-config")["data"]["lmcache.yaml"]
    assert yaml.safe_load(rendered)["kv_key_epoch"] == epoch
    assert rendered.startswith((CONFIGS / "prefill" / "lmcache.yaml").read_text().rstrip("\n"))
    path = tmp_path / "lmcache.yaml"
    path.write_text(rendered)
    loaded = validate.check_lmcache_file(path, CONFIGS / "prefill" / "env")
    assert loaded.kv_key_epoch == epoch
    # A new epoch changes the config's hash, so the prefill pods roll onto it.
    annotation = "glm53.io/config-sha256"
    sha = by(docs, "StatefulSet", "glm53-prefill")["spec"]["template"]["metadata"]["annotations"][annotation]
    default = by(render_cell(), "StatefulSet", "glm53-prefill")["spec"]["template"]["metadata"]["annotations"]
    assert sha != default[annotation]


@pytest.mark.parametrize("value", ["cell@a", "builds/3f9a", "-3f9a", "x" * 65])
def test_a_key_epoch_a_chunk_key_cannot_carry_is_refused_naming_it(value):
    with pytest.raises(render.RenderError) as err:
        render_cell(f"kvKeyEpoch={value}")
    assert f'kvKeyEpoch "{value}" cannot be part of a chunk key' in str(err.value)


def test_key_epoch_set_in_the_chart_and_in_lmcache_yaml_is_refused(tmp_path):
    configs = _configs_copy(tmp_path)
    lm = configs / "prefill" / "lmcache.yaml"
    lm.write_text(lm.read_text() + "kv_key_epoch: cell-a\n")
    # Set in the file alone, the file's stays (the entrypoint leaves it too).
    rendered = by(render_cell(chart=_chart(configs)), "ConfigMap", "glm53-prefill-config")["data"]["lmcache.yaml"]
    assert yaml.safe_load(rendered)["kv_key_epoch"] == "cell-a"
    with pytest.raises(render.RenderError) as err:
        render_cell("kvKeyEpoch=cell-b", chart=_chart(configs))
    assert 'kvKeyEpoch "cell-b": configs/prefill/lmcache.yaml sets kv_key_epoch already (cell-a)' in str(err.value)


@pytest.mark.parametrize("shards", [4, 16])
def test_shard_count_other_than_prefill_ranks_is_refused(shards):
    with pytest.raises(render.RenderError) as err:
        render_cell(f"valkeySpec.shards={shards}")
    message = str(err.value)
    assert f"valkeySpec.shards={shards}" in message and "8 ranks" in message
    assert "prefill-context-parallel-size 8" in message


def test_explicit_matching_shard_count_is_fine():
    assert len(render_cell("valkeySpec.shards=8")) == len(render_cell())


def _configs_copy(tmp_path):
    """configs/ with the chart, whose files/ links then point at the copy's engine configs."""
    copy = tmp_path / "configs"
    shutil.copytree(CONFIGS, copy, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    assert (copy / "deploy" / "chart" / "files" / "prefill").resolve() == (copy / "prefill").resolve()
    return copy


def _chart(configs):
    return configs / "deploy" / "chart"


def test_shards_follow_the_prefill_ranks(tmp_path):
    configs = _configs_copy(tmp_path)
    vllm_yaml = configs / "prefill" / "vllm.yaml"
    vllm_yaml.write_text(vllm_yaml.read_text().replace("prefill-context-parallel-size: 8",
                                                       "prefill-context-parallel-size: 4"))
    docs = render_cell(chart=_chart(configs))
    shards = sorted(d["metadata"]["name"] for d in docs if d["kind"] == "Service"
                    and d["metadata"]["name"].startswith("valkey-lmcache-"))
    assert shards == [f"valkey-lmcache-{i}" for i in range(4)]
    assert by(docs, "StatefulSet", "valkey-lmcache")["spec"]["replicas"] == 4
    limits = container(by(docs, "StatefulSet", "glm53-prefill"))["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 4


@pytest.mark.parametrize("url", [
    "resp://valkey-lmcache-0.vllm.svc.cluster.local:6379",  # no {rank}: every rank on shard 0
    "resp://valkey-{rank}.vllm.svc.cluster.local:6379",  # not the rendered Service names
    "resp://valkey-lmcache-{rank}.vllm.svc.cluster.local:6380",  # not the Service port
])
def test_remote_url_that_misses_the_shards_is_refused(tmp_path, url):
    configs = _configs_copy(tmp_path)
    lm = configs / "prefill" / "lmcache.yaml"
    lm.write_text(lm.read_text().replace("resp://valkey-lmcache-{rank}.vllm.svc.cluster.local:6379", url))
    with pytest.raises(render.RenderError) as err:
        render_cell(chart=_chart(configs))
    assert "remote_url" in str(err.value) and "valkey-lmcache-<rank>" in str(err.value)
    assert url in str(err.value)


def test_check_rendered_catches_a_missing_shard(docs):
    tampered = [d for d in docs if not (d["kind"] == "Service" and d["metadata"]["name"] == "valkey-lmcache-5")]
    with pytest.raises(render.RenderError) as err:
        render.check_rendered(tampered)
    assert "valkey-lmcache-5.vllm.svc.cluster.local" in str(err.value)


def test_check_rendered_catches_a_short_shard_statefulset(docs):
    tampered = list(yaml.safe_load_all(render.dump(docs)))
    by(tampered, "StatefulSet", "valkey-lmcache")["spec"]["replicas"] = 7
    with pytest.raises(render.RenderError) as err:
        render.check_rendered(tampered)
    assert "with 8 replicas" in str(err.value)


# --- engines and proxy --------------------------------------------------------------------------


@pytest.mark.parametrize("role, gpus, memory", [("prefill", 8, "1024Gi"), ("decode", 8, "512Gi")])
def test_gpu_pods(docs, role, gpus, memory):
    sts = by(docs, "StatefulSet", f"glm53-{role}")
    c = container(sts)
    assert c["image"] == IMAGE
    assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert c["resources"]["limits"]["vpc.amazonaws.com/efa"] == 16
    assert c["resources"]["limits"]["memory"] == memory  # prefill: 768 GiB L1 (pcp_shard_store) + 256 GiB
    assert "command" not in c   # the image's ENTRYPOINT (tini first): tests/configs/test_chart_lifecycle.py
    assert c["args"][4:] == ["vllm", "serve", "/models/GLM-5.3-FP8", "--config", f"/etc/glm53/{role}/vllm.yaml",
                             "--shutdown-timeout", "120"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    spec = sts["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    env = {e["name"]: e for e in c["env"]}
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # Non-root, no added capabilities (IPC_LOCK would not reach uid 1000's effective set).
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 1000
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                    "readOnlyRootFilesystem": True}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engines_write_only_to_their_volumes(docs, role):
    """A read-only root (the preflight too): /tmp and the image's HOME are emptyDirs, beside /cache,
    /dev/shm and the metrics folder; nothing else the engine can write."""
    spec = by(docs, "StatefulSet", f"glm53-{role}")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["tmp"]["emptyDir"] == {"sizeLimit": "16Gi"} and volumes["home"]["emptyDir"] == {"sizeLimit": "1Gi"}
    for c in [*spec["containers"], *spec.get("initContainers", [])]:
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, c["name"]
        writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
        assert writable == {"/tmp", "/home/serve", "/cache", "/dev/shm", "/run/glm53-prometheus"}, c["name"]
    assert {c["name"] for c in spec["initContainers"]} == {"preflight"}


def test_engine_root_may_be_writable_again():
    docs = render_cell("engineFiles.readOnlyRoot=false", "engineFiles.tmpSize=64Gi")
    spec = by(docs, "StatefulSet", "glm53-prefill")["spec"]["template"]["spec"]
    assert spec["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is False
    assert {v["name"]: v for v in spec["volumes"]}["tmp"]["emptyDir"] == {"sizeLimit": "64Gi"}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_every_engine_pod_keeps_its_compile_caches_at_slash_cache(docs, role):
    sts = by(docs, "StatefulSet", f"glm53-{role}")
    c = container(sts)
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["cache"] == {"name": "cache", "hostPath": {"path": "/var/cache/glm53", "type": "DirectoryOrCreate"}}
    assert {"name": "cache", "mountPath": "/cache"} in c["volumeMounts"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["VLLM_CACHE_ROOT"] == "/cache/vllm" and env["TORCHINDUCTOR_CACHE_DIR"] == "/cache/inductor"
    assert env["TRITON_CACHE_DIR"] == "/cache/triton" and env["FLASHINFER_WORKSPACE_BASE"] == "/cache"
    assert env["XDG_CACHE_HOME"] == "/cache"


def test_cache_volume_may_be_a_claim():
    docs = render_cell("cache.volume.hostPath=null", "cache.volume.persistentVolumeClaim.claimName=glm53-cache")
    volumes = {v["name"]: v for v in by(docs, "StatefulSet", "glm53-decode")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["cache"] == {"name": "cache", "persistentVolumeClaim": {"claimName": "glm53-cache"}}


def test_prefill_env_mounts_the_lmcache_config_it_names(docs):
    sts = by(docs, "StatefulSet", "glm53-prefill")
    c = container(sts)
    env = {e["name"]: e.get("value") for e in c["env"]}
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    assert env["LMCACHE_CONFIG_FILE"] == f"{mount['mountPath']}/lmcache.yaml"
    cm = by(docs, "ConfigMap", sts["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"])
    assert set(cm["data"]) == {"vllm.yaml", "lmcache.yaml"}
    for name in ("vllm.yaml",):
        assert cm["data"][name] == (CONFIGS / "prefill" / name).read_text()
    assert by(docs, "ConfigMap", "glm53-decode-config")["data"] == {
        "vllm.yaml": (CONFIGS / "decode" / "vllm.yaml").read_text()}


def _args(cmd, flag):
    """The values after ``flag`` up to the next --flag."""
    start = cmd.index(flag) + 1
    end = next((i for i in range(start, len(cmd)) if cmd[i].startswith("--")), len(cmd))
    return cmd[start:end]


def test_router_is_vllm_router_finding_the_cells_pods(docs):
    from tests.deploy import test_router

    deployment = by(docs, "Deployment", "glm53-pd-proxy")
    pod = deployment["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["proxy", "prefill-retry"]
    c, retry = container(deployment), container(deployment, "prefill-retry")
    cmd, retry_cmd = c["command"], retry["command"]
    assert cmd[:5] == retry_cmd[:5] == ["/usr/bin/tini", "--", "python3", "-m", "vllm_router.launch_router"]
    assert "--vllm-pd-disaggregation" in cmd and _args(cmd, "--kv-connector") == ["nixl"]
    assert "--vllm-pd-disaggregation" not in retry_cmd  # regular mode: the one with retries
    assert _args(cmd, "--host") == ["0.0.0.0"] and _args(cmd, "--port") == ["8000"]
    assert _args(retry_cmd, "--port") == ["8100"]
    # Kubernetes discovery in this namespace only (a Role, not a ClusterRole), the engines' port:
    # the P/D router watches the decode pods, the prefill-retry router the prefill pods.
    for command in (cmd, retry_cmd):
        assert "--service-discovery" in command and _args(command, "--service-discovery-namespace") == ["vllm"]
        assert _args(command, "--service-discovery-port") == ["8000"]
    for role, command, flag in (("prefill", retry_cmd, "--selector"), ("decode", cmd, "--decode-selector")):
        selector = dict(term.split("=", 1) for term in _args(command, flag))
        labels = by(docs, "StatefulSet", f"glm53-{role}")["spec"]["template"]["metadata"]["labels"]
        assert selector == {"app.kubernetes.io/name": "glm53", "app.kubernetes.io/component": role,
                            "glm53.io/cell": "cell-a"}
        assert all(labels[k] == v for k, v in selector.items())
    assert "--prefill-selector" not in cmd
    # Every prefill goes to the retry router beside it, which routes by prefix and retries.
    assert _args(cmd, "--prefill") == ["http://127.0.0.1:8100"] and _args(cmd, "--prefill-policy") == ["round_robin"]
    assert _args(retry_cmd, "--policy") == [test_router.PREFILL_POLICY] == ["cache_aware"]
    assert _args(retry_cmd, "--retry-max-retries") == ["3"] and _args(retry_cmd, "--cb-failure-threshold") == ["1"]
    assert _args(retry_cmd, "--cb-timeout-duration-secs") == ["5"]
    # Its /health (what the P/D router probes) is 503 while any worker is unhealthy: it never marks one.
    assert _args(retry_cmd, "--health-failure-threshold") == [str(2**32 - 1)]
    assert _args(cmd, "--decode-policy") == ["power_of_two"]
    # The health flags the router test measured the failure window with (tests/deploy/test_router.py).
    assert _args(cmd, "--health-check-endpoint") == ["/health"]
    assert _args(cmd, "--health-check-interval-secs") == [str(test_router.HEALTH_INTERVAL_S)]
    assert _args(cmd, "--health-failure-threshold") == [str(test_router.HEALTH_FAILURE_THRESHOLD)]
    assert _args(cmd, "--health-success-threshold") == [str(test_router.HEALTH_SUCCESS_THRESHOLD)]
    assert _args(cmd, "--health-check-timeout-secs") == [str(test_router.HEALTH_TIMEOUT_S)]
    for probe_of in (c, retry):
        assert probe_of["readinessProbe"]["httpGet"]["path"] == "/readiness"
        assert probe_of["livenessProbe"]["httpGet"]["path"] == "/liveness"
        assert probe_of["image"] == IMAGE
        assert probe_of["securityContext"]["readOnlyRootFilesystem"] is True
    assert retry["readinessProbe"]["httpGet"]["port"] == "prefill-retry"
    # The pod watch needs the API: a token for its ServiceAccount, bound to get/list/watch pods.
    assert pod["serviceAccountName"] == "glm53-pd-proxy" and pod["automountServiceAccountToken"] is True
    role = by(docs, "Role", "glm53-pd-proxy")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = by(docs, "RoleBinding", "glm53-pd-proxy")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "glm53-pd-proxy"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "glm53-pd-proxy", "namespace": "vllm"}]
    assert by(docs, "ServiceAccount", "glm53-pd-proxy")["metadata"]["namespace"] == "vllm"


def test_router_without_prefill_retry_is_the_pd_router_alone():
    deployment = by(render_cell("router.vllmRouter.prefillRetry.enabled=false"), "Deployment", "glm53-pd-proxy")
    assert [c["name"] for c in deployment["spec"]["template"]["spec"]["containers"]] == ["proxy"]
    cmd = container(deployment)["command"]
    assert "--prefill" not in cmd and _args(cmd, "--prefill-policy") == ["cache_aware"]
    assert dict(term.split("=", 1)
                for term in _args(cmd, "--prefill-selector"))["app.kubernetes.io/component"] == "prefill"


def test_router_extra_args_and_policies_come_from_values():
    docs = render_cell("router.vllmRouter.prefillPolicy=round_robin", "router.vllmRouter.extraArgs={--log-level,debug}",
                       "router.vllmRouter.health.intervalSecs=5", "router.vllmRouter.prefillRetry.maxRetries=5",
                       "router.vllmRouter.prefillRetry.port=8200")
    deployment = by(docs, "Deployment", "glm53-pd-proxy")
    cmd, retry_cmd = container(deployment)["command"], container(deployment, "prefill-retry")["command"]
    assert _args(retry_cmd, "--policy") == ["round_robin"] and cmd[-2:] == ["--log-level", "debug"]
    assert _args(cmd, "--health-check-interval-secs") == _args(retry_cmd, "--health-check-interval-secs") == ["5"]
    assert _args(retry_cmd, "--retry-max-retries") == ["5"] and _args(retry_cmd, "--port") == ["8200"]
    assert _args(cmd, "--prefill") == ["http://127.0.0.1:8200"]
    with pytest.raises(render.RenderError) as err:
        render_cell("router.vllmRouter.prefillRetry.port=8000")  # the P/D router's own port
    assert "prefillRetry" in str(err.value)
    with pytest.raises(render.RenderError) as err:
        render_cell("router.kind=nginx")
    assert "router.kind" in str(err.value)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engines_leave_the_router_then_drain_on_a_planned_stop(docs, role):
    pod = by(docs, "StatefulSet", f"glm53-{role}")["spec"]["template"]["spec"]
    c = container(by(docs, "StatefulSet", f"glm53-{role}"))
    assert c["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "10"]}}}
    assert _args(c["args"], "--shutdown-timeout") == ["120"]  # vLLM's default 0 aborts in-flight requests
    assert pod["terminationGracePeriodSeconds"] == 10 + 120 + 30


def test_toy_proxy_pairs_every_prefill_and_decode_pod(no_network):
    docs = render_cell("router.kind=toy-proxy")
    assert _validate_all(docs) == ENGINE_KINDS - {"ServiceAccount", "Role", "RoleBinding"}
    deployment = by(docs, "Deployment", "glm53-pd-proxy")
    c = container(deployment)
    cmd = c["command"]
    assert cmd[:4] == ["/usr/bin/tini", "--", "python3", "/opt/glm53/pd-proxy/toy_proxy_server.py"]
    hosts = cmd[cmd.index("--prefiller-hosts") + 1:cmd.index("--prefiller-ports")]
    assert hosts == [f"glm53-prefill-{i}.glm53-prefill.vllm.svc.cluster.local" for i in range(4)]
    assert cmd[cmd.index("--prefiller-ports") + 1:cmd.index("--decoder-hosts")] == ["8000"] * 4
    decoders = cmd[cmd.index("--decoder-hosts") + 1:cmd.index("--decoder-ports")]
    assert decoders == ["glm53-decode-0.glm53-decode.vllm.svc.cluster.local"]
    assert cmd[cmd.index("--decoder-ports") + 1:] == ["8000"]
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"  # the proxy's default is loopback
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthcheck"
    assert deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert c["image"] == IMAGE
    assert by(docs, "Service", "glm53-prefill")["spec"]["clusterIP"] == "None"


def test_config_change_rolls_the_pods(tmp_path):
    before = render_cell()
    configs = _configs_copy(tmp_path)
    lm = configs / "prefill" / "lmcache.yaml"
    lm.write_text(lm.read_text().replace("lookup_timeout_ms: 4000", "lookup_timeout_ms: 5000"))
    after = render_cell(chart=_chart(configs))

    def sha(docs, role):
        return by(docs, "StatefulSet", f"glm53-{role}")["spec"]["template"]["metadata"]["annotations"][
            "glm53.io/config-sha256"]

    assert sha(before, "prefill") != sha(after, "prefill")
    assert sha(before, "decode") == sha(after, "decode")


# --- digest discipline -------------------------------------------------------------------------


def test_one_image_by_digest_for_prefill_and_decode(docs):
    assert all("glm53.io/image-unpinned" not in d["spec"]["template"]["metadata"].get("annotations", {})
               for d in docs if d["kind"] == "StatefulSet")
    images = {container(by(docs, "StatefulSet", f"glm53-{role}"))["image"] for role in ("prefill", "decode")}
    assert images == {IMAGE}
    with pytest.raises(render.RenderError) as err:  # there is no per-role image to set
        render_cell("decode.image=registry.example/other@sha256:" + "f" * 64)
    assert "decode: additional properties 'image' not allowed" in str(err.value)


@pytest.mark.parametrize("image", ["registry.example/glm53-b300:v1", "registry.example/glm53-b300@sha256:abc"])
def test_engine_image_without_a_digest_is_refused(image):
    with pytest.raises(render.RenderError) as err:
        render.render([f"image={image}", f"valkeySpec.image={VALKEY_IMAGE}"])
    assert f'image "{image}" is not pinned by digest' in str(err.value)
    assert "allowUnpinnedImage=true" in str(err.value)


def test_a_tag_is_allowed_for_development_with_a_loud_warning(tmp_path):
    tag = "registry.example/glm53-b300:dev"
    docs = render.render([f"image={tag}", f"valkeySpec.image={VALKEY_IMAGE}", "allowUnpinnedImage=true"])
    assert container(by(docs, "StatefulSet", "glm53-decode"))["image"] == tag
    for role in ("prefill", "decode"):
        annotations = by(docs, "StatefulSet", f"glm53-{role}")["spec"]["template"]["metadata"]["annotations"]
        assert annotations["glm53.io/image-unpinned"].startswith("allowUnpinnedImage=true")
    cli = subprocess.run([sys.executable, str(DEPLOY / "render.py"), "--set", f"image={tag}", "--set",
                          f"valkeySpec.image={VALKEY_IMAGE}", "--set", "allowUnpinnedImage=true"],
                         capture_output=True, text=True)
    assert cli.returncode == 0 and f"render: WARNING: image {tag} is NOT pinned by digest" in cli.stderr
    # NOTES.txt, as `helm install` prints it (client-side dry run: no cluster contacted).
    out = subprocess.run([render.helm_binary(), "install", "glm53", str(render.CHART), "-n", "vllm", "--dry-run=client",
                          "--set", f"image={tag}", "--set", f"valkeySpec.image={VALKEY_IMAGE}",
                          "--set", "allowUnpinnedImage=true"],
                         capture_output=True, text=True,
                         env={"HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "none"),
                              "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:", 1)[1]
    assert f"WARNING: image {tag} is NOT pinned by digest" in notes
    pinned = subprocess.run([render.helm_binary(), "install", "glm53", str(render.CHART), "-n", "vllm",
                             "--dry-run=client", *[a for s in sets() for a in ("--set", s)]],
                            capture_output=True, text=True,
                            env={"HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "none"),
                                 "PATH": "/usr/bin:/bin"}, timeout=120)
    assert pinned.returncode == 0 and "NOTES:" in pinned.stdout and "WARNING" not in pinned.stdout.split("NOTES:", 1)[1]


def test_valkey_image_without_a_digest_is_refused():
    with pytest.raises(render.RenderError) as err:
        render.render([f"image={IMAGE}", "valkeySpec.image=valkey/valkey:8.1"])
    assert 'valkeySpec.image "valkey/valkey:8.1": give Valkey 8.1 by digest' in str(err.value)


# --- values and the CLI -------------------------------------------------------------------------


@pytest.mark.parametrize("values, message", [
    ([f"valkeySpec.image={VALKEY_IMAGE}"], "image: set the serving image"),
    ([*sets(), "prefil.replicas=2"], "values: additional properties 'prefil' not allowed"),
    ([*sets(), "prefill.replicas=0"], "prefill.replicas: minimum: got 0, want 1"),
    ([*sets(), "model.path=/weights/glm"], 'model.path "/weights/glm" is not inside model.mount "/models"'),
    ([*sets(), "valkeySpec.maxMemory=lots"], "valkeySpec.maxMemory: "),
    ([*sets(), "valkeySpec.maxMemoryPolicy=lru"], "valkeySpec.maxMemoryPolicy: "),
    ([*sets(), "shmSize=lots"], "shmSize: "),
    ([*sets(), "engineFiles.tmpSize=lots"], "engineFiles.tmpSize: "),
    ([*sets(), "engineFiles.readOnly=true"], "additional properties 'readOnly' not allowed"),
])
def test_bad_values(values, message):
    with pytest.raises(render.RenderError) as err:
        render.render(values)
    assert message in str(err.value)


def test_namespace_must_be_a_dns_label():
    with pytest.raises(render.RenderError) as err:
        render_cell(namespace="glm-prod-")
    assert 'namespace "glm-prod-" is not a DNS-1123 label' in str(err.value)


def test_cli_writes_one_file_per_component(tmp_path):
    out = tmp_path / "rendered"
    result = subprocess.run([sys.executable, str(DEPLOY / "render.py"), *[a for s in sets() for a in ("--set", s)],
                             "--out", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == [f for f in render.FILES
                                                     if f not in ("15-cache-warming.yaml", "50-monitoring.yaml")]
    total = sum(len([d for d in yaml.safe_load_all(p.read_text()) if d]) for p in out.iterdir())
    assert total == len(render_cell())


def test_cli_error_is_one_clear_line(tmp_path):
    values = tmp_path / "cell.yaml"
    values.write_text(f"image: {IMAGE}\nvalkeySpec:\n  image: {VALKEY_IMAGE}\n  shards: 6\n")
    result = subprocess.run([sys.executable, str(DEPLOY / "render.py"), "-f", str(values)],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("render: error: valkeySpec.shards=6 does not match")
    assert len(result.stderr.strip().splitlines()) == 1


def test_helm_alone_renders_the_same_objects():
    """render.py adds checks, not objects: plain `helm template` gives the same cell."""
    out = subprocess.run([render.helm_binary(), "template", "glm53", str(render.CHART), "-n", "vllm",
                          *[a for s in sets() for a in ("--set", s)]], capture_output=True, text=True, check=True)
    assert [d for d in yaml.safe_load_all(out.stdout) if d] == render_cell()


# --- NIXL backend and the node's libfabric ----------------------------------------------------


def _configs_with_backends(tmp_path, prefill: str, decode: str):
    copy = _configs_copy(tmp_path)
    for role, backend in (("prefill", prefill), ("decode", decode)):
        path = copy / role / "vllm.yaml"
        text = path.read_text()
        assert text.count("backends: [LIBFABRIC]") == 1
        path.write_text(text.replace("backends: [LIBFABRIC]", f"backends: [{backend}]"))
    return copy


def _runtime_ld_library_path() -> str:
    """LD_LIBRARY_PATH as the Dockerfile's runtime stage leaves it (ENV lines in order)."""
    text = (CONFIGS.parent / "Dockerfile").read_text()
    stage = text[text.index("FROM base AS runtime"):]
    value = ""
    for line in stage.replace("\\\n", " ").splitlines():
        if line.startswith("ENV "):
            for match in re.finditer(r"LD_LIBRARY_PATH=(\S+)", line):
                value = re.sub(r"\$\{?LD_LIBRARY_PATH\}?", value, match.group(1)).strip(":")
    return value


@pytest.mark.parametrize("prefix", ["/opt/amazon/efa", "/opt/amazon/efa/"])
def test_gpu_pods_mount_the_nodes_libfabric_lib64_and_lib_first(prefix):
    """The override (the AWS EFA installer's prefix, also with a trailing slash): the node's
    lib64 (Amazon Linux) and lib (Ubuntu), then the image's own LD_LIBRARY_PATH (the Dockerfile's)."""
    rendered = render_cell(f"nixlHostLibfabric={prefix}")
    lib = prefix
    expected = ":".join(filter(None, ["/opt/amazon/efa/lib64", "/opt/amazon/efa/lib", _runtime_ld_library_path()]))
    for role in ("prefill", "decode"):
        sts = by(rendered, "StatefulSet", f"glm53-{role}")
        spec = sts["spec"]["template"]["spec"]
        assert {"name": "nixl-libfabric", "hostPath": {"path": lib, "type": "Directory"}} in spec["volumes"]
        assert {"name": "nixl-libfabric", "mountPath": lib, "readOnly": True} in container(sts)["volumeMounts"]
        env = [e for e in container(sts)["env"] if e["name"] == "LD_LIBRARY_PATH"]
        assert env == [{"name": "LD_LIBRARY_PATH", "value": expected}]


def test_an_image_ld_library_path_stays_after_the_nodes(tmp_path):
    """A pod env var replaces the image's LD_LIBRARY_PATH: the chart repeats it last."""
    configs = _configs_copy(tmp_path)
    helpers = _chart(configs) / "templates" / "_helpers.tpl"
    text = helpers.read_text()
    anchor = '{{- define "glm53.imageLdLibraryPath" -}}'
    assert text.count(anchor) == 1
    helpers.write_text(text.replace(anchor, anchor + "/opt/image/lib"))
    env = {e["name"]: e.get("value") for e in container(by(render_cell("nixlHostLibfabric=/opt/amazon/efa",
                                                                       chart=_chart(configs)), "StatefulSet",
                                                           "glm53-prefill"))["env"]}
    assert env["LD_LIBRARY_PATH"] == "/opt/amazon/efa/lib64:/opt/amazon/efa/lib:/opt/image/lib"


def test_libfabric_backend_uses_the_images_libfabric_by_default(docs):
    """The presets' LIBFABRIC backend with the defaults: the image's own libfabric 2.1.0, so no
    host mount and the image's LD_LIBRARY_PATH untouched (the node's is an explicit override)."""
    for role in ("prefill", "decode"):
        sts = by(docs, "StatefulSet", f"glm53-{role}")
        assert "LIBFABRIC" in (CONFIGS / role / "vllm.yaml").read_text()
        assert all(v["name"] != "nixl-libfabric" for v in sts["spec"]["template"]["spec"]["volumes"])
        assert all(e["name"] != "LD_LIBRARY_PATH" for e in container(sts)["env"])


@pytest.mark.parametrize("value", ["/opt/amazon/efa/lib", "/opt/amazon/efa/lib64/"])
def test_node_libfabric_library_folder_is_refused(value):
    with pytest.raises(render.RenderError) as err:
        render_cell(f"nixlHostLibfabric={value}")
    assert f'nixlHostLibfabric: "{value}" is a library folder; give the installation prefix' in str(err.value)


def test_ucx_clusters_render_without_the_mount(tmp_path):
    configs = _configs_with_backends(tmp_path, "UCX", "UCX")
    rendered = render_cell("nixlHostLibfabric=null", chart=_chart(configs))
    for role in ("prefill", "decode"):
        sts = by(rendered, "StatefulSet", f"glm53-{role}")
        assert all(v["name"] != "nixl-libfabric" for v in sts["spec"]["template"]["spec"]["volumes"])
        assert all(e["name"] != "LD_LIBRARY_PATH" for e in container(sts)["env"])


def test_prefill_and_decode_must_use_the_same_nixl_backend(tmp_path):
    configs = _configs_with_backends(tmp_path, "LIBFABRIC", "UCX")
    with pytest.raises(render.RenderError) as err:
        render_cell(chart=_chart(configs))
    assert ("NIXL backends differ" in str(err.value) and '["LIBFABRIC"]' in str(err.value)
            and '["UCX"]' in str(err.value))


def test_nixl_host_libfabric_must_be_an_absolute_path():
    with pytest.raises(render.RenderError) as err:
        render_cell("nixlHostLibfabric=opt/efa")
    assert "nixlHostLibfabric: " in str(err.value) and "does not match pattern" in str(err.value)


def test_per_pod_env_in_the_env_file_is_refused(tmp_path):
    configs = _configs_copy(tmp_path)
    env = configs / "decode" / "env"
    env.write_text(env.read_text() + "VLLM_NIXL_SIDE_CHANNEL_HOST=10.0.0.1\n")
    with pytest.raises(render.RenderError) as err:
        render_cell(chart=_chart(configs))
    assert "configs/decode/env: VLLM_NIXL_SIDE_CHANNEL_HOST is per pod" in str(err.value)


# --- the chart as a package ---------------------------------------------------------------------


def test_helm_lint_strict_passes():
    out = subprocess.run([render.helm_binary(), "lint", "--strict", str(render.CHART),
                          *[a for s in sets() for a in ("--set", s)]], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout


def test_packaged_chart_carries_the_engine_configs(tmp_path):
    """`helm package` resolves files/ (links to configs/prefill, configs/decode): the .tgz alone,
    as a chart repository or Argo CD would use it, renders the same cell."""
    out = subprocess.run([render.helm_binary(), "package", str(render.CHART), "-d", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    (package,) = tmp_path.glob("glm53-cell-*.tgz")
    assert render.render(sets(), chart=package) == render_cell()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engines_export_lmcaches_metrics_from_a_fresh_multiprocess_folder(docs, role, tmp_path):
    """LMCache's counters live in vLLM's EngineCore and workers: /metrics serves them only through
    PROMETHEUS_MULTIPROC_DIR (an emptyDir), which the container's arguments (run by the image's
    entrypoint) empty before exec'ing vLLM. They run for real here with a stand-in for vllm that
    lists the folder."""
    sts = by(docs, "StatefulSet", f"glm53-{role}")
    c = container(sts)
    env = {e["name"]: e.get("value") for e in c["env"]}
    folder = env["PROMETHEUS_MULTIPROC_DIR"]
    assert {"name": "prometheus", "mountPath": folder} in c["volumeMounts"]
    assert {"name": "prometheus", "emptyDir": {"sizeLimit": "1Gi"}} in sts["spec"]["template"]["spec"]["volumes"]
    stale = tmp_path / "prom"
    stale.mkdir()
    (stale / "counter_1234.db").write_bytes(b"stale")
    fake_vllm = tmp_path / "bin" / "vllm"
    fake_vllm.parent.mkdir()
    fake_vllm.write_text('#!/bin/sh\nls -A "$PROMETHEUS_MULTIPROC_DIR"; echo "args: $*"\n')
    fake_vllm.chmod(0o755)
    done = subprocess.run(c["args"], capture_output=True, text=True,
                          env={"PATH": f"{fake_vllm.parent}:/usr/bin:/bin", "PROMETHEUS_MULTIPROC_DIR": str(stale)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"args: serve /models/GLM-5.3-FP8 --config /etc/glm53/{role}/vllm.yaml "
                                        "--shutdown-timeout 120"]
    unset = subprocess.run(c["args"], capture_output=True, text=True, env={"PATH": f"{fake_vllm.parent}:/usr/bin:/bin"})
    assert unset.returncode != 0 and "PROMETHEUS_MULTIPROC_DIR" in unset.stderr   # never rm -rf /*


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engine_pods_run_the_images_preflight_first_with_the_engines_devices(docs, role):
    """The image's preflight (IMAGE preflight ROLE MODEL) as an init container: the same GPUs, EFA
    devices, memory, volumes and environment as the engine, so it checks what the engine will get."""
    spec = by(docs, "StatefulSet", f"glm53-{role}")["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    engine = container(by(docs, "StatefulSet", f"glm53-{role}"))
    assert init["name"] == "preflight" and init["image"] == engine["image"]
    assert "command" not in init   # the image's entrypoint runs it
    assert init["args"] == ["preflight", role, "/models/GLM-5.3-FP8"]
    for key in ("env", "resources", "securityContext", "volumeMounts"):
        assert init[key] == engine[key], key
    assert "initContainers" not in by(render_cell("preflight=false"), "StatefulSet",
                                      f"glm53-{role}")["spec"]["template"]["spec"]


# --- InfiniBand: nixlBackends and the example values file --------------------------------------

INFINIBAND = DEPLOY / "examples" / "infiniband.yaml"


def _nixl_backends_of_rendered(docs, tmp_path) -> dict[str, list[str]]:
    """What the image's preflight reads from each role's mounted vllm.yaml (the ConfigMap)."""
    sys.path.insert(0, str(CONFIGS.parent / "image"))
    try:
        from imagectl import preflight
    finally:
        sys.path.pop(0)
    found = {}
    for role in ("prefill", "decode"):
        path = tmp_path / role / "vllm.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(by(docs, "ConfigMap", f"glm53-{role}-config")["data"]["vllm.yaml"])
        found[role] = preflight.preset_nixl_backends(path)
    return found


def _without_nixl_backends(cfg):
    """A vllm.yaml's parsed form with every `backends` key dropped."""
    if isinstance(cfg, dict):
        return {k: _without_nixl_backends(v) for k, v in cfg.items() if k != "backends"}
    if isinstance(cfg, list):
        return [_without_nixl_backends(v) for v in cfg]
    return cfg


def test_infiniband_example_renders_ucx_without_efa(tmp_path, no_network):
    """The InfiniBand values file over the defaults: UCX in both roles' mounted vllm.yaml (read
    with the preflight's own function), nothing else of the configs changed, the RDMA device
    plugin's resource instead of EFA's, and no AWS instance-type selector left from the defaults."""
    docs = render.render(sets(), values=[INFINIBAND])
    assert _validate_all(docs) == ENGINE_KINDS
    assert _nixl_backends_of_rendered(docs, tmp_path) == {"prefill": ["UCX"], "decode": ["UCX"]}
    for role in ("prefill", "decode"):
        rendered = yaml.safe_load(by(docs, "ConfigMap", f"glm53-{role}-config")["data"]["vllm.yaml"])
        preset = yaml.safe_load((CONFIGS / role / "vllm.yaml").read_text())
        assert _without_nixl_backends(rendered) == _without_nixl_backends(preset)
        sts = by(docs, "StatefulSet", f"glm53-{role}")
        limits = container(sts)["resources"]["limits"]
        assert limits.get("rdma/rdma_shared_device_a") == 1 and "vpc.amazonaws.com/efa" not in limits, limits
        selector = sts["spec"]["template"]["spec"]["nodeSelector"]
        assert "node.kubernetes.io/instance-type" not in selector and "nvidia.com/gpu.product" in selector
    shard_selector = by(docs, "StatefulSet", "valkey-lmcache")["spec"]["template"]["spec"]["nodeSelector"]
    assert "node.kubernetes.io/instance-type" not in shard_selector


def test_default_cell_keeps_the_presets_libfabric(docs, tmp_path):
    assert _nixl_backends_of_rendered(docs, tmp_path) == {"prefill": ["LIBFABRIC"], "decode": ["LIBFABRIC"]}


def test_nixl_backends_value_sets_every_listed_backend(tmp_path):
    docs = render_cell("nixlBackends={UCX,LIBFABRIC}")
    assert _nixl_backends_of_rendered(docs, tmp_path) == {"prefill": ["UCX", "LIBFABRIC"],
                                                          "decode": ["UCX", "LIBFABRIC"]}


def test_nixl_backends_change_rolls_the_pods():
    def sha(docs, role):
        return by(docs, "StatefulSet", f"glm53-{role}")["spec"]["template"]["metadata"]["annotations"]

    before, after = render_cell(), render_cell("nixlBackends={UCX}")
    for role in ("prefill", "decode"):
        assert sha(before, role) != sha(after, role)


@pytest.mark.parametrize("value, message", [
    ("nixlBackends={TCP}", "nixlBackends.0: value must be one of"),
    ("nixlBackends={UCX,UCX}", "nixlBackends: items at 0 and 1 are equal"),
])
def test_unknown_or_repeated_nixl_backend_is_refused(value, message):
    with pytest.raises(render.RenderError) as err:
        render_cell(value)
    assert message in str(err.value)


def test_nixl_backends_needs_one_backends_line_per_config(tmp_path):
    configs = _configs_copy(tmp_path)
    path = configs / "decode" / "vllm.yaml"
    path.write_text(path.read_text() + "# backends: [LIBFABRIC] was tried\n")
    with pytest.raises(render.RenderError) as err:
        render_cell("nixlBackends={UCX}", chart=_chart(configs))
    assert ("nixlBackends: configs/decode/vllm.yaml has 2 `backends: [...]` lines, so the chart cannot tell "
            "which to set") in str(err.value)


def test_nixl_backends_line_must_be_the_nixl_connectors(tmp_path):
    """A config whose only backends line is not the NixlConnector's: the override is refused
    rather than rendered with the connector left on its old backend."""
    configs = _configs_copy(tmp_path)
    path = configs / "prefill" / "vllm.yaml"
    text = path.read_text()
    assert text.count("backends: [LIBFABRIC]") == 1
    path.write_text(text.replace("backends: [LIBFABRIC]", "kv_buffer_size: 1") + "# backends: [LIBFABRIC]\n")
    with pytest.raises(render.RenderError) as err:
        render_cell("nixlBackends={LIBFABRIC}", chart=_chart(configs))
    assert ("nixlBackends: the `backends: [...]` line of configs/prefill/vllm.yaml is not its NixlConnector's "
            '(after setting it, the connector uses ["UCX"])') in str(err.value)


def test_engine_pods_declare_one_nixl_side_channel_port_per_data_parallel_rank(docs):
    # vLLM 0.31.0 listens on VLLM_NIXL_SIDE_CHANNEL_PORT (5600) + the data-parallel rank: decode runs DP8.
    for role, dp in (("prefill", 1), ("decode", 8)):
        ports = container(by(docs, "StatefulSet", f"glm53-{role}"))["ports"]
        assert ports[0] == {"name": "http", "containerPort": 8000}
        assert ports[1:] == [{"name": "nixl" if i == 0 else f"nixl-{i}", "containerPort": 5600 + i} for i in range(dp)]
