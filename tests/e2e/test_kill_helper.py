"""The privileged helper's kill (issue 44, item 9): an unprivileged daemon ends a condemned gVisor sandbox at once.

The systemd unit runs the daemon as user sandboxd, which may not signal a Sentry (it runs as nobody)
nor lift a quota in the cgroup filesystem: its kills went through the engine, 14.6 s for a bomb of
7,600 threads. sandboxd-quota.socket's helper (root, socket-activated) now does both for it, for a
container it checks itself: named in full, labelled by the engine as a sandbox of the helper's own
configuration, its Sentry the process the engine names and found in the container's cgroup. Here a
listener does what systemd does (test_quota_helper.SocketActivated) with real runsc containers, and
the daemon's uid is nobody's (tests/as_user.py). About 10 s.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from sandboxd.config import RUNNER_IMAGE
from tests.e2e.test_gvisor import _gvisor  # noqa: F401 (autouse: skipped, or failed in CI, without runsc)
from tests.e2e.test_quota_helper import DAEMON_UID, STRANGER_UID, SocketActivated, helper, timed  # noqa: F401 (helper: a fixture)

pytestmark = [pytest.mark.docker, pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as other uids")]


@pytest.fixture
def containers() -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    if made:
        subprocess.run(["docker", "rm", "-f", *made], capture_output=True, check=False)


def sandbox_like(made: list[str], **labels: str) -> str:
    """A runsc container with a quarter of a CPU, as sandboxd starts them, whose task sleeps; its id."""
    label_args = [arg for name, value in labels.items() for arg in ("--label", f"{name}={value}")]
    container = subprocess.run(
        ["docker", "run", "-d", "--runtime=runsc", "--network", "none", "--cpus", "0.25", *label_args,
         "--entrypoint", "/bin/sh", RUNNER_IMAGE, "-c", "sleep 600"], capture_output=True, text=True, check=True).stdout.strip()
    made.append(container)
    return container


def state(container: str) -> dict[str, Any]:
    import json

    return json.loads(subprocess.run(["docker", "inspect", "-f", "{{json .State}}", container],
                                     capture_output=True, text=True, check=True).stdout)


def kill(helper: SocketActivated, container: str, uid: int = DAEMON_UID) -> dict[str, Any]:
    answers, _ = timed(helper.path, uid, f'{{"op": "kill", "container": "{container}"}}\n'.encode())
    assert len(answers) == 1, answers
    return answers[0]


def test_the_helper_kills_its_daemons_gvisor_sandbox_at_once_and_nothing_else(
        helper: SocketActivated, containers: list[str]) -> None:
    data_path = str(Path(helper.path).parent / "data")  # the helper's configuration (SocketActivated)
    ours = sandbox_like(containers, **{"org.sandboxd.managed": "1", "org.sandboxd.data-path": data_path})
    strangers = sandbox_like(containers)
    other_daemons = sandbox_like(containers, **{"org.sandboxd.managed": "1", "org.sandboxd.data-path": "/srv/other"})
    sentry = state(ours)["Pid"]

    refused = kill(helper, ours, uid=STRANGER_UID)  # only the daemon's uid is served
    assert "is not the sandboxd daemon's" in refused["error"], refused
    for container in (strangers, other_daemons):
        refused = kill(helper, container)
        assert "is not a sandbox of the sandboxd on" in refused["error"], refused
    assert "not a container id in full" in kill(helper, ours[:12])["error"]
    assert all(state(container)["Running"] for container in (ours, strangers, other_daemons)), helper.log.read_text()

    started = time.monotonic()
    assert kill(helper, ours) == {"ok": True, "outcome": "killed"}, helper.log.read_text()
    took = time.monotonic() - started
    deadline = time.monotonic() + 10
    while state(ours)["Running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    ended = state(ours)
    assert not ended["Running"] and ended["ExitCode"] == 137, ended  # its Sentry SIGKILLed on the host
    assert not Path(f"/proc/{sentry}").exists() or f"/docker/{ours}" not in Path(f"/proc/{sentry}/cgroup").read_text()
    assert state(strangers)["Running"] and state(other_daemons)["Running"]
    assert kill(helper, ours) == {"ok": True, "outcome": "gone"}
    print(f"\nthe helper's kill answered in {took:.2f} s (its own start included)")
