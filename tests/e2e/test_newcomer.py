"""A newcomer's machine (issue 18), against a real daemon and Docker: a restart with another
socket path reaps what the last run left; a daemon on another data path is never touched;
a second daemon on the same data path is refused before it can take the first's sandboxes
for orphans."""

from __future__ import annotations

import json
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Daemon
from tests.e2e.hostile_harness import call, wait_until

pytestmark = pytest.mark.docker

A, B = "alice@example.com", "bob@example.com"


def events(daemon: Daemon, name: str) -> list[dict[str, Any]]:
    found = []
    for line in daemon.log_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == name:
            found.append(record)
    return found


def warm(daemon: Daemon, docker_api: Any, user: str) -> set[str]:
    """A call, so the daemon holds sandboxes; their ids."""
    with daemon.client() as client:
        assert call(client, user, "hello", {"name": "newcomer"})["status"] == "ok"
    return {c["Id"] for c in wait_until(lambda: daemon.containers(docker_api), 15, "a sandbox to exist")}


def existing(docker_api: Any, ids: set[str]) -> set[str]:
    return {c["Id"] for c in docker_api.api.containers(all=True) if c["Id"] in ids}


def test_a_restart_with_another_socket_path_leaves_no_container_of_the_old_one(make_daemon: Any, docker_api: Any) -> None:
    daemon = make_daemon()
    old = warm(daemon, docker_api, A)
    daemon.stop(signal.SIGKILL)  # no shutdown: its sandboxes stay behind
    assert existing(docker_api, old) == old
    try:
        daemon.socket = Path(tempfile.mkdtemp(prefix="sbd-")) / "moved.sock"  # a config edit, a move to the service
        daemon.start()
        wait_until(lambda: not existing(docker_api, old), 20, "the old socket's sandboxes to be removed")
        removed = events(daemon, "orphans_removed")
        assert removed and removed[-1]["count"] >= len(old) and "data path" in removed[-1]["reason"], removed
        assert removed[-1]["data_path"] == str(daemon.data)
        with daemon.client() as client:
            assert call(client, A, "hello", {"name": "moved"})["status"] == "ok"
    finally:
        for cid in existing(docker_api, old):  # only when the test failed
            subprocess.run(["docker", "rm", "-f", cid], capture_output=True, check=False)


def test_a_restart_never_removes_the_sandboxes_of_a_daemon_on_another_data_path(make_daemon: Any, docker_api: Any) -> None:
    first, second = make_daemon(), make_daemon()
    assert first.data != second.data
    theirs = warm(second, docker_api, B)
    ours = warm(first, docker_api, A)
    first.stop(signal.SIGKILL)
    first.start()
    wait_until(lambda: not existing(docker_api, ours), 20, "the restarted daemon's own orphans to be removed")
    running = {c["Id"] for c in docker_api.api.containers(filters={"status": "running"})}
    assert theirs <= running, "a restart removed another data path's sandboxes"
    with second.client() as client:
        assert call(client, B, "hello", {"name": "still here"})["status"] == "ok"


def test_a_second_daemon_on_the_same_data_path_is_refused_and_takes_nothing(make_daemon: Any, docker_api: Any) -> None:
    first = make_daemon()
    live = warm(first, docker_api, A)
    intruder = make_daemon(start=False)
    intruder.data = first.data  # same data path, its own socket
    with pytest.raises(AssertionError, match="daemon exited with 2"):
        intruder.start()
    assert f"serves the data path {first.data}" in intruder.log(), intruder.log()
    running = {c["Id"] for c in docker_api.api.containers(filters={"status": "running"})}
    assert live <= running, "a second daemon on the data path removed the first's live sandboxes"
    with first.client() as client:
        assert call(client, A, "hello", {"name": "undisturbed"})["status"] == "ok"
