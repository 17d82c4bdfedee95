"""What one call of a tool may reach, receive and open: TOOL.md's ``permissions`` block.

```yaml
permissions:
  network: [api.apify.com, "*.wikipedia.org"]   # egress.allow syntax; "*" = wherever the policy allows
  env: [OFFICER_APIFY_TOKEN]                     # call env names it receives
  email: read                                    # none | read | write
  browser: false                                 # the browser relay
```

A tool without the block keeps what every tool of its sandbox gets, unless the operator
sets ``tools.require_permissions``: then it gets nothing (``in_force``). The daemon enforces
the block per call (docs/security.md, "Each tool's permissions"); the linter checks the code
against it (dev/lint/permissions.py).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Literal, Mapping, get_args

from sandboxd.container import reserved_env
from sandboxd.rules.browser_relay import PORT_ENV
from sandboxd.rules.policy import AllowEntry
from sandboxd.rules.tool_network import ANY_HOST, ToolNetwork

EmailAccess = Literal["none", "read", "write"]
EMAIL_ACCESS: tuple[EmailAccess, ...] = get_args(EmailAccess)
PERMISSION_KEYS = ("network", "env", "email", "browser")
# The relay's variables come with ``browser: true``: a relay port without the relay is of no use.
RELAY_ENV = frozenset({PORT_ENV, "OFFICER_BROWSER_RELAY_TOKEN"})
MAX_ENTRIES = 64  # network entries or env names: a declaration, not a data set
# The pool's owner of a sandbox carrying ``read`` or ``none`` is the user, this, and the access (sandbox/email_access.py).
OWNER_MARK = " email:"  # never part of a user name (users.py: no spaces)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

Report = Callable[[str, str, str], None]  # (field, message, fix)


@dataclass(frozen=True)
class Permissions:
    """A tool's declared permissions; ``declared`` False when its TOOL.md has no block."""

    network: tuple[str, ...] = ()  # entries as written, egress.allow syntax or "*"
    env: frozenset[str] = frozenset()
    email: EmailAccess = "none"
    browser: bool = False
    declared: bool = False
    _entries: tuple[AllowEntry, ...] = field(default=(), repr=False, compare=False)

    @cached_property
    def env_names(self) -> frozenset[str]:
        """The call env names the tool receives: ``env``, and the relay's with ``browser: true``."""
        return self.env | RELAY_ENV if self.browser else self.env

    def network_for(self, tool: str) -> ToolNetwork:
        """What the egress proxy holds ``tool``'s calls to (rules/tool_network.py)."""
        return ToolNetwork(tool, self._entries, ANY_HOST in self.network)

    def call_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """The call's env with only the names the tool receives: the rest absent, never refused."""
        return _only(env, self.env_names)

    def to_protocol(self) -> dict[str, Any] | None:
        """The ``permissions`` of a Tool object in tools/list (docs/protocol.md); None when undeclared."""
        if not self.declared:
            return None
        return {"network": list(self.network), "env": sorted(self.env), "email": self.email, "browser": self.browser}

    def in_force(self, required: bool) -> Permissions | None:
        """What holds a call: None (no limit, today's behaviour) for an undeclared tool unless
        ``tools.require_permissions`` is on, then ``NOTHING``; a declared block always."""
        if self.declared:
            return self
        return NOTHING if required else None

    def email_access(self, required: bool) -> EmailAccess:
        """The email database's access for a call: ``write`` (today's) for an undeclared tool unless required."""
        force = self.in_force(required)
        return "write" if force is None else force.email

    def access_for(self, tool: str, required: bool) -> ToolAccess:
        """What every call of ``tool`` gets (``required``: tools.require_permissions); made once per tool."""
        force = self.in_force(required)
        if force is None:
            return ToolAccess()
        return ToolAccess(force.email, force.env_names, force.browser, force.network_for(tool))


@dataclass(frozen=True)
class ToolAccess:
    """What holds each call of one tool, worked out from its permissions once (Tool.accesses), not per call:
    the email access of the sandbox that runs it, the env names it receives (None: every name), whether it
    gets the browser relay, and where its egress may go (None: the policy alone). The defaults: no limit."""

    email: EmailAccess = "write"
    env_names: frozenset[str] | None = None
    relay: bool = True
    network: ToolNetwork | None = None
    # Appended to the user: the pool's owner whose sandboxes carry ``email`` (sandbox/email_access.py).
    owner_suffix: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "owner_suffix", owner_suffix(self.email))

    def call_env(self, env: Mapping[str, str]) -> Mapping[str, str]:
        """The call's env with only the names the tool receives: the rest absent, never refused."""
        return env if self.env_names is None else _only(env, self.env_names)


def owner_suffix(access: EmailAccess) -> str:
    """What follows the user in the pool's owner of sandboxes carrying ``access``: nothing for ``write``."""
    return "" if access == "write" else f"{OWNER_MARK}{access}"


def _only(env: Mapping[str, str], names: frozenset[str]) -> dict[str, str]:
    return {name: value for name, value in env.items() if name in names}


UNDECLARED = Permissions()
NOTHING = Permissions(declared=True)  # tools.require_permissions' answer to a tool without the block


def parse_permissions(value: Any, error: Report, warning: Report) -> Permissions:
    """The block as YAML read it; each problem told to ``error``/``warning`` as (field, message, fix)."""
    if value is None:
        return NOTHING  # "permissions:" with nothing under it declares nothing
    if not isinstance(value, dict):
        error("permissions", f"permissions must be a mapping, got {_describe(value)}",
              "write 'permissions:' then indented keys: network, env, email, browser")
        return NOTHING
    for key in value:
        if key not in PERMISSION_KEYS:
            close = difflib.get_close_matches(str(key), PERMISSION_KEYS, n=1)
            fix = f"did you mean '{close[0]}'?" if close else f"use the keys {', '.join(PERMISSION_KEYS)}"
            error(f"permissions.{key}", f"unknown permission {str(key)!r}", fix)
    network, entries = _network(value.get("network"), error, warning)
    browser = _browser(value.get("browser", False), error)
    env = _env(value.get("env"), error, warning, browser)
    email = _email(value.get("email", "none"), error)
    return Permissions(network, env, email, browser, True, entries)


def _list(value: Any, key: str, example: str, error: Report) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]  # one entry written without brackets
    if not isinstance(value, list):
        error(f"permissions.{key}", f"{key} must be a list, got {_describe(value)}", f"write '{key}: [{example}]'")
        return []
    if len(value) > MAX_ENTRIES:
        error(f"permissions.{key}", f"{key} lists {len(value)} items, over the limit of {MAX_ENTRIES}",
              f"list what the tool uses; for any host write '{key}: [\"*\"]'" if key == "network"
              else "list only the names the code reads")
        return []
    return value


def _network(value: Any, error: Report, warning: Report) -> tuple[tuple[str, ...], tuple[AllowEntry, ...]]:
    where = "permissions.network"
    texts: list[str] = []
    entries: list[AllowEntry] = []
    for item in _list(value, "network", "api.example.com", error):
        if not isinstance(item, str):
            error(where, f"each network entry must be text, got {_describe(item)}", "quote it: \"api.example.com\"")
            continue
        text = item.strip()
        if text in texts:
            warning(where, f"{text!r} is listed twice", "list each host once")
            continue
        if text != ANY_HOST:
            try:
                entries.append(AllowEntry.parse(_host_of_url(text)))
            except ValueError as exc:
                error(where, str(exc).replace("egress.allow entry", "network entry"),
                      "write a host as egress.allow does: api.example.com, *.example.com, host:8080 or 10.1.2.0/24")
                continue
        texts.append(text)
    if ANY_HOST in texts and len(texts) > 1:
        warning(where, "'*' already leaves every host to the operator's policy, so the other entries add nothing",
                "keep '*' alone, or drop it and list the hosts the tool uses")
    return tuple(texts), tuple(entries)


def _host_of_url(text: str) -> str:
    """A URL where a host belongs is refused with the host to write instead."""
    if "://" in text:
        host = text.split("://", 1)[1].split("/", 1)[0]
        raise ValueError(f"network entry {text!r} is a URL; write its host alone: '{host}'")
    return text


def _env(value: Any, error: Report, warning: Report, browser: bool) -> frozenset[str]:
    where = "permissions.env"
    names: set[str] = set()
    for item in _list(value, "env", "OFFICER_APIFY_TOKEN", error):
        if not isinstance(item, str) or not _ENV_NAME.fullmatch(item):
            error(where, f"env lists {_describe(item)}, which is not a variable name",
                  "list names such as OFFICER_APIFY_TOKEN (letters, digits and _)")
        elif reserved_env(item):
            warning(where, f"{item} is set in every sandbox, not per call, so declaring it does nothing",
                    f"remove {item} from env")
        elif item in RELAY_ENV and not browser:
            warning(where, f"{item} belongs to the browser relay, which the tool only reaches with browser: true",
                    f"set 'browser: true' (it brings {item}) and remove it from env")
            names.add(item)
        else:
            names.add(item)
    return frozenset(names)


def _email(value: Any, error: Report) -> EmailAccess:
    if value is False or value is None:
        return "none"  # YAML's "email: no" and "email:" mean none
    if isinstance(value, str) and value in EMAIL_ACCESS:
        return value
    error("permissions.email", f"email must be none, read or write, got {_describe(value)}",
          "write 'email: read' to query the mail database, 'email: write' to change it, or leave it out")
    return "none"


def _browser(value: Any, error: Report) -> bool:
    if isinstance(value, bool):
        return value
    error("permissions.browser", f"browser must be true or false, got {_describe(value)}",
          "write 'browser: true' for a tool that drives the browser relay, else leave it out")
    return False


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return "a list" if isinstance(value, list) else "a mapping"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
