"""A condemned gVisor sandbox ended by the host's kernel, not by gVisor's.

Under runsc, `docker kill` asks the sandbox's own kernel (the Sentry) to kill its tasks.
On the ptrace platform that is work per task, done within the sandbox's CPU quota, which
the engine cannot lift under runsc (it has no `runsc update`). With a fork bomb's thousands
of tasks it took 3-14 s, and past the engine's 10 s it failed ("did not receive an exit
event", docs/performance.md). A SIGKILL to the Sentry's host process ends every task at
once, as the OOM killer does: the sandbox was gone in 0.6-0.7 s. What is left, the ptrace stubs
dying, still runs within the quota; ten bombs dying at once took 95 s for one of them. So the
quota is lifted first, in the cgroup filesystem, as the engine does it under runc.
"""

from __future__ import annotations

import enum
import os
import re
import signal
from pathlib import Path
from typing import Any

import docker.errors

from sandboxd.helper_client import ask_helper
from sandboxd.sandbox.docker.sockets import CGROUP_ROOT, in_container_cgroup
from sandboxd.sandbox.docker.spec import LABEL_DATA_PATH, LABEL_MANAGED

FULL_ID = re.compile(r"[0-9a-f]{64}")
# Where the engine's cgroupfs and systemd drivers put a container's CPU controller: cgroup v1, then v2.
CPU_QUOTA_FILES = ("cpu/docker/{id}/cpu.cfs_quota_us", "cpu,cpuacct/docker/{id}/cpu.cfs_quota_us",
                   "cpu/system.slice/docker-{id}.scope/cpu.cfs_quota_us",
                   "cpu,cpuacct/system.slice/docker-{id}.scope/cpu.cfs_quota_us",
                   "docker/{id}/cpu.max", "system.slice/docker-{id}.scope/cpu.max")


def lift_cpu_quota(container_id: str, root: Path = CGROUP_ROOT) -> bool:
    """Remove the CFS quota of ``container_id``'s cgroup, where this process may write it (root).
    Whether it did; False where the cgroup is not found or not writable (the kill still comes, later)."""
    for pattern in CPU_QUOTA_FILES:
        path = root / pattern.format(id=container_id)
        try:  # never O_CREAT: on a cgroup v1 host /sys/fs/cgroup itself is a tmpfs
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
        except OSError:  # absent (another driver or version), gone, or not ours to write
            continue
        try:
            os.write(fd, b"max" if path.name == "cpu.max" else b"-1")
        except OSError:
            continue
        finally:
            os.close(fd)
        return True
    return False


class Outcome(enum.Enum):
    KILLED = "killed"
    GONE = "gone"  # it had exited already
    NOT_ITS = "not_its"  # the pid is not in the container's cgroup (or /proc hides it)
    NOT_PERMITTED = "not_permitted"  # the daemon may not signal it (neither root nor CAP_KILL)


def kill_sentry(pid: int, container_id: str) -> Outcome:
    """SIGKILL host process ``pid`` (the engine's ``State.Pid`` of a gVisor container: its
    Sentry) if it lives in the cgroup of ``container_id``.

    The pidfd is taken before the check, so the signal reaches the process checked or none.
    """
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return Outcome.GONE
    try:
        if not in_container_cgroup(pid, container_id):
            return Outcome.NOT_ITS
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        return Outcome.GONE
    except PermissionError:
        return Outcome.NOT_PERMITTED
    finally:
        os.close(pidfd)
    return Outcome.KILLED


def kill_through_helper(helper: Path, container_id: str) -> tuple[Outcome, str | None]:
    """For a daemon that may not signal the Sentry (not root): the privileged helper's kill (storage/helper.py).
    (its outcome, None), or (NOT_PERMITTED, what went wrong)."""
    try:
        answer = ask_helper(helper, {"op": "kill", "container": container_id})
        return Outcome(answer.get("outcome")), None
    except (OSError, ValueError) as exc:  # no helper, or its refusal (ValueError): the engine's kill, later
        return Outcome.NOT_PERMITTED, str(exc)


class Refused(Exception):
    """A kill the privileged helper will not do, and why."""


def checked_container_id(value: object) -> str:
    """``value`` if it is a container id in full, as the engine writes it; else Refused."""
    if not isinstance(value, str) or not FULL_ID.fullmatch(value):
        raise Refused(f"{str(value)[:80]!r} is not a container id in full (64 hex digits)")
    return value


def kill_owned_sandbox(api: Any, container_id: object, data_path: Path) -> Outcome:
    """The privileged helper's kill (storage/helper.py) for an unprivileged daemon: as ``_kill_sentry`` does it as root.

    Only a container named by its full id, that the engine (``api``) labels as a sandbox of the daemon on
    ``data_path``, and only the process the engine names as its init (its Sentry) if that lives in the
    container's cgroup. The request never names a pid, so the helper can signal nothing else.
    """
    container_id = checked_container_id(container_id)
    try:
        found = api.inspect_container(container_id)
    except docker.errors.NotFound:
        return Outcome.GONE
    labels = (found.get("Config") or {}).get("Labels") or {}
    if found.get("Id") != container_id or labels.get(LABEL_MANAGED) != "1" or labels.get(LABEL_DATA_PATH) != str(data_path):
        raise Refused(f"container {container_id[:12]} is not a sandbox of the sandboxd on {data_path}")
    lift_cpu_quota(container_id)
    state = found.get("State") or {}
    pid = int(state.get("Pid") or 0)
    if not state.get("Running") or pid <= 0:
        return Outcome.GONE
    return kill_sentry(pid, container_id)
