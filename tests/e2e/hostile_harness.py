"""Shared pieces of the hostile-tool, fault and protocol-abuse suites.

One daemon per test module (starting one costs a second or two, and these tests
do not disturb each other: each attacks as its own user), with the hostile tools
of ``tests/e2e/hostile/`` installed as global tools. The checks every hostile
test ends with live here: bystanders are still served, the pool settles back to
a sane shape, and Docker holds exactly the containers the pool knows about.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from sandboxd.client import Client

from tests.e2e.conftest import Daemon

HOSTILE_TOOLS = Path(__file__).resolve().parent / "hostile"
BYSTANDER_A, BYSTANDER_B = "alice@example.com", "bob@example.com"

# Small limits so that bombs die fast (192m still fits a 50 MB result while the
# shim cuts it); short grace so that cancels resolve fast.
MEMORY_LIMIT = "192m"
PIDS_LIMIT = 96
HOSTILE_CONFIG = f"""\
sandbox:
  memory: {MEMORY_LIMIT}
  pids_limit: {PIDS_LIMIT}
  tmp_size: 16m
calls:
  cancel_grace_ms: 500
  default_timeout_ms: 20000
  # Tool output at 4 MiB/s after a 1 MiB burst: a flood is slowed down measurably, in seconds.
  output_rate_bytes: 4194304
  output_burst_bytes: 1048576
pool:
  max_per_user: 2
  min_idle: 1
  acquire_timeout_ms: 20000
"""


def install_hostile_tools(daemon: Daemon) -> None:
    for tool in HOSTILE_TOOLS.iterdir():
        if tool.is_dir() and (tool / "TOOL.md").is_file():
            shutil.copytree(tool, daemon.data / "tools" / tool.name, dirs_exist_ok=True)


@contextlib.contextmanager
def module_daemon(tmp: Path, docker_api: Any, config: str = HOSTILE_CONFIG, **kwargs: Any) -> Iterator[Daemon]:
    """A started daemon with the hostile tools; stopped and checked for leftover containers after."""
    daemon = Daemon(tmp, config=config, **kwargs)
    install_hostile_tools(daemon)
    daemon.start()
    try:
        yield daemon
    finally:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.stop()
        daemon.remove_leftovers(docker_api)


def call(client: Client, user: str, name: str, arguments: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return client.call_tool(user, name, arguments or {}, **extra)


def text_of(result: dict[str, Any]) -> str:
    return "\n".join(block.get("text", "") for block in result["content"] if isinstance(block, dict))


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def assert_bystanders_served(daemon: Daemon, users: tuple[str, ...] = (BYSTANDER_A, BYSTANDER_B)) -> None:
    """Other users (and the attacker's own next call, when passed) get answers."""
    with daemon.client(timeout=60) as client:
        for user in users:
            result = call(client, user, "hello", {"name": user})
            assert result["status"] == "ok", f"{user}: {result}"
            assert text_of(result) == f"Hello, {user}!"


def containers_running(daemon: Daemon, docker_api: Any, user: str, marker: str) -> list[str]:
    """Ids of the user's sandboxes in whose process table the marker shows up."""
    found = []
    for container in daemon.containers(docker_api, **{"org.sandboxd.user": user}):
        top = subprocess.run(["docker", "top", container["Id"], "-eo", "pid,args"], capture_output=True, text=True)
        if marker in top.stdout:
            found.append(container["Id"])
    return found


def pool_matches_docker(daemon: Daemon, docker_api: Any) -> dict[str, Any] | None:
    """The pool's status when it is settled and Docker holds exactly its sandboxes, else None."""
    with daemon.client(timeout=30) as client:
        status = client.request("sandbox/status")
    totals = status["pool"]["totals"]
    if totals["starting"] or totals["busy"] or totals["stopping"] or totals["waiting"] or status["callsInFlight"]:
        return None
    containers = daemon.containers(docker_api)
    running = [c for c in containers if c["State"] == "running"]
    if len(containers) != totals["idle"] or len(running) != len(containers):
        return None
    return status


def assert_pool_recovers(daemon: Daemon, docker_api: Any, attacker: str, timeout: float = 20) -> dict[str, Any]:
    """Settled pool, no stray containers, the attacker's warm sandbox back, and within the limits."""
    def settled() -> dict[str, Any] | None:
        status = pool_matches_docker(daemon, docker_api)
        if status is None:
            return None
        row = status["pool"]["users"].get(attacker, {})
        return status if row.get("idle", 0) >= status["limits"]["minIdle"] else None

    status = wait_until(settled, timeout, f"the pool to settle with a warm sandbox for {attacker} and no stray containers")
    for user, row in status["pool"]["users"].items():
        assert row["idle"] <= status["limits"]["maxPerUser"], (user, row)
    return status


class Background:
    """A call running in a thread, so that the test can do other things meanwhile."""

    def __init__(self, daemon: Daemon, user: str, name: str, arguments: dict[str, Any] | None = None, **extra: Any) -> None:
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.client = daemon.client(timeout=120)
        self._thread = threading.Thread(target=self._run, args=(user, name, arguments, extra), daemon=True)
        self._thread.start()

    def _run(self, user: str, name: str, arguments: dict[str, Any] | None, extra: dict[str, Any]) -> None:
        try:
            self.result = call(self.client, user, name, arguments, **extra)
        except BaseException as exc:  # re-raised in the test's thread by join()
            self.error = exc

    def join(self, timeout: float = 90) -> dict[str, Any]:
        self._thread.join(timeout)
        self.client.close()
        if self._thread.is_alive():
            raise AssertionError(f"the call did not answer within {timeout} s")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def host_processes(marker: str) -> list[str]:
    """Command lines of every process on the host (containers' included) that mention ``marker``."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in out.splitlines() if marker in line and "ps -eo" not in line]

