"""The platform's integrations as an operator sets them up (issue 26, parts 4 and 5): real daemon, real Docker.

- An integration on a private address (a SearXNG at `http://10.x:8080`, an OCR service named
  in `OFFICER_RESOURCES`) is reached through `egress.allow`, as docs/config.md shows. The
  services here are this test's own on 127.0.0.1: like a private address, refused by default
  and passed only by the allow entry. Nothing here sends to any other address.
- `sandboxd call --env NAME=VALUE` (or `--env NAME`, from the shell) gives a call its env, and
  a name the daemon does not allow is a clear error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.e2e.conftest import REPO, Daemon, write_tool
from tests.web_site import RESULTS, Site, page, searxng, serve

pytestmark = pytest.mark.docker

A = "alice@example.com"
POLICY = "refused by sandboxd's egress policy"
OCR_KEY = "optical-character-recognition"

# A platform tool's way to its service (TOOLS.md: OFFICER_RESOURCES holds the integrations' configs).
RESOURCE_CLIENT = """
export async function execute(_id: string, params: { page: number }) {
  const resources = JSON.parse(process.env.OFFICER_RESOURCES ?? '{}');
  const ocr = resources['optical-character-recognition'];
  if (!ocr?.url) return { content: [{ type: 'text', text: 'OCR is not configured.' }], isError: true };
  const res = await fetch(`${ocr.url}/ocr?page=${params.page}`, { headers: { authorization: `Bearer ${ocr.token}` } });
  return { content: [{ type: 'text', text: `${res.status} ${await res.text()}` }], isError: !res.ok };
}
"""


def cli_call(daemon: Daemon, *args: str, environ: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandboxd", "call", "--socket", str(daemon.socket), "--user", A,
                           *args], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, **(environ or {})})


def operator_config(*sites: Site) -> str:
    """docs/config.md's hardened example: allow-list, each integration's host:port named."""
    entries = "".join(f'    - "127.0.0.1:{s.server.server_address[1]}"\n' for s in sites)
    return f"egress:\n  policy: allow-list\n  allow:\n{entries}"


def started(make_daemon: Any, config: str) -> Daemon:
    daemon = make_daemon(config, start=False)
    write_tool(daemon.data / "tools", "resource_client", RESOURCE_CLIENT,
               inputs="  page:\n    type: number\n    description: The page.\n")
    return daemon.start()


def test_integrations_on_private_addresses_are_reached_through_egress_allow(make_daemon: Any) -> None:
    with serve() as searx, serve() as ocr, serve() as unlisted:
        searx.routes["/search"] = searxng(RESULTS, [])
        ocr.routes["/ocr"] = page(b'{"text": "Invoice 1042"}', "application/json")
        unlisted.routes["/ocr"] = page(b'{"text": "must not be reached"}', "application/json")
        daemon = started(make_daemon, operator_config(searx, ocr))
        resources = {OCR_KEY: {"url": ocr.base, "token": "ocr-token-93d1"}}

        found = cli_call(daemon, "web_search", "--arg", "query=sandbox egress", "--env", f"PI_SEARXNG_URL={searx.base}")
        assert found.returncode == 0, found.stderr
        assert found.stdout.startswith('3 results for "sandbox egress":'), found.stdout
        # OFFICER_RESOURCES from the shell (--env NAME): the token stays off the command line.
        read = cli_call(daemon, "resource_client", "--arg", "page=2", "--env", "OFFICER_RESOURCES",
                        environ={"OFFICER_RESOURCES": json.dumps(resources)})
        assert read.returncode == 0, read.stderr
        assert read.stdout.strip() == '200 {"text": "Invoice 1042"}'
        assert ocr.requests == ["/ocr?page=2"]

        # A service the allow-list does not name: refused by the policy, before any connect.
        elsewhere = {OCR_KEY: {"url": unlisted.base, "token": "t"}}
        refused = cli_call(daemon, "resource_client", "--arg", "page=1", "--env", f"OFFICER_RESOURCES={json.dumps(elsewhere)}")
        assert refused.returncode == 1
        assert POLICY in refused.stdout + refused.stderr and "egress.allow" in refused.stdout + refused.stderr
        assert unlisted.requests == []
    decisions = {(e["port"], e["decision"]) for e in daemon.events("egress", user=A)}
    assert {(searx.server.server_address[1], "allowed"), (ocr.server.server_address[1], "allowed"),
            (unlisted.server.server_address[1], "refused")} <= decisions, decisions


def test_call_env_from_the_cli_and_the_names_the_daemon_refuses(make_daemon: Any) -> None:
    daemon = make_daemon()
    probe = cli_call(daemon, "env_probe", "--raw", "--env", "PI_SEARXNG_URL=http://10.0.0.7:8080",
                     "--env", "OFFICER_APIFY_TOKEN", environ={"OFFICER_APIFY_TOKEN": "apify-secret-61c2"})
    assert probe.returncode == 0, probe.stderr
    env = json.loads(probe.stdout)["details"]["env"]
    assert env["PI_SEARXNG_URL"] == "http://10.0.0.7:8080" and env["OFFICER_APIFY_TOKEN"] == "apify-secret-61c2"
    assert json.loads(cli_call(daemon, "env_probe", "--raw").stdout)["details"]["env"].get("PI_SEARXNG_URL") is None

    # Names the daemon does not allow: its refusal, by name, the value never echoed; exit status 2.
    for item, fragment in [("NOT_ALLOWED=secret-value-1", "NOT_ALLOWED is not an allowed env name (allowed: "
                                                          "OFFICER_RESOURCES, PI_SEARXNG_URL"),
                           ("HOME=secret-value-1", "HOME is set by sandboxd and cannot be overridden"),
                           ("SANDBOXD_SHIM_SOCKET=secret-value-1", "SANDBOXD_SHIM_SOCKET is set by sandboxd")]:
        refused = cli_call(daemon, "env_probe", "--env", item)
        assert refused.returncode == 2, refused
        assert fragment in refused.stderr, refused.stderr
        assert "secret-value-1" not in refused.stderr + refused.stdout
    # Mistakes of the command line itself, before the daemon is asked.
    empty = cli_call(daemon, "env_probe", "--raw", "--env", "OFFICER_RESOURCES", environ={"OFFICER_RESOURCES": ""})
    assert json.loads(empty.stdout)["details"]["env"]["OFFICER_RESOURCES"] == ""  # set, if empty
    missing = subprocess.run([sys.executable, "-m", "sandboxd", "call", "--socket", str(daemon.socket), "--user", A,
                              "env_probe", "--env", "OFFICER_RESOURCES"], capture_output=True, text=True, cwd=REPO,
                             env={k: v for k, v in os.environ.items() if k != "OFFICER_RESOURCES"})
    assert missing.returncode == 2 and "$OFFICER_RESOURCES is not set in this shell" in missing.stderr, missing.stderr
    bad = cli_call(daemon, "env_probe", "--env", "=x")
    assert bad.returncode == 2 and "must look like NAME=VALUE or NAME" in bad.stderr, bad.stderr


def test_the_allowed_env_names_are_the_daemons_own(make_daemon: Any) -> None:
    daemon = make_daemon("calls:\n  allowed_env: [PI_SEARXNG_URL, MY_SERVICE_URL]\n")
    ok = cli_call(daemon, "env_probe", "--env", "MY_SERVICE_URL=http://10.0.0.9")
    assert ok.returncode == 0, ok.stderr
    refused = cli_call(daemon, "env_probe", "--env", "OFFICER_RESOURCES={}")
    assert refused.returncode == 2
    assert "OFFICER_RESOURCES is not an allowed env name (allowed: PI_SEARXNG_URL, MY_SERVICE_URL" in refused.stderr
