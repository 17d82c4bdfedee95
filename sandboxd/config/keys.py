"""The configuration's keys one by one: their env names, defaults, and whether a reload applies them."""

from __future__ import annotations

import types
from typing import Any, Mapping, get_args

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from sandboxd.config.model import Config
from sandboxd.config.sections import Section


def iter_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, env name, default, description) for every key: docs/config.md is checked against it."""
    rows = []
    for key, field in model.model_fields.items():
        annotation = _section_of(field.annotation)
        dotted = f"{prefix}{key}"
        if annotation is not None:
            rows.extend(iter_keys(annotation, f"{dotted}."))
            continue
        default = None if field.default is PydanticUndefined and field.default_factory is None else field.get_default(call_default_factory=True)
        env = "SANDBOXD_" + dotted.replace(".", "_").upper()
        rows.append((dotted, env, default, field.description or ""))
    return rows


def _section_of(annotation: Any) -> type[Section] | None:
    """The section a field holds: ``X`` or an optional ``X | None`` (the cluster section)."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation
    if isinstance(annotation, types.UnionType):
        sections = [arg for arg in get_args(annotation) if isinstance(arg, type) and issubclass(arg, Section)]
        return sections[0] if len(sections) == 1 else None
    return None


# What a SIGHUP applies to the running daemon (docs/config.md, "What changes need"). A key
# matches an entry exactly or by its section prefix; every other key needs a restart.
LIVE_KEYS = ("pool.", "calls.", "sandbox.", "egress.", "integrations.", "tools.", "log_level", "log_rate", "log_burst", "max_message_bytes", "allowed_uids", "allowed_gids",
             "allow_unsafe")  # live with the sandbox settings it was checked against
# Exceptions inside live sections: fixed when the backend is built.
RESTART_KEYS = ("calls.max_result_bytes", "sandbox.docker_host")


def needs_restart(key: str) -> bool:
    if key in RESTART_KEYS:
        return True
    return not any(key == live or (live.endswith(".") and key.startswith(live)) for live in LIVE_KEYS)


def flatten(config: Config) -> dict[str, Any]:
    """Dotted key → value, the keys docs/config.md lists."""
    flat: dict[str, Any] = {}

    def walk(data: Mapping[str, Any], prefix: str) -> None:
        for key, value in data.items():
            if isinstance(value, Mapping):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(config.model_dump(), "")
    return flat
