"""The permissions check of `sandboxd validate` (dev/lint/permissions.py): each use the block does not grant
is an error with its line and fix, each grant never used a warning; every seed tool passes."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from sandboxd.dev.lint.permissions import check_permissions
from sandboxd.dev.lint.validation import validate_paths
from sandboxd.tools.manifest import parse_manifest_text

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "permissions"
PATH = Path("tools/demo/index.ts")

# Each fixture tool has one use its block does not grant: (check, line, what the message names).
FLAGGED = {
    "env_read": ("permission-env", 2, "process.env.OFFICER_APIFY_TOKEN"),
    "env_destructured": ("permission-env", 2, "process.env.PI_SEARXNG_URL"),
    "url_undeclared": ("permission-network", 4, "collector.evil.test:443"),
    "new_url": ("permission-network", 2, "exfil.example.net:8443"),
    "email_undeclared": ("permission-email", 2, "email database"),
    "relay_undeclared": ("permission-browser", 2, "OFFICER_BROWSER_RELAY_PORT"),
}


@pytest.mark.parametrize("tool", sorted(FLAGGED))
def test_each_fixture_s_one_undeclared_use_is_flagged_with_its_line(tool: str) -> None:
    check, line, named = FLAGGED[tool]
    problems = validate_paths([FIXTURES / tool])
    assert [(p.field, p.line, p.severity) for p in problems] == [(check, line, "error")], [str(p) for p in problems]
    assert named in problems[0].message and "TOOL.md" in problems[0].fix


def test_every_fixture_is_there() -> None:
    assert sorted(p.name for p in FIXTURES.iterdir()) == sorted(FLAGGED)


def test_every_seed_tool_declares_a_block_and_passes() -> None:
    seed = REPO / "seed" / "tools"
    for tool in sorted(p for p in seed.iterdir() if (p / "TOOL.md").is_file()):
        manifest, _ = parse_manifest_text((tool / "TOOL.md").read_text(), tool / "TOOL.md")
        assert manifest is not None and manifest.permissions.declared, tool.name
        assert validate_paths([tool], required=True) == [], tool.name


def lint(block: str, source: str, required: bool = False) -> list[tuple[str | None, int | None, str]]:
    manifest, problems = parse_manifest_text(f"---\nname: demo\ndescription: D.\nversion: 1\n{block}---\n# D\n",
                                             PATH.parent / "TOOL.md")
    assert manifest is not None, problems
    found = check_permissions(textwrap.dedent(source), PATH, manifest.permissions, required)
    return [(p.field, p.line, p.severity) for p in found]


def test_names_in_comments_and_messages_are_not_uses() -> None:
    source = """\
        // process.env.OFFICER_APIFY_TOKEN, fetch("https://evil.test/")
        const hint = 'set process.env.SECRET or see https://docs.example.com/page';
        export async function execute() { return { content: [{ type: "text", text: hint }] }; }
    """
    assert lint("permissions: {}\n", source) == []


def test_a_url_built_at_run_time_is_left_to_the_daemon() -> None:
    source = """\
        export async function execute(_id: string, p: { host: string; domain: string }) {
          await fetch(`https://${p.host}/x`);
          await fetch("https://api." + p.domain + "/x");
          await fetch(new URL(`/v2/acts`, `https://api.apify.com`));
          return { content: [] };
        }
    """
    assert lint("permissions:\n  network: [api.apify.com]\n", source) == []


def test_a_grant_the_code_never_uses_is_a_warning() -> None:
    block = "permissions:\n  network: [a.test]\n  env: [OFFICER_APIFY_TOKEN]\n  email: read\n  browser: true\n"
    found = lint(block, "export async function execute() { return { content: [] }; }\n")
    assert [f for f, _, severity in found if severity == "warning"] == [
        "permissions.env", "permissions.network", "permissions.email", "permissions.browser"]


def test_env_read_by_a_name_it_builds_may_use_every_env_grant() -> None:
    source = "export async function execute(_id: string, p: { n: string }) { return { content: [], x: process.env[p.n] }; }"
    assert lint("permissions:\n  env: [OFFICER_APIFY_TOKEN]\n", source) == []


def test_always_set_names_need_no_grant() -> None:
    source = "export async function execute() { return { content: [], x: process.env.OFFICER_USER_ROOT }; }"
    assert lint("permissions: {}\n", source) == []


def test_require_permissions_tells_an_undeclared_tool_it_gets_nothing_and_flags_its_uses() -> None:
    source = "export async function execute() { await fetch('https://a.test/'); return { content: [] }; }"
    assert lint("", source) == []  # no block, not required: today's behaviour, nothing to hold the code to
    found = lint("", source, required=True)
    assert ("permissions", None, "warning") in found and ("permission-network", 1, "error") in found
