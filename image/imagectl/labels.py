"""The image's provenance labels, derived from the manifest the sources stage wrote.

``make image`` passes these as build arguments of the runtime stage and, after
the build, checks the labels on the image against the manifest inside it.
"""
from __future__ import annotations

import hashlib

from .flashinfer_aot import DEVELOPMENT
from .keyepoch import image_epoch

UPSTREAMS = ("lmcache", "flashinfer", "vllm")

# What an image is: a release carries FlashInfer's artifact set (make image RELEASE=1 requires
# it); without it, DEVELOPMENT, in the words the self-test and the preflight use too.
RELEASE = "release: FlashInfer's artifact set and AOT modules baked in"


def image_kind(aot_status: str) -> str:
    """The ``io.glm53.image.kind`` label: release only when the FlashInfer modules were built
    from a complete artifact set (the flashinfer-wheel stage's status ``built``)."""
    return RELEASE if aot_status == "built" else DEVELOPMENT


def series_sha256(manifest: dict) -> str:
    """One hash over every upstream's series hash: names the whole patch set an image carries."""
    upstreams = manifest.get("upstreams", {})
    text = "".join(f"{name}:{upstreams[name]['series_sha256']}\n" for name in sorted(upstreams))
    return hashlib.sha256(text.encode()).hexdigest()


def kv_key_epoch(manifest: dict) -> str:
    """The ``io.glm53.kv-key-epoch`` label: the epoch the entrypoint gives LMCache (keyepoch.py)."""
    try:
        return image_epoch(manifest)
    except ValueError:
        return "unknown"


def build_args(manifest: dict, aot_status: str) -> dict[str, str]:
    upstreams = manifest.get("upstreams", {})
    args = {"PATCH_SERIES_SHA256": series_sha256(manifest), "FLASHINFER_AOT": aot_status,
            "IMAGE_KIND": image_kind(aot_status), "KV_KEY_EPOCH": kv_key_epoch(manifest)}
    for name in UPSTREAMS:
        args[f"{name.upper()}_PATCHED_TREE"] = upstreams.get(name, {}).get("patched_tree", "unknown")
    return args


LABEL_OF_ARG = {
    "PATCH_SERIES_SHA256": "io.glm53.patch-series.sha256",
    "LMCACHE_PATCHED_TREE": "io.glm53.lmcache.patched-tree",
    "FLASHINFER_PATCHED_TREE": "io.glm53.flashinfer.patched-tree",
    "VLLM_PATCHED_TREE": "io.glm53.vllm.patched-tree",
    "FLASHINFER_AOT": "io.glm53.flashinfer.fused-moe-aot",
    "IMAGE_KIND": "io.glm53.image.kind",
    "KV_KEY_EPOCH": "io.glm53.kv-key-epoch",
}


def mismatches(labels: dict[str, str], manifest: dict, aot_status: str) -> list[str]:
    """Labels on a built image that disagree with its manifest (empty when they agree)."""
    wrong = []
    for arg, value in build_args(manifest, aot_status).items():
        label = LABEL_OF_ARG[arg]
        if labels.get(label) != value:
            wrong.append(f"{label}={labels.get(label)!r}, manifest says {value!r}")
    return wrong
