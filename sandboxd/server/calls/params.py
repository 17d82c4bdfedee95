"""A tools/call's params, checked before anything runs (-32602 on any problem)."""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass
from typing import Any, Mapping

from sandboxd.config import Config
from sandboxd.container import reserved_env
from sandboxd.errors import InvalidParams
from sandboxd.rules.secrets import value_problem
from sandboxd.tools.discovery import Tool, ToolCatalog
from sandboxd.users import check_user
from sandboxd.wire import is_request_id

# A generated toolCallId: unique within this daemon's life, random across its starts
# (a counter: no read of the kernel's random source per call).
_GENERATED_PREFIX = f"call_{secrets.token_hex(4)}"
_GENERATED_IDS = (f"{_GENERATED_PREFIX}{n:08x}" for n in itertools.count())


@dataclass
class CallParams:
    user: str
    tool: Tool
    arguments: dict[str, Any]
    tool_call_id: str
    env: dict[str, str]
    timeout_s: float

    def secrets(self) -> list[Any]:
        names = self.tool.sensitive
        if not names:  # the common tool: nothing of its arguments is secret
            return list(self.env.values())
        return list(self.env.values()) + [v for k, v in self.arguments.items() if k in names]


def parse_call_params(params: Any, catalog: ToolCatalog, config: Config, *, since: float) -> CallParams:
    """Check everything about a tools/call before anything runs (-32602 on any problem).

    The tool is looked up in the catalog's last scans (``since``: when the request arrived);
    ScanNeeded means the tools changed and must be scanned, off the event loop, first.
    """
    if not isinstance(params, dict):
        raise InvalidParams("tools/call needs params {\"user\", \"name\", \"arguments\"}.")
    user = check_user(params.get("user"))
    name = params.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidParams("'name' is required: the tool to call, as tools/list names it.")
    meta = params.get("_meta")
    if meta is not None:
        if not isinstance(meta, dict):
            raise InvalidParams("'_meta' must be an object like {\"progressToken\": \"t1\"}.")
        token = meta.get("progressToken")
        if token is not None and not is_request_id(token):  # a token is what an id may be (docs/protocol.md)
            raise InvalidParams("'_meta.progressToken' must be a string or a number (that fits a double).")
    tool = catalog.lookup(name, user, since=since)
    if tool is None:
        known = ", ".join(catalog.known_names(user)[:20]) or "none"
        raise InvalidParams(f"unknown tool {name!r} for {user}; tools/list shows the tools (known: {known}).")
    arguments = params.get("arguments", {})
    arguments = tool.check_arguments({} if arguments is None else arguments)
    tool_call_id = params.get("toolCallId")
    if tool_call_id is None:
        tool_call_id = next(_GENERATED_IDS)
    elif not isinstance(tool_call_id, str) or not tool_call_id or len(tool_call_id) > 256:
        raise InvalidParams("'toolCallId' must be a non-empty string of at most 256 characters.")
    env = params.get("env")
    env = {} if env is None else _check_env(env, config.calls.allowed_env, config.egress.secrets)
    timeout_ms = params.get("timeoutMs")
    if timeout_ms is None:
        timeout_ms = config.calls.default_timeout_ms
    elif isinstance(timeout_ms, bool) or not isinstance(timeout_ms, (int, float)) or timeout_ms <= 0:
        raise InvalidParams("'timeoutMs' must be a positive number of milliseconds.")
    timeout_ms = min(timeout_ms, config.calls.max_timeout_ms)
    return CallParams(user, tool, arguments, tool_call_id, env, timeout_ms / 1000)


def _check_env(env: Any, allowed: list[str], secrets: Mapping[str, list[str]] | None = None) -> dict[str, str]:
    if not isinstance(env, dict):
        raise InvalidParams("'env' must be an object of string values.")
    problems = []
    for key, value in env.items():
        if reserved_env(key):
            problems.append(f"{key} is set by sandboxd and cannot be overridden")
        elif key not in allowed:
            problems.append(f"{key} is not an allowed env name (allowed: {', '.join(allowed)}; see calls.allowed_env)")
        elif not isinstance(value, str):
            problems.append(f"{key} must be a string")
        elif secrets and key in secrets and (problem := value_problem(key, value)):
            problems.append(problem)
    if problems:
        # Names only: env values are secrets and never appear in an error.
        raise InvalidParams("forbidden env: " + "; ".join(problems) + ".", data={"names": sorted(env)})
    return dict(env)
