"""Building a ``Config``: defaults < YAML file < SANDBOXD_* variables < flags."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import yaml
from pydantic import ValidationError

from sandboxd.config.defaults import SYSTEM_CONFIG
from sandboxd.config.keys import iter_keys
from sandboxd.config.model import Config
from sandboxd.errors import ConfigError


def _env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """SANDBOXD_<KEY> and SANDBOXD_<SECTION>_<KEY> → a nested dict; unknown names are errors."""
    # The names docs/config.md lists, optional sections (cluster:) and nested ones (cluster.tls) included.
    names = {env: tuple(dotted.split(".")) for dotted, env, _default, _meaning in iter_keys()}
    out: dict[str, Any] = {}
    for env_name, raw in environ.items():
        if not env_name.startswith("SANDBOXD_"):
            continue
        path = names.get(env_name)
        if path is None:
            # SANDBOXD_CONFIG names the file itself, SANDBOXD_MCP_TOKEN is `sandboxd mcp --http`'s
            # secret (never a config key: it must not sit in a file); everything else must be a key.
            if env_name in ("SANDBOXD_CONFIG", "SANDBOXD_MCP_TOKEN"):
                continue
            raise ConfigError(f"{env_name} is not a configuration key; see docs/config.md for the names.")
        # YAML parsing gives lists, numbers and booleans their natural spelling;
        # what is not YAML at all (e.g. "[::1]:9464") is meant as a plain string.
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        target = out
        for part in path[:-1]:
            target = target.setdefault(part, {})
        target[path[-1]] = value
    return out


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _describe(error: ValidationError, source: str) -> str:
    lines = []
    for item in error.errors():
        key = ".".join(str(p) for p in item["loc"])
        if item["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key (see docs/config.md for the keys)")
        else:
            message = str(item["msg"]).removeprefix("Value error, ")
            lines.append(f"{key}: {message}" if key else message)
    return f"invalid configuration ({source}): " + "; ".join(lines)


def config_file(path: Path | None = None, environ: Mapping[str, str] | None = None) -> Path | None:
    """The file load_config reads: ``path``, else $SANDBOXD_CONFIG, else /etc/sandboxd/config.yaml if present."""
    environ = os.environ if environ is None else environ
    if path is None and environ.get("SANDBOXD_CONFIG"):
        path = Path(environ["SANDBOXD_CONFIG"])
    if path is None and SYSTEM_CONFIG.is_file():
        path = SYSTEM_CONFIG
    return path


def env_keys(environ: Mapping[str, str] | None = None) -> list[str]:
    """The SANDBOXD_* variables that set keys (names only: a value may be a secret)."""
    environ = os.environ if environ is None else environ
    return sorted(name for name in environ if name.startswith("SANDBOXD_") and name != "SANDBOXD_CONFIG")


def load_config(
    path: Path | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Build the Config. ``path`` None means $SANDBOXD_CONFIG, then /etc/sandboxd/config.yaml if present."""
    environ = os.environ if environ is None else environ
    path = config_file(path, environ)
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8-sig"))
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist; pass an existing file to --config.") from None
        except PermissionError:
            raise ConfigError(
                f"config file {path} is not readable by this user; run as root or a member of its group "
                "(sandboxd), or pass another file with --config."
            ) from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"config file {path} is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(loaded).__name__}.")
        data = loaded
    data = _merge(data, _env_overrides(environ))
    if overrides:
        data = _merge(data, {k: v for k, v in overrides.items() if v is not None})
        source += " + flags"
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source)) from None
