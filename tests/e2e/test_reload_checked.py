"""A SIGHUP applies only what start-up would accept: a runtime the engine lacks keeps the running configuration."""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

from tests.e2e.conftest import RUNTIME

pytestmark = pytest.mark.docker

A = "alice@example.com"
RUNNING = "pool:\n  min_idle: 1\n  max_per_user: 2\n  shutdown_grace_s: 0.5\nsandbox:\n  runtime: runc\n"


def wait_for_event(daemon: Any, name: str, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := daemon.events(name):
            return found[-1]
        time.sleep(0.05)
    raise AssertionError(f"no {name} in the daemon's log within {timeout} s:\n{daemon.log()}")


@pytest.mark.skipif(bool(RUNTIME), reason="E2E_SANDBOX_RUNTIME overrides sandbox.runtime from the environment")
def test_a_reload_naming_a_runtime_the_engine_lacks_is_refused_and_calls_go_on(make_daemon: Any) -> None:
    daemon = make_daemon(RUNNING)
    with daemon.client() as client:
        assert client.call_tool(A, "hello", {"name": "before"})["status"] == "ok"
    assert daemon.proc is not None
    daemon.config_path.write_text(RUNNING.replace("runtime: runc", "runtime: nosuchruntime")
                                  .replace("max_per_user: 2", "max_per_user: 3"))
    daemon.proc.send_signal(signal.SIGHUP)
    failure = wait_for_event(daemon, "config_reload_failed")
    assert "'nosuchruntime', which the Docker engine does not know" in failure["error"], failure
    assert "unset sandbox.runtime" in failure["error"] and "unchanged" in failure["hint"], failure
    assert not daemon.events("config_reloaded"), "a part of the refused file was applied"
    with daemon.client() as client:
        assert client.request("sandbox/status")["limits"]["maxPerUser"] == 2  # nothing of the file applied
        for n in range(4):  # each under the running runtime: on a sandbox kept, and on ones started after
            result = client.call_tool(A, "hello", {"name": f"after {n}"})
            assert result["status"] == "ok", result
    # A good file still reloads.
    daemon.config_path.write_text(RUNNING.replace("max_per_user: 2", "max_per_user: 3"))
    daemon.proc.send_signal(signal.SIGHUP)
    reloaded = wait_for_event(daemon, "config_reloaded")
    assert reloaded["applied"] == ["pool.max_per_user"], reloaded
