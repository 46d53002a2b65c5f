"""The Python distributions LMCache's gpu-marked tests import, beyond torch.

Found by importing the test modules, tests/support and the LMCache modules on
their path (``lmcache.v1.cache_engine``, ``.config``, ``.gpu_connector``,
``.pcp_collectives``), and by running the CPU scenarios of the same engine path
(tests/lmcache/test_0010_pcp_shard_load_faults.py and friends), in a plain venv
holding only torch (CPU) and the patched LMCache source with its common C++
extensions built in place: every ``No module named`` answered with one
distribution, until none was left (check_local.sh repeats the import part).

Each entry says who provides it on the GPU machine:

* ``device``: the GPU host's Python has it (its package list: python3 is
  /opt/torch/.venv's Python 3.12); the bundle
  does not carry it, and install_deps.py fails, naming it, if it is missing.
* ``bundle``: the bundle carries its wheel; installed only where the machine
  lacks it (or has it older than ``min_version``). Pure ones are py3-none-any;
  ``native`` ones are carried for each Python the bundle is made for
  (make_bundle.py --pythons), ``native-any`` ones are a platform binary that
  fits any Python (ninja).

vLLM and its kernels do not travel (hundreds of MB of native code built for
one torch); the tests that need it are skipped there (device_plugin.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Provider = Literal["device", "bundle"]
Kind = Literal["pure", "native", "native-any"]


@dataclass(frozen=True)
class Dist:
    name: str                 # distribution name as the test venv spells it
    modules: tuple[str, ...]  # what importing it proves it is there
    provider: Provider
    kind: Kind
    via: str                  # who imports it on the test path
    min_version: str | None = None  # a device copy older than this is replaced by the bundle's


DISTS: tuple[Dist, ...] = (
    # Native, the machine lacks them: carried per Python.
    Dist("msgspec", ("msgspec",), "bundle", "native", "lmcache/v1/multiprocess/custom_types.py (platform discovery)"),
    Dist("pyzmq", ("zmq",), "bundle", "native", "lmcache/v1/cache_controller/executor.py (local_cpu_backend)"),
    Dist("cryptography", ("cryptography",), "bundle", "native",
         "lmcache/v1/distributed/serde/aesgcm.py (l2_adapters config)"),
    Dist("cffi", ("_cffi_backend",), "bundle", "native", "cryptography"),
    Dist("caio", ("caio",), "bundle", "native", "aiofile"),
    # Pure, the machine lacks them.
    Dist("cachetools", ("cachetools",), "bundle", "pure", "lmcache/utils.py"),
    Dist("aiofile", ("aiofile",), "bundle", "pure", "lmcache/v1/storage_backend/gds_backend.py"),
    # Pure, the machine has them: carried so that a machine image without one still runs.
    Dist("prometheus_client", ("prometheus_client",), "bundle", "pure", "lmcache/observability.py"),
    Dist("py-cpuinfo", ("cpuinfo",), "bundle", "pure", "lmcache/usage_telemetry/env_probe.py"),
    Dist("sortedcontainers", ("sortedcontainers",), "bundle", "pure", "lmcache/v1/memory_management.py"),
    Dist("requests", ("requests",), "bundle", "pure", "lmcache/connections.py"),
    Dist("urllib3", ("urllib3",), "bundle", "pure", "requests"),
    Dist("idna", ("idna",), "bundle", "pure", "requests, yarl"),
    Dist("certifi", ("certifi",), "bundle", "pure", "requests"),
    Dist("aiohappyeyeballs", ("aiohappyeyeballs",), "bundle", "pure", "aiohttp"),
    Dist("aiosignal", ("aiosignal",), "bundle", "pure", "aiohttp"),
    Dist("attrs", ("attr",), "bundle", "pure", "aiohttp"),
    Dist("packaging", ("packaging",), "bundle", "pure", "transformers, pytest"),
    Dist("tqdm", ("tqdm",), "bundle", "pure", "transformers"),
    # tests/conftest.py uses new-style hook wrappers (hookimpl(wrapper=True)): pytest 8,
    # and the pluggy that pytest 9 (the carried one, if the machine's is older) requires.
    Dist("pytest", ("pytest",), "bundle", "pure", "the tests", min_version="8.0"),
    Dist("pluggy", ("pluggy",), "bundle", "pure", "pytest", min_version="1.5"),
    Dist("iniconfig", ("iniconfig",), "bundle", "pure", "pytest"),
    Dist("Pygments", ("pygments",), "bundle", "pure", "pytest"),
    # Building LMCache's extensions (setup.py build_ext): pyproject's SPDX
    # license string needs setuptools >= 77; ninja makes torch's BuildExtension
    # compile in parallel (without it every unit compiles one after another).
    Dist("setuptools", ("setuptools",), "bundle", "pure", "LMCache's setup.py", min_version="77"),
    Dist("ninja", ("ninja",), "bundle", "native-any", "torch.utils.cpp_extension (parallel build)"),
    # Native, the machine's image has them (built against its numpy / Python).
    Dist("numpy", ("numpy",), "device", "native", "lmcache, numba"),
    Dist("numba", ("numba",), "device", "native", "lmcache/v1/platform/torch_ops.py"),
    Dist("llvmlite", ("llvmlite",), "device", "native", "numba"),
    Dist("PyYAML", ("yaml",), "device", "native", "lmcache/v1/config, numba"),
    Dist("psutil", ("psutil",), "device", "native", "lmcache/usage_telemetry/env_probe.py"),
    Dist("aiohttp", ("aiohttp",), "device", "native", "lmcache/connections.py"),
    Dist("multidict", ("multidict",), "device", "native", "aiohttp"),
    Dist("yarl", ("yarl",), "device", "native", "aiohttp"),
    Dist("propcache", ("propcache",), "device", "native", "aiohttp"),
    Dist("frozenlist", ("frozenlist",), "device", "native", "aiohttp"),
    Dist("regex", ("regex",), "device", "native", "transformers"),
    Dist("safetensors", ("safetensors",), "device", "native", "transformers"),
    Dist("tokenizers", ("tokenizers",), "device", "native", "transformers (AutoTokenizer)"),
    # Pure but large and coupled to the machine's tokenizers / httpx: the image's.
    Dist("transformers", ("transformers",), "device", "pure", "lmcache/v1/token_database.py", min_version="5.4"),
    Dist("huggingface_hub", ("huggingface_hub",), "device", "pure", "transformers"),
)


def by_name() -> dict[str, Dist]:
    return {d.name: d for d in DISTS}
