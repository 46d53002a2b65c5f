"""Models and caches of the chart: the shared-file-system example (configs/deploy/examples/fsx-lustre.yaml)
and its PersistentVolume and claim, /cache as a claim per engine pod, the cache-warming Job (its
script run for real on a folder here), and the read-rate arithmetic of docs/deploy.md against the
rendered startup budget."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from tests.configs.support import DEPLOY, REPO
from tests.configs.test_deploy import K8S_VERSION, _validate_all, no_network  # noqa: F401 (fixture)
from tests.deploy.cell import IMAGE, by, container, render, render_cell, sets

FSX = DEPLOY / "examples" / "fsx-lustre.yaml"
CLAIM = ("cache.volume=null", "cache.claimTemplate.size=100Gi", "cache.claimTemplate.storageClassName=gp3",
         "cache.claimTemplate.accessModes={ReadWriteOnce}")
PVC_MODEL = ("model.volume.hostPath=null", "model.volume.persistentVolumeClaim.claimName=glm53-weights",
             "model.volume.persistentVolumeClaim.readOnly=true")


@pytest.fixture(scope="module")
def fsx():
    return render.render(sets(), values=[FSX])


@pytest.fixture(scope="module")
def defaults():
    return render_cell()


@pytest.fixture(scope="module")
def claimed():
    return render_cell(*CLAIM)


def _commented_manifests(path):
    """The objects between the '# --- begin' and '# --- end' lines of a values file's comments."""
    text = path.read_text()
    block = text.split("# --- begin: weights volume\n", 1)[1].split("# --- end: weights volume\n", 1)[0]
    lines = [line[2:] if line.startswith("# ") else line.lstrip("#") for line in block.splitlines()]
    return [d for d in yaml.safe_load_all("\n".join(lines)) if d]


def test_fsx_example_renders_valid_objects_with_no_hostpath(fsx, no_network):
    assert _validate_all(fsx) >= {"StatefulSet", "Deployment", "Job", "PodDisruptionBudget"}
    for role in ("prefill", "decode"):
        spec = by(fsx, "StatefulSet", f"glm53-{role}")["spec"]
        volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
        assert volumes["model"] == {"name": "model",
                                    "persistentVolumeClaim": {"claimName": "glm53-weights", "readOnly": True}}
        assert "cache" not in volumes   # a claim per pod instead
        assert not [v for v in volumes.values() if "hostPath" in v]


def test_the_examples_volume_and_claim_are_valid_and_bind(no_network):
    """The PersistentVolume and claim in the example's comments: valid objects, ReadOnlyMany, bound
    to each other by name, and the claim is the one the example's model.volume names."""
    import kubernetes_validate

    objects = _commented_manifests(FSX)
    assert [o["kind"] for o in objects] == ["PersistentVolume", "PersistentVolumeClaim"]
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    pv, pvc = objects
    assert pv["spec"]["accessModes"] == pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert pv["spec"]["csi"]["driver"] == "fsx.csi.aws.com"
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"] and pvc["spec"]["storageClassName"] == ""
    values = yaml.safe_load(FSX.read_text())
    assert values["model"]["volume"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_cache_claim_per_pod(claimed, role):
    sts = by(claimed, "StatefulSet", f"glm53-{role}")
    (template,) = sts["spec"]["volumeClaimTemplates"]
    assert template["metadata"]["name"] == "cache"
    assert template["spec"] == {"accessModes": ["ReadWriteOnce"], "storageClassName": "gp3",
                                "resources": {"requests": {"storage": "100Gi"}}}
    assert all(v["name"] != "cache" for v in sts["spec"]["template"]["spec"]["volumes"])
    assert {"name": "cache", "mountPath": "/cache"} in container(sts)["volumeMounts"]
    assert ({"name": "cache", "mountPath": "/cache"}
            in sts["spec"]["template"]["spec"]["initContainers"][0]["volumeMounts"])


def test_cache_claim_without_a_storage_class_uses_the_default():
    docs = render_cell("cache.volume=null", "cache.claimTemplate.size=50Gi",
                       "cache.claimTemplate.accessModes={ReadWriteOnce}")
    (template,) = by(docs, "StatefulSet", "glm53-prefill")["spec"]["volumeClaimTemplates"]
    assert "storageClassName" not in template["spec"]


def test_default_cache_is_the_hostpath_and_no_claim(defaults):
    for role in ("prefill", "decode"):
        assert "volumeClaimTemplates" not in by(defaults, "StatefulSet", f"glm53-{role}")["spec"]


def test_helm_lint_strict_passes_with_the_example():
    """helm lint keeps the keys a values file sets to null (helm template drops them): the chart
    counts the volume sources left, so the example lints as it renders."""
    out = subprocess.run([render.helm_binary(), "lint", "--strict", str(render.CHART), "-f", str(FSX),
                          *[a for s in sets() for a in ("--set", s)]], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("values, message", [
    (PVC_MODEL[1:], "model.volume: give one volume source, got 2 (hostPath, persistentVolumeClaim); "
                    "a values file that gives its own sets the default's to null beside it"),
    (("cache.volume.nfs.server=fs", "cache.volume.nfs.path=/c"), "cache.volume: give one volume source, got 2"),
    (CLAIM[1:], "cache: set cache.volume or cache.claimTemplate, not both"),
    (("cache.volume=null",), "cache: set cache.volume (a volume source) or cache.claimTemplate"),
    (("cache.volume=null", "cache.claimTemplate.size=lots", "cache.claimTemplate.accessModes={ReadWriteOnce}"),
     "cache.claimTemplate.size: 'lots' does not match pattern"),
    (("cache.volume=null", "cache.claimTemplate.size=1Gi", "cache.claimTemplate.accessModes={ReadOnlyMany}"),
     "cache.claimTemplate.accessModes.0: value must be one of"),
])
def test_bad_cache_values_are_refused(values, message):
    with pytest.raises(render.RenderError) as err:
        render_cell(*values)
    assert message in str(err.value)


# --- the cache-warming Job ----------------------------------------------------------------------


def test_cache_warming_is_off_by_default(defaults):
    assert not [d for d in defaults if d["kind"] == "Job"]


def test_cache_warming_job_reads_the_model_volume_read_only(fsx):
    (job,) = [d for d in fsx if d["kind"] == "Job"]
    assert job["metadata"]["name"].startswith("glm53-cache-warming-")
    pod = job["spec"]["template"]["spec"]
    c = container(job)
    assert c["image"] == IMAGE and "command" not in c   # the image's ENTRYPOINT: tini, then python3
    assert c["args"][:2] == ["python3", "-c"] and c["args"][3:] == ["/models/GLM-5.3-FP8", "32"]
    assert c["args"][2] == (render.CHART / "files" / "warm-weights.py").read_text()
    assert c["volumeMounts"] == [{"name": "model", "mountPath": "/models", "readOnly": True}]
    assert pod["volumes"] == [{"name": "model", "persistentVolumeClaim": {"claimName": "glm53-weights",
                                                                          "readOnly": True}}]
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    assert job["spec"]["backoffLimit"] == 2
    assert c["resources"] == {"requests": {"cpu": "4", "memory": "2Gi"}, "limits": {"memory": "2Gi"}}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True


def test_cache_warming_script_reads_every_file_and_reports_the_rate(fsx, tmp_path):
    """The Job's own arguments, run here over a folder of files (the model folder's place)."""
    (job,) = [d for d in fsx if d["kind"] == "Job"]
    args = container(job)["args"]
    model = tmp_path / "GLM-5.3-FP8"
    (model / "sub").mkdir(parents=True)
    sizes = {"model-00001.safetensors": 3 << 20, "model-00002.safetensors": (17 << 20) + 5,
             "config.json": 100, "sub/tokenizer.json": 0}
    for name, size in sizes.items():
        (model / name).write_bytes(b"\x01" * size)
    done = subprocess.run([sys.executable, *args[1:3], str(model), "4"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"warm: read (\d+) files, ([\d.]+) GB in \d+ s: [\d.]+ GB/s with 4 readers", last)
    assert match and int(match[1]) == 4, last
    assert float(match[2]) == round(sum(sizes.values()) / 1e9, 1)
    empty = subprocess.run([sys.executable, *args[1:3], str(tmp_path / "none"), "4"], capture_output=True, text=True)
    assert empty.returncode == 1 and "no files" in empty.stderr


def test_cache_warming_job_is_a_new_job_when_its_spec_changes(fsx):
    """A Job's pod template is immutable: a changed spec must come as a new name."""
    name = [d for d in fsx if d["kind"] == "Job"][0]["metadata"]["name"]
    more = [d for d in render.render(sets("cacheWarming.readers=64"), values=[FSX]) if d["kind"] == "Job"]
    assert name != more[0]["metadata"]["name"]
    assert name == "glm53-cache-warming-" + name.rsplit("-", 1)[1] and len(name.rsplit("-", 1)[1]) == 10


def test_cache_warming_of_a_hostpath_model_is_refused():
    with pytest.raises(render.RenderError) as err:
        render_cell("cacheWarming.enabled=true")
    assert "cacheWarming.enabled: model.volume is a hostPath" in str(err.value)


def test_cache_warming_with_a_claim_of_its_own(no_network):
    docs = render_cell("cacheWarming.enabled=true", "cacheWarming.nodeSelector.pool=cpu", "cacheWarming.cpu=8",
                       "cacheWarming.memory=4Gi", "cacheWarming.backoffLimit=0", *PVC_MODEL)
    (job,) = by(docs, "Job")
    assert job["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "cpu"} and job["spec"]["backoffLimit"] == 0
    assert container(job)["resources"]["requests"] == {"cpu": "8", "memory": "4Gi"}
    assert job["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "glm53-weights"


# --- the read rate docs/deploy.md asks of the model volume ----------------------------------------


def test_docs_read_rate_follows_the_rendered_startup_budget(defaults):
    """docs/deploy.md's arithmetic uses the timeout the engines get: 5 pods x ~750 GB inside
    VLLM_ENGINE_READY_TIMEOUT_S (the whole of it, and half of it)."""
    docs = defaults
    pods = (by(docs, "StatefulSet", "glm53-prefill")["spec"]["replicas"]
            + by(docs, "StatefulSet", "glm53-decode")["spec"]["replicas"])
    timeouts = {int(e["value"]) for role in ("prefill", "decode")
                for e in container(by(docs, "StatefulSet", f"glm53-{role}"))["env"]
                if e["name"] == "VLLM_ENGINE_READY_TIMEOUT_S"}
    (timeout,) = timeouts
    text = (REPO / "docs" / "deploy.md").read_text()
    total = pods * 750
    assert f"{pods} pods x 750 GB = {total:,} GB" in text
    assert f"VLLM_ENGINE_READY_TIMEOUT_S={timeout}" in text
    assert f"{total:,} GB / {timeout:,} s = {total / timeout:.2f} GB/s" in text
    assert f"{total:,} GB / {timeout // 2:,} s = {total / (timeout // 2):.2f} GB/s" in text
    assert f"{750 / (timeout // 2) * 1000:.0f} MB/s per pod" in text
