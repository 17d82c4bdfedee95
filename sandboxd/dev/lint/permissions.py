"""The permissions check: what the entry file's code uses that TOOL.md's permissions block does not grant.

Read off the syntax tree (syntax.py), so a comment or a message that mentions a name is not a use:

- ``process.env.X``, ``process.env["X"]`` and ``const { X } = process.env`` read the call env name X;
- a URL written as a string, the argument of ``fetch``, ``new URL``, ``new Request`` or
  ``http(s).get``/``request``, names its host (a template's host when its text before the first
  ``${`` holds it whole);
- ``OFFICER_EMAIL_DB`` or the path ``/officer/data`` is the email database; the relay's variables
  are the browser relay.

Each use the block does not grant is an error with its line and the fix; each grant no use was
seen for is a warning. A URL built at run time is not seen, and the daemon's check still holds
it (docs/tools.md, "The linter checks the code against the block").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from sandboxd.container import CONTAINER_EMAIL_DIR, reserved_env
from sandboxd.dev.lint.syntax import MAX_SOURCE_BYTES, Node, line_of, node_text, parse, string_value, unwrap, walk
from sandboxd.rules.tool_network import ANY_HOST
from sandboxd.tools.permissions import RELAY_ENV, Permissions
from sandboxd.tools.problem import Problem

EMAIL_ENV = "OFFICER_EMAIL_DB"
DEFAULT_PORTS = frozenset({80, 443})  # egress.ports' default: an entry without a port means these
_URL_CALLS = frozenset({"fetch", "http.get", "http.request", "https.get", "https.request"})
_URL_CLASSES = frozenset({"URL", "Request"})


@dataclass
class Uses:
    """What the code was seen to use, each with the line of its first use."""

    env: dict[str, int] = field(default_factory=dict)
    urls: list[tuple[str, int, int]] = field(default_factory=list)  # (host, port, line)
    email: int | None = None
    whole_env: bool = False  # process.env read by a name not written out: every env grant may be used


def check_permissions_file(entry: Path, permissions: Permissions, required: bool) -> list[Problem]:
    """The permissions check of the tool whose entry file is ``entry`` (``required``: tools.require_permissions)."""
    try:
        data = entry.read_bytes()[:MAX_SOURCE_BYTES]
    except OSError:
        return []  # check_entry_file reports an unreadable entry
    return check_permissions(data.decode("utf-8", errors="replace"), entry, permissions, required)


def check_permissions(text: str, path: Path, permissions: Permissions, required: bool) -> list[Problem]:
    force = permissions.in_force(required)
    if force is None:
        return []  # no block and not required: the tool gets what every tool gets, nothing to hold it to
    problems: list[Problem] = []
    if not permissions.declared:
        problems.append(Problem(path.parent / "TOOL.md", "tools.require_permissions is on and TOOL.md has no "
                                "permissions block, so the tool gets no network, no env, no email database and "
                                "no browser relay", "add a permissions block declaring what the code uses "
                                "(docs/tools.md, Permissions)", field="permissions", severity="warning"))
    uses = find_uses(parse(text, path.name))
    problems += _undeclared(uses, force, path)
    if permissions.declared:
        problems += _unused(uses, force, path)
    return sorted(problems, key=lambda p: p.line or 0)


def find_uses(root: Node) -> Uses:
    uses = Uses()
    for node in walk(root):
        kind = node.type
        if kind in ("member_expression", "subscript_expression") and _is_process_env(node.child_by_field_name("object")):
            _env_read(node, uses)
        elif kind == "variable_declarator" and _is_process_env(unwrap(node.child_by_field_name("value"))):
            _env_destructured(node, uses)
        elif kind in ("call_expression", "new_expression"):
            _url_arguments(node, uses)
        elif kind == "string_fragment" and node_text(node).startswith(CONTAINER_EMAIL_DIR) and uses.email is None:
            uses.email = line_of(node)
    if EMAIL_ENV in uses.env and uses.email is None:
        uses.email = uses.env[EMAIL_ENV]
    return uses


def _is_process_env(node: Node | None) -> bool:
    return node is not None and node.type == "member_expression" and node_text(node).replace("?.", ".") == "process.env"


def _env_read(node: Node, uses: Uses) -> None:
    if node.type == "member_expression":
        name = node_text(node.child_by_field_name("property"))
    else:
        index = unwrap(node.child_by_field_name("index"))
        name = string_value(index) if index is not None and index.type == "string" else ""
    if name:
        uses.env.setdefault(name, line_of(node))
    else:
        uses.whole_env = True


def _env_destructured(node: Node, uses: Uses) -> None:
    pattern = node.child_by_field_name("name")
    if pattern is None or pattern.type != "object_pattern":
        uses.whole_env = True  # const env = process.env: any name may be read through it
        return
    for child in pattern.named_children:
        key = child.child_by_field_name("key") if child.type == "pair_pattern" else child
        if key is not None and child.type in ("pair_pattern", "shorthand_property_identifier_pattern",
                                              "object_assignment_pattern"):
            if child.type == "object_assignment_pattern":
                key = child.child_by_field_name("left")
            uses.env.setdefault(node_text(key), line_of(child))
        else:
            uses.whole_env = True  # ...rest


def _url_arguments(node: Node, uses: Uses) -> None:
    callee = node.child_by_field_name("function" if node.type == "call_expression" else "constructor")
    name = node_text(callee)
    if name not in (_URL_CALLS if node.type == "call_expression" else _URL_CLASSES):
        return
    arguments = node.child_by_field_name("arguments")
    for argument in arguments.named_children if arguments is not None else ():
        literal = _literal_url(unwrap(argument))
        if literal is not None:
            uses.urls.append((*literal, line_of(argument)))


def _literal_url(node: Node | None) -> tuple[str, int] | None:
    """(host, port) of a URL written as a string, or begun by one (``"https://h/?q=" + q``, a template)
    whose host comes whole before what is added at run time."""
    text = _url_text(node)
    if text is None:
        return None
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return parts.hostname.lower().rstrip("."), port or (443 if parts.scheme == "https" else 80)


def _url_text(node: Node | None) -> str | None:
    """The URL's written start, when it holds the host whole; None when the host is built at run time."""
    whole = node is not None and (node.type == "string" or node.type == "template_string" and all(
        child.type == "string_fragment" for child in node.named_children))
    while node is not None and node.type == "binary_expression" and node_text(node.child_by_field_name("operator")) == "+":
        node = unwrap(node.child_by_field_name("left"))
    first = _first_text(node)
    if first is None:
        return None
    text = string_value(first) if first.type == "string" else node_text(first)
    authority = text.split("://", 1)[1] if "://" in text else ""
    if not whole and not any(mark in authority for mark in "/?#"):
        return None  # `https://${host}` or "https://api." + domain: the host is built at run time
    return text


def _first_text(node: Node | None) -> Node | None:
    """A string, or a template's text before its first ``${``."""
    if node is None or node.type not in ("string", "template_string"):
        return None
    first = node if node.type == "string" else node.named_children[0] if node.named_children else None
    return first if first is not None and first.type in ("string", "string_fragment") else None


def _undeclared(uses: Uses, force: Permissions, path: Path) -> list[Problem]:
    problems = []

    def error(check: str, line: int, message: str, fix: str) -> None:
        problems.append(Problem(path, message, fix, field=check, line=line))

    for name, line in uses.env.items():
        if name in RELAY_ENV and not force.browser:
            error("permission-browser", line, f"the code reads {name}, the browser relay's, and the permissions "
                  "block does not set browser: true, so its calls cannot reach the relay",
                  "set 'browser: true' under permissions in TOOL.md")
        elif name not in force.env_names and not reserved_env(name) and name not in RELAY_ENV:
            wanted = ", ".join(sorted(force.env | {name}))
            error("permission-env", line, f"the code reads process.env.{name}, which permissions.env does not "
                  "list, so its calls never have it", f"add it in TOOL.md: 'env: [{wanted}]'")
    network = force.network_for("")
    for host, port, line in uses.urls:
        if network.grant(host, port, DEFAULT_PORTS) is None:
            entry = host if port in DEFAULT_PORTS else f"{host}:{port}"
            error("permission-network", line, f"the code requests {host}:{port}, which permissions.network does not "
                  "name, so the egress proxy refuses it", f"add '{entry}' to permissions.network in TOOL.md")
    if uses.email is not None and force.email == "none":
        error("permission-email", uses.email, "the code opens the email database, and the permissions block does "
              "not grant email, so its calls have no database", "set 'email: read' under permissions in TOOL.md "
              "('email: write' if the tool changes the mail)")
    return problems


def _unused(uses: Uses, force: Permissions, path: Path) -> list[Problem]:
    manifest = path.parent / "TOOL.md"
    problems = []

    def warning(check: str, message: str, fix: str) -> None:
        problems.append(Problem(manifest, message, fix, field=check, severity="warning"))

    for name in sorted(force.env - set(uses.env)) if not uses.whole_env else ():
        warning("permissions.env", f"permissions.env grants {name}, and the code never reads it",
                f"remove {name} from env (a grant the tool does not use is a grant a bug or an injection can)")
    network = force.network_for("")
    used = {network.grant(host, port, DEFAULT_PORTS) for host, port, _ in uses.urls}
    for entry in force.network:
        if entry != ANY_HOST and entry not in used:
            warning("permissions.network", f"permissions.network grants {entry}, and no URL in the code names it",
                    f"remove {entry}, unless the code builds that URL at run time")
    if force.email != "none" and uses.email is None:
        warning("permissions.email", f"permissions.email grants {force.email}, and the code never opens the database",
                f"remove 'email: {force.email}'")
    if force.browser and not RELAY_ENV & set(uses.env):
        warning("permissions.browser", "browser: true, and the code never reads OFFICER_BROWSER_RELAY_PORT",
                "remove 'browser: true'")
    return problems
