"""gVisor (``sandbox.runtime: runsc``): a tool really runs on gVisor's kernel, the daemon knows
its sandboxes' connections there. (A runtime the engine does not know stops start-up: test_faults.py,
which needs no runsc.)

The rest of the e2e set runs under runsc too (``make test-gvisor``: E2E_SANDBOX_RUNTIME=runsc
over the seed tools, progress, cancel and kill, the egress proxy and the hostile catalogue).
Needs runsc registered as scripts/ensure-gvisor.sh does (``sudo make gvisor``); skipped
without it unless E2E_REQUIRE_GVISOR is set, as CI sets it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Daemon, gvisor_registered, write_tool

pytestmark = pytest.mark.docker

A = "alice@example.com"
RUNSC = "sandbox:\n  runtime: runsc\n"
KERNEL_PROBE = """
import { execSync } from "node:child_process";
import { readFileSync } from "node:fs";
export async function execute() {
  let dmesg;
  try { dmesg = execSync("dmesg", { stdio: ["ignore", "pipe", "pipe"] }).toString(); }
  catch (error) { dmesg = `dmesg failed: ${error.stderr}`; }
  return { content: [{ type: "text", text: JSON.stringify({ version: readFileSync("/proc/version", "utf8"), dmesg }) }] };
}
"""


@pytest.fixture(autouse=True)
def _gvisor() -> None:
    problem = gvisor_registered()
    if problem is not None:
        if os.environ.get("E2E_REQUIRE_GVISOR"):
            pytest.fail(problem)
        pytest.skip(problem)


def kernel_of(daemon: Daemon) -> dict[str, Any]:
    import json

    with daemon.client() as client:
        result = client.call_tool(A, "kernel_probe", {})
    assert not result.get("isError"), result
    return dict(json.loads(result["content"][0]["text"]))


def test_a_tool_runs_on_gvisors_kernel_not_the_hosts(make_daemon: Any) -> None:
    gvisor = make_daemon(RUNSC, start=False)
    write_tool(gvisor.data / "tools", "kernel_probe", KERNEL_PROBE)
    seen = kernel_of(gvisor.start())
    assert "Starting gVisor" in seen["dmesg"]
    assert seen["version"] != Path("/proc/version").read_text()
    # The same tool under runc sees the host's kernel (and may not read its log): the probe tells them apart.
    runc = make_daemon("sandbox:\n  runtime: runc\n", start=False, env={"SANDBOXD_SANDBOX_RUNTIME": "runc"})
    write_tool(runc.data / "tools", "kernel_probe", KERNEL_PROBE)
    seen = kernel_of(runc.start())
    assert "gVisor" not in seen["dmesg"]
    assert seen["version"] == Path("/proc/version").read_text()


def test_the_shim_and_egress_sockets_serve_the_gvisor_sandbox(make_daemon: Any) -> None:
    """Under gVisor runsc's gofer (root, on the host) makes the sandbox's connections: the daemon
    knows it by the container's cgroup. Before that, every call failed with -32002."""
    import json

    daemon = make_daemon(RUNSC)
    request = "CONNECT 127.0.0.1:9 HTTP/1.1\r\nHost: 127.0.0.1:9\r\n\r\n"
    with daemon.client() as client:
        result = client.call_tool(A, "egress_probe", {"mode": "raw", "request": request}, timeout_ms=60_000)
    assert result["status"] == "ok", result
    seen = json.loads(result["content"][0]["text"])
    assert "refused by sandboxd's egress policy: loopback address" in seen["answer"], seen  # the proxy answered
    assert not daemon.events("egress_foreign_peer")
