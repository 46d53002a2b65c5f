"""Pod Security and EFA huge pages of the chart.

Pod Security: every rendered pod template is checked against the controls of Kubernetes' Pod
Security Standards (baseline, then restricted), as the Kubernetes documentation lists them, by
the small checker below. docs/deploy.md ("Pod Security") states the profile each object meets;
these tests hold it to that: with the defaults only the engines' hostPath volumes keep them out of
baseline, and with the shared-file-system example every pod of the cell meets restricted.

Huge pages: hugepages-2Mi requested (= limited) on the engine and preflight containers by default;
with hugepages2Mi null, no request and FI_EFA_USE_HUGE_PAGE=0."""
from __future__ import annotations

import pytest

from tests.configs.support import DEPLOY
from tests.deploy.cell import VALKEY_IMAGE, by, container, render, render_cell, sets

FSX = DEPLOY / "examples" / "fsx-lustre.yaml"
WORKLOADS = ("StatefulSet", "Deployment", "Job", "DaemonSet")

# Pod Security Standards: the capabilities baseline allows to add, and the volume types restricted allows.
BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                 "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}


def _containers(pod):
    return [*pod.get("initContainers", []), *pod["containers"], *pod.get("ephemeralContainers", [])]


def baseline_violations(pod: dict) -> list[str]:
    found = []
    sc = pod.get("securityContext", {})
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            found.append(f"host namespaces: {key}")
    hostpaths = [v["name"] for v in pod.get("volumes", []) if "hostPath" in v]
    if hostpaths:
        found.append(f"hostPath volumes: {', '.join(hostpaths)}")
    if sc.get("windowsOptions", {}).get("hostProcess"):
        found.append("hostProcess")
    if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        found.append("seccomp Unconfined (pod)")
    bad_sysctls = [s["name"] for s in sc.get("sysctls", []) if s["name"] not in SAFE_SYSCTLS]
    if bad_sysctls:
        found.append(f"sysctls: {bad_sysctls}")
    for c in _containers(pod):
        csc = c.get("securityContext", {})
        if csc.get("privileged"):
            found.append(f"{c['name']}: privileged")
        added = set((csc.get("capabilities") or {}).get("add", [])) - BASELINE_CAPS
        if added:
            found.append(f"{c['name']}: capabilities added {sorted(added)}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            found.append(f"{c['name']}: hostPort")
        if csc.get("procMount", "Default") != "Default":
            found.append(f"{c['name']}: procMount")
        if (csc.get("seccompProfile") or {}).get("type") == "Unconfined":
            found.append(f"{c['name']}: seccomp Unconfined")
        if csc.get("windowsOptions", {}).get("hostProcess"):
            found.append(f"{c['name']}: hostProcess")
    return found


def restricted_violations(pod: dict) -> list[str]:
    found = baseline_violations(pod)
    sc = pod.get("securityContext", {})
    for v in pod.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume {v['name']}: type {sorted(kinds)}")
    pod_seccomp = (sc.get("seccompProfile") or {}).get("type")
    for c in _containers(pod):
        csc = c.get("securityContext", {})
        if csc.get("allowPrivilegeEscalation") is not False:
            found.append(f"{c['name']}: allowPrivilegeEscalation not false")
        if not csc.get("runAsNonRoot", sc.get("runAsNonRoot")):
            found.append(f"{c['name']}: runAsNonRoot not true")
        if csc.get("runAsUser", sc.get("runAsUser")) == 0:
            found.append(f"{c['name']}: runAsUser 0")
        if csc.get("seccompProfile", {}).get("type", pod_seccomp) not in ("RuntimeDefault", "Localhost"):
            found.append(f"{c['name']}: seccomp not RuntimeDefault/Localhost")
        caps = csc.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            found.append(f"{c['name']}: capabilities not dropping ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{c['name']}: capabilities added")
    return found


@pytest.fixture(scope="module")
def defaults():
    return render_cell()


@pytest.fixture(scope="module")
def no_huge_pages():
    return render_cell("hugepages2Mi=null")


def pods(docs):
    return {f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"]["spec"]
            for d in docs if d["kind"] in WORKLOADS}


def test_the_checker_catches_what_each_profile_forbids():
    pod = {"securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
           "volumes": [{"name": "x", "emptyDir": {}}],
           "containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False,
                                                             "capabilities": {"drop": ["ALL"]}}}]}
    assert restricted_violations(pod) == []
    pod["volumes"].append({"name": "h", "hostPath": {"path": "/"}})
    assert baseline_violations(pod) == ["hostPath volumes: h"]
    pod["volumes"].pop()
    pod["containers"][0]["securityContext"]["capabilities"] = {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert baseline_violations(pod) == ["c: capabilities added ['SYS_ADMIN']"]
    pod["containers"][0]["securityContext"]["capabilities"] = {"drop": ["ALL"], "add": ["CHOWN"]}
    assert baseline_violations(pod) == [] and restricted_violations(pod) == ["c: capabilities added"]
    pod["containers"][0]["securityContext"] = {"capabilities": {"drop": ["ALL"]}}
    assert restricted_violations(pod) == ["c: allowPrivilegeEscalation not false"]
    pod["containers"][0]["securityContext"] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                               "runAsUser": 0}
    assert restricted_violations(pod) == ["c: runAsUser 0"]


def test_with_the_defaults_only_the_engines_hostpaths_leave_baseline(defaults):
    """Valkey and the router meet restricted; the engine pods miss baseline for their hostPath
    model and cache volumes alone (docs/deploy.md: what hostPath costs)."""
    found = {name: (baseline_violations(pod), restricted_violations(pod)) for name, pod in pods(defaults).items()}
    assert found.pop("StatefulSet/valkey-lmcache") == ([], [])
    assert found.pop("Deployment/glm53-pd-proxy") == ([], [])
    for role in ("prefill", "decode"):
        baseline, restricted = found.pop(f"StatefulSet/glm53-{role}")
        assert baseline == ["hostPath volumes: model, cache"]
        assert restricted == baseline + ["volume model: type ['hostPath']", "volume cache: type ['hostPath']"]
    assert not found


def test_with_the_shared_file_system_example_every_pod_meets_restricted():
    docs = render.render(sets("monitoring.valkeyExporter.enabled=true",
                              f"monitoring.valkeyExporter.image={VALKEY_IMAGE}"),
                         values=[FSX])
    found = {name: restricted_violations(pod) for name, pod in pods(docs).items()}
    assert set(found) == {"StatefulSet/valkey-lmcache", "Deployment/glm53-pd-proxy", "StatefulSet/glm53-prefill",
                          "StatefulSet/glm53-decode", f"Job/{by(docs, 'Job')[0]['metadata']['name']}"}
    assert found == {name: [] for name in found}


def test_the_nodes_libfabric_is_a_hostpath_again():
    docs = render.render(sets("nixlHostLibfabric=/opt/amazon/efa"), values=[FSX])
    for role in ("prefill", "decode"):
        assert baseline_violations(pods(docs)[f"StatefulSet/glm53-{role}"]) == ["hostPath volumes: nixl-libfabric"]


# --- EFA huge pages -----------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engine_pods_request_huge_pages_for_efa(defaults, role):
    spec = by(defaults, "StatefulSet", f"glm53-{role}")["spec"]["template"]["spec"]
    for c in (spec["containers"][0], spec["initContainers"][0]):
        assert c["resources"]["requests"]["hugepages-2Mi"] == c["resources"]["limits"]["hugepages-2Mi"] == "5120Mi"
        assert "FI_EFA_USE_HUGE_PAGE" not in {e["name"] for e in c["env"]}
    # No hugetlbfs volume: libfabric maps its huge pages anonymously.
    assert not [v for v in spec["volumes"] if (v.get("emptyDir") or {}).get("medium", "").startswith("HugePages")]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_without_huge_pages_efa_is_told_to_use_regular_pages(no_huge_pages, role):
    spec = by(no_huge_pages, "StatefulSet", f"glm53-{role}")["spec"]["template"]["spec"]
    for c in (spec["containers"][0], spec["initContainers"][0]):
        assert not [k for part in c["resources"].values() for k in part if k.startswith("hugepages")]
        assert {"name": "FI_EFA_USE_HUGE_PAGE", "value": "0"} in c["env"]


def test_other_huge_page_amounts():
    docs = render_cell("hugepages2Mi=4Gi")
    limits = container(by(docs, "StatefulSet", "glm53-decode"))["resources"]["limits"]
    assert limits["hugepages-2Mi"] == "4Gi"
    assert "hugepages-2Mi" not in container(by(docs, "StatefulSet", "valkey-lmcache"), "valkey")["resources"]["limits"]


@pytest.mark.parametrize("value, message", [
    ("5121Mi", 'hugepages2Mi "5121Mi" is not a whole number of 2 MiB pages'),
    ("5G", "hugepages2Mi: '5G' does not match pattern"),
    ("0Mi", "hugepages2Mi: '0Mi' does not match pattern"),
])
def test_bad_huge_page_amounts_are_refused(value, message):
    with pytest.raises(render.RenderError) as err:
        render_cell(f"hugepages2Mi={value}")
    assert message in str(err.value)


def test_infiniband_example_drops_the_efa_huge_pages():
    docs = render.render(sets(), values=[DEPLOY / "examples" / "infiniband.yaml"])
    c = container(by(docs, "StatefulSet", "glm53-prefill"))
    assert "hugepages-2Mi" not in c["resources"]["limits"]
