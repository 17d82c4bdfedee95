"""A condemned gVisor sandbox ended by the host's kernel, not by gVisor's.

Under runsc, `docker kill` asks the sandbox's own kernel (the Sentry) to kill its tasks.
On the ptrace platform that is work per task, done within the sandbox's CPU quota, which
the engine cannot lift under runsc (it has no `runsc update`). With a fork bomb's thousands
of tasks it took 3-14 s, and past the engine's 10 s it failed ("did not receive an exit
event", docs/performance.md). A SIGKILL to the Sentry's host process ends every task at
once, as the OOM killer does: the sandbox was gone in 0.6-0.7 s.
"""

from __future__ import annotations

import enum
import os
import signal

from sandboxd.sandbox.docker.sockets import in_container_cgroup


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
