"""The image's KV key epoch: LMCache's ``kv_key_epoch`` (patch 0030), from the build's trees.

Every LMCache chunk key carries the epoch, so the pods of two images that share a Valkey (an
upgrade, two cells on one L2) never load or overwrite each other's chunks, while the pods of one
image share them. 0028's ``kv_layout`` tag already keeps two chunk layouts apart; the epoch keeps
two builds of one layout apart, whose kernels or patches may write other bytes.

The epoch is derived from the patched source trees manifest.json names (vLLM, FlashInfer,
LMCache: the code that computes, copies and stores the KV), not from the image's digest, which
changes with any file (a Debian package, a tool, a preset): an image rebuilt from the same trees
keeps its epoch, and its chunks. The ``io.glm53.kv-key-epoch`` label shows it without a run.

The entrypoint sets ``LMCACHE_KV_KEY_EPOCH`` to it for the command it runs unless the operator
chose one: ``LMCACHE_KV_KEY_EPOCH`` in the environment (empty: no epoch, keys as an image
without 0030 writes them), or ``kv_key_epoch`` in the LMCache config file ``LMCACHE_CONFIG_FILE``
names (the chart writes its ``kvKeyEpoch`` there).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

ENV = "LMCACHE_KV_KEY_EPOCH"
CONFIG_KEY = "kv_key_epoch"
CONFIG_FILE_ENV = "LMCACHE_CONFIG_FILE"
# The upstreams whose trees the KV bytes depend on; the manifest must name each one's patched tree.
KV_UPSTREAMS = ("flashinfer", "lmcache", "vllm")
# 12 hex digits (48 bits): short enough to read in a key, far from colliding among a cell's builds.
LENGTH = 12


def image_epoch(manifest: dict) -> str:
    """The epoch of the build a manifest describes: the first LENGTH hex digits of the sha256 over
    each upstream's patched tree (every upstream the manifest names, sorted). ValueError when a
    tree of KV_UPSTREAMS is missing."""
    upstreams = manifest.get("upstreams") or {}
    missing = [name for name in KV_UPSTREAMS if not (upstreams.get(name) or {}).get("patched_tree")]
    if missing:
        raise ValueError(f"the manifest names no patched tree of {', '.join(missing)}")
    trees = {name: entry.get("patched_tree") for name, entry in upstreams.items()}
    text = "".join(f"{name}:{trees[name]}\n" for name in sorted(trees) if trees[name])
    return hashlib.sha256(text.encode()).hexdigest()[:LENGTH]


def config_sets_epoch(path: Path) -> bool:
    """Whether the LMCache config file at ``path`` sets ``kv_key_epoch`` (null or not: LMCache then
    takes the file's value). False for a file that cannot be read or parsed; LMCache names it."""
    try:
        import yaml

        data = yaml.safe_load(path.read_text())
    except Exception:  # noqa: BLE001 - unreadable, or not YAML: LMCache names the file itself
        return False
    return isinstance(data, dict) and CONFIG_KEY in data


def default_env(environ: Mapping[str, str], manifest_path: Path) -> tuple[dict[str, str], str]:
    """What the entrypoint adds to the command's environment, and the line it logs."""
    if ENV in environ:
        chosen = environ[ENV]
        return {}, f"{ENV}={chosen} (set by the operator)" if chosen else \
            f"{ENV} is empty: chunk keys carry no key epoch (set by the operator)"
    config = environ.get(CONFIG_FILE_ENV)
    if config and config_sets_epoch(Path(config)):
        return {}, f"{CONFIG_KEY} from {config}"
    try:
        epoch = image_epoch(json.loads(manifest_path.read_text()))
    except (OSError, ValueError) as exc:
        return {}, f"no KV key epoch ({manifest_path}: {exc}): chunk keys carry none"
    return {ENV: epoch}, f"{ENV}={epoch} (the image's KV key epoch, from its vLLM, FlashInfer and LMCache trees)"
