#!/usr/bin/env python3
"""Render the Kubernetes manifests of a GLM-5.3 P/D cell.

    python3 configs/deploy/render.py --params my-cell.yaml --out rendered/
    python3 configs/deploy/render.py --set image=REGISTRY/glm53:TAG > cell.yaml

Inputs: the parameters (configs/deploy/params.yaml, overlaid by --params and
--set), the engine configs in configs/prefill and configs/decode, and the
templates in configs/deploy/templates. Needs only Python 3.9+ and PyYAML.

Templates are YAML documents. A value that is exactly "${name}" is replaced
by the parameter's value (a mapping, a list, a number); "${name}" inside a
longer string is substituted as text. Nothing is pasted into YAML text, so a
value cannot change the document's structure.

Derived, never set by hand (so they cannot drift apart):
  * the Valkey shard count = ranks of one prefill engine (PCP x TP x PP of
    configs/prefill/vllm.yaml); valkey.shards may repeat it, any other value
    is refused;
  * LMCache's remote_url host = the rendered shard Services, in the cell's
    namespace (the file's URL must have the valkey-lmcache-{rank} form);
  * GPUs per pod = the engine's world size (x data-parallel size on decode);
  * the prefill pod's memory = LMCache's L1 for the pod + overhead (with
    pcp_shard_store the configured size is the pod's, split over the ranks;
    without it, max_local_cpu_size is per rank);
  * the config mount = the directory of LMCACHE_CONFIG_FILE in configs/prefill/env;
  * the proxy's prefill/decode host lists = the StatefulSet pods.
check_rendered() re-reads the rendered objects and fails when remote_url's
{rank} expansions and the shard Services do not match one to one.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import posixpath
import re
import string
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parent
TEMPLATES = HERE / "templates"
DEFAULT_PARAMS = HERE / "params.yaml"

CELL = "glm53"
VALKEY = "valkey-lmcache"
VALKEY_PORT = 6379
REMOTE_URL_RE = re.compile(
    r"^resp://valkey-lmcache-\{rank\}\.(?P<namespace>[a-z0-9]([-a-z0-9]*[a-z0-9])?)"
    r"\.svc\.cluster\.local:6379$"
)
VOLUME_SOURCES = {"hostPath", "persistentVolumeClaim", "nfs", "csi", "ephemeral", "emptyDir"}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")
VALKEY_MEMORY = re.compile(r"^[0-9]+(b|kb|mb|gb|k|m|g)?$", re.IGNORECASE)
# The serving image's LD_LIBRARY_PATH (Dockerfile, runtime stage; none today). A pod env var
# replaces the image's, so the node-libfabric mount repeats it after the node's folders;
# tests/configs/test_deploy.py checks that it equals the Dockerfile's.
IMAGE_LD_LIBRARY_PATH = ""


class RenderError(Exception):
    """A parameter or config that would produce a broken cell."""


# --------------------------------------------------------------------------
# parameters


def _merge(base: dict, over: dict, where: str = "") -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        path = f"{where}{key}"
        if key not in base:
            raise RenderError(f"unknown parameter '{path}' (known: {', '.join(sorted(base))})")
        if isinstance(base[key], dict) and isinstance(value, dict) and key not in (
            "node_selector", "model_volume", "rdma_resources"
        ):
            out[key] = _merge(base[key], value, f"{path}.")
        else:
            out[key] = copy.deepcopy(value)
    return out


def _set(params: dict, assignment: str) -> dict:
    path, sep, raw = assignment.partition("=")
    if not sep or not path:
        raise RenderError(f"--set {assignment!r}: expected KEY.PATH=VALUE")
    value = yaml.safe_load(raw) if raw else ""
    over: dict = {}
    node = over
    parts = path.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return _merge(params, over)


def load_params(path: str | Path | None = None, sets: list[str] | None = None) -> dict:
    params = yaml.safe_load(DEFAULT_PARAMS.read_text())
    if path is not None:
        user = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(user, dict):
            raise RenderError(f"{path}: expected a mapping of parameters")
        params = _merge(params, user)
    for assignment in sets or []:
        params = _set(params, assignment)
    validate_params(params)
    return params


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise RenderError(message)


def _check_pool(params: dict, role: str) -> None:
    sel = params[role]["node_selector"]
    _need(isinstance(sel, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in sel.items()),
          f"{role}.node_selector: expected a mapping of label to string value")
    tol = params[role]["tolerations"]
    _need(isinstance(tol, list) and all(isinstance(t, dict) for t in tol),
          f"{role}.tolerations: expected a list of Kubernetes tolerations")


def _positive_int(value: Any, name: str) -> None:
    _need(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
          f"{name}: expected a positive integer, got {value!r}")


def validate_params(p: dict) -> None:
    _need(isinstance(p["namespace"], str) and bool(DNS_LABEL.match(p["namespace"])),
          f"namespace: {p['namespace']!r} is not a DNS-1123 label")
    _need(isinstance(p["image"], str) and p["image"].strip() != "" and " " not in p["image"],
          "image: set the serving image (params.yaml marks it MUST)")
    _need(isinstance(p["model_path"], str) and p["model_path"].startswith("/"),
          f"model_path: expected an absolute path, got {p['model_path']!r}")
    _need(isinstance(p["model_mount"], str) and p["model_mount"].startswith("/"),
          f"model_mount: expected an absolute path, got {p['model_mount']!r}")
    mount = p["model_mount"].rstrip("/") + "/"
    _need(p["model_path"].startswith(mount),
          f"model_path {p['model_path']!r} is not inside model_mount {p['model_mount']!r}")
    vol = p["model_volume"]
    _need(isinstance(vol, dict) and len(vol) == 1 and next(iter(vol)) in VOLUME_SOURCES,
          f"model_volume: expected one volume source ({', '.join(sorted(VOLUME_SOURCES))}), got {vol!r}")
    for role in ("prefill", "decode", "valkey", "proxy"):
        _check_pool(p, role)
    for role in ("prefill", "decode", "proxy"):
        _positive_int(p[role]["replicas"], f"{role}.replicas")
    _positive_int(p["prefill"]["memory_overhead_gib"], "prefill.memory_overhead_gib")
    _positive_int(p["decode"]["memory_gib"], "decode.memory_gib")
    for role in ("prefill", "decode", "valkey"):
        _positive_int(p[role]["cpu"], f"{role}.cpu")
    _need(isinstance(p["gpu_resource"], str) and "/" in p["gpu_resource"],
          f"gpu_resource: expected an extended resource name like nvidia.com/gpu, got {p['gpu_resource']!r}")
    lib = p["nixl_host_libfabric"]
    _need(lib is None or (isinstance(lib, str) and lib.startswith("/")),
          f"nixl_host_libfabric: expected an absolute path on the node or null, got {lib!r}")
    _need(lib is None or posixpath.basename(lib.rstrip("/")) not in ("lib", "lib64"),
          f"nixl_host_libfabric: {lib!r} is a library folder; give the installation prefix "
          f"(e.g. /opt/amazon/efa): its lib and lib64 are both put on LD_LIBRARY_PATH")
    rdma = p["rdma_resources"]
    _need(isinstance(rdma, dict) and all(isinstance(k, str) and "/" in k and isinstance(v, int)
                                         and not isinstance(v, bool) and v >= 1 for k, v in rdma.items()),
          f"rdma_resources: expected {{resource-name: positive count}}, got {rdma!r}")
    _need(isinstance(p["shm_size"], str) and bool(QUANTITY.match(p["shm_size"])),
          f"shm_size: {p['shm_size']!r} is not a Kubernetes quantity")
    v = p["valkey"]
    _need(isinstance(v["image"], str) and v["image"] != "", "valkey.image: set a Valkey 8.1 image")
    _need(isinstance(v["maxmemory"], str) and bool(VALKEY_MEMORY.match(v["maxmemory"])),
          f"valkey.maxmemory: {v['maxmemory']!r} is not a Valkey memory size (e.g. 150gb)")
    _need(v["maxmemory_policy"] in ("allkeys-lru", "allkeys-lfu", "volatile-lru", "allkeys-random",
                                    "volatile-lfu", "volatile-random", "volatile-ttl", "noeviction"),
          f"valkey.maxmemory_policy: {v['maxmemory_policy']!r} is not a Valkey eviction policy")
    _positive_int(v["io_threads"], "valkey.io_threads")
    _need(isinstance(v["memory_limit"], str) and bool(QUANTITY.match(v["memory_limit"])),
          f"valkey.memory_limit: {v['memory_limit']!r} is not a Kubernetes quantity")
    _need(v["shards"] is None or (isinstance(v["shards"], int) and not isinstance(v["shards"], bool)),
          f"valkey.shards: expected null (= prefill ranks) or an integer, got {v['shards']!r}")
    _need(p["proxy"]["image"] is None or isinstance(p["proxy"]["image"], str), "proxy.image: a string or null")
    _need(isinstance(p["proxy"]["script"], str) and p["proxy"]["script"].startswith("/"),
          "proxy.script: the absolute path of toy_proxy_server.py in the image")


# --------------------------------------------------------------------------
# engine configs


def _yaml_file(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise RenderError(f"{path}: not found") from None
    if not isinstance(data, dict):
        raise RenderError(f"{path}: expected a mapping")
    return data


def read_env(path: Path) -> list[tuple[str, str]]:
    pairs = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise RenderError(f"{path}: expected KEY=VALUE, got {raw!r}")
        pairs.append((key.strip(), value))
    return pairs


def _opt(cfg: dict, name: str, default: int = 1) -> int:
    for key in (name, name.replace("-", "_")):
        if key in cfg:
            value = cfg[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RenderError(f"{name}: expected a positive integer, got {value!r}")
            return value
    return default


def engine_ranks(cfg: dict) -> int:
    """Workers of one engine (vLLM's ParallelConfig.world_size): PP x PCP x TP."""
    return (_opt(cfg, "pipeline-parallel-size") * _opt(cfg, "prefill-context-parallel-size")
            * _opt(cfg, "tensor-parallel-size"))


def pod_gpus(cfg: dict) -> int:
    return engine_ranks(cfg) * _opt(cfg, "data-parallel-size")


def valkey_host(rank: int | str, namespace: str) -> str:
    return f"{VALKEY}-{rank}.{namespace}.svc.cluster.local"


def remote_url(namespace: str) -> str:
    return f"resp://{valkey_host('{rank}', namespace)}:{VALKEY_PORT}"


def _ranks_text(cfg: dict) -> str:
    return (f"prefill-context-parallel-size {_opt(cfg, 'prefill-context-parallel-size')} x "
            f"tensor-parallel-size {_opt(cfg, 'tensor-parallel-size')} x "
            f"pipeline-parallel-size {_opt(cfg, 'pipeline-parallel-size')}")


def shard_count(params: dict, prefill_cfg: dict) -> int:
    """Shards = prefill ranks; a different explicit valkey.shards is refused."""
    ranks = engine_ranks(prefill_cfg)
    asked = params["valkey"]["shards"]
    if asked is not None and asked != ranks:
        if asked < ranks:
            gap = f"ranks {asked}..{ranks - 1} would address shards that do not exist"
        else:
            gap = f"shards {ranks}..{asked - 1} would never be read or written"
        raise RenderError(
            f"valkey.shards={asked} does not match the prefill engine's {ranks} ranks "
            f"(configs/prefill/vllm.yaml: {_ranks_text(prefill_cfg)}): rank r reads "
            f"{VALKEY}-r through remote_url's {{rank}}, so {gap}. Leave valkey.shards "
            f"null or set it to {ranks}."
        )
    return ranks


def prefill_lmcache_text(path: Path, namespace: str) -> tuple[str, dict]:
    """The LMCache YAML with remote_url pointed at this cell's shard Services."""
    text = path.read_text()
    cfg = _yaml_file(path)
    url = cfg.get("remote_url")
    match = REMOTE_URL_RE.match(url) if isinstance(url, str) else None
    if match is None:
        raise RenderError(
            f"{path}: remote_url {url!r} does not address the rendered Valkey shards; expected "
            f"{remote_url('<namespace>')!r} (one {VALKEY}-<rank> Service per prefill rank)"
        )
    new_url = remote_url(namespace)
    if url != new_url:
        occurrences = text.count(url)
        if occurrences != 1:
            raise RenderError(f"{path}: remote_url {url!r} appears {occurrences} times in the text")
        text = text.replace(url, new_url)
    cfg = yaml.safe_load(text)
    if cfg["remote_url"] != new_url:
        raise RenderError(f"{path}: could not point remote_url at namespace {namespace!r}")
    size = cfg.get("max_local_cpu_size", 5.0)
    if not isinstance(size, (int, float)) or isinstance(size, bool) or size <= 0:
        raise RenderError(f"{path}: max_local_cpu_size {size!r}: expected a positive number of GiB")
    return text, cfg


def pod_l1_gib(lmcache_cfg: dict, ranks: int) -> float:
    """The prefill pod's LMCache L1 in GiB, as the patched LMCache allocates it:
    under pcp_shard_store every rank takes budget / ranks of the pod's budget
    (first_rank_max_local_cpu_size if set, else max_local_cpu_size); otherwise
    every rank allocates max_local_cpu_size."""
    size = lmcache_cfg.get("max_local_cpu_size", 5.0)
    extra = lmcache_cfg.get("extra_config") or {}
    if extra.get("pcp_shard_store") and ranks > 1:
        return float(extra.get("first_rank_max_local_cpu_size", size))
    return float(size) * ranks


def valkey_args(params: dict) -> list[str]:
    """valkey-server arguments of every shard (tests start real servers with them)."""
    v = params["valkey"]
    return [
        "--port", str(VALKEY_PORT),
        "--bind", "0.0.0.0",
        # No password: the NetworkPolicy admits only prefill pods.
        "--protected-mode", "no",
        "--maxmemory", v["maxmemory"],
        "--maxmemory-policy", v["maxmemory_policy"],
        "--io-threads", str(v["io_threads"]),
        # A cache: no RDB snapshots, no AOF.
        "--save", "",
        "--appendonly", "no",
    ]


# --------------------------------------------------------------------------
# templates


def _substitute(node: Any, values: dict, where: str) -> Any:
    if isinstance(node, dict):
        return {_substitute(k, values, where): _substitute(v, values, where) for k, v in node.items()}
    if isinstance(node, list):
        return [_substitute(v, values, where) for v in node]
    if isinstance(node, str):
        whole = re.fullmatch(r"\$\{(\w+)\}", node)
        if whole:
            name = whole.group(1)
            if name not in values:
                raise RenderError(f"{where}: template value ${{{name}}} has no parameter")
            return copy.deepcopy(values[name])
        try:
            return string.Template(node).substitute({k: str(v) for k, v in values.items()})
        except KeyError as e:
            raise RenderError(f"{where}: template text names ${{{e.args[0]}}}, which has no parameter") from None
    return node


def render_template(name: str, values: dict) -> list[dict]:
    docs = [d for d in yaml.safe_load_all((TEMPLATES / name).read_text()) if d is not None]
    return [_substitute(doc, values, f"templates/{name}") for doc in docs]


def _labels(component: str, **extra: str) -> dict:
    labels = {"app.kubernetes.io/name": CELL, "app.kubernetes.io/component": component,
              "app.kubernetes.io/part-of": f"{CELL}-pd-cell"}
    labels.update(extra)
    return labels


def _sha(*parts: Any) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(yaml.safe_dump(part, sort_keys=True).encode())
    return h.hexdigest()


def _engine(role: str, params: dict, cfg: dict, env: list[tuple[str, str]], config_dir: str,
            configmap: dict, memory_gib: int) -> list[dict]:
    name = f"{CELL}-{role}"
    gpus = pod_gpus(cfg)
    env_list = [{"name": k, "value": v} for k, v in env]
    env_list.append({"name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
                     "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    limits = {params["gpu_resource"]: gpus, **params["rdma_resources"], "memory": f"{memory_gib}Gi"}
    requests = {"cpu": params[role]["cpu"], "memory": f"{memory_gib}Gi"}
    mounts = [{"name": "config", "mountPath": config_dir, "readOnly": True},
              {"name": "model", "mountPath": params["model_mount"], "readOnly": True},
              {"name": "dshm", "mountPath": "/dev/shm"}]
    volumes = [{"name": "config", "configMap": {"name": configmap["metadata"]["name"]}},
               {"name": "model", **copy.deepcopy(params["model_volume"])},
               {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": params["shm_size"]}}]
    libfabric = params["nixl_host_libfabric"]
    if libfabric is not None:
        mounts.append({"name": "nixl-libfabric", "mountPath": libfabric, "readOnly": True})
        volumes.append({"name": "nixl-libfabric", "hostPath": {"path": libfabric, "type": "Directory"}})
        env_list.append({"name": "LD_LIBRARY_PATH", "value": host_libfabric_path(libfabric)})
    values = {
        "name": name, "namespace": params["namespace"], "labels": _labels(role),
        "selector": {"app.kubernetes.io/name": CELL, "app.kubernetes.io/component": role},
        "replicas": params[role]["replicas"], "node_selector": params[role]["node_selector"],
        "tolerations": params[role]["tolerations"], "image": params["image"],
        "command": ["vllm", "serve", params["model_path"], "--config", f"{config_dir}/vllm.yaml"],
        "env": env_list, "requests": requests, "limits": limits,
        "volume_mounts": mounts, "volumes": volumes,
        "config_sha256": _sha(configmap["data"], env),
    }
    return render_template("engine.yaml", values)


def _configmap(role: str, params: dict, data: dict, config_dir: str) -> dict:
    values = {"name": f"{CELL}-{role}-config", "namespace": params["namespace"],
              "labels": _labels(role), "data": data, "config_dir": config_dir}
    return render_template("configmap.yaml", values)[0]


def host_libfabric_path(prefix: str) -> str:
    """The node's libfabric first (EFA installer: lib on Ubuntu, lib64 on Amazon Linux), then
    the image's own LD_LIBRARY_PATH, which a pod env var would otherwise replace."""
    root = prefix.rstrip("/") or "/"
    return ":".join(filter(None, [posixpath.join(root, "lib"), posixpath.join(root, "lib64"), IMAGE_LD_LIBRARY_PATH]))


def nixl_backends(cfg: dict) -> list[str]:
    """The NIXL backends of a vllm.yaml: NixlConnector alone or as a MultiConnector child
    (vLLM's default is UCX)."""
    ktc = cfg.get("kv-transfer-config") or cfg.get("kv_transfer_config") or {}
    nodes = [ktc] + list((ktc.get("kv_connector_extra_config") or {}).get("connectors") or [])
    for node in nodes:
        if node.get("kv_connector") == "NixlConnector":
            return list((node.get("kv_connector_extra_config") or {}).get("backends") or ["UCX"])
    return []


def check_nixl_backends(params: dict, prefill_cfg: dict, decode_cfg: dict, prefill_path: Path,
                        decode_path: Path) -> None:
    """Prefill and decode must name the same NIXL backends (both ends of a transfer load the
    same plugin), and LIBFABRIC needs the node's libfabric (nixl_host_libfabric)."""
    prefill, decode = nixl_backends(prefill_cfg), nixl_backends(decode_cfg)
    if prefill != decode:
        raise RenderError(f"NIXL backends differ: {prefill_path} uses {prefill}, {decode_path} uses {decode}")
    if "LIBFABRIC" in prefill and params["nixl_host_libfabric"] is None:
        raise RenderError(f"{prefill_path}: NIXL backend LIBFABRIC needs the node's libfabric with FABRIC_1.10: set "
                          "nixl_host_libfabric (the AWS EFA installer's prefix, /opt/amazon/efa) or use UCX")


def _env_without_per_pod(path: Path) -> list[tuple[str, str]]:
    env = read_env(path)
    for key, _ in env:
        if key == "VLLM_NIXL_SIDE_CHANNEL_HOST":
            raise RenderError(f"{path}: VLLM_NIXL_SIDE_CHANNEL_HOST is per pod (its IP); the "
                              "renderer sets it, remove it from the env file")
    return env


def render(params: dict, configs: Path = CONFIGS) -> list[dict]:
    """All objects of the cell, in apply order."""
    ns = params["namespace"]
    prefill_dir, decode_dir = configs / "prefill", configs / "decode"
    prefill_cfg = _yaml_file(prefill_dir / "vllm.yaml")
    decode_cfg = _yaml_file(decode_dir / "vllm.yaml")
    prefill_env = _env_without_per_pod(prefill_dir / "env")
    decode_env = _env_without_per_pod(decode_dir / "env")

    config_file = dict(prefill_env).get("LMCACHE_CONFIG_FILE")
    if not config_file or posixpath.basename(config_file) != "lmcache.yaml" or not config_file.startswith("/"):
        raise RenderError(f"{prefill_dir / 'env'}: LMCACHE_CONFIG_FILE must be an absolute path ending "
                          f"in /lmcache.yaml (the ConfigMap is mounted at its directory), got {config_file!r}")
    prefill_mount = posixpath.dirname(config_file)
    decode_mount = posixpath.join(posixpath.dirname(prefill_mount), "decode")

    check_nixl_backends(params, prefill_cfg, decode_cfg, prefill_dir / "vllm.yaml", decode_dir / "vllm.yaml")
    shards = shard_count(params, prefill_cfg)
    lmcache_text, lmcache_cfg = prefill_lmcache_text(prefill_dir / "lmcache.yaml", ns)
    ranks = engine_ranks(prefill_cfg)
    l1_gib = pod_l1_gib(lmcache_cfg, ranks)
    prefill_memory = int(-(-l1_gib // 1)) + params["prefill"]["memory_overhead_gib"]

    prefill_cm = _configmap("prefill", params, {
        "vllm.yaml": (prefill_dir / "vllm.yaml").read_text(), "lmcache.yaml": lmcache_text}, prefill_mount)
    decode_cm = _configmap("decode", params, {"vllm.yaml": (decode_dir / "vllm.yaml").read_text()}, decode_mount)

    docs: list[dict] = [prefill_cm, decode_cm]
    tier = {"app.kubernetes.io/name": VALKEY}
    for shard in range(shards):
        instance = f"{VALKEY}-{shard}"
        v = params["valkey"]
        docs += render_template("valkey-shard.yaml", {
            "name": instance, "namespace": ns, "shard": shard, "shards": shards,
            "labels": {**tier, "app.kubernetes.io/instance": instance,
                       "app.kubernetes.io/component": "lmcache-l2", "app.kubernetes.io/part-of": f"{CELL}-pd-cell"},
            "selector": {**tier, "app.kubernetes.io/instance": instance},
            "tier_labels": tier, "node_selector": v["node_selector"], "tolerations": v["tolerations"],
            "image": v["image"], "args": valkey_args(params), "cpu": v["cpu"], "memory_limit": v["memory_limit"],
        })
    docs += render_template("valkey-networkpolicy.yaml", {
        "namespace": ns, "labels": {**tier, "app.kubernetes.io/part-of": f"{CELL}-pd-cell"},
        "tier_labels": tier,
        "prefill_selector": {"app.kubernetes.io/name": CELL, "app.kubernetes.io/component": "prefill"},
    })
    docs += _engine("prefill", params, prefill_cfg, prefill_env, prefill_mount, prefill_cm, prefill_memory)
    docs += _engine("decode", params, decode_cfg, decode_env, decode_mount, decode_cm,
                    params["decode"]["memory_gib"])

    def hosts(role: str) -> list[str]:
        name = f"{CELL}-{role}"
        return [f"{name}-{i}.{name}.{ns}.svc.cluster.local" for i in range(params[role]["replicas"])]

    prefill_hosts, decode_hosts = hosts("prefill"), hosts("decode")
    docs += render_template("proxy.yaml", {
        "name": f"{CELL}-pd-proxy", "namespace": ns, "labels": _labels("pd-proxy"),
        "selector": {"app.kubernetes.io/name": CELL, "app.kubernetes.io/component": "pd-proxy"},
        "replicas": params["proxy"]["replicas"], "node_selector": params["proxy"]["node_selector"],
        "tolerations": params["proxy"]["tolerations"], "image": params["proxy"]["image"] or params["image"],
        "command": ["python3", params["proxy"]["script"], "--host", "0.0.0.0", "--port", "8000",
                    "--prefiller-hosts", *prefill_hosts, "--prefiller-ports", *(["8000"] * len(prefill_hosts)),
                    "--decoder-hosts", *decode_hosts, "--decoder-ports", *(["8000"] * len(decode_hosts))],
    })
    check_rendered(docs)
    return docs


def check_rendered(docs: list[dict]) -> None:
    """remote_url's {rank} expansions and the shard Services match one to one."""
    cms = [d for d in docs if d.get("kind") == "ConfigMap" and "lmcache.yaml" in d.get("data", {})]
    if len(cms) != 1:
        raise RenderError(f"expected one ConfigMap with lmcache.yaml, found {len(cms)}")
    lmcache = yaml.safe_load(cms[0]["data"]["lmcache.yaml"])
    ranks = engine_ranks(yaml.safe_load(cms[0]["data"]["vllm.yaml"]))
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


# --------------------------------------------------------------------------
# output


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)

FILES = ["00-config.yaml", "10-valkey.yaml", "20-prefill.yaml", "30-decode.yaml", "40-proxy.yaml"]


def dump(docs: list[dict]) -> str:
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)


def split(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {name: [] for name in FILES}
    for doc in docs:
        labels = doc["metadata"].get("labels", {})
        if doc["kind"] == "ConfigMap":
            out["00-config.yaml"].append(doc)
        elif labels.get("app.kubernetes.io/name") == VALKEY:
            out["10-valkey.yaml"].append(doc)
        else:
            component = labels.get("app.kubernetes.io/component")
            name = {"prefill": "20-prefill.yaml", "decode": "30-decode.yaml", "pd-proxy": "40-proxy.yaml"}[component]
            out[name].append(doc)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Render the Kubernetes manifests of a GLM-5.3 P/D cell.")
    ap.add_argument("--params", type=Path, help="a parameters file overlaid on configs/deploy/params.yaml")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY.PATH=VALUE",
                    help="override one parameter (YAML value), e.g. --set prefill.replicas=2")
    ap.add_argument("--configs", type=Path, default=CONFIGS, help="the configs/ directory (default: this repo's)")
    ap.add_argument("--out", type=Path, help="write one file per component here (default: stdout)")
    args = ap.parse_args(argv)
    try:
        params = load_params(args.params, args.sets)
        docs = render(params, args.configs)
    except RenderError as e:
        print(f"render: error: {e}", file=sys.stderr)
        return 2
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
