"""A kill that always lands: a condemned sandbox is gone within seconds, whatever its processes do.

Seen before the fix (cgroup v1, this project's kind of machine): a fork bomb under a large
pids limit (4096) and a quarter of a CPU ignored `docker kill` for minutes ("did not receive an
exit event"): thousands of throttled processes never got the CPU time to die. The backend now
lifts a condemned sandbox's CPU quota before the kill (sandbox/docker/backend.py, _lift_cpu_quota).

Under gVisor the engine cannot lift the quota, and its kill goes through the Sentry, which ends
the bomb's tasks one by one within that quota. With memory and pids to spare (so that neither the
OOM killer nor the pids limit ends the Sentry first) a bomb of thousands of tasks outlived the
engine's 10 s, its removal failed ("did not receive an exit event") and the sandbox outlived the
test (issue 44, item 9). The backend now SIGKILLs the Sentry on the host first (sentry.py).
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import RUNTIME, write_tool
from tests.e2e.hostile_harness import host_processes, wait_until

pytestmark = pytest.mark.docker

A, B = "alice@example.com", "bob@example.com"
GVISOR = RUNTIME == "runsc"
# Under gVisor: room for the bomb to grow for a minute, to the thousands of tasks that the Sentry's own
# kill took more than 10 s to end (the OOM killer or the pids limit would end the Sentry at once instead).
CONFIG = ("sandbox:\n  pids_limit: 16384\n  cpus: 0.25\n  memory: 2g\npool:\n  min_idle: 0\n" if GVISOR
          else "sandbox:\n  pids_limit: 4096\n  cpus: 0.25\npool:\n  min_idle: 0\n")
GONE_WITHIN_S = 15
BOMBING_S = 60 if GVISOR else 30  # the call's timeout: the bomb spreads meanwhile, then the timeout condemns the sandbox
ENOUGH = 500  # processes of the bomb on the host, at least, for the test to mean something
ENOUGH_GVISOR = 3000  # host threads in a gVisor sandbox's cgroup (a stub and tracer per task), likewise
BOMB = """
import { spawn } from "node:child_process";
export async function execute(_id: string, params: { marker: string }) {
  // The marker rides in every forked shell's command line, so the host can count them.
  spawn("/bin/sh", ["-c", `b() { b | b & }; b # ${params.marker}`], { detached: true, stdio: "ignore" }).unref();
  await new Promise(() => {});  // never answers: the call's timeout condemns the sandbox
}
"""


def test_a_fork_bombed_sandbox_is_gone_within_seconds_of_being_condemned(make_daemon: Any, docker_api: Any) -> None:
    daemon = make_daemon(CONFIG, start=False)
    write_tool(daemon.data / "tools", "bomber", BOMB,
               inputs="  marker:\n    type: string\n    description: Marks its processes.\n")
    daemon.start()
    marker = f"bomb{uuid.uuid4().hex[:12]}"
    answers: list[dict[str, Any]] = []

    def bomb() -> None:
        with daemon.client(timeout=120) as client:
            answers.append(client.call_tool(A, "bomber", {"marker": marker}, timeoutMs=BOMBING_S * 1000))

    caller = threading.Thread(target=bomb)
    caller.start()
    most = -1 if GVISOR else 0  # -1: this host's cgroups not found, the threads not counted
    while caller.is_alive():
        most = max(most, sandbox_threads_of(daemon, docker_api, A) if GVISOR else len(host_processes(marker)))
        caller.join(0.5)
    condemned = time.monotonic()
    # The bomb may exhaust the sandbox's memory before the timeout: the kernel's OOM killer (or, under
    # gVisor, the Sentry's) takes the shim, the call ends "crashed", and the sandbox is condemned for
    # that instead. Either way it is condemned now, and what follows is what the test is about.
    assert answers and answers[0]["status"] in ("timeout", "crashed"), answers
    if GVISOR:  # its processes live inside gVisor's kernel: the host sees the threads that serve them
        assert most >= ENOUGH_GVISOR or most == -1, f"the bomb did not go off ({most} threads): the test proves nothing"
    else:
        assert most >= ENOUGH, f"the bomb did not go off ({most} processes): the test proves nothing"
    with daemon.client(timeout=60) as client:  # another user is served while the bombed sandbox goes
        served = client.call_tool(B, "hello", {"name": B})
    assert served["status"] == "ok", served
    assert time.monotonic() - condemned < GONE_WITHIN_S, "the other user waited behind the kill"
    wait_until(lambda: not daemon.containers(docker_api, **{"org.sandboxd.user": A}),
               GONE_WITHIN_S - (time.monotonic() - condemned), f"the bombed sandbox gone within {GONE_WITHIN_S} s")
    gone_s = time.monotonic() - condemned
    left = host_processes(marker)
    assert not left, f"{len(left)} of the bomb's processes outlived its sandbox"
    print(f"\nthe bomb peaked at {most} {'threads' if GVISOR else 'processes'} on the host; its sandbox gone "
          f"{gone_s:.1f} s after it was condemned ({RUNTIME or 'runc'}, {answers[0]['status']})")


def sandbox_threads_of(daemon: Any, docker_api: Any, user: str) -> int:
    """Host threads in the cgroup of ``user``'s sandbox (cgroup v1 or v2, either driver); -1 where none is found."""
    counts = [-1]
    for container in daemon.containers(docker_api, **{"org.sandboxd.user": user}):
        cid = container["Id"]
        for path in (f"/sys/fs/cgroup/pids/docker/{cid}", f"/sys/fs/cgroup/pids/system.slice/docker-{cid}.scope",
                     f"/sys/fs/cgroup/system.slice/docker-{cid}.scope"):
            try:
                counts.append(int(Path(path, "pids.current").read_text()))
            except (OSError, ValueError):
                continue
    return max(counts)
