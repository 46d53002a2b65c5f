"""LMCache's KV copy for vLLM's CPU backend, loaded as a vLLM general plugin.

LMCache 0.5.5 has no connector for vLLM's CPU platform: ``CreateGPUConnector``
raises "No supported cpu connector found", and LMCache then switches itself
off (degraded mode) while the server starts and answers. ``register`` (entry
point ``dist_cpu_connector = dist_cpu_connector:register`` in the group
``vllm.general_plugins``: ``tests/support/engine.py``'s ``plugin_site`` links
this folder as ``dist_cpu_connector`` next to that entry-point metadata, on
the engine's PYTHONPATH) makes ``CreateGPUConnector`` return
:class:`.connector.CPUMLAConnector` on a CPU platform, for vLLM only, and
leaves every other case to LMCache. See that class for what it stands in for
(the GPU copy only) and what it does not do (CUDA streams).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys


TARGET = "lmcache.v1.gpu_connector"


def register() -> None:
    """vLLM calls this in every process it starts (API server, engine core, workers).

    LMCache is not imported here: importing it pulls in numba/llvmlite, whose
    objects break the CPU worker's Triton-kernel override scan that runs after
    the plugins load. The factory is replaced when LMCache imports it.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return  # never replace the real copy on a GPU platform
    if TARGET in sys.modules:
        _install(sys.modules[TARGET])
    elif not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs ``_install`` on ``lmcache.v1.gpu_connector`` right after it executes."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            _install(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _install(factory) -> None:
    if getattr(factory.CreateGPUConnector, "dist_cpu_connector", False):
        return
    original = factory.CreateGPUConnector

    def create(config, metadata, engine, layout_hints=None):
        from lmcache import torch_device_type
        from lmcache.utils import EngineType

        if engine != EngineType.VLLM or torch_device_type != "cpu":
            return original(config, metadata, engine, layout_hints=layout_hints)
        from .connector import CPUMLAConnector

        return CPUMLAConnector.from_metadata(config, metadata)

    create.dist_cpu_connector = True  # type: ignore[attr-defined]
    factory.CreateGPUConnector = create
