#!/usr/bin/env python3
"""Validate the GLM-5.3 launch configs with the pinned engines' own loaders.

    python3 configs/validate.py configs/prefill/vllm.yaml configs/prefill/lmcache.yaml configs/prefill/env

A file's kind comes from its name: ``vllm.yaml`` (a ``vllm serve --config``
file), ``lmcache.yaml`` (an LMCache engine config), ``env`` (KEY=VALUE lines).
Each check stops at the first problem and raises :class:`ConfigError`, whose
message names the file and the key: ``configs/prefill/lmcache.yaml: key
'chunk_sise': unknown LMCache config key (did you mean 'chunk_size'?)``.

How far each check goes (configs/README.md, "Validation", says why):

* vLLM (needs the vllm 0.31.0 wheel, no GPU): every key is an option of
  ``vllm serve``; every JSON-valued key validates against its vLLM config
  class; vLLM's own parser (``vllm serve <model> --config FILE``), its serve
  argument checks and ``AsyncEngineArgs.from_cli_args``; then the config
  objects that need neither the model's files nor a GPU: ``ParallelConfig``,
  the ``KVTransferConfig`` of every MultiConnector child built the way
  MultiConnector builds it, and each connector class resolved by vLLM's
  ``KVConnectorFactory``; and the kernel pins: ``moe-backend`` (not auto, one
  vLLM's FP8 MoE oracle maps) and ``attention-backend`` are set and valid for
  vLLM's ``KernelConfig`` / ``AttentionConfig``.
* LMCache (needs the lmcache package): every key is an LMCache config key with
  the declared type (LMCache's own loader only logs unknown keys and turns a
  value it cannot convert into None), the ``extra_config`` keys the
  distribution uses, then ``LMCacheEngineConfig.from_file`` +
  ``update_config_from_env`` (which runs LMCache's ``validate``) under the
  role's env file.
* env: KEY=VALUE syntax; ``VLLM_*`` names vLLM 0.31.0 reads, with values its
  own parsers accept (needs vllm); ``LMCACHE_*`` limited to the config file
  path, so the YAML stays the single source; no ``expandable_segments:True``
  (vLLM refuses it with a KV connector); the offline switches
  (``OFFLINE_SWITCHES``) are ``0`` or ``1``; no variable the image sets
  itself (``IMAGE_SET``).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import logging
import os
import re
import string
import sys
import typing
from pathlib import Path
from typing import Any, Iterator

import yaml

DEFAULT_MODEL = "/models/GLM-5.3-FP8"

# LMCache reads extra_config keys ad hoc (config.get_extra_config_value), so
# its loader cannot tell a typo from a new key. These are the keys the
# distribution's configs may use, with their types and where they are read.
EXTRA_CONFIG_KEYS: dict[str, tuple[type, str]] = {
    "pcp_shard_store": (bool, "the distribution's sharded-store patches 0009-0012"),
    "resp_num_threads": (int, "lmcache/v1/storage_backend/connector/redis_adapter.py"),
    "save_only_first_rank": (bool, "lmcache/v1/cache_engine.py, token_database.py"),
    "first_rank_max_local_cpu_size": (float, "lmcache/v1/storage_backend/local_cpu_backend.py"),
    "remote_enable_mla_worker_id_as0": (bool, "lmcache/v1/storage_backend/remote_backend.py"),
}

# LMCACHE_* variables the env files may set: the config file path only (an
# LMCACHE_<KEY> would silently override the YAML), plus the RESP credentials
# that redis_adapter.py reads from the environment and never logs.
LMCACHE_ENV_ALLOWED = {"LMCACHE_CONFIG_FILE", "LMCACHE_RESP_USERNAME", "LMCACHE_RESP_PASSWORD"}

# The presets' offline defaults. vLLM turns VLLM_NO_USAGE_STATS and DO_NOT_TRACK on only for
# exactly "1" (envs.py), so any other value would leave the node reporting without a word.
OFFLINE_SWITCHES = {
    "HF_HUB_OFFLINE": "huggingface_hub: nothing is fetched from the Hub",
    "VLLM_NO_USAGE_STATS": "vLLM's usage statistics (vllm/usage/usage_lib.py)",
    "DO_NOT_TRACK": "the do-not-track convention vLLM, LMCache and huggingface_hub honour",
}

# Variables the image sets from what it carries; a preset value would contradict it.
IMAGE_SET = {
    "VLLM_HAS_FLASHINFER_CUBIN": "the image sets it to 1 only when it carries FlashInfer's artifact set; "
                                 "in a preset it would tell vLLM that a development image has cubins it lacks",
}


class ConfigError(Exception):
    """A config problem, located by file and (where known) key."""

    def __init__(self, path: str | os.PathLike, key: str | None, message: str):
        self.path = str(path)
        self.key = key
        self.message = message
        where = f"{self.path}: key '{key}'" if key is not None else self.path
        super().__init__(f"{where}: {message}")


def _suggest(word: str, candidates) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.75)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _load_mapping(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(path, None, "file not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(path, None, f"not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(path, None, f"expected a mapping of keys to values, got {type(data).__name__}")
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(path, str(key), "keys must be strings")
    return data


# --------------------------------------------------------------------------
# env files


def read_env_file(path: str | os.PathLike) -> dict[str, str]:
    """KEY=VALUE lines (docker --env-file format); # comments and blank lines."""
    path = Path(path)
    env: dict[str, str] = {}
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise ConfigError(path, None, "file not found") from None
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ConfigError(path, None, f"line {number}: expected KEY=VALUE, got {raw!r}")
        if key in env:
            raise ConfigError(path, key, f"line {number}: set twice")
        if value != value.strip() or value[:1] in ("'", '"'):
            raise ConfigError(path, key, f"line {number}: no quotes or surrounding spaces "
                              "(docker --env-file keeps them literally)")
        env[key] = value
    return env


def check_env_file(path: str | os.PathLike, *, vllm: bool = True, lmcache: bool = True) -> dict[str, str]:
    """Check an env file; ``vllm``/``lmcache`` turn on the checks that import them."""
    path = Path(path)
    env = read_env_file(path)
    for key, value in env.items():
        if key == "PYTORCH_CUDA_ALLOC_CONF" and "expandable_segments:True" in value:
            raise ConfigError(path, key, "vLLM 0.31.0 refuses expandable_segments:True with a KV "
                              "connector (config/vllm.py _verify_kv_transfer_compat)")
        if key in IMAGE_SET:
            raise ConfigError(path, key, f"set by the image, not by a preset: {IMAGE_SET[key]}")
        if key in OFFLINE_SWITCHES and value not in ("0", "1"):
            raise ConfigError(path, key, f"{value!r} is neither 0 nor 1 ({OFFLINE_SWITCHES[key]}; "
                              "only 1 turns it on)")
        if key.startswith("LMCACHE_") and key not in LMCACHE_ENV_ALLOWED:
            if lmcache:
                from lmcache.v1.config import _CONFIG_DEFINITIONS
                name = key[len("LMCACHE_"):].lower()
                if name in _CONFIG_DEFINITIONS:
                    raise ConfigError(path, key, f"overrides lmcache.yaml's '{name}' silently; "
                                      "set it in the LMCache YAML instead")
            raise ConfigError(path, key, "not an LMCACHE_* variable the distribution sets "
                              f"(allowed: {', '.join(sorted(LMCACHE_ENV_ALLOWED))})")
        if key.startswith("VLLM_") and vllm:
            import vllm.envs as envs
            getter = envs.environment_variables.get(key)
            if getter is None:
                raise ConfigError(path, key, "not an environment variable vLLM 0.31.0 reads"
                                  + _suggest(key, envs.environment_variables))
            with _patched_environ({key: value}):
                try:
                    getter()
                except Exception as e:  # vLLM's own parser for the variable
                    raise ConfigError(path, key, f"vLLM 0.31.0 cannot parse {value!r}: {e}") from None
    return env


@contextlib.contextmanager
def _patched_environ(values: dict[str, str], drop_prefix: str | None = None) -> Iterator[None]:
    saved = dict(os.environ)
    try:
        if drop_prefix:
            for key in [k for k in os.environ if k.startswith(drop_prefix)]:
                del os.environ[key]
        os.environ.update(values)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


# --------------------------------------------------------------------------
# LMCache


def _type_name(tp: Any) -> str:
    """A declared type as a user reads it: ``Optional[str]`` is "str or None", not "Optional"."""
    if typing.get_origin(tp) is typing.Union:
        return " or ".join("None" if arg is type(None) else _type_name(arg) for arg in typing.get_args(tp))
    if typing.get_origin(tp) is not None:
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _matches(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        return any(_matches(value, arg) for arg in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is typing.Any:
        return True
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if tp is dict or origin is dict:
        return isinstance(value, dict)
    if tp is list or origin is list:
        if not isinstance(value, list):
            return False
        args = typing.get_args(tp)
        return not args or all(_matches(v, args[0]) for v in value)
    return isinstance(value, tp) if isinstance(tp, type) else True


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def check_remote_url(path: Path, url: str) -> None:
    """``{rank}`` is the only placeholder the patched LMCache substitutes."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(url) if f is not None]
    except ValueError as e:
        raise ConfigError(path, "remote_url", f"malformed placeholder in {url!r}: {e}") from None
    for field in fields:
        if field != "rank":
            raise ConfigError(path, "remote_url", f"unknown placeholder {{{field}}} in {url!r}; "
                              "only {rank} is substituted")
    if len(fields) > 1:
        raise ConfigError(path, "remote_url", f"{{rank}} appears {len(fields)} times in {url!r}")
    if not url.startswith("resp://"):
        raise ConfigError(path, "remote_url", f"{url!r}: the Valkey tier is reached with resp://")


def check_lmcache_file(path: str | os.PathLike, env_file: str | os.PathLike | None = None):
    """Check an LMCache YAML; returns the LMCacheEngineConfig LMCache loaded."""
    path = Path(path)
    data = _load_mapping(path)
    from lmcache.v1.config import _CONFIG_ALIASES, _CONFIG_DEFINITIONS, LMCacheEngineConfig

    for key, value in data.items():
        if key in _CONFIG_ALIASES:
            raise ConfigError(path, key, f"deprecated alias of '{_CONFIG_ALIASES[key]}'; use that name")
        if key not in _CONFIG_DEFINITIONS:
            raise ConfigError(path, key, "unknown LMCache config key" + _suggest(key, _CONFIG_DEFINITIONS))
        declared = _CONFIG_DEFINITIONS[key]["type"]
        if not _matches(value, declared):
            raise ConfigError(path, key, f"expected {_type_name(declared)}, got "
                              f"{type(value).__name__} {value!r}")
    extra = data.get("extra_config") or {}
    for key, value in extra.items():
        if key not in EXTRA_CONFIG_KEYS:
            raise ConfigError(path, f"extra_config.{key}", "not an extra_config key the distribution "
                              "knows LMCache to read" + _suggest(key, EXTRA_CONFIG_KEYS)
                              + " (add it to EXTRA_CONFIG_KEYS in configs/validate.py with its source)")
        declared, _ = EXTRA_CONFIG_KEYS[key]
        if not _matches(value, declared):
            raise ConfigError(path, f"extra_config.{key}", f"expected {_type_name(declared)}, got "
                              f"{type(value).__name__} {value!r}")
    if isinstance(data.get("remote_url"), str):
        check_remote_url(path, data["remote_url"])

    env = read_env_file(env_file) if env_file is not None else {}
    env = {k: v for k, v in env.items() if k != "LMCACHE_CONFIG_FILE"}
    collect = _Collect()
    loggers = [logging.getLogger(name) for name in ("lmcache.v1.config_base", "lmcache.v1.config")]
    for lg in loggers:
        lg.addHandler(collect)
    try:
        # The same two calls as lmcache_get_or_create_config (LMCache's vLLM
        # adapter), with the process's own LMCACHE_* variables removed.
        with _patched_environ(env, drop_prefix="LMCACHE_"):
            try:
                config = LMCacheEngineConfig.from_file(str(path))
                config.update_config_from_env()
            except Exception as e:  # LMCache's validate() raises ValueError/AssertionError
                message = f"{e}"
                key = next((k for k in data if re.search(rf"\b{re.escape(k)}\b", message)), None)
                raise ConfigError(path, key, f"LMCache's loader refused it: {type(e).__name__}: {message}") from None
    finally:
        for lg in loggers:
            lg.removeHandler(collect)
    for record in collect.records:
        message = record.getMessage()
        key = next((k for k in data if re.search(rf"\b{re.escape(k)}\b", message)), None)
        raise ConfigError(path, key, f"LMCache's loader warned: {message}")
    for key, value in data.items():
        loaded = getattr(config, key)
        if loaded != value and not (isinstance(value, int) and loaded == float(value)):
            raise ConfigError(path, key, f"LMCache loaded {loaded!r} from {value!r}")
    return config


# --------------------------------------------------------------------------
# vLLM


@dataclasses.dataclass
class VllmCheck:
    """What the vLLM check built, for tests and the report."""

    path: Path
    args: argparse.Namespace
    engine_args: Any
    parallel_config: Any
    kv_transfer_config: Any = None
    connector_class: Any = None
    children: list = dataclasses.field(default_factory=list)  # [(KVTransferConfig, class)]
    hma_supported: bool | None = None
    moe_backend: str | None = None        # KernelConfig.moe_backend, as vLLM normalizes it
    attention_backend: Any = None         # AttentionConfig.backend (an AttentionBackendEnum)


# The kernels every role pins (configs/README.md, "Kernels and model"): with
# "auto" vLLM falls back silently (FP8 MoE to DeepGEMM or Triton when FlashInfer
# is missing), with a named backend it raises at start.
PINNED_KERNEL_KEYS = ("moe-backend", "attention-backend")


_SERVE_PARSER = None


def use_cpu_platform_if_unspecified() -> str:
    """Give vLLM a platform on a machine without a GPU; returns its device type.

    vLLM picks a platform at import; without CUDA (no libcuda.so.1) it finds
    none, and building the serve parser fails ("Failed to infer device
    type"). vLLM's own CLI falls back to its CPU platform in that case for
    ``vllm bench`` (entrypoints/cli/main.py); this does the same. It affects
    platform-derived defaults only (e.g. kv_buffer_device when unset).
    """
    import vllm.platforms as platforms

    if platforms.current_platform.is_unspecified():
        from vllm.platforms.cpu import CpuPlatform

        platforms.current_platform = CpuPlatform()
    return platforms.current_platform.device_type


def serve_parser():
    """The parser of ``vllm serve``, built as vLLM's CLI main() builds it."""
    global _SERVE_PARSER
    if _SERVE_PARSER is None:
        use_cpu_platform_if_unspecified()
        from vllm.entrypoints.cli.serve import ServeSubcommand
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = FlexibleArgumentParser(description="vLLM CLI")
        subparsers = parser.add_subparsers(required=False, dest="subparser")
        serve = ServeSubcommand().subparser_init(subparsers)
        _SERVE_PARSER = (parser, serve)
    return _SERVE_PARSER


class _ParseError(Exception):
    pass


def _raise_instead_of_exit(message: str):
    raise _ParseError(message)


def _option_key(data: dict, message: str) -> str | None:
    """The YAML key an argparse message ("argument --x/-y: ...") is about."""
    match = re.match(r"argument ([^:]+):", message)
    if not match:
        return None
    options = match.group(1).split("/")
    for key in data:
        if f"--{key.replace('_', '-')}" in options:
            return key
    return None


def _dataclass_of(dest: str):
    """The vLLM config class of a JSON-valued EngineArgs field, if any."""
    from vllm.engine.arg_utils import AsyncEngineArgs, get_type_hints

    field = next((f for f in dataclasses.fields(AsyncEngineArgs) if f.name == dest), None)
    if field is None:
        return None
    return next((th for th in get_type_hints(field.type) if dataclasses.is_dataclass(th)), None)


def _pydantic_error(path: Path, key: str, error) -> ConfigError:
    first = error.errors()[0]
    loc = ".".join(str(part) for part in first.get("loc", ()))
    return ConfigError(path, f"{key}.{loc}" if loc else key, first.get("msg", str(error)))


def check_vllm_file(path: str | os.PathLike, model: str = DEFAULT_MODEL) -> VllmCheck:
    """Check a ``vllm serve --config`` YAML as far as a CPU-only machine allows."""
    path = Path(path)
    data = _load_mapping(path)
    parser, serve = serve_parser()
    actions = serve._option_string_actions
    _check_keys(path, data, actions)
    _check_json_values(path, data, actions)
    args = _parse_as_vllm(path, data, parser, serve, model)
    check = _build_configs(path, args)
    if check.engine_args.kv_transfer_config is not None:
        _check_kv_transfer(path, check)
    check_kernel_pins(path, data, check.engine_args, check)
    return check


def _check_keys(path: Path, data: dict, actions: dict) -> None:
    """Every key is an exact option of ``vllm serve``: argparse accepts unambiguous prefixes
    (allow_abbrev), so a truncated key could slip through vLLM's parser."""
    for key, value in data.items():
        option = "--" + key.replace("_", "-")
        if option not in actions:
            names = {o[2:] for o in actions if o.startswith("--")}
            raise ConfigError(path, key, "not an option of `vllm serve` in vLLM 0.31.0"
                              + _suggest(key.replace("_", "-"), names))
        if isinstance(value, bool) and value is False and f"--no-{key.replace('_', '-')}" not in actions:
            raise ConfigError(path, key, "false is dropped silently by vLLM's config loader for a "
                              "flag without a --no- form; remove the key")


def _check_json_values(path: Path, data: dict, actions: dict) -> None:
    """JSON-valued keys against their config classes, for a located message."""
    from pydantic import TypeAdapter, ValidationError

    for key, value in data.items():
        if not isinstance(value, dict):
            continue
        cls = _dataclass_of(actions["--" + key.replace("_", "-")].dest)
        if cls is None:
            continue
        try:
            TypeAdapter(cls).validate_json(json.dumps(value))
        except ValidationError as e:
            raise _pydantic_error(path, key, e) from None


def _parse_as_vllm(path: Path, data: dict, parser, serve, model: str):
    """vLLM's own parse of ``vllm serve <model> --config FILE`` and its serve checks."""
    saved = parser.error, serve.error
    parser.error = serve.error = _raise_instead_of_exit
    try:
        args = parser.parse_args(["serve", model, "--config", str(path)])
    except _ParseError as e:
        message = str(e)
        raise ConfigError(path, _option_key(data, message), f"vLLM's parser: {message}") from None
    except (ValueError, TypeError, AssertionError) as e:
        raise ConfigError(path, None, f"vLLM's parser: {e}") from None
    finally:
        parser.error, serve.error = saved

    from vllm.entrypoints.cli.serve import ServeSubcommand

    try:
        ServeSubcommand().validate(args)
    except (ValueError, TypeError) as e:
        raise ConfigError(path, None, f"vLLM's serve checks: {e}") from None
    args.model = args.model_tag  # what ServeSubcommand.cmd does
    return args


def _build_configs(path: Path, args) -> VllmCheck:
    """The engine args and the config objects that need neither the model's files nor a GPU."""
    from pydantic import ValidationError
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    engine_args = AsyncEngineArgs.from_cli_args(args)
    parallel_fields = {
        f.name: getattr(engine_args, f.name)
        for f in dataclasses.fields(ParallelConfig)
        if f.init and not f.name.startswith("_") and getattr(engine_args, f.name, None) is not None
    }
    try:
        parallel = ParallelConfig(**parallel_fields)
    except ValidationError as e:
        raise ConfigError(path, None, f"vLLM's ParallelConfig: {e.errors()[0].get('msg')}") from None
    except ValueError as e:
        raise ConfigError(path, None, f"vLLM's ParallelConfig: {e}") from None
    return VllmCheck(path, args, engine_args, parallel)


def _check_kv_transfer(path: Path, check: VllmCheck) -> None:
    """The KV connector class vLLM would load, each MultiConnector child's, and HMA support."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    ktc = check.engine_args.kv_transfer_config
    check.kv_transfer_config = ktc
    try:
        check.connector_class = KVConnectorFactory.get_connector_class(ktc)
    except (ValueError, AttributeError, ImportError) as e:
        raise ConfigError(path, "kv-transfer-config.kv_connector", str(e)) from None
    if ktc.kv_connector == "MultiConnector":
        _check_multi_connector_children(path, ktc, check)
    check.hma_supported = KVConnectorFactory.supports_hma_config(ktc)


def _check_multi_connector_children(path: Path, ktc, check: VllmCheck) -> None:
    """Each child config as MultiConnector._get_connector_classes_and_configs builds it."""
    from pydantic import ValidationError
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    children = ktc.kv_connector_extra_config.get("connectors")
    base = "kv-transfer-config.kv_connector_extra_config.connectors"
    if not isinstance(children, list) or not children:
        raise ConfigError(path, base, "MultiConnector needs a non-empty list of child configs")
    for i, child in enumerate(children):
        if not isinstance(child, dict):
            raise ConfigError(path, f"{base}[{i}]", "expected a mapping")
        if "engine_id" in child:
            raise ConfigError(path, f"{base}[{i}].engine_id", "MultiConnector passes the "
                              "parent's engine_id; a child's own breaks "
                              "KVTransferConfig(**child, engine_id=...)")
        try:
            child_cfg = KVTransferConfig(**child, engine_id=ktc.engine_id)
        except ValidationError as e:
            raise _pydantic_error(path, f"{base}[{i}]", e) from None
        except (TypeError, ValueError) as e:
            raise ConfigError(path, f"{base}[{i}]", str(e)) from None
        try:
            child_cls = KVConnectorFactory.get_connector_class(child_cfg)
        except (ValueError, AttributeError, ImportError) as e:
            raise ConfigError(path, f"{base}[{i}].kv_connector", str(e)) from None
        check.children.append((child_cfg, child_cls))


def check_kernel_pins(path: Path, data: dict, engine_args, check: VllmCheck) -> None:
    """The MoE and attention backends are named (not auto), valid for vLLM's config classes,
    and the MoE backend is one vLLM's FP8 MoE oracle runs (GLM-5.3 FP8's experts)."""
    from pydantic import ValidationError
    from vllm.config import AttentionConfig, KernelConfig

    for key in PINNED_KERNEL_KEYS:
        if key not in data and key.replace("-", "_") not in data:
            raise ConfigError(path, key, "not set: the presets pin it so that a missing kernel fails at start "
                              "instead of vLLM falling back silently (configs/README.md)")
    if str(engine_args.moe_backend) == "auto":
        raise ConfigError(path, "moe-backend", "'auto' lets vLLM fall back silently; name the backend")
    try:
        check.moe_backend = KernelConfig(moe_backend=engine_args.moe_backend).moe_backend
    except ValidationError as e:
        raise ConfigError(path, "moe-backend", e.errors()[0].get("msg", str(e))) from None
    try:
        check.attention_backend = AttentionConfig(backend=engine_args.attention_backend).backend
    except ValidationError as e:
        raise ConfigError(path, "attention-backend", e.errors()[0].get("msg", str(e))) from None
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import map_fp8_backend

    try:
        map_fp8_backend(check.moe_backend)
    except ValueError as e:
        raise ConfigError(path, "moe-backend", f"vLLM's FP8 MoE oracle: {e}") from None


# --------------------------------------------------------------------------


def check_file(path: str | os.PathLike, model: str = DEFAULT_MODEL):
    path = Path(path)
    if path.name == "env":
        return check_env_file(path)
    if path.name == "lmcache.yaml":
        env = path.with_name("env")
        return check_lmcache_file(path, env if env.is_file() else None)
    if path.name == "vllm.yaml":
        return check_vllm_file(path, model)
    raise ConfigError(path, None, "unknown kind: expected a file named vllm.yaml, lmcache.yaml or env")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model path passed to vllm serve (default %(default)s)")
    args = p.parse_args(argv)
    failed = 0
    for path in args.files:
        try:
            check_file(path, args.model)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            failed += 1
        else:
            print(f"ok: {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
