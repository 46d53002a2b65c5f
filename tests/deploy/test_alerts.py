"""Monitoring objects of the chart: the PodMonitors find the pods' ports, the PrometheusRule is
configs/deploy/chart/files/prometheus-rules.yaml, Debian's promtool accepts it, and its alerts
fire on the incidents' series (tests/deploy/rules_test.yaml) under the metric names vLLM 0.31.0,
LMCache and Valkey really export."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.cell import VALKEY_IMAGE, by, container, render, render_cell
from tests.support.valkey import start_valkey

RULES = render.CHART / "files" / "prometheus-rules.yaml"
RULE_TESTS = Path(__file__).with_name("rules_test.yaml")
REPO = render.REPO


def promtool() -> str:
    for candidate in (os.environ.get("DIST_PROMTOOL"), str(REPO / "work" / "tools" / "bin" / "promtool"),
                      shutil.which("promtool")):
        if candidate and Path(candidate).is_file():
            return candidate
    pytest.fail("promtool not found: make test installs work/tools/bin/promtool (or set DIST_PROMTOOL)")


def run_promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def monitored():
    return render_cell("monitoring.podMonitors=true", "monitoring.prometheusRules=true",
                       "monitoring.valkeyExporter.enabled=true", f"monitoring.valkeyExporter.image={VALKEY_IMAGE}",
                       "monitoring.labels.release=kube-prometheus")


def test_monitoring_is_off_by_default():
    assert not [d for d in render_cell() if d["apiVersion"].startswith("monitoring.coreos.com/")]


def test_promtool_accepts_the_rules_file():
    done = run_promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 8 rules found" in done.stdout


def test_rendered_prometheus_rule_is_the_rules_file(monitored, tmp_path):
    rule = by(monitored, "PrometheusRule", "glm53-cell")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus"
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    rendered = tmp_path / "rendered-rules.yaml"
    rendered.write_text(yaml.safe_dump(rule["spec"]))
    done = run_promtool("check", "rules", str(rendered))
    assert done.returncode == 0 and "SUCCESS: 8 rules found" in done.stdout, done.stdout + done.stderr


def test_pod_monitors_select_pods_with_those_ports(monitored):
    monitors = {d["metadata"]["name"]: d for d in monitored if d["kind"] == "PodMonitor"}
    workloads = {"glm53-prefill": "StatefulSet", "glm53-decode": "StatefulSet", "valkey-lmcache": "StatefulSet",
                 "glm53-pd-proxy": "Deployment"}
    assert set(monitors) == set(workloads)
    for name, monitor in monitors.items():
        workload = by(monitored, workloads[name], name)
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert all(labels[k] == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
        ports = {p["name"] for c in workload["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        endpoints = monitor["spec"]["podMetricsEndpoints"]
        assert endpoints and all(endpoint["port"] in ports for endpoint in endpoints), (name, endpoints, ports)
    assert monitors["glm53-prefill"]["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"
    exporter = container(by(monitored, "StatefulSet", "valkey-lmcache"), "exporter")
    env = {e["name"]: e for e in exporter["env"]}
    assert env["REDIS_ADDR"]["value"] == "redis://localhost:6379"
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "glm53-valkey-auth", "key": "password"}
    policy = by(monitored, "NetworkPolicy", "valkey-lmcache")
    assert {"protocol": "TCP", "port": 9121} in policy["spec"]["ingress"][1]["ports"]


def test_alerts_fire_on_their_incidents():
    done = run_promtool("test", "rules", str(RULE_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


@pytest.mark.parametrize("metric, misspelt, alert", [
    ("redis_evicted_keys_total", "redis_evicted_total", "GLM53ValkeyChunksEvictedTooSoon"),
    ("lmcache:num_lookup_timeouts_total", "lmcache:lookup_timeouts_total", "GLM53LookupTimeouts"),
])
def test_a_misspelt_metric_fails_the_rule_tests(tmp_path, metric, misspelt, alert):
    """The unit tests are not a rubber stamp: one wrong metric name and its alert stays silent."""
    (tmp_path / "rules").mkdir()
    rules = tmp_path / "rules" / "prometheus-rules.yaml"
    text = RULES.read_text()
    assert text.count(metric) == 1
    rules.write_text(text.replace(metric, misspelt))
    tests = tmp_path / "rules_test.yaml"
    tests.write_text(RULE_TESTS.read_text().replace("../../configs/deploy/chart/files/prometheus-rules.yaml",
                                                    "rules/prometheus-rules.yaml"))
    done = run_promtool("test", "rules", str(tests))
    assert done.returncode == 1
    assert f"alertname: {alert}" in done.stdout + done.stderr


def _metric_names() -> set[str]:
    exprs = [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    return {m for e in exprs for m in re.findall(r"\b((?:vllm|lmcache|redis)[:_][a-z_:]+)(?=[{\[\s)]|$)", e)}


def _package_source(module: str, relative: str) -> str:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"{module} is not installed in this interpreter"
    return (Path(spec.origin).parent / relative).read_text()


def test_vllm_and_lmcache_metric_names_are_the_real_ones():
    """Each vllm:/lmcache: series the rules read is a prometheus_client Counter (read as _total)
    or Histogram (_bucket) of that name in vLLM 0.31.0's and LMCache's sources."""
    vllm_src = _package_source("vllm", "v1/metrics/loggers.py")
    lmcache_src = _package_source("lmcache", "observability.py")
    names = _metric_names()
    assert {n for n in names if n.startswith(("vllm:", "lmcache:"))} == {
        "vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total",
        "lmcache:remote_ping_errors_total", "lmcache:remote_time_to_get_bucket",
        "lmcache:num_lookup_timeouts_total"}
    for name in names:
        if name.startswith("vllm:"):
            base = name.removesuffix("_total")
            assert re.search(r"_counter_cls\(\s*name=" + re.escape(f'"{base}"'), vllm_src), name
        elif name.startswith("lmcache:"):
            base, suffix = re.match(r"(.*?)(_total|_bucket)$", name).groups()
            kind = {"_total": "_create_counter", "_bucket": "_create_histogram"}[suffix]
            assert re.search(re.escape(kind) + r"\(\s*name=" + re.escape(f'"{base}"'), lmcache_src), name


def test_valkey_reports_what_the_exporter_turns_into_the_redis_series(tmp_path):
    """redis_exporter derives redis_cpu_{user,sys}_main_thread_seconds_total, redis_evicted_keys_total
    and redis_db_keys from INFO fields: real Valkey 8.1 has each of them."""
    assert {n for n in _metric_names() if n.startswith("redis_")} == {
        "redis_cpu_user_main_thread_seconds_total", "redis_cpu_sys_main_thread_seconds_total",
        "redis_evicted_keys_total", "redis_db_keys", "redis_up"}
    server = start_valkey(tmp_path)
    try:
        client = server.client()
        client.set("k", "v")
        info = client.info("all")
        for field in ("used_cpu_user_main_thread", "used_cpu_sys_main_thread", "evicted_keys"):
            assert field in info, field
        assert info["db0"]["keys"] == 1
    finally:
        server.stop()
