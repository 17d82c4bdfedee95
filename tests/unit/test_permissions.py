"""TOOL.md's permissions block: parsing (every problem names the key and the fix), and what a call gets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sandboxd.sandbox.backend import CallGuard, CallRequest
from sandboxd.tools.manifest import parse_manifest_text
from sandboxd.tools.permissions import NOTHING, UNDECLARED, Permissions
from sandboxd.tools.tool import Tool

PATH = Path("tools/demo/TOOL.md")


def manifest(block: str) -> tuple[Permissions | None, list[str]]:
    text = f"---\nname: demo\ndescription: Demo.\nversion: 1\n{block}---\n# Demo\n"
    parsed, problems = parse_manifest_text(text, PATH)
    return (parsed.permissions if parsed is not None else None), [str(p) for p in problems]


def test_the_issue_s_example_is_read_whole() -> None:
    permissions, problems = manifest('permissions:\n  network: [api.apify.com, "*.wikipedia.org"]\n'
                                     '  env: [OFFICER_APIFY_TOKEN]\n  email: read\n  browser: false\n')
    assert problems == []
    assert permissions == Permissions(("api.apify.com", "*.wikipedia.org"), frozenset({"OFFICER_APIFY_TOKEN"}),
                                      "read", False, True)
    assert permissions.to_protocol() == {"network": ["api.apify.com", "*.wikipedia.org"],
                                         "env": ["OFFICER_APIFY_TOKEN"], "email": "read", "browser": False}


def test_no_block_is_undeclared_and_keeps_today_s_behaviour_unless_required() -> None:
    permissions, problems = manifest("")
    assert permissions is UNDECLARED and problems == []
    assert permissions.to_protocol() is None
    assert permissions.in_force(False) is None and permissions.email_access(False) == "write"
    assert permissions.in_force(True) is NOTHING and permissions.email_access(True) == "none"


def test_an_empty_block_declares_nothing() -> None:
    for block in ("permissions:\n", "permissions: {}\n"):
        permissions, problems = manifest(block)
        assert permissions == NOTHING and problems == []
        assert permissions.call_env({"OFFICER_APIFY_TOKEN": "x"}) == {}


@pytest.mark.parametrize(("block", "field", "fix"), [
    ("permissions: [a.test]\n", "permissions", "indented keys"),
    ("permissions:\n  netwrok: [a.test]\n", "permissions.netwrok", "did you mean 'network'"),
    ("permissions:\n  network: [https://a.test/x]\n", "permissions.network", "write its host alone: 'a.test'"),
    ("permissions:\n  network: [not a host]\n", "permissions.network", "egress.allow does"),
    ("permissions:\n  network: {a: 1}\n", "permissions.network", "network: [api.example.com]"),
    ("permissions:\n  env: [BAD-NAME]\n", "permissions.env", "letters, digits and _"),
    ("permissions:\n  email: readwrite\n", "permissions.email", "email: read"),
    ("permissions:\n  browser: \"yes\"\n", "permissions.browser", "browser: true"),
])
def test_a_bad_block_is_an_error_naming_the_key_and_the_fix(block: str, field: str, fix: str) -> None:
    permissions, problems = manifest(block)
    assert permissions is None  # a manifest with an error is not used: the tool is skipped
    assert any(f"error: {field}:" in problem and fix in problem for problem in problems), problems


def test_the_problem_points_at_the_block_s_line() -> None:
    _, problems = manifest("permissions:\n  email: all\n")
    assert problems[0].startswith(f"{PATH}:6: error: permissions.email")


def test_what_a_call_receives() -> None:
    permissions, _ = manifest("permissions:\n  env: [OFFICER_APIFY_TOKEN, HOME]\n  browser: true\n")
    assert permissions is not None
    env = {"OFFICER_APIFY_TOKEN": "t", "PI_SEARXNG_URL": "u", "OFFICER_BROWSER_RELAY_PORT": "9222"}
    assert permissions.call_env(env) == {"OFFICER_APIFY_TOKEN": "t", "OFFICER_BROWSER_RELAY_PORT": "9222"}


def test_network_grants_name_the_entry_that_decided() -> None:
    permissions, _ = manifest('permissions:\n  network: [a.test, "*.b.test", "10.1.0.0/16", "c.test:8080"]\n')
    assert permissions is not None
    network = permissions.network_for("demo")
    ports = frozenset({80, 443})
    assert network.grant("a.test", 443, ports) == "a.test"
    assert network.grant("x.b.test", 80, ports) == "*.b.test"
    assert network.grant("10.1.2.3", 443, ports) == "10.1.0.0/16"
    assert network.grant("c.test", 8080, ports) == "c.test:8080"
    for host, port in (("b.test", 443), ("a.test", 8080), ("c.test", 443), ("evil.test", 443)):
        assert network.grant(host, port, ports) is None
    assert "tool 'demo' does not declare evil.test in" in network.refusal("evil.test", 443, ports)
    assert "adds 'a.test:8080' to permissions.network" in network.refusal("a.test", 8080, ports)
    assert manifest('permissions:\n  network: ["*"]\n')[0].network_for("t").grant("any.where", 1, ports) == "*"


@pytest.mark.parametrize(("block", "warning"), [
    ("permissions:\n  env: [HOME]\n", "set in every sandbox"),
    ("permissions:\n  env: [OFFICER_BROWSER_RELAY_PORT]\n", "set 'browser: true'"),
    ("permissions:\n  network: [a.test, a.test]\n", "listed twice"),
    ('permissions:\n  network: ["*", a.test]\n', "keep '*' alone"),
])
def test_a_declaration_that_does_nothing_is_a_warning(block: str, warning: str) -> None:
    permissions, problems = manifest(block)
    assert permissions is not None
    assert any("warning: permissions." in problem and warning in problem for problem in problems), problems


# -- what the daemon hands a call (server/calls/runner.py), on the fake backend --------------------

def request_for(block: str, env: dict[str, str], **tools: Any) -> tuple[CallRequest, CallGuard]:
    request, guard, _ = requested(block, env, **tools)
    return request, guard


def requested(block: str, env: dict[str, str], **tools: Any) -> tuple[CallRequest, CallGuard, str]:
    """The call's request, its guard, and the pool's owner whose sandbox runs it."""
    from sandboxd.config import load_config
    from sandboxd.sandbox.fake import FakeBackend
    from sandboxd.server.calls.params import CallParams
    from sandboxd.server.calls.runner import CallRunner

    parsed, problems = parse_manifest_text(f"---\nname: demo\ndescription: Demo.\nversion: 1\n{block}---\n# Demo\n",
                                           PATH)
    assert parsed is not None, problems
    config = load_config(environ={}, overrides={
        "backend": "fake", "seed_tools": None, "tools": tools,
        "egress": {"secrets": {"OFFICER_APIFY_TOKEN": ["apify.test"]}},
        "integrations": {"browser_relay": "127.0.0.1:9222"}})
    runner = CallRunner(config, pool=None, backend=FakeBackend(None))  # type: ignore[arg-type]
    tool = Tool(parsed, PATH.parent, PATH.parent / "index.ts", "user")
    return runner._request(CallParams("u@example.com", tool, {}, "id", env, 1.0), frozenset())


ENV = {"OFFICER_APIFY_TOKEN": "real", "PI_SEARXNG_URL": "http://s", "OFFICER_BROWSER_RELAY_PORT": "9222"}


def test_an_undeclared_tool_gets_what_it_got_before() -> None:
    request, guard = request_for("", ENV)
    assert set(request.env) == set(ENV) and guard.network is None
    assert request.stand_ins is not None and request.browser_relay is not None


def test_a_declared_tool_gets_its_env_names_its_network_and_no_relay_without_browser() -> None:
    request, guard = request_for("permissions:\n  env: [OFFICER_APIFY_TOKEN]\n  network: [apify.test]\n", ENV)
    assert list(request.env) == ["OFFICER_APIFY_TOKEN"] and request.env["OFFICER_APIFY_TOKEN"] != "real"
    assert request.browser_relay is None
    assert guard.network is not None and guard.network.grant("apify.test", 443, frozenset({443})) == "apify.test"


def test_browser_true_brings_the_relay_and_its_port() -> None:
    request, _ = request_for("permissions:\n  browser: true\n", ENV)
    assert list(request.env) == ["OFFICER_BROWSER_RELAY_PORT"]
    assert request.browser_relay is not None and request.browser_relay.granted == 9222


def test_require_permissions_gives_an_undeclared_tool_nothing() -> None:
    request, guard = request_for("", ENV, require_permissions=True)
    assert request.env == {} and not request.stand_ins and request.browser_relay is None
    assert guard.network is not None and guard.network.grant("anywhere.test", 443, frozenset({443})) is None


def test_the_call_goes_to_the_owner_of_its_tool_s_email_access() -> None:
    assert requested("", {})[2] == "u@example.com"  # undeclared: today's sandboxes
    assert requested("", {}, require_permissions=True)[2] == "u@example.com email:none"
    assert requested("permissions:\n  email: read\n", {})[2] == "u@example.com email:read"
    assert requested("permissions:\n  email: write\n", {})[2] == "u@example.com"


def test_a_tool_s_accesses_are_worked_out_once_not_per_call() -> None:
    parsed, _ = parse_manifest_text("---\nname: demo\ndescription: D.\nversion: 1\npermissions:\n  network: [a.test]\n"
                                    "---\n# D\n", PATH)
    assert parsed is not None
    tool = Tool(parsed, PATH.parent, PATH.parent / "index.ts", "user")
    assert tool.accesses is tool.accesses and tool.accesses[True].network is tool.accesses[True].network
    assert tool.accesses[False] == tool.accesses[True]  # a declared block holds its calls either way
    assert tool.accesses[False].network == parsed.permissions.network_for("demo")


def test_mcp_s_tools_list_carries_the_block_as_annotations_and_meta() -> None:
    from sandboxd.mcp.convert import mcp_tool

    declared, _ = manifest("permissions:\n  network: [a.test]\n  email: read\n")
    tool = Tool(parse_manifest_text("---\nname: demo\ndescription: D.\nversion: 1\npermissions:\n  email: read\n---\n# D\n",
                                    PATH)[0], PATH.parent, PATH.parent / "index.ts", "user")  # type: ignore[arg-type]
    quiet = mcp_tool(tool.to_protocol()).model_dump(by_alias=True, exclude_none=True)
    assert quiet["annotations"] == {"openWorldHint": False}
    assert quiet["_meta"] == {"sandboxd/permissions": {"network": [], "env": [], "email": "read", "browser": False}}
    assert declared is not None
    networked = mcp_tool({**tool.to_protocol(), "permissions": declared.to_protocol()})
    assert networked.annotations is not None and networked.annotations.open_world_hint is True
    undeclared = mcp_tool({**tool.to_protocol(), "permissions": None}).model_dump(by_alias=True, exclude_none=True)
    assert "annotations" not in undeclared and "_meta" not in undeclared
