"""A sandbox has a budget in every state, and its output never leaks a secret into a log (issue 11, items 3 and 5).

Real daemon, real Docker, hostile tools from tests/e2e/hostile/: protocol lines a tool
forges (while idle, or about another call), an idle sandbox that keeps writing, progress
floods past the caps, a client that stops reading while its tool floods progress, and a
tool that echoes its secrets everywhere with the daemon at log_level debug.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.e2e.conftest import Daemon
from tests.e2e.hostile_harness import (
    BYSTANDER_A,
    HOSTILE_CONFIG,
    assert_bystanders_served,
    assert_pool_recovers,
    call,
    module_daemon,
    text_of,
    wait_until,
)

pytestmark = pytest.mark.docker

# The hostile daemon's settings, with small progress caps. The idle allowance stays at its
# default (4 MiB): the throttled flood in test_hostile.py shows it holds what the pipes hold.
BUDGET_CONFIG = HOSTILE_CONFIG.replace("calls:\n", "calls:\n  max_progress_updates: 1000\n  max_progress_bytes: 16777216\n", 1)
# No progress byte cap to speak of: only backpressure stands between a flood and the daemon's memory.
UNCAPPED_CONFIG = HOSTILE_CONFIG.replace("calls:\n", "calls:\n  max_progress_bytes: 4294967296\n", 1)


@pytest.fixture(scope="module")
def budget(tmp_path_factory: pytest.TempPathFactory, docker_api: Any) -> Iterator[Daemon]:
    with module_daemon(tmp_path_factory.mktemp("budget"), docker_api, config=BUDGET_CONFIG) as daemon:
        yield daemon


@pytest.fixture
def attacker(request: pytest.FixtureRequest) -> str:
    return f"mallory.{request.node.name.split('[')[0].removeprefix('test_')[:40].replace('_', '-')}@example.com"


def sandbox_gone(daemon: Daemon, docker_api: Any, user: str, hostname: str) -> bool:
    """The sandbox whose hostname (its container id's first 12 characters) the tool reported is removed."""
    assert len(hostname) == 12, hostname
    return not any(c["Id"].startswith(hostname) for c in daemon.containers(docker_api, **{"org.sandboxd.user": user}))


def log_since(daemon: Daemon, offset: int) -> str:
    with daemon.log_path.open("rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace")


# -- unsolicited protocol lines ------------------------------------------------------------


def test_a_protocol_line_while_idle_gets_the_sandbox_destroyed_at_once(budget: Daemon, docker_api: Any, attacker: str) -> None:
    log_from = budget.log_path.stat().st_size
    with budget.client() as client:
        result = call(client, attacker, "protocol_stray", {"what": "idle_line"})
    assert result["status"] == "ok", result
    # Not at the idle TTL (300 s): as soon as the forged line arrives, 300 ms after the answer.
    wait_until(lambda: sandbox_gone(budget, docker_api, attacker, text_of(result)), 15,
               "the sandbox that forged a protocol line while idle to be removed")
    assert "while no call was running" in log_since(budget, log_from)
    assert_pool_recovers(budget, docker_api, attacker)
    assert_bystanders_served(budget, (attacker, BYSTANDER_A))


@pytest.mark.parametrize("what", ["other_call", "unknown_method"])
def test_a_protocol_line_about_another_call_crashes_the_call(budget: Daemon, docker_api: Any, attacker: str, what: str) -> None:
    with budget.client() as client:
        result = call(client, attacker, "protocol_stray", {"what": what})
    # The tool sleeps 8 s after forging: crashed means the daemon stopped it on the forged line.
    assert result["status"] == "crashed" and "not about the running call" in text_of(result), result
    assert_pool_recovers(budget, docker_api, attacker)
    assert_bystanders_served(budget, (attacker, BYSTANDER_A))


# -- output while idle ---------------------------------------------------------------------


def test_an_idle_sandbox_that_keeps_writing_is_destroyed_within_seconds(budget: Daemon, docker_api: Any, attacker: str) -> None:
    log_from = budget.log_path.stat().st_size
    with budget.client() as client:
        result = call(client, attacker, "idle_writer")
    assert result["status"] == "ok", result
    # 4 MiB of idle allowance at 4 MiB/s (after a 1 MiB burst): a second or so after the timer starts, not at the TTL.
    wait_until(lambda: sandbox_gone(budget, docker_api, attacker, text_of(result)), 15,
               "the idle sandbox flooding stderr to be removed")
    assert "calls.idle_output_bytes" in log_since(budget, log_from)
    assert_pool_recovers(budget, docker_api, attacker)
    assert_bystanders_served(budget, (attacker, BYSTANDER_A))


# -- progress caps ---------------------------------------------------------------------------


@pytest.mark.parametrize(("count", "kb", "key"), [
    (5000, 0, "calls.max_progress_updates"),  # cap 1000
    (64, 1024, "calls.max_progress_bytes"),  # cap 16 MiB
])
def test_progress_past_a_cap_crashes_the_call_and_replaces_the_sandbox(budget: Daemon, docker_api: Any, attacker: str,
                                                                       count: int, kb: int, key: str) -> None:
    updates: list[Any] = []
    with budget.client() as client:
        result = client.request("tools/call", {"user": attacker, "name": "progress_flood",
                                               "arguments": {"count": count, "kb": kb}},
                                on_progress=lambda params: updates.append(params["progress"]))
    assert result["status"] == "crashed" and key in text_of(result), result
    assert 0 < len(updates) < count
    assert_pool_recovers(budget, docker_api, attacker)
    assert_bystanders_served(budget, (attacker, BYSTANDER_A))


# -- backpressure ----------------------------------------------------------------------------


def peak_rss_kb(daemon: Daemon) -> int:
    assert daemon.proc is not None
    status = Path(f"/proc/{daemon.proc.pid}/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0])


def test_a_client_that_stops_reading_stalls_the_tool_not_the_daemon(tmp_path: Path, docker_api: Any) -> None:
    attacker = "mallory.no-reader@example.com"
    with module_daemon(tmp_path, docker_api, config=UNCAPPED_CONFIG) as daemon:
        with daemon.client() as client:  # warm the attacker's sandbox first: its start is not the flood
            assert call(client, attacker, "hello", {"name": "warm"})["status"] == "ok"
        before = peak_rss_kb(daemon)
        counter = daemon.user_dir(attacker) / "progress_flood.count"
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(str(daemon.socket))
        try:
            # 400 updates of 1 MiB: unread, they would grow the daemon by hundreds of MiB.
            request = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                       "params": {"user": attacker, "name": "progress_flood", "arguments": {"count": 400, "kb": 1024},
                                  "timeoutMs": 120000}}
            raw.sendall(json.dumps(request).encode() + b"\n")
            wait_until(counter.exists, 30, "the flood to start")

            # Evidence of backpressure: the tool stops getting further, well short of 400.
            seen = {"count": -1, "since": time.monotonic()}

            def stalled() -> bool:
                count = int(counter.read_text() or 0)
                if count != seen["count"]:
                    seen.update(count=count, since=time.monotonic())
                return time.monotonic() - seen["since"] > 3

            wait_until(stalled, 60, "the progress flood to stall")
            assert seen["count"] < 100, f"the tool sent {seen['count']} MiB of progress to a client that reads nothing"
            grown_mb = (peak_rss_kb(daemon) - before) / 1024
            assert grown_mb < 64, f"the daemon's peak memory grew by {grown_mb:.0f} MiB"
        finally:
            raw.close()  # the call is cancelled; its sandbox does not stop within the grace and is replaced
        assert_pool_recovers(daemon, docker_api, attacker, timeout=30)
        assert_bystanders_served(daemon, (attacker, BYSTANDER_A))
        assert peak_rss_kb(daemon) - before < 64 * 1024


# -- secrets ---------------------------------------------------------------------------------


def test_secrets_never_reach_the_log_at_debug(tmp_path: Path, docker_api: Any) -> None:
    attacker = "mallory.echo@example.com"
    secrets = [f"{kind}-{uuid.uuid4().hex}" for kind in ("tok1", "pw1", "tok2", "pw2")]
    with module_daemon(tmp_path, docker_api, config="log_level: debug\n" + HOSTILE_CONFIG) as daemon:
        with daemon.client() as client:
            # Warm sandboxes first, started outside any call with secrets: the echoing calls then
            # run where only the sandbox itself knows what to mask (its output arrives outside the call).
            assert call(client, attacker, "hello", {"name": "warm"})["status"] == "ok"
            for fail, token, password in ((False, secrets[0], secrets[1]), (True, secrets[2], secrets[3])):
                result = call(client, attacker, "secret_echo", {"password": password, "fail": fail},
                              env={"OFFICER_APIFY_TOKEN": token})
                assert result["status"] == ("error" if fail else "ok"), result
            # The timers each call left print its secrets after it answered (the first one's
            # while the second call runs, or after): wait for both.
            wait_until(lambda: daemon.log_path.read_text(errors="replace").count("late timer") >= 2, 15,
                       "the late timers' lines in the log")
        log = daemon.log_path.read_text(errors="replace")  # the whole file, not the tail
        leaked = [secret.split("-")[0] for secret in secrets if secret in log]
        assert not leaked, f"secrets reached the daemon's log: {leaked}"
        assert "thrown: token=*** password=***" in log and "late timer: token=***" in log, "stderr was not logged masked"


# -- the attach transport (protocol and output on one stream) ------------------------------


def test_over_attach_output_is_throttled_and_a_stray_line_still_breaks_the_sandbox(tmp_path: Path, docker_api: Any) -> None:
    attacker = "mallory.attach@example.com"
    config = HOSTILE_CONFIG.replace("sandbox:\n", "sandbox:\n  transport: attach\n", 1)
    with module_daemon(tmp_path, docker_api, config=config) as daemon:
        with daemon.client() as client:
            # Pausing the one stream pauses the protocol too: the answer still comes, after the flood.
            result = call(client, attacker, "output_flood", {"stream": "stderr", "mb": 24}, timeoutMs=60000)
            assert result["status"] == "ok" and result["details"]["writeMs"] >= 3000, result
            assert call(client, attacker, "hello", {"name": "after"})["status"] == "ok"
            result = call(client, attacker, "protocol_stray", {"what": "idle_line"})
            assert result["status"] == "ok", result
        wait_until(lambda: sandbox_gone(daemon, docker_api, attacker, text_of(result)), 15,
                   "the sandbox that forged a protocol line while idle to be removed")
        assert_pool_recovers(daemon, docker_api, attacker)
